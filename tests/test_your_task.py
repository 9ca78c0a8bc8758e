"""docs/your-task.md as a user follows it: a reward module outside the repository, found on PYTHONPATH,
named by a minimal config (no prepare steps, no critic), run by launch.py from another directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tandem.data import write_prompts
from tandem.telemetry import read_history

ROOT = Path(__file__).resolve().parent.parent

REWARD = '''\
def reward(prompt, completion, record):
    """A constant, so the run's reward/mean shows it came from here."""
    assert prompt == record["prompt"]  # the raw field, not the templated text
    return 0.25
'''


@pytest.mark.slow
def test_own_reward_module_outside_the_repository(tmp_path: Path, tiny_ckpt: dict[str, Path]) -> None:
    mine = tmp_path / "mytask"
    mine.mkdir()
    (mine / "myreward.py").write_text(REWARD)
    write_prompts(mine / "prompts.jsonl", [{"prompt": f"say {i}", "answer": str(i)} for i in range(40)])
    config = {
        "run": {"name": "mytask", "device": "cpu", "output_dir": str(tmp_path / "runs")},
        "model": {"actor": str(tiny_ckpt["actor"])},
        "data": {"prompts": "prompts.jsonl", "max_prompt_tokens": 64},
        "reward": {"functions": [{"path": "myreward:reward"}]},
        "rollout": {"n_samples": 4, "prompts_per_batch": 2, "max_new_tokens": 6},
        "algorithm": {"batch_size": 8, "minibatch_size": 8},
        "learner": {"total_steps": 2, "micro_batch_size": 8},
        "logging": {"wandb_mode": "disabled"},
    }
    (mine / "mytask.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(mine)}
    r = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "mytask.yaml", "--no-console"],
        cwd=mine,  # relative data paths are read from here
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    rows = [row for row in read_history(run_dir, "learner") if "reward/mean" in row]
    assert rows, "no learner steps logged"
    assert all(row["reward/mean"] == pytest.approx(0.25) for row in rows)
    assert all(row["reward/myreward"] == pytest.approx(0.25) for row in rows)
