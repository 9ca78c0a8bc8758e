"""Environment episodes in the rollout loop: one batch in flight against several, under a heavy-tailed
environment.

    python bench/episode_window.py [--engine hf|vllm] [--batches 12] [--inflight 3] [--chunk 4]
                                   [--prompts-per-batch 4] [--n-samples 4] [--turns 3] [--turn-tokens 16]
                                   [--slow-ms 1000] [--slow-share 0.1] [--fast-ms 2] [--threads 1]

Each episode plays up to ``--turns`` model turns of ``--turn-tokens`` tokens (EOS ignored on hf), and every
environment step sleeps ``--fast-ms``, except a ``--slow-share`` of them that sleep ``--slow-ms`` (a tool
call that hits the network). Episodes progress independently (``env.progression: independent``), so each
turn is its own engine call. The full rollout loop runs them (a real Redis via EmbeddedRedis: admission,
prompt claims, the append), with ``rollout.max_inflight_batches`` 1 and ``--inflight``, taking turns of
``--chunk`` batches each on the same engine, so load from other processes hits both alike.

With one batch in flight a batch ends with its slowest episode, and the engine waits for it; with several,
the next batches' turns fill the engine meanwhile (docs/design.md §1.3). Figure: episodes/s of each and
their ratio. ``--engine vllm`` needs ``.venv-vllm`` and uses a head_dim-32 checkpoint. The last line is
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

# This script's folder must not shadow the packages it measures.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from buffer.redis_server import EmbeddedRedis
from buffer.schema import PromptRecord
from buffer.streams import ReplayBuffer
from rollout.engines.base import Engine
from rollout.engines.hf import HFEngine
from rollout.loop import RolloutLoop
from tandem.config import Config, load_config
from tandem.rewards import RewardFunctions
from tandem.telemetry import Telemetry
from toy.tasks import make_records
from toy.tiny import make_tiny
from weightsync import make_publisher, make_subscriber

VLLM_ARGS = ["--max-model-len", "512", "--kv-cache-memory-bytes", str(256 << 20)]


def config(args: argparse.Namespace, tmp: str, redis_url: str, ckpt: Path, window: int) -> Config:
    rows = args.prompts_per_batch * args.n_samples
    return load_config(None, raw={
        "run": {"name": f"benchwindow{window}", "device": "cpu", "output_dir": tmp},
        "redis": {"url": redis_url},
        "model": {"actor": str(ckpt), "dtype": "float32"},
        "data": {"prompts": "unused.jsonl"},
        "rollout": {
            "n_samples": args.n_samples, "prompts_per_batch": args.prompts_per_batch,
            "max_new_tokens": args.turn_tokens, "max_inflight_batches": window, "engine": args.engine,
            "vllm": {"extra_args": VLLM_ARGS, "startup_timeout_s": 600},
        },
        "env": {
            "path": "toy.tasks.slow_tool:SlowTool", "max_turns": args.turns, "progression": "independent",
            "max_total_tokens": 400,
            "kwargs": {"slow_ms": args.slow_ms, "slow_share": args.slow_share, "fast_ms": args.fast_ms},
        },
        "reward": {"functions": [{"path": "toy.tasks.echo:reward"}]},
        # Admission never binds here: this measures the servers, not the learner.
        "algorithm": {"batch_size": rows, "minibatch_size": rows, "max_staleness": 10_000},
        "learner": {"micro_batch_size": rows},
        "weightsync": {"shm_dir": str(Path(tmp) / "shm")},
        "logging": {"wandb_mode": "disabled"},
    })  # fmt: skip


def make_loop(cfg: Config, engine: Engine, tok, client, records: list[dict], weights: dict) -> RolloutLoop:
    """A run of its own (its Redis keys, prompts and version 0) around the shared engine."""
    buffer = ReplayBuffer.from_config(client, cfg, consumer="server-0")
    buffer.put_prompts([PromptRecord(r["id"], r["prompt"], tok(r["prompt"]).input_ids, r) for r in records])
    make_publisher(cfg, client).publish(weights.items(), 0)
    return RolloutLoop(
        cfg, engine, tok, buffer, make_subscriber(cfg, client, "server-0"),
        Telemetry(cfg, "server-0", client), server_index=0, rewards=RewardFunctions(cfg.reward),
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--engine", choices=["hf", "vllm"], default="hf", help="vllm: run with .venv-vllm's python"
    )
    ap.add_argument("--batches", type=int, default=12, help="timed batches per window setting")
    ap.add_argument("--inflight", type=int, default=3, help="the window compared with 1")
    ap.add_argument("--chunk", type=int, default=4, help="batches per turn of each setting")
    ap.add_argument("--prompts-per-batch", type=int, default=4)
    ap.add_argument("--n-samples", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--turn-tokens", type=int, default=16)
    ap.add_argument("--slow-ms", type=float, default=1000.0)
    ap.add_argument("--slow-share", type=float, default=0.1)
    ap.add_argument("--fast-ms", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis") as redis_server:
        head_dim = 32 if args.engine == "vllm" else None  # vLLM's CPU attention refuses 16
        ckpt = make_tiny(Path(tmp) / "tiny", head_dim=head_dim)["actor"]
        tok = AutoTokenizer.from_pretrained(ckpt)
        client = redis_server.client()
        windows = (1, args.inflight)
        cfgs = {w: config(args, tmp, redis_server.url, ckpt, w) for w in windows}
        if args.engine == "hf":
            engine: Engine = HFEngine(str(ckpt), device="cpu", seed=0)
            engine.eos_token_ids = set()  # every turn generates its whole budget
        else:
            from rollout.engines.vllm import VLLMEngine

            engine = VLLMEngine(cfgs[1], str(ckpt), server_index=0, device="cpu")
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
        weights = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
        records = make_records("echo", args.prompts_per_batch * (args.batches + 2), seed=0)
        loops = {w: make_loop(cfgs[w], engine, tok, client, records, weights) for w in windows}
        assert loops[args.inflight].window == args.inflight, "the window was capped (sync mode or rounds?)"
        for loop in loops.values():  # warm-up: applies the version-0 weights, not timed
            loop.step()
            loop.drain()
        seconds = dict.fromkeys(windows, 0.0)
        episodes = dict.fromkeys(windows, 0)
        done = 0
        while done < args.batches:  # in turns, so a change of machine load hits both alike
            k = min(args.chunk, args.batches - done)
            for w, loop in loops.items():
                before = loop.groups
                t0 = time.perf_counter()
                for _ in range(k):
                    loop.step()  # with several in flight, returns while the batch plays
                loop.drain()
                seconds[w] += time.perf_counter() - t0
                episodes[w] += (loop.groups - before) * args.n_samples
            done += k
        for loop in loops.values():
            loop.close()
        engine.close()

    out = {f"window{w}_episodes_per_s": episodes[w] / seconds[w] for w in windows}
    ratio = out[f"window{args.inflight}_episodes_per_s"] / out["window1_episodes_per_s"]
    for w in windows:
        print(f"{w} batch(es) in flight: {out[f'window{w}_episodes_per_s']:7.2f} episodes/s "
              f"({episodes[w]} episodes in {seconds[w]:.1f} s)")  # fmt: skip
    print(f"heavy-tailed environment ({args.slow_share:.0%} of steps {args.slow_ms:g} ms): "
          f"{args.inflight} in flight / 1 = {ratio:.2f}x episodes/s")  # fmt: skip
    print(json.dumps({"bench": "episode_window", **vars(args), **{k: round(v, 3) for k, v in out.items()},
                      "ratio": round(ratio, 3)}))  # fmt: skip


if __name__ == "__main__":
    main()
