"""Toy tasks with verifiable rewards, small enough for a random tiny model on 2 CPU cores.

A task is a prompt generator (records for the JSONL dataset) plus reward functions
``fn(prompt, completion, record) -> float | dict[str, float]`` that return 0 for malformed output and never
raise. ``echo`` is learned from scratch under RL; ``reverse`` (digit reversal) comes with a supervised
warm-start on synthetic demonstrations (``python -m tandem warmstart``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from rollout.envs import calculator
from tandem.tasks import echo, reverse

# calc is multi-turn: its reward is the environment's (rollout/envs/calculator.py), not a function here.
TASKS: dict[str, Any] = {"echo": echo, "reverse": reverse, "calc": calculator}


def make_records(task: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` prompt records of a task, deterministic in ``seed``."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {sorted(TASKS)}")
    rng = random.Random(seed)
    return [TASKS[task].make_record(rng, i) for i in range(n)]


def demonstrations(task: str, n: int, seed: int = 0) -> list[tuple[str, str]]:
    """(prompt, ideal completion) pairs for a supervised warm-start."""
    return [(r["prompt"], r["answer"]) for r in make_records(task, n, seed)]


RewardFn = Callable[[str, str, dict[str, Any]], "float | dict[str, float]"]
