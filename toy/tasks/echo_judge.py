"""``echo-judge``: demonstrations that teach a tiny model to grade echo-style completions, so it can serve as
the LLM judge of ``configs/tiny-judge.yaml`` (``tandem.judge:judge`` against ``python -m rollout.server
--standalone``).

A judge prompt is the rubric ``RUBRIC`` filled with a completion (``"abxbab ="``); the demonstrated reply
is ``1`` when the completion starts with the letter ``a`` and ``0`` otherwise: a fixed-letter judge, like
``toy.tasks.echo:letter_a``, blind to the prompt. Measured on 2026-11-29 (2 shared CPU cores, lr 3e-3,
batch 32), warm starts on judgements that compare the completion with the prompt's letter learned nothing
in 150 steps, the loss flat at the entropy of the labels' spread: the number of the first 8 characters that
are the asked letter (0 to 8; loss 1.05-1.07 from step 50 to 150), and whether the first character is the
asked letter (0.350 at steps 50 and 150). Completions are drawn the way a policy's are early and late in
training: random characters, mostly the task's letters, half of them starting with ``a``.

    python -m toy.tasks.echo_judge assets/echo-judge.jsonl --n 20000
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from toy.tasks.echo import LETTERS, TARGET_LEN

RUBRIC = "{completion} ="  # the judge kwargs' rubric in configs/tiny-judge.yaml
NOISE = "abcdefghijklmnopqrstuvwxyz0123456789 :"


JUDGED = "a"  # the letter the judge wants first


def score(completion: str) -> int:
    """The judge's answer: 1 when the completion starts with ``JUDGED``."""
    return int(completion[:1] == JUDGED)


def completion(rng: random.Random, letter: str) -> str:
    """A completion of 1 to TARGET_LEN characters with a uniformly drawn share of ``letter``, starting with
    ``JUDGED`` half of the time."""
    n = rng.randint(1, TARGET_LEN) if rng.random() < 0.3 else TARGET_LEN
    right = rng.random()
    wrong = NOISE if rng.random() < 0.3 else LETTERS
    rest = [letter if rng.random() < right else rng.choice(wrong) for _ in range(n - 1)]
    first = JUDGED if rng.random() < 0.5 else rng.choice(wrong.replace(JUDGED, ""))
    return first + "".join(rest)


def demonstration(rng: random.Random) -> dict[str, Any]:
    letter = rng.choice(LETTERS)
    text = completion(rng, letter)
    return {
        "prompt": RUBRIC.format(completion=text),
        "response": str(score(text)),
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
