"""Train/inference mismatch on a mixture-of-experts model, with and without routing replay (R3).

A tiny Qwen3-MoE checkpoint is built locally (8 experts, top-2). The hf engine samples from it in
bfloat16 and records each token's experts (``record_routing``); the learner's forward reads the same tokens
in float32, as a trainer holding float32 weights does. Each router's logits then differ by bfloat16's
rounding, and a token whose 2nd and 3rd expert logits are close flips to another expert. Per token, with
``d = logp_learner - logp_engine``:

- the mismatch KL, k3 estimate of KL(engine || learner) from the engine's samples: mean of ``exp(d) - 1 - d``
  (the learner's ``mismatch/kl_k3``);
- ``max |d|``, and the share of token-layer routing slots the learner's own top-2 differs from the recorded
  one (``moe/routing_flips``).

Measured twice on the same samples: the learner routing by itself, and with ``learner.routing_replay``
forcing the recorded experts (:class:`learner.routing_replay.RoutingReplay`). What is left under replay is
bfloat16's rounding everywhere else.

    python bench/moe_mismatch.py [--hidden 128] [--layers 4] [--prompts 16] [--n 4] [--tokens 48]

The last line is one JSON object: both conditions' figures and the ratio of their KLs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

# bench/buffer.py would shadow the package of the same name.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from buffer.schema import Trajectory
from learner.batch import make_batch, micro_batches, response_view
from learner.models import policy_logits
from learner.routing_replay import RoutingReplay
from rollout.engines.base import SamplingParams
from rollout.engines.hf import HFEngine
from tandem.logprobs import logprobs_from_logits
from toy.tiny import make_tiny


def sample(path: Path, prompts: list[list[int]], n: int, tokens: int, dtype: str) -> list[Trajectory]:
    engine = HFEngine(str(path), device="cpu", dtype=dtype, seed=0, record_routing=True)
    try:
        out = engine.generate(prompts, SamplingParams(n=n, max_new_tokens=tokens, temperature=1.0, seed=1))
    finally:
        engine.close()
    return [
        Trajectory(
            traj_id=f"{i}-{j}", group_id=str(i), prompt_id=str(i), prompt_tokens=np.asarray(p),
            response_tokens=np.asarray(c.token_ids), behav_logp=np.asarray(c.logprobs, dtype=np.float32),
            token_versions=np.asarray(c.versions), reward=0.0, routed_experts=c.routed_experts,
        )
        for i, (p, group) in enumerate(zip(prompts, out, strict=True))
        for j, c in enumerate(group)
    ]  # fmt: skip


def mismatch(model: torch.nn.Module, trajs: list[Trajectory], replay: bool) -> dict[str, float]:
    """The learner's figures against the engine's log-probabilities, routing replayed or not."""
    batch = make_batch(trajs, 0)
    hooks = RoutingReplay(model)
    d, flips, slots = [], 0.0, 0.0
    try:
        for mb in micro_batches(batch, torch.arange(len(batch)), 8, "pad", torch.device("cpu")):
            mask = batch.mask[mb.rows].bool()
            with torch.no_grad(), hooks.replaying(mb.routed if replay else None):
                logp = logprobs_from_logits(response_view(policy_logits(model, mb, 1.0), mb), mb.targets)
            if replay:
                f, s = hooks.take_flips()
                flips, slots = flips + float(f), slots + float(s)
            d.append((logp - batch.behav_logp[mb.rows])[mask].double())
    finally:
        hooks.close()
    diff = torch.cat(d)
    out = {
        "kl_k3": float((diff.exp() - 1 - diff).mean()),
        "max_abs_log_ratio": float(diff.abs().max()),
        "tokens": diff.numel(),
    }
    if replay:  # the flips of the learner's own routing against the recorded one, counted while forcing
        out["routing_flip_frac"] = flips / max(slots, 1.0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--tokens", type=int, default=48, help="max new tokens per sample")
    ap.add_argument("--engine-dtype", default="bfloat16", help="the engine's dtype; the learner's is float32")
    args = ap.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny(Path(tmp) / "moe", arch="qwen3-moe", hidden=args.hidden, layers=args.layers)["actor"]
        rng = np.random.default_rng(0)
        prompts = [rng.integers(4, 40, size=int(rng.integers(4, 12))).tolist() for _ in range(args.prompts)]
        start = time.perf_counter()
        trajs = sample(path, prompts, args.n, args.tokens, args.engine_dtype)
        sampled_s = time.perf_counter() - start
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        plain = mismatch(model, trajs, replay=False)
        replayed = mismatch(model, trajs, replay=True)
    ratio = replayed["kl_k3"] / plain["kl_k3"] if plain["kl_k3"] > 0 else float("nan")
    print(
        f"engine {args.engine_dtype}, learner float32; {plain['tokens']} sampled tokens ({sampled_s:.1f} s)"
    )
    print(f"routing slots the learner's own top-2 flips: {replayed['routing_flip_frac']:.2%}")
    for name, r in (("own routing", plain), ("routing replay", replayed)):
        print(
            f"  {name:15s} mismatch KL (k3) {r['kl_k3']:.3e}   max |log ratio| {r['max_abs_log_ratio']:.3f}"
        )
    print(f"KL with replay / without: {ratio:.3f}")
    print(
        json.dumps({"engine_dtype": args.engine_dtype, "own": plain, "replay": replayed, "kl_ratio": ratio})
    )


if __name__ == "__main__":
    main()
