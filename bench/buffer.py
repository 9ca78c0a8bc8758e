"""Replay-buffer throughput against the raw Redis ceiling, measured in the same run on the same server.

Each round moves batches of realistic trajectories (512 prompt + 1,024 response tokens) through the full
path: ``put`` (encode + Lua append), ``take`` (XREADGROUP + decode + validate), ``ack`` (XACK + XDEL). The
raw arm moves opaque blobs of the same size with the same pipelining: one MULTI of XADDs per batch,
XREADGROUP COUNT batch, XACK. The arms alternate batch by batch, so load from other processes on a shared
machine hits both alike; figures are totals over all rounds. The embedded Redis keeps its AOF on (as deployed) unless
``--no-aof``.

    python bench/buffer.py [--batches 100] [--batch 64] [--prompt 512] [--response 1024] [--repeats 3]

The last line is one JSON object of figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

# This script is named like the package it measures: keep its own folder from shadowing `buffer`.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import numpy as np
import redis

from buffer.redis_server import EmbeddedRedis
from buffer.schema import Trajectory, decode_trajectory, encode_trajectory
from buffer.streams import ReplayBuffer


def make_trajs(n: int, prompt: int, response: int, seed: int = 0) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    return [
        Trajectory(
            traj_id=f"t{i}",
            group_id=f"g{i // 8}",
            prompt_id=f"p{i // 8}",
            prompt_tokens=rng.integers(0, 150_000, prompt),
            response_tokens=rng.integers(0, 150_000, response),
            behav_logp=-rng.exponential(1.0, response),
            token_versions=np.full(response, 3),
            reward=float(rng.normal()),
            reward_parts={"answer": 1.0, "format": 0.5},
            finish_reason="length",
            server_id="server-0",
            meta={"engine": "hf"},
        )
        for i in range(n)
    ]


class BufferArm:
    """The full path: put (encode + Lua append), take (XREADGROUP + decode + validate), ack (XACK + XDEL)."""

    def __init__(self, client: redis.Redis, run: str, trajs: list[Trajectory]) -> None:
        self.buf = ReplayBuffer(client, run, consumer="bench", maxlen=100_000)
        self.buf.take(1, timeout_s=0)  # create the group outside the timing
        self.trajs = trajs

    def batch(self) -> None:
        self.buf.put(self.trajs)
        taken = self.buf.take(len(self.trajs), timeout_s=10)
        assert len(taken) == len(self.trajs), "the buffer lost entries"
        self.buf.ack([t.id for t in taken])


class RawArm:
    """The same traffic as opaque blobs: a MULTI of XADDs, XREADGROUP COUNT batch, XACK."""

    def __init__(self, client: redis.Redis, key: str, blobs: list[bytes]) -> None:
        self.client, self.key, self.blobs = client, key, blobs
        client.xgroup_create(key, "learner", id="0", mkstream=True)

    def batch(self) -> None:
        pipe = self.client.pipeline(transaction=True)
        for b in self.blobs:
            pipe.xadd(self.key, {"d": b})
        pipe.execute()
        got = self.client.xreadgroup("learner", "bench", {self.key: ">"}, count=len(self.blobs), block=10_000)
        ids = [i for _, entries in got for i, _ in entries]
        assert len(ids) == len(self.blobs), "raw read came back short"
        self.client.xack(self.key, "learner", *ids)
        self.last_id = ids[-1]

    def cleanup(self) -> None:
        """Drop acknowledged blobs so memory stays flat (outside the timing: the raw arm keeps them)."""
        self.client.xtrim(self.key, minid=self.last_id, approximate=False)


def run_round(buffer_arm: BufferArm, raw_arm: RawArm, batches: int) -> tuple[float, float]:
    """Seconds spent by each arm, batches interleaved so load from other processes hits both alike."""
    spent = [0.0, 0.0]
    for _ in range(batches):
        for k, arm in enumerate((buffer_arm, raw_arm)):
            start = time.perf_counter()
            arm.batch()
            spent[k] += time.perf_counter() - start
        raw_arm.cleanup()
    return spent[0], spent[1]


def per_item_us(fn, items: list, loops: int = 5) -> float:
    best = float("inf")
    for _ in range(loops):
        start = time.perf_counter()
        for x in items:
            fn(x)
        best = min(best, time.perf_counter() - start)
    return best / len(items) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=100, help="batches per arm per repeat")
    ap.add_argument("--batch", type=int, default=64, help="trajectories per put/take")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    ap.add_argument("--response", type=int, default=1024, help="response tokens")
    ap.add_argument("--repeats", type=int, default=5, help="alternating rounds of both arms")
    ap.add_argument("--no-aof", action="store_true", help="turn the embedded Redis's AOF off")
    args = ap.parse_args()

    trajs = make_trajs(args.batch, args.prompt, args.response)
    payloads = [encode_trajectory(t) for t in trajs]
    size = sum(len(p) for p in payloads) / len(payloads)
    blobs = [os.urandom(len(p)) for p in payloads]
    encode_us = per_item_us(encode_trajectory, trajs)
    decode_us = per_item_us(decode_trajectory, payloads)
    n = args.batches * args.batch

    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp, EmbeddedRedis(tmp) as server:
        client = server.client()
        if args.no_aof:
            client.config_set("appendonly", "no")
        buffer_arm = BufferArm(client, "bench", trajs)
        raw_arm = RawArm(client, "raw:traj", blobs)
        ours, raw = [], []
        for r in range(args.repeats):
            t_ours, t_raw = run_round(buffer_arm, raw_arm, args.batches)
            ours.append(t_ours)
            raw.append(t_raw)
            print(f"round {r}: buffer {n / t_ours:8.0f} traj/s   raw {n / t_raw:8.0f} traj/s")
        client.close()

    traj_per_s, raw_per_s = n * args.repeats / sum(ours), n * args.repeats / sum(raw)
    figures = {
        "traj_per_s": round(traj_per_s, 1),
        "mb_per_s": round(traj_per_s * size / 1e6, 1),
        "raw_traj_per_s": round(raw_per_s, 1),
        "raw_mb_per_s": round(raw_per_s * size / 1e6, 1),
        "ratio_to_raw": round(traj_per_s / raw_per_s, 3),
        "encode_us": round(encode_us, 1),
        "decode_us": round(decode_us, 1),
        "bytes_per_traj": round(size),
        "batch": args.batch,
        "trajectories": n * args.repeats,
        "aof": not args.no_aof,
    }
    print(f"trajectory size {size / 1024:.1f} KiB ({args.prompt} prompt + {args.response} response tokens)")
    print(f"encode {encode_us:.1f} us/traj, decode+validate {decode_us:.1f} us/traj")
    print(f"buffer  {traj_per_s:8.0f} traj/s  {figures['mb_per_s']:7.1f} MB/s  (put + take + ack)")
    print(f"raw     {raw_per_s:8.0f} traj/s  {figures['raw_mb_per_s']:7.1f} MB/s  (XADD + XREADGROUP + XACK)")
    print(f"ratio to raw: {figures['ratio_to_raw']:.2f} (target >= 0.5)")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
