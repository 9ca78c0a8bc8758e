"""Rollout-loop throughput against the bare engine, and the generation pause per weight update.

    python bench/rollout.py [--engine hf|vllm] [--steps 20] [--prompts-per-batch 4] [--n-samples 4]
                            [--max-new-tokens 32] [--hidden 64] [--layers 2] [--threads 1] [--updates 10]
                            [--inflight K] [--chunk 5] [--device cpu|cuda] [--dtype float32|bfloat16]
                            [--stop STRING]

In one run, on the same tiny checkpoint and the same batch shapes (``prompts_per_batch × n_samples`` rows):
  (a) ``tokens_per_s``: the full rollout loop (admission, prompt claims and trajectory writes in a real
      Redis via EmbeddedRedis, the engine, reward scoring), response tokens over wall time, with up to
      ``--inflight`` batches held at once (``rollout.max_inflight_batches``; 0: the engine's default, 1 for
      hf and 3 for vllm; 1: one batch at a time). Where the loop's time goes: ``engine_busy`` (share of its
      wall time with a generation running), and seconds in admission waits, prompt claims, weight checks,
      scoring and trajectory writes (Redis); ``group_wait_s``: the mean time from a group's last sample
      to its append (with several batches in flight, groups are appended as they finish, not when their
      batch does);
  (b) ``engine_tokens_per_s``: the engine adapter's ``generate`` alone;
  (c) ``direct_tokens_per_s``: the engine without tandem, counting the tokens up to and including EOS:
      ``hf``: ``model.generate`` (sampling, KV cache); ``vllm``: an offline ``vllm.LLM.generate`` in this
      process on the same token-id prompts and sampling (``logprobs=0``, processed logprobs, like the
      server); ``overhead_ratio`` = direct / loop (> 1: the loop is slower), ``loop_ratio`` = loop / direct;
  The three run in rounds of three turns, ``--chunk`` batches each (the loop's batches in flight finish
  within its turn), every other round in reverse order, so load from other processes hits them alike; on
  vLLM each turn starts ``SETTLE_S`` after the last, once the idle engine's worker has stopped spinning.
  Besides the ratio of the totals, ``loop_ratio_rounds_*`` are the median, least and greatest of each
  round's own loop / bare: a round's loop and bare turns run seconds apart, so a burst of outside load moves one
  round, not the median. Each turn also counts the CPU seconds of every process
  (this one, and for vllm the server's HTTP front, its scheduler and its worker), per 1,000 tokens: on a
  CPU build the worker computes on one core and everything else shares the one vLLM reserves, so a
  busier front slows the engine itself. ``cpu_ratio`` is bare's total CPU seconds per token over the loop's:
  when every process together keeps the machine's cores busy (vLLM's worker spins while it waits), tokens/s
  is cores / CPU seconds per token and loop / bare comes to ``cpu_ratio``, however busy the engine is;
  (d) ``update_pause_s``: median time the generation thread spends on one weight update through the
      real shm transport (hf: poll, map and verify the files, copy into the model; vllm: poll and verify,
      then pause → reload in the server's worker → reset the prefix cache → label → resume).
``--stop``: answers of mixed length, as in a real task (vllm only). Generation ends at the stop string
(``rollout.stop``; the bare ``LLM.generate`` gets the same); a one-character string, e.g. ``--stop a``,
ends the tiny model's near-uniform samples after about as many tokens as its tokenizer has characters,
some at ``--max-new-tokens``. Without it every answer runs to ``--max-new-tokens``, so a batch's groups
finish nearly together and the group wait cannot show what streaming them saves.
``--engine vllm`` needs vLLM (``.venv-vllm``) and uses a head_dim-32 checkpoint (vLLM's CPU attention refuses
16). ``--device cuda`` runs the engine, the bare engine and the server's model on the GPU (``run.device``), in
``--dtype`` (``model.dtype``; the published weights too). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# This script is named like the package it measures: keep its own folder from shadowing `rollout`.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import psutil
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from buffer.redis_server import EmbeddedRedis
from buffer.schema import PromptRecord
from buffer.streams import ReplayBuffer
from rollout.engines.base import SamplingParams
from rollout.engines.hf import HFEngine
from rollout.loop import RolloutLoop
from tandem.config import load_config
from tandem.rewards import RewardFunctions
from tandem.telemetry import Telemetry
from toy.tasks import make_records
from toy.tiny import make_tiny
from weightsync import make_publisher, make_subscriber


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    ap.add_argument("--steps", type=int, default=20, help="timed batches per measurement")
    ap.add_argument("--prompts-per-batch", type=int, default=4)
    ap.add_argument("--n-samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--updates", type=int, default=10)
    ap.add_argument(
        "--inflight", type=int, default=0, help="rollout.max_inflight_batches (0: engine default)"
    )
    ap.add_argument("--chunk", type=int, default=5, help="batches per turn of loop, engine and bare engine")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="run.device of the engines")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="model.dtype")
    ap.add_argument("--stop", default=None, help="a stop string: answers of mixed length (vllm only)")
    args = ap.parse_args()
    if args.stop is not None and args.engine != "vllm":
        ap.error("--stop: vllm only (model.generate, the hf bare engine, counts tokens past a stop string)")
    stop = [args.stop] if args.stop is not None else []
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis") as redis_server:
        head_dim = 32 if args.engine == "vllm" else None
        ckpt = make_tiny(Path(tmp) / "tiny", hidden=args.hidden, layers=args.layers, head_dim=head_dim)[
            "actor"
        ]
        rows = args.prompts_per_batch * args.n_samples
        cfg = load_config(
            None,
            raw={
                "run": {"name": "benchrollout", "device": args.device, "output_dir": tmp},
                "redis": {"url": redis_server.url},
                "model": {"actor": str(ckpt), "dtype": args.dtype},
                "data": {"prompts": "unused.jsonl"},
                "rollout": {
                    "n_samples": args.n_samples,
                    "prompts_per_batch": args.prompts_per_batch,
                    "max_new_tokens": args.max_new_tokens,
                    "stop": stop,
                    "inflight_updates": True,
                    "max_inflight_batches": args.inflight,
                    "engine": args.engine,
                    "vllm": {"extra_args": VLLM_ARGS, "startup_timeout_s": 600},
                },
                "reward": {"functions": [{"path": "toy.tasks.echo:reward"}]},
                # Admission never binds here: this measures generation, not the learner.
                "algorithm": {"batch_size": rows, "minibatch_size": rows, "max_staleness": 10_000},
                "learner": {"micro_batch_size": rows},
                "weightsync": {"shm_dir": str(Path(tmp) / "shm")},
                "logging": {"wandb_mode": "disabled"},
            },
        )
        client = redis_server.client()
        if args.engine == "hf":
            # as a single-turn run: no prefix cache
            engine = HFEngine(str(ckpt), device=args.device, dtype=args.dtype, seed=0, prefix_cache_mb=0)
        else:
            from rollout.engines.vllm import VLLMEngine

            engine = VLLMEngine(cfg, str(ckpt), server_index=0, device=args.device)
        tok = AutoTokenizer.from_pretrained(ckpt)
        records = make_records("echo", args.prompts_per_batch * (args.steps + 2), seed=0)
        prompts = [PromptRecord(r["id"], r["prompt"], tok(r["prompt"]).input_ids, r) for r in records]
        buffer = ReplayBuffer.from_config(client, cfg, consumer="server-0")
        buffer.put_prompts(prompts)
        publisher = make_publisher(cfg, client)
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, args.dtype))
        weights = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
        publisher.publish(weights.items(), 0)
        subscriber = make_subscriber(cfg, client, "server-0")
        loop = RolloutLoop(
            cfg,
            engine,
            tok,
            buffer,
            subscriber,
            Telemetry(cfg, "server-0", client),
            server_index=0,
            rewards=RewardFunctions(cfg.reward),
        )

        # The three take turns, --chunk batches each, so load from other processes hits them alike.
        batch = [p.tokens.tolist() for p in prompts[: args.prompts_per_batch]]
        sampling = SamplingParams(
            n=args.n_samples, max_new_tokens=args.max_new_tokens, temperature=1.0, stop=stop
        )
        if args.engine == "hf":
            direct = DirectGenerate(engine, batch, args.n_samples, args.max_new_tokens)
        else:
            direct = DirectLLM(str(ckpt), batch, args.n_samples, args.max_new_tokens, args.dtype, stop)
        loop.step()  # warm-up (applies the version-0 weights), not timed
        loop.drain()
        buffer.take(rows, timeout_s=30)
        engine.generate(batch, sampling)
        direct()
        loop.totals.clear()
        waited = (loop.group_waits.total_s, loop.group_waits.count)
        seconds = {"loop": 0.0, "engine": 0.0, "direct": 0.0}
        tokens = {"loop": 0, "engine": 0, "direct": 0}
        cpu: dict[str, dict[str, float]] = {key: {} for key in seconds}
        groups_before, done = loop.groups, 0
        settle = SETTLE_S if args.engine == "vllm" else 0.0
        rounds: list[float] = []  # loop / bare in each round: its turns ran under the same outside load
        while done < args.steps:
            k = min(args.chunk, args.steps - done)
            spans, before = [], dict(tokens)
            # every other round backwards, so no measurement always follows the same one
            for key in list(seconds)[:: 1 if len(rounds) % 2 == 0 else -1]:
                time.sleep(settle)  # the engine measured last stops spinning before this one starts
                c0, t0 = cpu_seconds(), time.perf_counter()
                if key == "loop":
                    for _ in range(k):
                        loop.step()  # claims one batch; with several in flight, returns while it generates
                    loop.drain()
                elif key == "engine":
                    for _ in range(k):
                        tokens[key] += sum(
                            len(c.token_ids) for g in engine.generate(batch, sampling) for c in g
                        )
                else:
                    for _ in range(k):
                        tokens[key] += direct()
                spans.append((key, c0, t0, cpu_seconds(), time.perf_counter()))
            appended = buffer.take(rows * k, timeout_s=30)  # the loop's turn put all k batches
            assert len(appended) == rows * k, "the loop appended short"
            tokens["loop"] += sum(len(t.traj.response_tokens) for t in appended)
            rate = {}
            for key, c0, t0, c1, t1 in spans:
                for proc in c1:
                    cpu[key][proc] = cpu[key].get(proc, 0.0) + c1[proc] - c0.get(proc, 0.0)
                seconds[key] += t1 - t0
                rate[key] = (tokens[key] - before[key]) / (t1 - t0)
            rounds.append(rate["loop"] / rate["direct"])
            done += k
        assert loop.groups - groups_before == args.prompts_per_batch * args.steps, "the loop appended short"
        stages = dict(loop.totals)
        group_wait = (loop.group_waits.total_s - waited[0]) / max(loop.group_waits.count - waited[1], 1)

        # (d) the pause per update: what the generation thread spends inside one apply.
        pauses = []
        for v in range(1, args.updates + 1):
            publisher.publish(weights.items(), v)
            t0 = time.perf_counter()
            loop.weights.apply(subscriber.poll(0.0))
            pauses.append(time.perf_counter() - t0)
            assert engine.version == v
        engine.close()

    figures = {
        "tokens_per_s": tokens["loop"] / seconds["loop"],
        "engine_tokens_per_s": tokens["engine"] / seconds["engine"],
        "direct_tokens_per_s": tokens["direct"] / seconds["direct"],
        "update_pause_s": statistics.median(pauses),
    }
    figures["overhead_ratio"] = figures["direct_tokens_per_s"] / figures["tokens_per_s"]
    figures["loop_ratio"] = figures["tokens_per_s"] / figures["direct_tokens_per_s"]
    figures["loop_ratio_rounds_median"] = statistics.median(rounds)
    figures["loop_ratio_rounds_min"], figures["loop_ratio_rounds_max"] = min(rounds), max(rounds)
    figures["inflight"] = loop.window
    figures["engine_busy"] = stages.get("time/engine_busy", 0.0) / seconds["loop"]
    figures["loop_s"] = seconds["loop"]
    figures["group_wait_s"] = group_wait
    figures["response_tokens_mean"] = tokens["loop"] / (rows * args.steps)
    for stage in STAGES:
        figures[f"{stage}_s"] = stages.get(f"time/{stage}", 0.0)
    # CPU seconds per 1,000 tokens of each process, in each measurement (the other side's idle processes
    # spend next to nothing once settled: a sleeping vLLM server, or the offline LLM between its calls)
    for key in seconds:
        for proc, secs in cpu[key].items():
            figures[f"cpu_{key}_{proc}_s_per_ktok"] = 1000 * secs / tokens[key]
    # While every process together keeps all the cores busy (on a small CPU machine, vLLM's worker spins when
    # it waits), tokens/s is cores / CPU seconds per token, so this is what loop / bare comes to.
    per_ktok = {key: 1000 * sum(cpu[key].values()) / tokens[key] for key in seconds}
    figures["cpu_ratio"] = per_ktok["direct"] / per_ktok["loop"]
    bare = "model.generate" if args.engine == "hf" else "LLM.generate"
    print(
        f"rollout loop   {figures['tokens_per_s']:9.0f} tok/s  (Redis, scoring, writes included)\n"
        f"{args.engine} engine{' ' * (9 - len(args.engine))}{figures['engine_tokens_per_s']:9.0f} tok/s\n"
        f"{bare:<15}{figures['direct_tokens_per_s']:9.0f} tok/s  -> loop / bare {figures['loop_ratio']:.2f}\n"
        f"loop / bare    per round: median {figures['loop_ratio_rounds_median']:.2f} "
        f"(min {min(rounds):.2f}, max {max(rounds):.2f}, {len(rounds)} rounds)\n"
        f"update pause   {figures['update_pause_s'] * 1e3:9.2f} ms (median of {len(pauses)}, shm transport)\n"
        f"loop stages    {loop.window} batch(es) in flight; engine busy {figures['engine_busy']:.2f} of "
        f"{seconds['loop']:.1f} s; "
        + ", ".join(f"{stage} {figures[f'{stage}_s']:.2f} s" for stage in STAGES)
        + f"\ngroup wait     {group_wait * 1e3:9.1f} ms from a group's last sample to its append (mean); "
        f"answers {figures['response_tokens_mean']:.1f} tokens on average (at most {args.max_new_tokens})"
    )
    for key, label in (("loop", "rollout loop"), ("engine", f"{args.engine} engine"), ("direct", bare)):
        spent = ", ".join(
            f"{proc} {1000 * secs / tokens[key]:.3f}" for proc, secs in sorted(cpu[key].items())
        )
        print(f"cpu s / 1k tok {label:<15} {spent}; total {per_ktok[key]:.3f}")
    print(
        f"cpu ratio      {figures['cpu_ratio']:9.2f}  (bare's CPU s per token / the loop's: loop / bare when "
        "the cores are the limit)"
    )
    figures_out: dict[str, float | str] = {"device": args.device, "dtype": args.dtype}
    figures_out |= {k: round(v, 4) for k, v in figures.items()}
    print(json.dumps(figures_out))


def cpu_seconds() -> dict[str, float]:
    """User + system CPU seconds of this process and its descendants, summed by role: ``bench`` (this
    process: the loop, the HTTP client, the offline LLM's front), the vLLM server's ``server_front`` (its
    API process), ``server_scheduler`` (``VLLM::EngineCore``) and ``server_worker`` (``VLLM::Worker``),
    and the offline LLM's ``offline_scheduler`` and ``offline_worker``."""
    me = psutil.Process()
    out: dict[str, float] = {}
    server: set[int] = set()  # the vLLM server's process tree
    for p in [me, *me.children(recursive=True)]:
        try:
            t, cmd = p.cpu_times(), " ".join(p.cmdline())
            if "vllm.entrypoints" in cmd:
                server |= {p.pid, *(c.pid for c in p.children(recursive=True))}
        except psutil.Error:  # gone between the listing and the read
            continue
        side = "server" if p.pid in server else "offline"
        name = (
            "bench" if p.pid == me.pid
            else "server_front" if "vllm.entrypoints" in cmd
            else f"{side}_scheduler" if "EngineCore" in cmd
            else f"{side}_worker" if "Worker" in cmd
            else "other"
        )  # fmt: skip
        out[name] = out.get(name, 0.0) + t.user + t.system
    return out


# The loop's phases (time/<stage> in its logged stats); generate overlaps itself with several in flight.
STAGES = ("wait_admission", "take_prompts", "weight_sync", "generate", "score", "put")
# vLLM's workers spin on their shared-memory queue for 1 s after their last step (SpinCondition's
# busy_loop_s in vllm/distributed/device_communicators/shm_broadcast.py). Two vLLMs bind their workers to
# the same core here, so without a pause the engine measured last takes CPU from the one measured next.
SETTLE_S = 1.5
VLLM_ARGS = ["--max-model-len", "256", "--kv-cache-memory-bytes", str(256 << 20)]


class DirectLLM:
    """An offline ``vllm.LLM`` with the server's settings; ``generate`` on the same token-id prompts."""

    def __init__(
        self, ckpt: str, batch: list[list[int]], n: int, max_new_tokens: int, dtype: str, stop: list[str]
    ) -> None:
        from vllm import LLM
        from vllm import SamplingParams as VSampling

        self.llm = LLM(
            model=ckpt,
            dtype=dtype,
            max_model_len=256,
            kv_cache_memory_bytes=256 << 20,
            enforce_eager=True,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",
            seed=0,
        )
        self.prompts = [{"prompt_token_ids": p} for p in batch]
        self.sampling = VSampling(
            n=n, max_tokens=max_new_tokens, temperature=1.0, logprobs=0, stop=stop, detokenize=bool(stop)
        )

    def __call__(self) -> int:
        out = self.llm.generate(self.prompts, self.sampling, use_tqdm=False)
        return sum(len(c.token_ids) for r in out for c in r.outputs)


class DirectGenerate:
    """``model.generate`` on the same left-padded rows; tokens counted up to and including EOS."""

    def __init__(self, engine: HFEngine, batch: list[list[int]], n: int, max_new_tokens: int) -> None:
        rows = [p for p in batch for _ in range(n)]
        width = max(map(len, rows))
        self.model, self.pad, self.width = engine.model, engine.pad_token_id, width
        device = engine.device
        self.ids = torch.tensor([[self.pad] * (width - len(r)) + r for r in rows], device=device)  # (B, P)
        self.mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        self.eos, self.max_new_tokens = engine.eos_token_ids, max_new_tokens

    @torch.inference_mode()
    def __call__(self) -> int:
        out = self.model.generate(
            self.ids,
            attention_mask=self.mask,
            do_sample=True,
            max_new_tokens=self.max_new_tokens,
            pad_token_id=self.pad,
        )[:, self.width :]
        total = 0
        for row in out.tolist():
            ends = [i for i, t in enumerate(row) if t in self.eos]
            total += ends[0] + 1 if ends else len(row)
        return total


if __name__ == "__main__":
    main()
