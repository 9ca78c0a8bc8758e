"""Weight-sync throughput of each transport against a plain memory copy of the same bytes, in one run.

A model of the requested size with a transformer's name/shape mix (bf16 matrices, fp32 norms) goes from a
publisher in this process to a subscriber in a spawned process, several versions in a row. A version's
time runs from ``publish`` being called to the subscriber holding every tensor, verified and ready to copy
into its engine (the engine's own copy is reported apart as ``apply_s``, the same for every transport).
Figures are the median over the versions after the first three (steady state: by then shm rewrites the
files of retired versions instead of allocating tmpfs pages, dist reuses its buffers); the first version's
time is printed too. The baseline copies every tensor into a preallocated, already-touched tensor of the
same shape (``Tensor.copy_``). It is timed right before every version, and each version's ratio is
taken against that copy: this machine's memory bandwidth drifts by tens of percent within seconds, and
pairing keeps the drift out of the ratio (the median of the paired ratios is reported).

    python bench/weightsync.py [--sizes 100,500] [--transports shm,dist] [--versions 7] [--bucket-mb 256]
    python bench/weightsync.py --sizes 1000                               # 1 GB

The last line is one JSON object keyed by transport and size, each with ``gb_per_s`` and ``ratio_to_memcpy``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib

# This script is named like the package it measures: keep its own folder from shadowing `weightsync`.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import msgpack
import redis
import torch

from buffer.redis_server import EmbeddedRedis
from weightsync.base import Registry
from weightsync.dist import DistPublisher, DistSubscriber
from weightsync.shm import ShmPublisher, ShmSubscriber, raw_bytes

HIDDEN, INTERMEDIATE, VOCAB = 768, 2048, 16000


def make_model(size_mb: int) -> dict[str, torch.Tensor]:
    """Embedding plus as many layers as fill ``size_mb`` MB; bf16 matrices, fp32 norms and biases."""
    h, i = HIDDEN, INTERMEDIATE
    layer_bytes = 2 * (4 * h * h + 3 * h * i) + 4 * (3 * h + 2 * h)
    layers = max(1, round((size_mb * 1e6 - 2 * VOCAB * h) / layer_bytes))
    out = {"model.embed_tokens.weight": torch.randn(VOCAB, h).to(torch.bfloat16)}
    for n in range(layers):
        p = f"model.layers.{n}"
        for proj in ("q", "k", "v", "o"):
            out[f"{p}.self_attn.{proj}_proj.weight"] = torch.randn(h, h).to(torch.bfloat16)
        for proj in ("q", "k", "v"):
            out[f"{p}.self_attn.{proj}_proj.bias"] = torch.randn(h)
        out[f"{p}.mlp.gate_proj.weight"] = torch.randn(i, h).to(torch.bfloat16)
        out[f"{p}.mlp.up_proj.weight"] = torch.randn(i, h).to(torch.bfloat16)
        out[f"{p}.mlp.down_proj.weight"] = torch.randn(h, i).to(torch.bfloat16)
        out[f"{p}.input_layernorm.weight"] = torch.ones(h)
        out[f"{p}.post_attention_layernorm.weight"] = torch.ones(h)
    out["model.norm.weight"] = torch.ones(h)
    return out


def best_of(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


class Memcpy:
    """The baseline: copy every tensor into a preallocated, already-touched tensor of the same shape."""

    def __init__(self, model: dict[str, torch.Tensor]) -> None:
        self.pairs = [(torch.empty_like(t), t) for t in model.values()]
        self()  # fault the destination pages in first, as an engine's parameters are

    def __call__(self) -> float:
        start = time.perf_counter()
        for dst, src in self.pairs:
            dst.copy_(src)
        return time.perf_counter() - start


def checksum_gb_per_s(model: dict[str, torch.Tensor]) -> dict[str, float]:
    import xxhash

    nbytes = sum(t.nbytes for t in model.values())
    views = [raw_bytes(t) for t in model.values()]
    return {
        "xxh3_64": nbytes / best_of(lambda: [xxhash.xxh3_64_intdigest(v) for v in views]) / 1e9,
        "crc32": nbytes / best_of(lambda: [zlib.crc32(v) for v in views]) / 1e9,
    }


def subscriber_main(url: str, run: str, transport: str, last: int, done_key: str) -> None:
    """Receive versions until ``last``; after each, push (version, perf_counter at done, apply seconds)."""
    client = redis.Redis.from_url(url)
    if transport == "shm":
        sub = ShmSubscriber(client, run, "bench-sub", timeout_s=120)
    else:
        sub = DistSubscriber(client, run, "bench-sub", timeout_s=120)
    dst: dict[str, torch.Tensor] = {}
    while sub.version < last:
        upd = sub.poll(timeout=60)
        if upd is None:
            continue
        received = list(upd.tensors())  # verified (shm) / arrived (dist): ready to apply
        done = time.perf_counter()
        start = time.perf_counter()
        for name, t in received:
            if name not in dst:
                dst[name] = torch.empty_like(t)
            dst[name].copy_(t)
        apply_s = time.perf_counter() - start
        client.rpush(done_key, msgpack.packb([upd.version, done, apply_s]))
    sub.close()


def run_transport(url: str, transport: str, model: dict[str, torch.Tensor], args, root: str) -> dict:
    client = redis.Redis.from_url(url)
    run = f"bench-{transport}-{os.getpid()}-{time.monotonic_ns()}"
    done_key = f"{run}:bench:done"
    if transport == "shm":
        pub = ShmPublisher(client, run, os.path.join(root, run), shard_bytes=args.bucket_mb << 20)
    else:
        pub = DistPublisher(client, run, backend="gloo", bucket_bytes=args.bucket_mb << 20, timeout_s=120)
    proc = mp.get_context("spawn").Process(
        target=subscriber_main, args=(url, run, transport, args.versions - 1, done_key), daemon=True
    )
    proc.start()
    registry = Registry(client, run, live_s=120)
    deadline = time.monotonic() + 120
    while "bench-sub" not in registry.live():
        if time.monotonic() > deadline or proc.exitcode is not None:
            raise RuntimeError(f"{transport} subscriber did not register (exit code {proc.exitcode})")
        time.sleep(0.05)
    memcpy = Memcpy(model)
    rows = []
    for version in range(args.versions):
        copy_s = memcpy()
        start = time.perf_counter()
        pub.publish(model.items(), version)
        publish_s = time.perf_counter() - start
        item = client.blpop([done_key], timeout=120)
        if item is None:
            raise RuntimeError(f"{transport}: subscriber did not report v{version} within 120s")
        got, done, apply_s = msgpack.unpackb(item[1])
        assert got == version, (got, version)
        rows.append({"total_s": done - start, "publish_s": publish_s, "apply_s": apply_s, "memcpy_s": copy_s})
    proc.join(timeout=60)
    pub.close()
    shutil.rmtree(os.path.join(root, run), ignore_errors=True)
    steady = rows[3:] or rows
    return {
        "ratio": statistics.median(r["memcpy_s"] / r["total_s"] for r in steady),
        "memcpy_s": statistics.median(r["memcpy_s"] for r in steady),
        "total_s": statistics.median(r["total_s"] for r in steady),
        "publish_s": statistics.median(r["publish_s"] for r in steady),
        "apply_s": statistics.median(r["apply_s"] for r in steady),
        "first_s": rows[0]["total_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="100,500", help="model sizes in MB, comma-separated")
    parser.add_argument("--transports", default="shm,dist")
    parser.add_argument("--versions", type=int, default=7, help="versions per run (the first 3 warm up)")
    parser.add_argument("--bucket-mb", type=int, default=256, help="dist bucket / shm shard size in MiB")
    parser.add_argument("--root", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core per side, as a learner rank and a server would spare for this

    figures: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(os.path.join(tmp, "redis")) as server:
        for size_mb in (int(s) for s in args.sizes.split(",")):
            model = make_model(size_mb)
            nbytes = sum(t.nbytes for t in model.values())
            label = f"{size_mb}MB"
            sums = checksum_gb_per_s(model)
            print(
                f"{label}: {len(model)} tensors, {nbytes / 1e9:.3f} GB; "
                f"checksums xxh3_64 {sums['xxh3_64']:.1f} GB/s, crc32 {sums['crc32']:.1f} GB/s"
            )
            for transport in args.transports.split(","):
                r = run_transport(server.url, transport, model, args, args.root)
                gbps = nbytes / r["total_s"] / 1e9
                ratio = r["ratio"]
                figures.setdefault(transport, {})[label] = {
                    "gb_per_s": round(gbps, 3),
                    "ratio_to_memcpy": round(ratio, 3),
                    "memcpy_gb_per_s": round(nbytes / r["memcpy_s"] / 1e9, 3),
                    "publish_s": round(r["publish_s"], 4),
                    "total_s": round(r["total_s"], 4),
                    "first_version_s": round(r["first_s"], 4),
                    "apply_s": round(r["apply_s"], 4),
                }
                print(
                    f"  {transport:<5} {gbps:6.2f} GB/s  {ratio:5.2f}x memcpy ({nbytes / r['memcpy_s'] / 1e9:.2f} GB/s)  "
                    f"(publish {r['publish_s']:.3f}s, publish->held {r['total_s']:.3f}s, first version "
                    f"{r['first_s']:.3f}s, engine copy {r['apply_s']:.3f}s)"
                )
            del model
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
