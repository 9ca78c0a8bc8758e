"""The learner entry point: ``python -m learner.train --config FILE [key.sub=value ...] --run-dir DIR [--resume]``.

Several ranks through ``torchrun --nproc-per-node N -m learner.train ...``. The config's
``algorithm.recipe`` picks the recipe (docs/stages.md): ``ppo`` (the default: PPO/GRPO/RLOO/REINFORCE++
against the replay buffer, as launch.py starts it), or one of the offline trainers ``sft``, ``rm``, ``dpo``
on a fixed dataset. Each recipe is a module with a short ``step``; the shared plumbing is
``learner/runtime.py`` (ranks, telemetry, stopping), ``learner/online.py`` (buffer, weight sync,
exactly-once) and ``learner/offline_runtime.py`` (dataset, evaluation, early stop).
"""

from __future__ import annotations

import argparse
import importlib

import torch.distributed as dist

from learner.ppo import reward_part_means
from learner.runtime import Runtime, Stats
from tandem.config import load_config
from tandem.procs import exit_now
from tandem.telemetry import setup_logging

__all__ = ["RECIPES", "RECIPE_CLASSES", "Stats", "main", "recipe_class", "reward_part_means"]


RECIPE_CLASSES: dict[str, str] = {
    "ppo": "learner.ppo:PPOLearner",
    "sft": "learner.sft:SFTTrainer",
    "rm": "learner.rm:RewardModelTrainer",
    "dpo": "learner.dpo:DPOTrainer",
}  # algorithm.recipe -> "module:Class" of the learner that runs it
RECIPES = tuple(RECIPE_CLASSES)


def recipe_class(recipe: str) -> type[Runtime]:
    """The learner class of ``algorithm.recipe`` (imported lazily: each recipe loads only its own code)."""
    if recipe not in RECIPE_CLASSES:
        raise ValueError(f"algorithm.recipe: unknown recipe {recipe!r}")
    module, name = RECIPE_CLASSES[recipe].split(":")
    return getattr(importlib.import_module(module), name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m learner.train", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="YAML config (launch.py writes the resolved one)")
    p.add_argument("--run-dir", required=True, help="run directory: checkpoints, trained.jsonl, final/")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint, if any")
    p.add_argument("--layout", choices=["pad", "pack"], default="pad", help="see learner/batch.py")
    p.add_argument("overrides", nargs="*", help="key.sub=value")
    args = p.parse_intermixed_args(argv)
    cfg = load_config(args.config, args.overrides)
    setup_logging(cfg.logging.level)
    if cfg.learner.lora.adapters:  # several adapters at once, a run each (learner/adapter_runs.py)
        from learner.adapter_runs import train_adapters

        train_adapters(cfg, args.run_dir, resume=args.resume, layout=args.layout)
    else:
        recipe_class(cfg.algorithm.recipe)(cfg, args.run_dir, resume=args.resume, layout=args.layout).run()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_now(main())  # its work done and its files closed: skip the interpreter's teardown (tandem/procs.py)
