"""What serving several LoRA adapters in one batch costs the hf engine (rollout/engines/hf_lora.py).

A Qwen2-architecture checkpoint is built locally with two random rank-``--rank`` adapters on every linear
layer (peft ``save_pretrained``). The same rows (``--rows`` prompts, ``--tokens`` new tokens each, greedy)
are generated five ways, each after one untimed warm-up, ``--repeats`` times:

- ``base``: a plain engine, no adapter loaded (what a full-weight run's server does);
- ``merged``: a plain engine holding one adapter's merged model (a single-adapter run's server);
- ``served, base rows``: the engine serving both adapters, every row asking for none;
- ``served, one adapter``: every row of one adapter;
- ``served, two adapters``: half the rows of each, in two concurrent calls that share decode steps (what
  ``learner.lora.adapters`` puts on a server).

    python bench/multi_lora.py [--hidden 256] [--layers 4] [--rank 8] [--rows 16] [--tokens 32]

Printed: tokens per second of each, and each against the plain engine doing the same arithmetic: base
rows against ``base``, adapter rows against ``merged``. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

# bench/weightsync.py would shadow the package of the same name.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import torch

from learner.lora import merge
from rollout.engines.base import SamplingParams
from rollout.engines.hf import HFEngine
from toy.tiny import make_tiny, make_tiny_lora

CALL_TIMEOUT_S = 600.0  # a generate call still running after this is stuck


def tokens_per_s(
    engine: HFEngine, rows: list[list[int]], tokens: int, adapters: list[str | None], repeats: int
) -> float:
    """Generated tokens per second, the rows split evenly between ``adapters`` in concurrent calls."""

    def once() -> int:
        share = len(rows) // len(adapters)
        out: list[int] = [0] * len(adapters)

        def call(i: int) -> None:
            sampling = SamplingParams(max_new_tokens=tokens, temperature=0.0, adapter=adapters[i])
            done = engine.generate(rows[i * share : (i + 1) * share], sampling)
            out[i] = sum(len(c.token_ids) for group in done for c in group)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(adapters))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=CALL_TIMEOUT_S)
            if t.is_alive():
                raise TimeoutError(f"a generate call ran past {CALL_TIMEOUT_S:.0f} s")
        return sum(out)

    once()  # warm-up
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        n = once()
        rates.append(n / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = make_tiny(root / "tiny", hidden=args.hidden, layers=args.layers)["actor"]
        a = make_tiny_lora(base, root / "a", rank=args.rank, seed=0)
        b = make_tiny_lora(base, root / "b", rank=args.rank, seed=1)
        plain = HFEngine(str(base), device="cpu", prefix_cache_mb=0)
        rows = [
            plain.tokenizer(f"say {i} {i + 1}:", add_special_tokens=False).input_ids for i in range(args.rows)
        ]
        one = HFEngine(str(merge(base, a, root / "merged")), device="cpu", prefix_cache_mb=0)
        served = HFEngine(str(base), device="cpu", prefix_cache_mb=0, loras={"a": str(a), "b": str(b)})
        measure = partial(tokens_per_s, rows=rows, tokens=args.tokens, repeats=args.repeats)
        rates = {
            "base": measure(plain, adapters=[None]),
            "merged": measure(one, adapters=[None]),
            "served, base rows": measure(served, adapters=[None]),
            "served, one adapter": measure(served, adapters=["a"]),
            "served, two adapters": measure(served, adapters=["a", "b"]),
        }
    reference = {name: "base" if name in ("base", "served, base rows") else "merged" for name in rates}
    ratios = {name: rate / rates[reference[name]] for name, rate in rates.items()}
    print(
        f"hidden {args.hidden}, {args.layers} layers, rank {args.rank}, {args.rows} rows x {args.tokens} tokens"
    )
    for name, rate in rates.items():
        print(f"  {name:22s} {rate:9.0f} tok/s   {ratios[name]:5.2f}x {reference[name]}")
    print(json.dumps({"config": vars(args), "tokens_per_s": rates, "vs_plain": ratios}))


if __name__ == "__main__":
    main()
