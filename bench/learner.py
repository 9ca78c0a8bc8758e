"""Learner throughput: our PPO step against a bare DeepSpeed forward/backward/step loop, same batch, same run.

Our step (``Learner.train``: advantages, a PPO epoch over micro-batches, optimizer step; the proximal
no-grad pass is skipped with one optimizer step per batch, ``algorithm.prox_forward=auto``) is timed in both forward layouts (``pack``: sequences concatenated with restarting position ids;
``pad``: length-sorted micro-batches trimmed to their longest member), and the bare loop (padded to the
batch's longest sequence, attention mask, next-token loss on responses, one optimizer step) on the same
trajectories. Tokens are real tokens (prompt + response) per second of the timed call. The same step is
then timed with and without the proximal pass, and with and without DeepSpeed's gradient allreduce (a lone
rank could skip it), each interleaved, to show what skipping each saves.

    python bench/learner.py [--batch 32] [--iters 5] [--hidden 128] [--layers 4] [--chunked-head auto]

The last line is one JSON object: tokens_per_s, bare_tokens_per_s, overhead_ratio, peak_rss_mb, and the
per-layout figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# bench/buffer.py and bench/weightsync.py would shadow the packages of the same name.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch

from buffer.schema import Trajectory
from learner.batch import make_batch
from learner.models import load_models
from learner.ppo import PPOLearner as Learner
from tandem.config import load_config
from toy.tiny import make_tiny


def trajectories(batch: int, n: int, seed: int = 0) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    out = []
    for g in range(batch // n):
        prompt = rng.integers(4, 40, size=rng.integers(8, 25))
        for i in range(n):
            resp = rng.integers(4, 40, size=rng.integers(16, 97))
            out.append(
                Trajectory(
                    traj_id=f"{g}-{i}",
                    group_id=str(g),
                    prompt_id=str(g),
                    prompt_tokens=prompt,
                    response_tokens=resp,
                    behav_logp=np.full(len(resp), -3.5, dtype=np.float32),
                    token_versions=np.zeros(len(resp)),
                    reward=float(rng.random()),
                )
            )
    return out


def timed(fn, iters: int) -> float:
    """Median seconds of ``iters`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved(
    set_arm: Callable[[bool], None],
    step: Callable[[], None],
    iters: int,
    order: tuple[bool, bool] = (True, False),
) -> dict[bool, float]:
    """An A/B interleaved round by round: median seconds of ``step`` under each arm, first round dropped."""
    times: dict[bool, list[float]] = {arm: [] for arm in order}
    for _ in range(iters + 1):
        for arm in order:
            set_arm(arm)
            t0 = time.perf_counter()
            step()
            times[arm].append(time.perf_counter() - t0)
    return {arm: statistics.median(ts[1:]) for arm, ts in times.items()}


def bare_step(engine, trajs: list[Trajectory], micro: int) -> None:
    """The textbook loop: pad to the longest sequence, mask, next-token loss on responses, step."""
    seqs = [np.concatenate([t.prompt_tokens, t.response_tokens]) for t in trajs]
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)  # (B, T)
    attn = torch.zeros(len(seqs), width, dtype=torch.long)
    loss_mask = torch.zeros(len(seqs), width - 1)
    for i, (s, t) in enumerate(zip(seqs, trajs, strict=True)):
        ids[i, : len(s)] = torch.from_numpy(s.astype(np.int64))
        attn[i, : len(s)] = 1
        loss_mask[i, len(t.prompt_tokens) - 1 : len(s) - 1] = 1
    total = loss_mask.sum()
    for k in range(0, len(seqs), micro):
        sl = slice(k, k + micro)
        logits = engine(input_ids=ids[sl], attention_mask=attn[sl]).logits[:, :-1].float()  # (b, T-1, V)
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[sl, 1:], reduction="none")
        engine.backward((nll * loss_mask[sl]).sum() / total)
    engine.step()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument(
        "--chunked-head", choices=("auto", "on", "off"), default="auto", help="learner.chunked_head"
    )
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)

    with tempfile.TemporaryDirectory() as tmp:
        paths = make_tiny(Path(tmp) / "tiny", hidden=args.hidden, layers=args.layers)
        raw = {
            "run": {"name": "bench", "device": "cpu"},
            "model": {"actor": str(paths["actor"])},
            "data": {"prompts": __file__},
            "reward": {"functions": [{"path": "toy.tasks.echo:reward"}]},
            "rollout": {"n_samples": 4},
            "algorithm": {"advantage": "grpo", "batch_size": args.batch, "minibatch_size": args.batch},
            "learner": {"micro_batch_size": args.micro, "actor_lr": 1e-5, "chunked_head": args.chunked_head},
            "logging": {"wandb_mode": "disabled"},
        }
        cfg = load_config(None, raw=raw)
        trajs = trajectories(args.batch, cfg.rollout.n_samples)
        learner = Learner(cfg, tmp)
        learner.models = load_models(cfg, learner.device)
        batch = make_batch(trajs, 0)
        tokens = batch.num_tokens

        ours = {}
        for layout in ("pack", "pad"):
            learner.layout = layout
            ours[layout] = tokens / timed(lambda: learner.train(batch), args.iters)
            print(f"our step ({layout}): {ours[layout]:,.0f} tokens/s")
        bare = tokens / timed(lambda: bare_step(learner.models.actor, trajs, args.micro), args.iters)
        print(f"bare DeepSpeed fwd/bwd/step (padded): {bare:,.0f} tokens/s")
        # algorithm.prox_forward: the same step with and without the proximal no-grad pass, interleaved.
        learner.layout = max(ours, key=ours.get)
        prox_s = interleaved(
            lambda skip: setattr(learner, "prox_is_current", skip), lambda: learner.train(batch), args.iters
        )
        skip_s, full_s = prox_s[True], prox_s[False]
        print(
            f"proximal forward: {1000 * full_s:.0f} ms per step with it, {1000 * skip_s:.0f} ms skipped "
            f"(prox_forward=auto with one optimizer step); saves {100 * (1 - skip_s / full_s):.0f}%"
        )
        # DeepSpeed's gradient allreduce is pure overhead for a lone rank: the same step with it turned off
        # (``engine.enable_backward_allreduce``), interleaved; make_engine keeps it unless this pays.
        learner.prox_is_current = True
        actor = learner.models.actor
        ar_s = interleaved(
            lambda on: setattr(actor, "enable_backward_allreduce", on),
            lambda: learner.train(batch),
            args.iters,
            order=(False, True),
        )
        actor.enable_backward_allreduce = True
        off_s, on_s = ar_s[False], ar_s[True]
        print(
            f"gradient allreduce at world 1: {1000 * on_s:.0f} ms per step with it, {1000 * off_s:.0f} ms "
            f"skipped; saves {100 * (1 - off_s / on_s):.0f}%"
        )

    best = max(ours, key=ours.get)
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"overhead ratio (bare / ours, {best}): {bare / ours[best]:.2f}; pad / pack: {ours['pad'] / ours['pack']:.2f}"
    )
    print(
        json.dumps(
            {
                "tokens_per_s": round(ours[best], 1),
                "bare_tokens_per_s": round(bare, 1),
                "overhead_ratio": round(bare / ours[best], 3),
                "peak_rss_mb": round(peak_rss_mb, 1),
                "layout": best,
                "pack_tokens_per_s": round(ours["pack"], 1),
                "pad_tokens_per_s": round(ours["pad"], 1),
                "batch_tokens": tokens,
                "step_ms_prox_forward": round(1000 * full_s, 1),
                "step_ms_prox_skipped": round(1000 * skip_s, 1),
                "prox_skip_ratio": round(skip_s / full_s, 3),
                "step_ms_allreduce": round(1000 * on_s, 1),
                "step_ms_allreduce_skipped": round(1000 * off_s, 1),
                "allreduce_skip_ratio": round(off_s / on_s, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
