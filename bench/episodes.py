"""Multi-turn episodes: turn-synchronous rounds against independent progression, and against single-turn
generation at the same token budget.

    python bench/episodes.py [--engine hf|vllm] [--episodes 32] [--turns 4] [--turn-tokens 16]
                             [--obs-tokens 4] [--repeats 3] [--slow-ms 200] [--slow-share 0.1] [--fast-ms 2]
                             [--gather-ms 2] [--hidden 64] [--layers 2] [--threads 1]
                             [--prefix-cache-mb 256]

In one run, on the same tiny checkpoint (CPU), the same prompts and the same budget of ``turns ×
turn_tokens`` generated tokens per episode (no stop string; EOS ignored on hf):
  (a) **heavy-tailed environment**: every step sleeps ``fast_ms``, except a ``slow_share`` of them that
      sleep ``slow_ms`` (a tool call that hits the network). ``rounds`` (``env.progression: rounds``) waits
      for the slowest step of every round; ``independent`` lets each episode take its next turn as soon as
      its own step returns. Figure: episodes/s of each and their ratio.
  (b) **instant environment** against single-turn: each progression's generated tokens/s against one
      ``engine.generate`` call of ``turns × turn_tokens`` new tokens per prompt. Below 1, multi-turn is
      slower per generated token: each turn is an engine call of its own, and its prefill covers the
      context's new tokens (the hf engine's prefix cache, ``rollout.hf_prefix_cache_mb``, holds the earlier
      turns' KV) or, with the cache off, the whole context again.
  (c) on hf, (b)'s two progressions again on a second engine with the prefix cache off
      (``*_nocache``), in the same interleaved runs: the cache's gain is ``*_cache_vs_nocache``, and
      ``prefix_*`` says how many rows hit and what share of context tokens came from the cache.
Independent episodes send each turn as a call of its own into the engine's running batch: the hf
engine's (an idle engine waits ``--gather-ms``, ``env.gather_ms``, for the turns of the same moment, as a
run with independent progression sets it) or, with ``--engine vllm`` (run it with
``.venv-vllm/bin/python``; a head_dim-32 checkpoint), the server's. The environment answers every turn with ``obs_tokens`` tokens (context, not generated).
The last line is one JSON object.
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

from rollout.engines.base import Engine, SamplingParams
from rollout.engines.hf import DEFAULT_PREFIX_CACHE_MB, HFEngine
from rollout.envs.base import Task
from rollout.envs.episode import Episode, EpisodeRunner
from toy.tasks.slow_tool import SlowTool, reseed
from toy.tiny import make_tiny


def env(obs: str, args: argparse.Namespace, tail: bool) -> SlowTool:
    """The heavy-tailed environment (``--slow-ms``, ``--slow-share``, ``--fast-ms``), or an instant one."""
    if not tail:
        return SlowTool(obs)
    return SlowTool(obs, slow_ms=args.slow_ms, slow_share=args.slow_share, fast_ms=args.fast_ms)


def run_multi(
    engine: HFEngine, tok, prompts: list[list[int]], args, progression: str, tail: bool
) -> tuple[float, int]:
    obs = "ok, go\n"[: args.obs_tokens].ljust(args.obs_tokens, " ")
    sampling = SamplingParams(max_new_tokens=args.turn_tokens, temperature=1.0, seed=None)
    runner = EpisodeRunner(engine, tok, sampling, max_turns=args.turns, max_total_tokens=10_000,
                           step_timeout_s=30.0, vocab_size=len(tok), progression=progression,
                           gather_s=args.gather_ms / 1000)  # fmt: skip
    eps = [
        Episode(Task("", tuple(p), {"id": str(i)}), env(obs, args, tail), list(p))
        for i, p in enumerate(prompts)
    ]
    if isinstance(engine, HFEngine):  # as make_engine sets it for a run of this progression
        engine.gather_s = args.gather_ms / 1000 if progression == "independent" else 0.0
    t0 = time.perf_counter()
    runner.run(eps)
    return time.perf_counter() - t0, sum(sum(e.mask) for e in eps)


def make_engine(
    args: argparse.Namespace, path: str, tmp: str, prefix_cache_mb: float | None = None
) -> Engine:
    if args.engine == "hf":
        mb = args.prefix_cache_mb if prefix_cache_mb is None else prefix_cache_mb
        engine = HFEngine(path, device="cpu", seed=0, prefix_cache_mb=mb)
        engine.eos_token_ids = set()  # EOS ignored, so every side generates exactly the budget
        return engine
    from rollout.engines.vllm import VLLMEngine
    from tandem.config import load_config

    vllm_args = ["--max-model-len", "512", "--kv-cache-memory-bytes", str(256 << 20)]
    cfg = load_config(None, raw={
        "run": {"name": "benchepisodes", "device": "cpu", "output_dir": tmp},
        "model": {"actor": path, "dtype": "float32"},
        "data": {"prompts": "unused.jsonl"},
        "rollout": {"engine": "vllm", "vllm": {"extra_args": vllm_args, "startup_timeout_s": 600}},
        "reward": {"functions": [{"path": "toy.tasks.echo:reward"}]},  # unused: the config needs one
        "logging": {"wandb_mode": "disabled"},
    })  # fmt: skip
    return VLLMEngine(cfg, path, server_index=0, device="cpu")


def run_single(engine: HFEngine, prompts: list[list[int]], args) -> tuple[float, int]:
    sampling = SamplingParams(max_new_tokens=args.turns * args.turn_tokens, temperature=1.0, seed=None)
    t0 = time.perf_counter()
    out = engine.generate(prompts, sampling)
    return time.perf_counter() - t0, sum(len(c.token_ids) for (c,) in out)


def run_order(kinds: list[str], repeat: int) -> list[str]:
    """``kinds`` in order, except that in every other repeat each ``*_nocache`` kind runs just before its
    cached neighbour rather than just after it."""
    order: list[str] = []
    for kind in kinds:
        order.insert(len(order) - 1 if kind.endswith("_nocache") and repeat % 2 else len(order), kind)
    return order


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--engine", choices=["hf", "vllm"], default="hf", help="vllm: run with .venv-vllm's python"
    )
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=16)
    ap.add_argument("--obs-tokens", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each; the medians are reported")
    ap.add_argument("--slow-ms", type=float, default=200.0, help="a slow environment step")
    ap.add_argument("--slow-share", type=float, default=0.1, help="the share of steps that are slow")
    ap.add_argument("--fast-ms", type=float, default=2.0, help="every other step")
    ap.add_argument("--gather-ms", type=float, default=2.0, help="env.gather_ms of independent progression")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--prefix-cache-mb",
        type=float,
        default=DEFAULT_PREFIX_CACHE_MB,
        help="hf: rollout.hf_prefix_cache_mb",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    reseed(0)

    runs: dict[str, list[tuple[float, int]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        head_dim = 32 if args.engine == "vllm" else None  # vLLM's CPU attention refuses 16
        path = str(make_tiny(tmp, hidden=args.hidden, layers=args.layers, head_dim=head_dim)["actor"])
        tok = AutoTokenizer.from_pretrained(path)
        engine = make_engine(args, path, tmp)
        prompts = [tok(f"{i % 90 + 10}+{i % 7 + 3}=")["input_ids"] for i in range(args.episodes)]
        run_single(engine, prompts[:2], args)  # warm-up
        plain = make_engine(args, path, tmp, prefix_cache_mb=0) if args.engine == "hf" else None
        # Two phases, each interleaved over the repeats so a change of machine load hits its kinds alike.
        # Single-turn and the instant kinds run back to back; the heavy-tailed kinds, which mostly sleep,
        # come after them: a run that follows an idle second measured 10-20% slower (a shared 2-core
        # machine, 2026-11-25), which would bias whichever kind came next. Cache on and off run as
        # neighbours, taking turns at going first.
        busy = {"single": lambda: run_single(engine, prompts, args)}
        for p in ("rounds", "independent"):
            busy[f"instant_{p}"] = lambda p=p: run_multi(engine, tok, prompts, args, p, False)
            if plain is not None:
                busy[f"instant_{p}_nocache"] = lambda p=p: run_multi(plain, tok, prompts, args, p, False)
        tail = {
            "tail_rounds": lambda: run_multi(engine, tok, prompts, args, "rounds", True),
            "tail_independent": lambda: run_multi(engine, tok, prompts, args, "independent", True),
        }  # fmt: skip
        try:
            for phase in (busy, tail):
                for r in range(args.repeats):
                    for kind in run_order(list(phase), r):
                        runs.setdefault(kind, []).append(phase[kind]())
        finally:
            prefix = engine.prefix_stats() if isinstance(engine, HFEngine) else None
            prefilled = engine.prefilled_tokens if isinstance(engine, HFEngine) else 0
            for e in (engine, plain):
                if e is not None:
                    e.close()

    out: dict[str, float] = {}
    for kind, rs in runs.items():
        out[f"{kind}_episodes_per_s"] = statistics.median(args.episodes / dt for dt, _ in rs)
        out[f"{kind}_tokens_per_s"] = statistics.median(n / dt for dt, n in rs)
        print(f"{kind:>27}: {out[f'{kind}_episodes_per_s']:8.2f} episodes/s  "
              f"{out[f'{kind}_tokens_per_s']:9.1f} generated tok/s  "
              f"({statistics.median(n for _, n in rs):.0f} generated tokens per run)")  # fmt: skip
    out["tail_independent_vs_rounds"] = (
        out["tail_independent_episodes_per_s"] / out["tail_rounds_episodes_per_s"]
    )
    for p in ("rounds", "independent"):
        out[f"instant_{p}_vs_single_tokens"] = out[f"instant_{p}_tokens_per_s"] / out["single_tokens_per_s"]
    print(f"heavy-tailed environment ({args.slow_share:.0%} of steps {args.slow_ms:g} ms, the rest {args.fast_ms:g} ms): "
          f"independent / rounds {out['tail_independent_vs_rounds']:.2f}x episodes/s")  # fmt: skip
    print(f"instant environment, multi-turn / single-turn tokens/s: rounds {out['instant_rounds_vs_single_tokens']:.2f}x, "
          f"independent {out['instant_independent_vs_single_tokens']:.2f}x")  # fmt: skip
    if plain is not None:
        for p in ("rounds", "independent"):
            out[f"instant_{p}_cache_vs_nocache"] = (
                out[f"instant_{p}_tokens_per_s"] / out[f"instant_{p}_nocache_tokens_per_s"]
            )
        print(f"hf prefix cache on / off, generated tokens/s: rounds {out['instant_rounds_cache_vs_nocache']:.2f}x, "
              f"independent {out['instant_independent_cache_vs_nocache']:.2f}x")  # fmt: skip
    if prefix is not None and prefix.lookups:
        out["prefix_hit_rows"] = prefix.hits / prefix.lookups
        out["prefix_reused_share"] = prefix.reused_tokens / (prefix.reused_tokens + prefilled)
        print(f"prefix cache (every run of the cached engine): {prefix.hits}/{prefix.lookups} rows hit, "
              f"{out['prefix_reused_share']:.0%} of context tokens reused rather than prefilled, "
              f"{prefix.evicted} entries evicted")  # fmt: skip
    print(json.dumps({"bench": "episodes", **vars(args), **{k: round(v, 4) for k, v in out.items()}}))


if __name__ == "__main__":
    main()
