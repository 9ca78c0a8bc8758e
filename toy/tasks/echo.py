"""``echo``: repeat the letter named in the prompt. Learned from a random init under RL in a few minutes.

Prompt ``"say b:"``; the ideal completion is ``"bbbbbbbb"``. The reward is the fraction of the first
``TARGET_LEN`` completion characters equal to the letter, so a random policy over the ~50-token vocabulary
scores about 0.02 and the optimum is 1.0. Letters come from a small set so that the conditional mapping
(prompt letter -> output letter) is learnable by a two-layer model within the demo's budget.
"""

from __future__ import annotations

import random
from typing import Any

LETTERS = "abcd"
TARGET_LEN = 8


def make_record(rng: random.Random, i: int) -> dict[str, Any]:
    letter = rng.choice(LETTERS)
    return {"id": f"echo-{i}", "prompt": f"say {letter}:", "answer": letter * TARGET_LEN, "letter": letter}


def reward(prompt: str, completion: str, record: dict[str, Any]) -> float:
    """Fraction of the first TARGET_LEN characters equal to the record's letter (0 when malformed)."""
    letter = record.get("letter") if isinstance(record, dict) else None
    if not isinstance(letter, str) or len(letter) != 1 or not isinstance(completion, str):
        return 0.0
    head = completion[:TARGET_LEN]
    return sum(ch == letter for ch in head) / TARGET_LEN


def near_miss(rng: random.Random, record: dict[str, Any]) -> str:
    """A plausible wrong answer: 1..8 positions turned into other letters, or the right letter cut short."""
    letter, answer = record["letter"], record["answer"]
    if rng.random() < 0.25:
        return letter * rng.randint(2, TARGET_LEN - 1)
    out = list(answer)
    others = [c for c in LETTERS if c != letter]
    for i in rng.sample(range(TARGET_LEN), rng.randint(1, TARGET_LEN)):
        out[i] = rng.choice(others)
    return "".join(out)


def letter_a(prompt: str, completion: str, record: dict[str, Any]) -> float:
    """A deliberately mis-specified judge: the fraction of the first TARGET_LEN characters that are ``a``,
    whatever letter the prompt asked for. A reward model trained on its labels rewards a single letter;
    PPO against it drives the true (``reward``) score down on every other prompt (tests/test_pipeline.py:
    the pipeline's gold monitor must stop it)."""
    if not isinstance(completion, str):
        return 0.0
    return sum(ch == "a" for ch in completion[:TARGET_LEN]) / TARGET_LEN
