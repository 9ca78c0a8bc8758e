"""Peak memory and tokens/s of the learner's log-prob + entropy forward/backward: plain logits vs chunked head.

Per configuration (vocabulary V, response tokens T) one learner-step-like pass: last hidden states
``(T, H)`` and an untied head ``(V, H)``, tempered log-probs of the sampled tokens and entropies through a
mask, a PPO-shaped loss ``mean(−A·logp) − c·mean(H)``, backward to the hidden states and the head. Plain
is ``policy_logits``' float32 logits fed to ``learner/losses.py`` (a lower bound for the learner's plain
path, which also gathers a response view of the logits); chunked is ``learner/lm_head.py``.

Each (V, T, path) runs in a fresh subprocess, so peaks do not mix: peak memory is the child's
``getrusage`` maximum resident set (``ru_maxrss``) minus its resident set after setup (torch, the
tensors), i.e. what the pass itself adds. Tokens/s is T over the fastest of ``--repeats`` passes. Plain
configurations whose logits would not fit in ``--max-plain-gb`` are skipped and reported as such.

    python bench/learner_memory.py [--hidden 64] [--vocabs 52,32768,151936] [--tokens 512,2048,4096,8192]

Prints a table, the chunked/plain ratios, writes a PNG (``--png``; needs matplotlib) and ends with one JSON
line. The target at V = 151,936 and 4,096 tokens: chunked peak ≤ 0.3x plain at ≥ 0.9x plain tokens/s.
The default grid takes about 4.5 minutes on 2 idle CPU cores. At a small hidden size the pass is bound by
the (T, V) elementwise work, which chunking makes cache-friendly; at a large one (``--hidden 1024``) by
the matmuls, of which the chunked head runs four to the plain path's three (the recompute), so expect
up to ~0.75x tokens/s there.

``--sequence-parallel``: one long response (``--sp-tokens``, default 32,768) trained on 1 rank and on 2
sequence-parallel ranks (``learner.sequence_parallel``, DeepSpeed's Ulysses attention), through the learner's
own pieces: a tiny Qwen2 built here (hidden 128, 4 query and 2 KV heads of 32, 2 layers, the toy vocabulary;
nothing downloads), ``load_policy`` and ``make_engine`` (ZeRO stage 2, float32), ``make_batch`` /
``micro_batches`` / ``SequenceParallel.shard``, then per repeat ``policy_logprobs`` (chunked head, entropy)
under the PPO-shaped loss above, ``engine.backward`` and ``engine.step``. Each N runs as
``torch.distributed.run --nproc-per-node N`` (gloo), each rank on ``cores / N`` threads; per rank, peak
memory is ``ru_maxrss`` minus the resident set after setup (model, engine, batch), and tokens/s is the
response length over the fastest repeat. The first repeat's per-token log-probs (before any step) and the
gradient norm DeepSpeed clips against are compared between N = 1 and N = 2:

    python bench/learner_memory.py --sequence-parallel [--sp-tokens 32768] [--sp-repeats 2]

It prints the per-rank figures and the 2-rank / 1-rank ratios and ends with one JSON line. What CPU can show is
the per-rank memory (activations of ``T / N`` positions, attention's whole sequence over ``heads / N``
heads); tokens/s with 2 ranks sharing the same cores is no scaling figure. About 2.5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

# bench/buffer.py and bench/weightsync.py would shadow the packages of the same name.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPERATURE = 0.7
ENTROPY_COEF = 0.01
TARGET = {"vocab": 151_936, "tokens": 4096, "max_memory_ratio": 0.3, "min_speed_ratio": 0.9}


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def child(path: str, vocab: int, tokens: int, hidden: int, repeats: int, chunk_logits: int) -> dict:
    """One configuration in this process: its peak memory above setup and its fastest pass."""
    import torch

    from learner.advantages import masked_mean
    from learner.lm_head import chunk_tokens, chunked_logprobs_entropy
    from learner.losses import entropy_from_logits, logprobs_from_logits

    gen = torch.Generator().manual_seed(0)
    # In place: a freed setup temporary would raise the baseline and hide part of the pass's peak.
    h = torch.randn(tokens, hidden, generator=gen).requires_grad_()
    weight = torch.randn(vocab, hidden, generator=gen).div_(hidden**0.5).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    adv = torch.randn(tokens, generator=gen)
    mask = (torch.rand(tokens, generator=gen) > 0.05).float()
    chunk = chunk_tokens(vocab, chunk_logits)

    def step() -> float:
        if path == "plain":
            logits = (h @ weight.T).float() / TEMPERATURE  # (T, V), what policy_logits returns
            logp = logprobs_from_logits(logits[None], labels[None])[0]
            ent = entropy_from_logits(logits[None])[0]
        else:
            logp, ent = chunked_logprobs_entropy(h, weight, labels, temperature=TEMPERATURE, chunk=chunk)
        loss = masked_mean(-adv * logp, mask) - ENTROPY_COEF * masked_mean(ent, mask)
        loss.backward()
        h.grad = weight.grad = None
        return float(loss)

    base = _rss_gb()  # torch and the inputs: not the pass's
    times, loss = [], 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
    return {
        "path": path,
        "vocab": vocab,
        "tokens": tokens,
        "peak_gb": _rss_gb() - base,
        "process_peak_gb": _rss_gb(),
        "tokens_per_s": tokens / min(times),
        "loss": loss,
        "chunk_tokens": chunk if path == "chunked" else None,
    }


# A batch whose lengths vary 100x: one long trajectory among short ones, against all-short rows of the same
# token count; row-count micro-batches (``learner.micro_batch_size``) against a token budget
# (``learner.max_tokens_per_micro_batch``), through the learner's own micro-batching (learner/batch.py).
VARIED = {"short": 40, "long": 4000, "rows": 32, "micro_batch_size": 8, "budget": 4096, "vocab": 8192}


def varied_child(batch_kind: str, split: str, hidden: int) -> dict:
    """Peak memory of one accumulated forward/backward over ``batch_kind`` (varied | short) rows split by
    ``split`` (rows | budget): a 2-layer model, logits and a log-sum-exp loss per micro-batch."""
    import numpy as np
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from buffer.schema import Trajectory
    from learner.batch import budget_sizes, make_batch, micro_batches

    v = VARIED
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=v["vocab"], hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=8192)  # fmt: skip
    model = Qwen2ForCausalLM(config)
    if batch_kind == "varied":
        lens = [v["long"]] + [v["short"]] * (v["rows"] - 1)
    else:  # all short, the same token count
        lens = [v["short"]] * ((v["long"] + v["short"] * (v["rows"] - 1)) // v["short"])
    rng = np.random.default_rng(0)

    def traj(i: int, n: int) -> Trajectory:
        resp = rng.integers(1, v["vocab"], n - 8)
        return Trajectory(traj_id=str(i), group_id="g", prompt_id=str(i), prompt_tokens=np.ones(8, np.int64),
                          response_tokens=resp, behav_logp=np.zeros(n - 8, np.float32),
                          token_versions=np.zeros(n - 8, np.int64), reward=0.0)  # fmt: skip

    batch = make_batch([traj(i, n) for i, n in enumerate(lens)], 0)
    rows = torch.arange(len(batch))
    cpu = torch.device("cpu")
    if split == "budget":
        sizes = budget_sizes(sorted(lens, reverse=True), v["budget"], "pad")
        mbs = micro_batches(batch, rows, 0, "pad", cpu, sizes=sizes)
    else:
        mbs = micro_batches(batch, rows, v["micro_batch_size"], "pad", cpu)
    base = _rss_gb()
    for mb in mbs:
        logits = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False).logits
        logits.float().logsumexp(-1).mean().backward()
        del logits
    return {
        "batch": batch_kind,
        "split": split,
        "tokens": int(sum(lens)),
        "passes": len(mbs),
        "largest_pass_tokens": max(int(mb.input_ids.numel()) for mb in mbs),
        "peak_gb": _rss_gb() - base,
    }


def run_child(args: argparse.Namespace, path: str, vocab: int, tokens: int) -> dict:
    cmd = [
        sys.executable, os.path.abspath(__file__), "--child", path,
        "--vocabs", str(vocab), "--tokens", str(tokens), "--hidden", str(args.hidden),
        "--repeats", str(args.repeats), "--chunk-logits", str(args.chunk_logits),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        why = "killed (out of memory?)" if out.returncode < 0 else out.stderr.strip().splitlines()[-1:]
        return {"path": path, "vocab": vocab, "tokens": tokens, "error": str(why)}
    return json.loads(out.stdout.strip().splitlines()[-1])


def varied_lengths(hidden: int) -> dict:
    """Row-count against token-budget micro-batches on a batch whose lengths vary 100x, each against an
    all-short batch of the same token count, split the same way (one fresh child per run)."""
    v = VARIED
    print(
        f"\nlengths varying {v['long'] // v['short']}x: one {v['long']}-token row among {v['rows'] - 1} of "
        f"{v['short']}, V {v['vocab']}; micro_batch_size {v['micro_batch_size']} vs "
        f"max_tokens_per_micro_batch {v['budget']}"
    )
    runs = {}
    for split in ("rows", "budget"):
        for kind in ("varied", "short"):
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--varied-child",
                kind,
                split,
                "--hidden",
                str(hidden),
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
            r = json.loads(out.strip().splitlines()[-1])
            runs[f"{kind}/{split}"] = r
            print(f"  {kind:>6} batch, {split:>6} split: {r['passes']:>3} passes, largest {r['largest_pass_tokens']:>6} "
                  f"tokens, peak {r['peak_gb']:.3f} GB", flush=True)  # fmt: skip
    factor = {
        s: runs[f"varied/{s}"]["peak_gb"] / max(runs[f"short/{s}"]["peak_gb"], 1e-9)
        for s in ("rows", "budget")
    }
    print(
        f"  varied / all-short peak: row-count micro-batches {factor['rows']:.2f}x, token budget {factor['budget']:.2f}x"
    )
    return {"runs": runs, "varied_over_short": factor, "budget_within_1_2x": factor["budget"] <= 1.2}


# One long response trained on 1 rank and on a sequence-parallel group of 2 (--sequence-parallel).
SP = {"hidden": 128, "head_dim": 32, "layers": 2, "prompt": 16, "zero_stage": 2, "ranks": (1, 2)}
DIST_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _rss_now_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def sp_checkpoint(out: str, tokens: int) -> str:
    """The tiny Qwen2 of the sequence-parallel row (toy/tiny.py), its positions raised to hold ``tokens``."""
    from toy.tiny import make_tiny

    paths = make_tiny(out, hidden=SP["hidden"], layers=SP["layers"], head_dim=SP["head_dim"])
    for path in paths.values():
        config = os.path.join(path, "config.json")
        with open(config) as f:
            raw = json.load(f)
        raw["max_position_embeddings"] = max(raw["max_position_embeddings"], SP["prompt"] + tokens)
        with open(config, "w") as f:
            json.dump(raw, f, indent=2)
    return str(paths["actor"])


def sp_child(model: str, out: str, tokens: int, repeats: int) -> None:
    """One rank of a ``torch.distributed.run`` group training one ``tokens``-long response: all ranks'
    figures go to ``out`` (JSON) from rank 0, with its first repeat's per-token log-probs beside it (.npy)."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from buffer.schema import Trajectory
    from learner.advantages import masked_mean
    from learner.batch import make_batch, micro_batches
    from learner.models import (
        init_distributed,
        load_policy,
        make_engine,
        output_head,
        policy_logprobs,
        resolve_dtype,
    )
    from learner.runtime import start_sequence_parallel
    from learner.sequence_parallel import check_models
    from tandem.config import load_config

    cpu = torch.device("cpu")
    init_distributed(cpu)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    critic = os.path.join(os.path.dirname(model), "critic")
    cfg = load_config(
        os.path.join(ROOT, "configs", "tiny.yaml"),
        [
            f"model.actor={model}", f"model.critic={critic}", f"learner.num_ranks={world}",
            f"learner.sequence_parallel={world}", "learner.chunked_head=on", f"learner.zero_stage={SP['zero_stage']}",
            "learner.micro_batch_size=1", f"data.max_prompt_tokens={SP['prompt']}", f"rollout.max_new_tokens={tokens}",
        ],
    )  # fmt: skip
    sp = start_sequence_parallel(cfg)
    torch.manual_seed(0)
    dtype = resolve_dtype(cfg, cpu)
    engine = make_engine(load_policy(cfg, model, dtype), cfg, dtype, cfg.learner.actor_lr)
    if sp.size > 1:
        check_models({"actor": engine.module}, engine.module)
    head = output_head(engine)
    if head is None:
        raise RuntimeError(f"{model}: no plain output head for the chunked head")
    vocab = head.out_features
    rng = np.random.default_rng(0)  # the same sequence on every rank and for every N
    p = SP["prompt"]
    traj = Trajectory(traj_id="0", group_id="g", prompt_id="0", prompt_tokens=rng.integers(4, vocab, p),
                      response_tokens=rng.integers(4, vocab, tokens), behav_logp=np.zeros(tokens, np.float32),
                      token_versions=np.zeros(tokens, np.int64), reward=0.0)  # fmt: skip
    batch = make_batch([traj], 0)
    (whole,) = micro_batches(batch, torch.arange(1), 1, "pad", cpu)
    mb = sp.shard(whole)
    mask = batch.mask[mb.rows]
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))

    def step() -> tuple[float, np.ndarray]:
        logp, ent = policy_logprobs(engine, mb, TEMPERATURE, mask, head,
                                    chunk_logits=cfg.learner.chunked_head_chunk, with_entropy=True)  # fmt: skip
        loss = masked_mean(-adv * logp, mask) - ENTROPY_COEF * masked_mean(ent, mask)
        engine.backward(loss)
        engine.step()
        return float(loss.detach()), logp.detach()[0].numpy().copy()

    dist.barrier()
    base, setup_peak = _rss_now_gb(), _rss_gb()
    times, losses, grad_norms, first_logp = [], [], [], None
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        loss, logp = step()
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        grad_norms.append(float(engine.get_global_grad_norm()))
        first_logp = logp if first_logp is None else first_logp
    mine = {
        "rank": rank,
        "input_positions": int(mb.input_ids.shape[1]),
        "setup_rss_gb": base,
        "setup_peak_gb": setup_peak,
        "peak_gb": _rss_gb() - base,
        "process_peak_gb": _rss_gb(),
        "seconds": times,
    }
    ranks: list = [None] * world
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        np.save(out + ".logp.npy", first_logp)
        result = {
            "ranks": world,
            "threads_per_rank": torch.get_num_threads(),
            "tokens": tokens,
            "vocab": vocab,
            "zero_stage": cfg.learner.zero_stage,
            "per_rank": ranks,
            # a rank's peak: the largest of the group's; the step's time: the slowest rank's fastest repeat
            "peak_gb": max(r["peak_gb"] for r in ranks),
            "seconds": max(min(r["seconds"]) for r in ranks),
            "tokens_per_s": tokens / max(min(r["seconds"]) for r in ranks),
            "loss": losses[0],
            "grad_norm": grad_norms[0],
            "logp_sum": float(first_logp.sum()),
        }
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def run_sp(model: str, ranks: int, tokens: int, repeats: int, out: str) -> dict:
    """``torch.distributed.run`` of :func:`sp_child` on ``ranks`` processes; its rank 0's JSON."""
    from tandem.net import free_port

    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
        "--master-port", str(free_port()), os.path.abspath(__file__), "--sp-child", model, out,
        "--sp-tokens", str(tokens), "--sp-repeats", str(repeats),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // ranks))
    env["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    if proc.returncode != 0:
        # torchrun's own report ends its stderr; a rank's exception is the last "[rankK]: ...Error" line
        raised = [line for line in proc.stderr.splitlines() if line.startswith("[rank") and "Error" in line]
        why = raised[-1] if raised else proc.stderr[-500:]
        if not raised and "Signal" in proc.stderr:
            why = "killed (out of memory?)"
        return {"ranks": ranks, "tokens": tokens, "error": why}
    with open(out) as f:
        result = json.load(f)
    return {**result, "wall_s": round(time.perf_counter() - t0, 1)}


def sequence_parallel(tokens: int, repeats: int) -> dict:
    """The ``--sequence-parallel`` row: 1 rank against a sequence-parallel group of 2 on one response."""
    import numpy as np

    print(
        f"sequence parallel (Ulysses): one {tokens:,}-token response after a {SP['prompt']}-token prompt; tiny "
        f"Qwen2 hidden {SP['hidden']}, {SP['hidden'] // SP['head_dim']} heads of {SP['head_dim']}, "
        f"{SP['layers']} layers; ZeRO {SP['zero_stage']}, chunked head; {os.cpu_count()} cores"
    )
    print(f"{'ranks':>5} {'threads':>7} {'positions':>9} {'peak GB/rank':>12} {'tok/s':>8} {'wall s':>7}")
    runs: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = sp_checkpoint(os.path.join(tmp, "ckpt"), tokens)
        logp = {}
        for n in SP["ranks"]:
            out = os.path.join(tmp, f"sp{n}.json")
            runs[n] = r = run_sp(model, n, tokens, repeats, out)
            if "error" in r:
                print(f"{n:>5} {r['error']}", flush=True)
                continue
            logp[n] = np.load(out + ".logp.npy")
            peaks = " / ".join(f"{x['peak_gb']:.3f}" for x in r["per_rank"])
            print(f"{n:>5} {r['threads_per_rank']:>7} {r['per_rank'][0]['input_positions']:>9} {peaks:>12} "
                  f"{r['tokens_per_s']:>8.0f} {r['wall_s']:>7.1f}", flush=True)  # fmt: skip
    one, two = runs.get(1, {}), runs.get(2, {})
    if "peak_gb" not in one or "peak_gb" not in two:
        return {"tokens": tokens, "runs": runs, "error": "a run failed"}
    agree = {
        "logp_max_abs_diff": float(np.abs(logp[1] - logp[2]).max()),
        "logp_sum": [one["logp_sum"], two["logp_sum"]],
        "loss_abs_diff": abs(one["loss"] - two["loss"]),
        "grad_norm": [one["grad_norm"], two["grad_norm"]],
        "grad_norm_rel_diff": abs(one["grad_norm"] - two["grad_norm"]) / max(abs(one["grad_norm"]), 1e-12),
    }
    ratios = {
        "peak_per_rank": two["peak_gb"] / max(one["peak_gb"], 1e-9),
        "tokens_per_s": two["tokens_per_s"] / one["tokens_per_s"],
    }
    print(
        f"2 ranks / 1 rank: peak per rank {ratios['peak_per_rank']:.2f}x, tokens/s {ratios['tokens_per_s']:.2f}x; "
        f"log-probs max |diff| {agree['logp_max_abs_diff']:.1e} (sums {one['logp_sum']:.2f} / "
        f"{two['logp_sum']:.2f}), grad norm {one['grad_norm']:.6g} / {two['grad_norm']:.6g}"
    )
    return {"tokens": tokens, "runs": runs, "ratios": ratios, "agreement": agree}


def plot(rows: list[dict], png: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no PNG written"
    fig, (ax_mem, ax_speed) = plt.subplots(1, 2, figsize=(11, 4.2))
    for vocab in sorted({r["vocab"] for r in rows}):
        for path, style in (("plain", "--"), ("chunked", "-")):
            pts = [r for r in rows if r["vocab"] == vocab and r["path"] == path and "peak_gb" in r]
            if pts:
                xs = [r["tokens"] for r in pts]
                ax_mem.plot(xs, [r["peak_gb"] for r in pts], style, marker="o", label=f"{path} V={vocab:,}")
                ax_speed.plot(
                    xs, [r["tokens_per_s"] for r in pts], style, marker="o", label=f"{path} V={vocab:,}"
                )
    for ax, title in ((ax_mem, "peak memory above setup (GB)"), (ax_speed, "tokens/s (forward + backward)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("response tokens per micro-batch")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    ax_mem.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    return f"wrote {png}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=64, help="hidden size H (small: the head's cost is V·H)")
    ap.add_argument("--vocabs", default="52,32768,151936", help="comma-separated vocabulary sizes")
    ap.add_argument("--tokens", default="512,2048,4096,8192", help="comma-separated response lengths")
    ap.add_argument("--repeats", type=int, default=2, help="passes per configuration; the fastest is timed")
    ap.add_argument("--chunk-logits", type=int, default=1 << 24, help="learner.chunked_head_chunk")
    ap.add_argument("--max-plain-gb", type=float, default=None, help="skip plain above this logits size x4")
    ap.add_argument("--png", default=os.path.join(tempfile.gettempdir(), "learner_memory.png"))
    ap.add_argument("--child", choices=["plain", "chunked"], help=argparse.SUPPRESS)
    ap.add_argument("--varied-child", nargs=2, metavar=("BATCH", "SPLIT"), help=argparse.SUPPRESS)
    ap.add_argument("--skip-grid", action="store_true", help="only the varied-length comparison")
    ap.add_argument(
        "--sequence-parallel", action="store_true", help="only the 1 vs 2 sequence-parallel ranks row"
    )
    ap.add_argument(
        "--sp-tokens", type=int, default=32768, help="response tokens of the sequence-parallel row"
    )
    ap.add_argument("--sp-repeats", type=int, default=2, help="its steps per run; the fastest is timed")
    ap.add_argument("--sp-child", nargs=2, metavar=("MODEL", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.sp_child:
        sp_child(*args.sp_child, args.sp_tokens, args.sp_repeats)
        return 0
    if args.sequence_parallel:
        t_start = time.perf_counter()
        result = sequence_parallel(args.sp_tokens, args.sp_repeats)
        wall = round(time.perf_counter() - t_start, 1)
        print(json.dumps({"bench": "learner_memory", "mode": "sequence_parallel", "cores": os.cpu_count(),
                          **result, "wall_s": wall}))  # fmt: skip
        return 0 if "error" not in result else 1
    if args.varied_child:
        import torch

        torch.set_num_threads(os.cpu_count() or 1)
        print(json.dumps(varied_child(*args.varied_child, args.hidden)))
        return 0
    vocabs = [int(v) for v in args.vocabs.split(",")]
    lengths = [int(t) for t in args.tokens.split(",")]
    if args.child:
        import torch

        torch.set_num_threads(os.cpu_count() or 1)
        print(
            json.dumps(child(args.child, vocabs[0], lengths[0], args.hidden, args.repeats, args.chunk_logits))
        )
        return 0

    if args.skip_grid:
        vocabs, lengths = [], []
    total_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    # The plain pass holds about four float32 (T, V) tensors at its peak (measured: ~4.1x the logits).
    max_plain_gb = args.max_plain_gb if args.max_plain_gb is not None else 0.6 * total_gb
    rows: list[dict] = []
    t_start = time.perf_counter()
    print(f"hidden {args.hidden}, {os.cpu_count()} cores, {total_gb:.0f} GB RAM, temperature {TEMPERATURE}")
    print(f"{'V':>8} {'tokens':>6} {'path':>8} {'peak GB':>8} {'tok/s':>9}")
    for vocab in vocabs:
        for tokens in lengths:
            for path in ("plain", "chunked"):
                logits_gb = 4 * vocab * tokens * 4 / 2**30
                if path == "plain" and logits_gb > max_plain_gb:
                    row = {
                        "path": path,
                        "vocab": vocab,
                        "tokens": tokens,
                        "error": f"skipped: ~{logits_gb:.0f} GB",
                    }
                else:
                    row = run_child(args, path, vocab, tokens)
                rows.append(row)
                if "error" in row:
                    print(f"{vocab:>8} {tokens:>6} {path:>8} {row['error']}", flush=True)
                else:
                    print(
                        f"{vocab:>8} {tokens:>6} {path:>8} {row['peak_gb']:>8.3f} {row['tokens_per_s']:>9.0f}",
                        flush=True,
                    )

    print("\nchunked / plain: memory ratio (peak above setup), speed ratio (tokens/s)")
    ratios = []
    for vocab in vocabs:
        for tokens in lengths:
            p, c = (next(r for r in rows if (r["vocab"], r["tokens"], r["path"]) == (vocab, tokens, k))
                    for k in ("plain", "chunked"))  # fmt: skip
            if "error" in p or "error" in c:
                continue
            mem, speed = c["peak_gb"] / max(p["peak_gb"], 1e-9), c["tokens_per_s"] / p["tokens_per_s"]
            rel_loss = abs(c["loss"] - p["loss"]) / max(abs(p["loss"]), 1e-12)
            ratios.append({"vocab": vocab, "tokens": tokens, "memory_ratio": mem, "speed_ratio": speed})
            print(
                f"{vocab:>8} {tokens:>6}   memory {mem:6.3f}x   speed {speed:5.2f}x   |Δloss|/loss {rel_loss:.1e}"
            )
    if rows:
        print(plot(rows, args.png))
    varied = varied_lengths(args.hidden)

    target = next(
        (r for r in ratios if (r["vocab"], r["tokens"]) == (TARGET["vocab"], TARGET["tokens"])), None
    )
    met = None
    if target is not None:
        met = (
            target["memory_ratio"] <= TARGET["max_memory_ratio"]
            and target["speed_ratio"] >= TARGET["min_speed_ratio"]
        )
    print(
        json.dumps(
            {
                "bench": "learner_memory",
                "hidden": args.hidden,
                "cores": os.cpu_count(),
                "rows": rows,
                "ratios": ratios,
                "target": {**TARGET, "measured": target, "met": met},
                "varied": varied,
                "wall_s": round(time.perf_counter() - t_start, 1),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
