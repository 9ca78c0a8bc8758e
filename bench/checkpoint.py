"""The learner's stall per checkpoint: synchronous (``learner/checkpoint.py`` ``save``) against asynchronous
(``learner/checkpoint_async.py``: snapshot to host memory, a writer thread, the commit at a later step).

One DeepSpeed engine (torch AdamW, ZeRO stage ``--zero``) over a Qwen2-shaped causal LM built locally with
random weights, for each ``--sizes`` entry (``HIDDENxLAYERS``). The two modes take turns, ``--checkpoints``
times each after one untimed warm-up of each. Synchronous stall: the whole ``save``. Asynchronous stall: the
snapshot plus the commit; between the two the learner keeps training steps until the writer is done, and
the bench reports the write's duration and the training steps' slowdown while the writer shares the cores.

    python bench/checkpoint.py [--sizes 64x2,768x12] [--checkpoints 3] [--zero 0]

The last line is one JSON object: per size the parameter count, both stalls (median seconds), their ratio
(async / sync; the target is <= 0.10), the write time and the step slowdown.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# bench/buffer.py and bench/weightsync.py would shadow the packages of the same name.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import deepspeed
import torch
from transformers import Qwen2ForCausalLM

from learner import checkpoint
from learner.checkpoint import LearnerState
from learner.checkpoint_async import AsyncCheckpointer
from learner.models import init_distributed
from toy.tiny import tiny_config

VOCAB = 32_000


def make_engine(hidden: int, layers: int, zero: int) -> deepspeed.DeepSpeedEngine:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_config(VOCAB, hidden=hidden, layers=layers, head_dim=min(64, hidden)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": zero},
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 30,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def train_step(engine: deepspeed.DeepSpeedEngine) -> float:
    start = time.perf_counter()
    ids = torch.randint(0, VOCAB, (1, 32))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return time.perf_counter() - start


def sync_stall(engine, ckpt_dir: Path, version: int) -> dict[str, float]:
    start = time.perf_counter()
    checkpoint.save(ckpt_dir, {"actor": engine}, LearnerState(version, []))
    return {"stall_s": time.perf_counter() - start}


def async_stall(engine, writer: AsyncCheckpointer, version: int) -> dict[str, float]:
    start = time.perf_counter()
    writer.snapshot({"actor": engine}, LearnerState(version, []))
    snapshot_s = time.perf_counter() - start
    steps = []  # the learner trains on while the writer writes
    while not writer.in_flight.done:
        steps.append(train_step(engine))
    write_s = time.perf_counter() - start
    start = time.perf_counter()
    assert writer.poll() is not None
    commit_s = time.perf_counter() - start
    return {
        "stall_s": snapshot_s + commit_s,
        "snapshot_s": snapshot_s,
        "commit_s": commit_s,
        "write_s": write_s,
        "step_during_write_s": statistics.mean(steps),
    }


def bench_size(hidden: int, layers: int, n: int, zero: int) -> dict[str, float]:
    engine = make_engine(hidden, layers, zero)
    n_params = sum(p.numel() for p in engine.module.parameters())
    alone = statistics.median(train_step(engine) for _ in range(3))
    rows: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_CKPT_DIR")) as tmp:
        sync_dir, async_dir = Path(tmp) / "sync", Path(tmp) / "async"
        writer = AsyncCheckpointer(async_dir, timeout_s=3600)
        for version in range(n + 1):  # version 0: the untimed warm-up of each
            train_step(engine)
            s = sync_stall(engine, sync_dir, version)
            train_step(engine)
            a = async_stall(engine, writer, version)
            if version:
                rows["sync"].append(s)
                rows["async"].append(a)
            print(f"{hidden}x{layers} #{version}: sync {s['stall_s']:.3f}s, async {a}", flush=True)

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[mode])

    sync, asyn = med("sync", "stall_s"), med("async", "stall_s")
    return {
        "params": n_params,
        "sync_stall_s": sync,
        "async_stall_s": asyn,
        "ratio": asyn / sync,
        "async_snapshot_s": med("async", "snapshot_s"),
        "async_commit_s": med("async", "commit_s"),
        "async_write_s": med("async", "write_s"),
        "step_alone_s": alone,
        "step_during_write_s": med("async", "step_during_write_s"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="64x2,768x12", help="HIDDENxLAYERS, comma-separated")
    p.add_argument("--checkpoints", type=int, default=3)
    p.add_argument("--zero", type=int, default=0, help="ZeRO stage (0-2; one rank)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    init_distributed(torch.device("cpu"))
    out = {}
    for size in args.sizes.split(","):
        hidden, layers = (int(x) for x in size.split("x"))
        out[size] = bench_size(hidden, layers, args.checkpoints, args.zero)
    print(json.dumps({"checkpoints": args.checkpoints, "zero_stage": args.zero, "sizes": out}))


if __name__ == "__main__":
    main()
