"""``reverse``: write the digits of the prompt in reverse order. Needs the supervised warm-start first.

Prompt ``"rev 4071="``; the ideal completion is ``"1704"`` followed by end-of-sequence. Rewards:
``exact`` (1 for the exact answer), ``digits`` (fraction of positions right, partial credit), and a
``format`` part that is 1 only when the completion is all digits of the right length.
"""

from __future__ import annotations

import random
from typing import Any

MIN_DIGITS, MAX_DIGITS = 3, 6


def make_record(rng: random.Random, i: int) -> dict[str, Any]:
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(MIN_DIGITS, MAX_DIGITS)))
    return {"id": f"reverse-{i}", "prompt": f"rev {digits}=", "answer": digits[::-1]}


def reward(prompt: str, completion: str, record: dict[str, Any]) -> dict[str, float]:
    """Named parts: exact match, per-position digit accuracy, and well-formedness. 0s when malformed."""
    zero = {"exact": 0.0, "digits": 0.0, "format": 0.0}
    answer = record.get("answer") if isinstance(record, dict) else None
    if not isinstance(answer, str) or not answer or not isinstance(completion, str):
        return zero
    text = completion.strip()
    well_formed = text.isdigit() and len(text) == len(answer)
    right = sum(a == b for a, b in zip(text, answer, strict=False)) / len(answer)
    return {"exact": float(text == answer), "digits": right, "format": float(well_formed)}


def near_miss(rng: random.Random, record: dict[str, Any]) -> str:
    """A plausible wrong answer: the digits unreversed, two neighbours swapped, one digit wrong, or one dropped."""
    answer = record["answer"]
    candidates = [answer[::-1], answer[:-1]]
    i = rng.randrange(len(answer) - 1)
    candidates.append(answer[:i] + answer[i + 1] + answer[i] + answer[i + 2 :])
    j = rng.randrange(len(answer))
    candidates.append(answer[:j] + rng.choice([d for d in "0123456789" if d != answer[j]]) + answer[j + 1 :])
    wrong = [c for c in candidates if c != answer]
    return rng.choice(wrong)
