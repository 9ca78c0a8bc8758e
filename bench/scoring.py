"""The learner's scoring passes, one after another against side by side (``placement.scoring``), same run.

A 4-model PPO learner (actor, reference, critic; the proximal pass forced on, so three passes) scores the
same batch with ``serial`` (each pass on every thread, in turn) and ``split`` (each pass in its own thread
on its share of them, ``learner/passes.py``), the two interleaved round by round. Reports the median
seconds of each and their ratio, and checks that both give the same numbers.

    python bench/scoring.py [--batch 32] [--iters 7] [--hidden 128] [--layers 4] [--threads 2]

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

# This script's folder must not shadow the packages it measures.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import torch

from learner.batch import make_batch
from learner.models import load_models
from learner.ppo import PPOLearner
from tandem.config import load_config
from toy.tiny import make_tiny


def learner(actor: str, critic: str, out: str, scoring: str, micro: int) -> PPOLearner:
    cfg = load_config(None, raw={
        "run": {"name": "bench-scoring", "device": "cpu", "output_dir": out},
        "model": {"actor": actor, "critic": critic},
        "data": {"prompts": "unused.jsonl"},
        "reward": {"functions": [{"path": "toy.tasks.echo:reward"}]},
        "algorithm": {"advantage": "gae", "kl_coef": 0.05, "prox_forward": "always"},
        "learner": {"micro_batch_size": micro},
        "placement": {"scoring": scoring},
        "logging": {"wandb_mode": "disabled"},
    })  # fmt: skip
    return PPOLearner(cfg, out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    logging.disable(logging.WARNING)
    torch.set_num_threads(args.threads)
    # bench/learner.py's batch and A/B helpers (the bench folder is not a package)
    spec = importlib.util.spec_from_file_location("bench_learner", Path(__file__).with_name("learner.py"))
    bench_learner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_learner)
    interleaved, trajectories = bench_learner.interleaved, bench_learner.trajectories

    with tempfile.TemporaryDirectory() as tmp:
        paths = make_tiny(tmp, hidden=args.hidden, layers=args.layers)
        runs = {
            s: learner(str(paths["actor"]), str(paths["critic"]), tmp, s, args.micro)
            for s in ("serial", "split")
        }
        runs["split"].models = runs["serial"].models = load_models(runs["serial"].cfg, torch.device("cpu"))
        batch = make_batch(trajectories(args.batch, 4), 0)
        want, got = runs["serial"].score(batch), runs["split"].score(batch)
        same = max(float((w - g).abs().max()) for w, g in zip(want, got, strict=True))
        arm = {"s": "serial"}

        def set_arm(split: bool) -> None:
            arm["s"] = "split" if split else "serial"

        secs = interleaved(set_arm, lambda: runs[arm["s"]].score(batch), args.iters)
    serial_s, split_s = secs[False], secs[True]
    print(
        f"[scoring] {args.threads} threads, 3 passes, batch {args.batch}, hidden {args.hidden} x {args.layers}"
    )
    print(
        f"[scoring] serial {serial_s * 1e3:.1f} ms, split {split_s * 1e3:.1f} ms: split / serial {split_s / serial_s:.2f}"
    )
    print(f"[scoring] largest difference between the two: {same:.2e}")
    print(json.dumps({"bench": "scoring", "threads": args.threads, "batch": args.batch, "hidden": args.hidden,
                      "layers": args.layers, "serial_s": round(serial_s, 4), "split_s": round(split_s, 4),
                      "split_over_serial": round(split_s / serial_s, 3), "max_abs_diff": same}))  # fmt: skip


if __name__ == "__main__":
    main()
