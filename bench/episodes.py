"""Multi-turn episodes against single-turn generation at the same token budget.

    python bench/episodes.py [--episodes 32] [--turns 4] [--turn-tokens 16] [--obs-tokens 4] [--repeats 3]
                             [--hidden 64] [--layers 2] [--threads 1]

In one run, on the same tiny checkpoint (hf engine, CPU), the same prompts and the same budget of
``turns × turn_tokens`` generated tokens per episode:
  (a) ``multi``: :class:`rollout.envs.episode.EpisodeRunner` runs ``turns`` model turns of ``turn_tokens``
      each (no stop string, EOS ignored), an environment answering every turn with ``obs_tokens`` tokens
      (context, not generated); each turn is one engine call over every live episode's whole context, so
      every turn prefills again;
  (b) ``single``: one ``engine.generate`` call of ``turns × turn_tokens`` new tokens per prompt.
Figures: episodes/s and generated tokens/s (``tokens_per_s``) of each; ``ratio`` = multi / single (< 1:
multi-turn is slower per generated token; the gap is the re-prefill, the per-turn engine call and the
environment's thread hand-offs). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

# This script's folder must not shadow the packages it measures.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import torch
from transformers import AutoTokenizer

from rollout.engines.base import SamplingParams
from rollout.engines.hf import HFEngine
from rollout.envs.base import Action, Env, StepResult, Task
from rollout.envs.episode import Episode, EpisodeRunner
from tandem.tiny import make_tiny


class FixedReply(Env):
    """Answers every model turn with the same observation; never ends an episode itself."""

    def __init__(self, obs: str) -> None:
        self.obs = obs

    def step(self, action: Action) -> StepResult:
        return StepResult(self.obs, 0.0, False)


def run_multi(engine: HFEngine, tok, prompts: list[list[int]], args) -> tuple[float, int]:
    obs = "ok, go\n"[: args.obs_tokens].ljust(args.obs_tokens, " ")
    sampling = SamplingParams(max_new_tokens=args.turn_tokens, temperature=1.0, seed=None)
    runner = EpisodeRunner(engine, tok, sampling, max_turns=args.turns, max_total_tokens=10_000,
                           step_timeout_s=30.0, vocab_size=len(tok))  # fmt: skip
    eps = [
        Episode(Task("", tuple(p), {"id": str(i)}), FixedReply(obs), list(p)) for i, p in enumerate(prompts)
    ]
    t0 = time.perf_counter()
    runner.run(eps)
    return time.perf_counter() - t0, sum(sum(e.mask) for e in eps)


def run_single(engine: HFEngine, prompts: list[list[int]], args) -> tuple[float, int]:
    sampling = SamplingParams(max_new_tokens=args.turns * args.turn_tokens, temperature=1.0, seed=None)
    t0 = time.perf_counter()
    out = engine.generate(prompts, sampling)
    return time.perf_counter() - t0, sum(len(c.token_ids) for (c,) in out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=16)
    ap.add_argument("--obs-tokens", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each; the medians are reported")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        path = str(make_tiny(tmp, hidden=args.hidden, layers=args.layers)["actor"])
        tok = AutoTokenizer.from_pretrained(path)
        engine = HFEngine(path, device="cpu", seed=0)
        # EOS ignored (like vLLM's ignore_eos), so both sides generate exactly the budget.
        engine.eos_token_ids = set()
        prompts = [tok(f"{i % 90 + 10}+{i % 7 + 3}=")["input_ids"] for i in range(args.episodes)]
        run_single(engine, prompts[:2], args)  # warm-up
        figures = {"multi": [], "single": []}
        for _ in range(args.repeats):
            for kind in ("multi", "single"):
                dt, n = (
                    run_multi(engine, tok, prompts, args)
                    if kind == "multi"
                    else run_single(engine, prompts, args)
                )
                figures[kind].append((dt, n))

    out = {}
    for kind, runs in figures.items():
        out[f"{kind}_episodes_per_s"] = statistics.median(args.episodes / dt for dt, _ in runs)
        out[f"{kind}_tokens_per_s"] = statistics.median(n / dt for dt, n in runs)
        out[f"{kind}_generated_tokens"] = statistics.median(n for _, n in runs)
        print(f"{kind:>6}: {out[f'{kind}_episodes_per_s']:8.2f} episodes/s  "
              f"{out[f'{kind}_tokens_per_s']:9.1f} generated tok/s  "
              f"({out[f'{kind}_generated_tokens']:.0f} generated tokens per run)")  # fmt: skip
    out["ratio_tokens_per_s"] = out["multi_tokens_per_s"] / out["single_tokens_per_s"]
    out["ratio_episodes_per_s"] = out["multi_episodes_per_s"] / out["single_episodes_per_s"]
    print(f"multi-turn / single-turn: {out['ratio_tokens_per_s']:.2f}x tokens/s, "
          f"{out['ratio_episodes_per_s']:.2f}x episodes/s")  # fmt: skip
    print(json.dumps({"bench": "episodes", **vars(args), **{k: round(v, 4) for k, v in out.items()}}))


if __name__ == "__main__":
    main()
