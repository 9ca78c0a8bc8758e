"""A supervised warm-start of a tiny checkpoint on a toy task's demonstrations (``python -m toy warmstart``).

A one-rank run of the learner's ``sft`` recipe (:class:`learner.sft.SFTTrainer`, docs/stages.md §3.1) on
demonstrations written here, or on a given ``{"prompt", "response"}`` file.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from learner.sft import SFTTrainer
from tandem.config import load_config
from toy.tasks import uses_chat_template, write_demonstrations


def warmstart(
    task: str,
    model_path: str,
    out: str,
    *,
    steps: int = 300,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
    demos: str | Path | None = None,
) -> Path:
    """Supervised warm-start of ``model_path`` on ``steps × batch_size`` demonstrations of a toy task, or on
    the ``{"prompt", "response"}`` records of ``demos`` (cycled through) when given."""
    with tempfile.TemporaryDirectory() as tmp:
        if demos is not None:
            data = Path(demos)
        else:
            data = write_demonstrations(task, Path(tmp) / "demos.jsonl", steps * batch_size, seed=seed + 1)
        raw = {
            "run": {"name": f"warmstart-{task}", "seed": seed, "device": "cpu"},
            "model": {"actor": model_path},
            "data": {"prompts": str(data)},
            "algorithm": {
                "recipe": "sft",
                "train_file": str(data),
                "chat_template": demos is None and uses_chat_template(task),
                "batch_size": batch_size,
                # as many passes over a given file as ``steps`` needs
                "epochs": max(1, -(-steps * batch_size // sum(1 for _ in data.open()))),
            },
            "learner": {
                "total_steps": steps,
                "actor_lr": lr,
                "micro_batch_size": batch_size,
                "checkpoint_interval": 0,
            },
            "logging": {"wandb_mode": "disabled", "log_interval": 50},
        }
        SFTTrainer(load_config(None, raw=raw), Path(tmp) / "run").run()
        path = Path(out)
        shutil.copytree(Path(tmp) / "run" / "final", path, dirs_exist_ok=True)
    for extra in Path(model_path).iterdir():  # what the trainer does not write: a VL model's processor
        if extra.is_file() and not (path / extra.name).exists():
            shutil.copy2(extra, path / extra.name)
    return path
