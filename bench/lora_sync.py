"""LoRA adapter-only weight sync against full weights: bytes and time per sync, shm and dist, into an hf engine.

A Qwen2-architecture checkpoint is built locally, wrapped in LoRA adapters (``learner/lora.py``) with
random ``B`` (so updates are not no-ops), and each version is published from this process either as the
merged full weights or as the adapter tensors alone (``weightsync/adapters.py``). A spawned subscriber
process holds a real ``HFEngine`` loaded from the base checkpoint and applies every update with
``update_weights`` (copy for full weights, ``W0 + scaling · B @ A`` for adapters). Timed: publish until the
engine has applied it (the learner's ``time/weight_sync`` plus the server's apply), medians after warm-up.

    python bench/lora_sync.py [--hidden 256] [--layers 4] [--rank 8] [--versions 6]

The last line is one JSON object: bytes of each kind, their ratio, and per transport the times.
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

# bench/weightsync.py would shadow the package of the same name.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import msgpack
import redis
import torch

from buffer.redis_server import EmbeddedRedis
from learner import lora
from tandem.config import LoRAConfig
from weightsync.base import Registry
from weightsync.dist import DistPublisher, DistSubscriber
from weightsync.shm import ShmPublisher, ShmSubscriber


def subscriber_main(url: str, run: str, transport: str, model_dir: str, last: int, done_key: str) -> None:
    from rollout.engines.hf import HFEngine

    torch.set_num_threads(1)
    client = redis.Redis.from_url(url)
    engine = HFEngine(model_dir, device="cpu", dtype="float32")
    sub = (ShmSubscriber if transport == "shm" else DistSubscriber)(client, run, "bench-sub", timeout_s=120)
    while sub.version < last:
        upd = sub.poll(timeout=60)
        if upd is None:
            continue
        start = time.perf_counter()
        engine.update_weights(upd)
        done = time.perf_counter()
        client.rpush(done_key, msgpack.packb([upd.version, done, done - start]))
    sub.close()


def run_case(url: str, transport: str, named: list, model_dir: str, versions: int, root: str) -> dict:
    client = redis.Redis.from_url(url)
    run = f"lora-{transport}-{os.getpid()}-{time.monotonic_ns()}"
    done_key = f"{run}:bench:done"
    if transport == "shm":
        pub = ShmPublisher(client, run, os.path.join(root, run))
    else:
        pub = DistPublisher(client, run, backend="gloo", timeout_s=120)
    proc = mp.get_context("spawn").Process(
        target=subscriber_main, args=(url, run, transport, model_dir, versions - 1, done_key), daemon=True
    )
    proc.start()
    registry = Registry(client, run, live_s=120)
    deadline = time.monotonic() + 180
    while "bench-sub" not in registry.live():
        if time.monotonic() > deadline or proc.exitcode is not None:
            raise RuntimeError(f"{transport} subscriber did not register (exit code {proc.exitcode})")
        time.sleep(0.05)
    rows = []
    for version in range(versions):
        start = time.perf_counter()
        pub.publish(named, version)
        publish_s = time.perf_counter() - start
        item = client.blpop([done_key], timeout=180)
        if item is None:
            raise RuntimeError(f"{transport}: subscriber did not apply v{version} within 180s")
        got, done, apply_s = msgpack.unpackb(item[1])
        assert got == version, (got, version)
        rows.append({"total_s": done - start, "publish_s": publish_s, "apply_s": apply_s})
    proc.join(timeout=60)
    pub.close()
    shutil.rmtree(os.path.join(root, run), ignore_errors=True)
    steady = rows[2:] or rows
    return {k: statistics.median(r[k] for r in steady) for k in ("total_s", "publish_s", "apply_s")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--versions", type=int, default=6, help="versions per case (the first 2 warm up)")
    ap.add_argument("--transports", default="shm,dist")
    ap.add_argument("--root", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    args = ap.parse_args()
    torch.set_num_threads(1)
    from toy.tiny import make_tiny

    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(os.path.join(tmp, "redis")) as server:
        base_dir = make_tiny(os.path.join(tmp, "tiny"), hidden=args.hidden, layers=args.layers)["actor"]
        from transformers import AutoModelForCausalLM

        model = lora.wrap(AutoModelForCausalLM.from_pretrained(base_dir), LoRAConfig(rank=args.rank))
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)
        params = [(n, p.detach()) for n, p in model.named_parameters()]
        kinds = {
            "full": list(lora.merged_tensors(model, params)),
            "adapter": list(lora.adapter_tensors(model, params)),
        }
        nbytes = {k: sum(t.numel() * t.element_size() for _, t in v) for k, v in kinds.items()}
        print(
            f"hidden {args.hidden}, {args.layers} layers, LoRA r={args.rank} on attention and MLP: full "
            f"{nbytes['full'] / 1e6:.2f} MB, adapter {nbytes['adapter'] / 1e6:.3f} MB "
            f"({100 * nbytes['adapter'] / nbytes['full']:.1f}% of full)"
        )
        figures: dict[str, dict] = {}
        for transport in args.transports.split(","):
            for kind, named in kinds.items():
                r = run_case(server.url, transport, named, str(base_dir), args.versions, args.root)
                figures.setdefault(transport, {})[kind] = r
                print(
                    f"{transport:4s} {kind:7s}: publish->applied {r['total_s'] * 1e3:7.1f} ms "
                    f"(publish {r['publish_s'] * 1e3:.1f} ms, engine apply {r['apply_s'] * 1e3:.1f} ms)"
                )
            f = figures[transport]
            f["time_ratio"] = f["adapter"]["total_s"] / f["full"]["total_s"]
            print(f"{transport}: adapter sync takes {f['time_ratio']:.2f}x the time of a full sync")
    print(
        json.dumps(
            {
                "hidden": args.hidden,
                "layers": args.layers,
                "rank": args.rank,
                "full_bytes": nbytes["full"],
                "adapter_bytes": nbytes["adapter"],
                "bytes_ratio": nbytes["adapter"] / nbytes["full"],
                **figures,
            }
        )
    )


if __name__ == "__main__":
    main()
