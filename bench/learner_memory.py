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
    args = ap.parse_args()
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
