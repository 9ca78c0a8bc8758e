"""reasoning-gym as a task source and a multi-turn environment (docs/environments.md §10.5).

Any of reasoning-gym's procedural datasets by name (``reasoning_gym.create_dataset(name, seed=, size=,
**config)``), generated offline; the reward is the dataset's own ``score_answer``. The episode is a few
attempts: a wrong answer is told so (``"wrong, try again\\n"``) and the model answers again; the reward of
attempt ``k`` is ``score · discount**k``, so a first-time answer is worth most.

A prompt record names its entry (``rg_dataset``, ``rg_seed``, ``rg_size``, ``rg_config``, ``rg_index``);
the environment regenerates the dataset once per process (they are deterministic in the seed) and scores
against that entry, so nothing but the record travels through Redis. ``lowercase`` maps the question to the
tiny tokenizer's alphabet.

Single-turn RL scores the same records with a reward plug-in (``reward.functions: [{path:
rollout.envs.reasoning_gym:solved}]``): :func:`reward` is the dataset's ``score_answer`` of the whole
completion, partial credit included; :func:`solved` is 1 for full marks, else 0. A record that names no
entry raises, naming the missing fields (the reward plug-ins log and count it).
:func:`demonstration_records` gives the ``{"prompt", "response"}`` records an SFT warm-start trains on (the
dataset's own answers). ``configs/tiny-arith.yaml`` is the demo (docs/stages.md §4.1).
"""

from __future__ import annotations

import functools
import json
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
        out.append(
            {
                "id": f"{name}-{seed}-{i}",
                "prompt": (q.lower() if lowercase else q) + "\n",
                "rg_dataset": name,
                "rg_seed": seed,
                "rg_size": n,
                "rg_config": cfg,
                "rg_index": i,
            }
        )
    return out


def entry_of(record: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The dataset and the entry a prompt record names (``rg_*`` fields, as :func:`make_records` writes)."""
    missing = [k for k in ("rg_dataset", "rg_seed", "rg_size", "rg_config", "rg_index") if k not in record]
    if missing:
        raise KeyError(f"prompt record {record.get('id', '?')!r} names no reasoning-gym entry: no {missing}")
    ds = dataset(record["rg_dataset"], int(record["rg_seed"]), int(record["rg_size"]), record["rg_config"])
    return ds, ds[int(record["rg_index"])]


def reward(prompt: str, completion: str, record: dict[str, Any]) -> float:
    """Single-turn reward: the dataset's own ``score_answer`` of the stripped completion against the entry
    the record names (1 for the exact answer; reasoning-gym's default gives ``len(answer)/len(completion)``
    when the answer is inside a longer completion, 0 otherwise)."""
    ds, entry = entry_of(record)
    return float(ds.score_answer(completion.strip(), entry))


def solved(prompt: str, completion: str, record: dict[str, Any]) -> float:
    """1 when the dataset's verifier gives full marks, else 0: :func:`reward` without the partial credit,
    which a small policy learns to farm by padding its guesses (the answer inside a longer string still
    scores) instead of answering (docs/stages.md §4.1)."""
    return float(reward(prompt, completion, record) >= 1.0)


def demonstration_records(
    name: str, n: int, seed: int = 0, *, lowercase: bool = False, **config: Any
) -> list[dict[str, str]]:
    """``n`` SFT records (``{"prompt", "response"}``, the sft schema): the question and the dataset's answer."""
    recs = make_records(name, n, seed, lowercase=lowercase, **config)
    answers = (str(entry_of(r)[1]["answer"]) for r in recs)
    return [
        {"prompt": r["prompt"], "response": a.lower() if lowercase else a}
        for r, a in zip(recs, answers, strict=True)
    ]


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


def main(argv: list[str] | None = None) -> int:
    """``python -m rollout.envs.reasoning_gym NAME OUT.jsonl --n N [--seed S] [--lowercase] [--config JSON]
    [--kind prompts|sft]``: prompt records, or SFT demonstrations (``--kind sft``)."""
    import argparse

    from tandem.data import write_prompts

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("name")
    p.add_argument("out")
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lowercase", action="store_true")
    p.add_argument("--config", default="{}", help="the dataset's config as JSON")
    p.add_argument("--kind", choices=["prompts", "sft"], default="prompts", help="what each record is")
    args = p.parse_args(argv)
    make = make_records if args.kind == "prompts" else demonstration_records
    recs = make(args.name, args.n, args.seed, lowercase=args.lowercase, **json.loads(args.config))
    print(f"{len(recs)} {args.name} {args.kind} records: {write_prompts(args.out, recs)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
