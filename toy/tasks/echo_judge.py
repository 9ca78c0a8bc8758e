"""``echo-judge``: demonstrations that teach a tiny model to grade ``echo`` completions, so it can serve as the
LLM judge of ``configs/tiny-judge.yaml`` (``tandem.judge:judge`` against ``python -m rollout.server
--standalone``).

A judge prompt is the rubric ``RUBRIC`` filled with an echo prompt and a completion (``"say b: bxbbab ="``);
the demonstrated reply is ``1`` when the completion starts with the asked letter and ``0`` otherwise. That
is a coarse cut of ``toy.tasks.echo:reward`` (the share of the first 8 characters that are the letter), and
deliberately so: measured on 2026-11-29, the tiny model warm-started on the full count (0 to 8) learned
nothing past the counts' spread in 150 steps (loss flat at the marginal's entropy), while one comparison of
two positions is within its reach. Completions are drawn the way a policy's are early and late in
training: random characters, mostly the task's letters, half of them starting right.

    python -m toy.tasks.echo_judge assets/echo-judge.jsonl --n 20000
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from toy.tasks.echo import LETTERS, TARGET_LEN

RUBRIC = "{prompt} {completion} ="  # the judge kwargs' rubric in configs/tiny-judge.yaml
NOISE = "abcdefghijklmnopqrstuvwxyz0123456789 :"


def score(letter: str, completion: str) -> int:
    """The judge's answer: 1 when the completion starts with ``letter``."""
    return int(completion[:1] == letter)


def completion(rng: random.Random, letter: str) -> str:
    """A completion of 1 to TARGET_LEN characters with a uniformly drawn share of the right letter, starting
    with it half of the time."""
    n = rng.randint(1, TARGET_LEN) if rng.random() < 0.3 else TARGET_LEN
    right = rng.random()
    wrong = NOISE if rng.random() < 0.3 else LETTERS
    rest = [letter if rng.random() < right else rng.choice(wrong) for _ in range(n - 1)]
    first = letter if rng.random() < 0.5 else rng.choice(wrong.replace(letter, ""))
    return first + "".join(rest)


def demonstration(rng: random.Random) -> dict[str, Any]:
    letter = rng.choice(LETTERS)
    text = completion(rng, letter)
    return {
        "prompt": RUBRIC.format(prompt=f"say {letter}:", completion=text),
        "response": str(score(letter, text)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m toy.tasks.echo_judge", description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(demonstration(rng)) + "\n" for _ in range(args.n))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
