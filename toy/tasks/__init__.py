"""Toy tasks with verifiable rewards, small enough for a random tiny model on 2 CPU cores.

A task is a prompt generator (records for the JSONL dataset) plus reward functions
``fn(prompt, completion, record) -> float | dict[str, float]`` that return 0 for malformed output and never
raise. ``echo`` is learned from scratch under RL; ``reverse`` (digit reversal) comes with a supervised
warm-start on synthetic demonstrations (``python -m toy warmstart``). ``colour`` is visual: each prompt
carries an image, written beside the prompt file (:func:`write_prompt_file`).

Each task also makes offline data for the training stages (docs/stages.md §2): demonstrations (prompt,
ideal completion) for ``sft``, and preference pairs for ``rm`` and ``dpo`` whose ``chosen`` is the ideal
completion and whose ``rejected`` is a realistic near-miss (``near_miss``: a few wrong characters, a
truncation, a swap), always scoring strictly lower under the task's own reward.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tandem.data import write_prompts
from toy import calculator
from toy.tasks import calc_think, calc_tools, colour, echo, reverse

# calc is multi-turn: its reward is the environment's (toy/calculator.py), not a function here;
# calc-agent's and calc-agent-think's are the agent's (toy/tasks/calc_agent.py).
TASKS: dict[str, Any] = {
    "echo": echo,
    "reverse": reverse,
    "calc": calculator,
    "calc-agent": calc_tools,
    "calc-agent-think": calc_think,
    "colour": colour,
}


def make_records(task: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` prompt records of a task, deterministic in ``seed``."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {sorted(TASKS)}")
    rng = random.Random(seed)
    return [TASKS[task].make_record(rng, i) for i in range(n)]


def write_prompt_file(task: str, path: str | Path, n: int, seed: int = 0) -> Path:
    """A task's prompt file: its records as JSONL, and, for a task with images (one with a ``write``), the
    images beside it."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {sorted(TASKS)}")
    own = getattr(TASKS[task], "write", None)
    return own(path, n, seed=seed) if own is not None else write_prompts(path, make_records(task, n, seed))


RewardFn = Callable[[str, str, dict[str, Any]], "float | dict[str, float]"]


def demonstration_records(task: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``{"prompt", "response"}`` records (the sft schema) for a supervised warm-start: each record's prompt
    and ideal completion, or what the task's own ``demonstration_record`` makes of it (colour's carry
    their image)."""
    own = getattr(TASKS[task], "demonstration_record", None)
    records = make_records(task, n, seed)
    if own is not None:
        return [own(r) for r in records]
    return [{"prompt": r["prompt"], "response": r["answer"]} for r in records]


def uses_chat_template(task: str) -> bool:
    """Whether a task's prompts go through the model's chat template (colour's: the image before the text)."""
    return bool(getattr(TASKS[task], "CHAT_TEMPLATE", False))


def preference_records(task: str, n: int, seed: int = 0) -> list[dict[str, str]]:
    """``{"prompt", "chosen", "rejected"}`` records (the rm/dpo schema): chosen is the ideal completion."""
    rng = random.Random(seed * 7919 + 1)
    out = []
    for r in make_records(task, n, seed):
        rejected = TASKS[task].near_miss(rng, r)
        out.append({"prompt": r["prompt"], "chosen": r["answer"], "rejected": rejected})
    return out


def write_demonstrations(task: str, path: str | Path, n: int, seed: int = 0) -> Path:
    return write_prompts(path, demonstration_records(task, n, seed))


def write_preferences(task: str, path: str | Path, n: int, seed: int = 0) -> Path:
    return write_prompts(path, preference_records(task, n, seed))
