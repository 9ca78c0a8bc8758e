"""reasoning-gym as a task source and a multi-turn environment (docs/design.md §10.5).

Any of reasoning-gym's procedural datasets by name (``reasoning_gym.create_dataset(name, seed=, size=,
**config)``), generated offline; the reward is the dataset's own ``score_answer``. The episode is a few
attempts: a wrong answer is told so (``"wrong, try again\\n"``) and the model answers again; the reward of
attempt ``k`` is ``score · discount**k``, so a first-time answer is worth most.

A prompt record names its entry (``rg_dataset``, ``rg_seed``, ``rg_size``, ``rg_config``, ``rg_index``);
the environment regenerates the dataset once per process (they are deterministic in the seed) and scores
against that entry, so nothing but the record travels through Redis. ``lowercase`` maps the question to the
tiny tokenizer's alphabet.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from rollout.envs.base import Action, Env, StepResult, Task


@functools.lru_cache(maxsize=16)
def dataset(name: str, seed: int, size: int, config_json: str) -> Any:
    import reasoning_gym

    return reasoning_gym.create_dataset(name, seed=seed, size=size, **json.loads(config_json))


def make_records(
    name: str, n: int, seed: int = 0, *, lowercase: bool = False, **config: Any
) -> list[dict[str, Any]]:
    """``n`` prompt records of dataset ``name`` (deterministic in ``seed``)."""
    cfg = json.dumps(config, sort_keys=True)
    ds = dataset(name, seed, n, cfg)
    out = []
    for i in range(n):
        q = ds[i]["question"]
        out.append({
            "id": f"{name}-{seed}-{i}", "prompt": (q.lower() if lowercase else q) + "\n",
            "rg_dataset": name, "rg_seed": seed, "rg_size": n, "rg_config": cfg, "rg_index": i,
        })  # fmt: skip
    return out


class ReasoningGymEnv(Env):
    def __init__(
        self, max_attempts: int = 2, discount: float = 0.5, feedback: str = "wrong, try again\n"
    ) -> None:
        self.max_attempts, self.discount, self.feedback = max_attempts, discount, feedback
        self.attempt = 0
        self.ds: Any = None
        self.entry: dict[str, Any] = {}

    def reset(self, task: Task) -> str:
        r = task.record
        self.ds = dataset(r["rg_dataset"], int(r["rg_seed"]), int(r["rg_size"]), r["rg_config"])
        self.entry = self.ds[int(r["rg_index"])]
        self.attempt = 0
        return task.prompt

    def step(self, action: Action) -> StepResult:
        score = float(self.ds.score_answer(action.text.strip(), self.entry))
        reward = score * self.discount**self.attempt
        self.attempt += 1
        done = score >= 1.0 or self.attempt >= self.max_attempts
        metrics = {"solved": float(score >= 1.0), "attempts": float(self.attempt)}
        return StepResult("" if done else self.feedback, reward, done, {"metrics": metrics})


def demonstrations(
    name: str, n: int, seed: int = 0, *, lowercase: bool = False, **config: Any
) -> list[dict[str, str]]:
    """``n`` ``{"prompt", "response"}`` records (the sft schema): each entry's own answer, for a warm-start."""
    ds = dataset(name, seed, n, json.dumps(config, sort_keys=True))
    out = []
    for rec, entry in zip(make_records(name, n, seed, lowercase=lowercase, **config), ds, strict=True):
        answer = str(entry["answer"])
        out.append({"prompt": rec["prompt"], "response": answer.lower() if lowercase else answer})
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m rollout.envs.reasoning_gym NAME OUT.jsonl --n N [--lowercase] [--config JSON] [--demos]``."""
    import argparse

    from tandem.data import write_prompts

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("name")
    p.add_argument("out")
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lowercase", action="store_true")
    p.add_argument("--config", default="{}", help="the dataset's config as JSON")
    p.add_argument("--demos", action="store_true", help="write prompt/answer demonstrations (sft schema)")
    args = p.parse_args(argv)
    config = json.loads(args.config)
    if args.demos:
        recs = demonstrations(args.name, args.n, args.seed, lowercase=args.lowercase, **config)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps(r) + "\n" for r in recs))
        print(f"{len(recs)} {args.name} demonstrations: {out}")
        return 0
    recs = make_records(args.name, args.n, args.seed, lowercase=args.lowercase, **config)
    print(f"{len(recs)} {args.name} prompts: {write_prompts(args.out, recs)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
