"""The policy-loss, importance-weight and staleness variants on one task, same seed, same steps.

    python bench/algorithms.py [--config configs/tiny.yaml] [--steps 120] [--target 0.5] [--only a,b]
                               [--shapes base,generation-heavy,training-heavy] [key=value ...]

Runs ``launch.py`` once per variant (docs/design.md §4.9 and §3.7): the default loss (ppo, token-level
truncated importance weights, ``max_staleness`` 1), ``algorithm.loss`` gspo and cispo, ``algorithm.importance``
masked and sequence-level, and ``max_staleness`` 0, 2, 4 and auto. For each it prints the wall time until the
5-step moving average of ``reward/mean`` first reaches ``--target`` (from the learner's first logged step),
the final reward (mean of the last tenth of the steps), the mean staleness and the mean ``policy/ess``.
``--shapes`` repeats the variants on other workload shapes (:data:`SHAPES`) and, after each shape's table,
prints ``staleness-auto`` against the best of the fixed bounds run. The last line is one JSON object. The
default (echo on the tiny model, 120 steps, one shape) runs nine launches, each with its own start-up: 22
minutes on the loaded 2-core machine of docs/benchmarks.md §7; ``--only`` picks some.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from tandem.telemetry import read_history

ROOT = Path(__file__).resolve().parent.parent

# name -> overrides of the base config; "ppo" is the base itself (max_staleness 1 in configs/tiny.yaml)
VARIANTS: dict[str, list[str]] = {
    "ppo": [],
    "gspo": [
        "algorithm.loss=gspo",
        "algorithm.importance.level=sequence",
        "algorithm.loss_agg=seq-mean-token-mean",
    ],
    "cispo": ["algorithm.loss=cispo"],
    "is-mask": ["algorithm.importance.treatment=mask"],
    "is-sequence": ["algorithm.importance.level=sequence"],
    "staleness-0": ["algorithm.max_staleness=0"],
    "staleness-2": ["algorithm.max_staleness=2"],
    "staleness-4": ["algorithm.max_staleness=4"],
    "staleness-auto": [
        "algorithm.max_staleness=auto",
        "algorithm.staleness_min=0",
        "algorithm.staleness_max=4",
        "algorithm.staleness_patience=5",
        "algorithm.staleness_ess_target=0.9",
    ],
}

# The variants that fix the admission bound: "ppo" is the base config's bound of 1.
FIXED_BOUNDS = ("staleness-0", "ppo", "staleness-2", "staleness-4")

# Workload shapes, each added to every variant. The echo reward reads the first 8 characters, so 32 new
# tokens quadruple generation without changing the task; four PPO epochs quadruple training per batch.
SHAPES: dict[str, list[str]] = {
    "base": [],
    "generation-heavy": ["rollout.max_new_tokens=32"],
    "training-heavy": ["algorithm.ppo_epochs=4"],
}


def run_variant(name: str, config: str, steps: int, out_dir: Path, overrides: list[str]) -> Path:
    out = out_dir / name
    out.mkdir(parents=True)
    cmd = [
        sys.executable,
        str(ROOT / "launch.py"),
        config,
        f"learner.total_steps={steps}",
        f"run.output_dir={out}",
        "logging.wandb_mode=disabled",
        "logging.log_interval=1",
        *VARIANTS[name],
        *overrides,
        "--no-console",
    ]
    print(f"[algorithms] {name}: {' '.join(cmd[2:])}", flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    return run_dir


def moving_average(xs: list[float], k: int = 5) -> list[float]:
    return [sum(xs[max(0, i - k + 1) : i + 1]) / len(xs[max(0, i - k + 1) : i + 1]) for i in range(len(xs))]


def figures(rows: list[dict], target: float) -> dict[str, float | None]:
    """Time to target, final reward, mean staleness and ESS of one run's learner rows."""
    t0 = rows[0]["time"]
    rewards = moving_average([r["reward/mean"] for r in rows])
    hit = next((r["time"] - t0 for r, m in zip(rows, rewards, strict=True) if m >= target), None)
    k = max(1, len(rows) // 10)

    def mean(key: str) -> float | None:
        xs = [r[key] for r in rows if key in r]
        return sum(xs) / len(xs) if xs else None

    bounds = [r["staleness/bound"] for r in rows if "staleness/bound" in r]
    return {
        "time_to_target_s": None if hit is None else round(hit, 1),
        "final_reward": round(sum(r["reward/mean"] for r in rows[-k:]) / k, 3),
        "staleness_mean": round(mean("staleness/mean") or 0.0, 2),
        "ess_mean": None if mean("policy/ess") is None else round(mean("policy/ess"), 3),
        "wall_s": round(rows[-1]["time"] - t0, 1),
        **({"bound_last": bounds[-1], "bound_max": max(bounds)} if bounds else {}),
    }


def auto_against_fixed(results: dict[str, dict]) -> dict[str, float | None]:
    """``staleness-auto`` over the best fixed bound among those run (``ppo`` is bound 1): its time to target
    over the fastest fixed one's, and its final reward over the highest fixed one's. None where either is
    missing (a bound not run, or no run reaching the target)."""
    fixed = {n: f for n, f in results.items() if n in FIXED_BOUNDS}
    auto = results.get("staleness-auto")
    if auto is None or not fixed:
        return {"time_ratio": None, "final_ratio": None}
    times = [f["time_to_target_s"] for f in fixed.values() if f["time_to_target_s"] is not None]
    best_final = max(f["final_reward"] for f in fixed.values())
    t = auto["time_to_target_s"]
    return {
        "time_ratio": round(t / min(times), 3) if t is not None and times else None,
        "final_ratio": round(auto["final_reward"] / best_final, 3) if best_final > 0 else None,
    }


def print_table(shape: str, results: dict[str, dict]) -> None:
    print(f"\n[{shape}]\n{'variant':<16}{'to target':>11}{'final':>8}{'staleness':>11}{'ess':>7}{'wall':>8}")
    for name, f in results.items():
        hit = "never" if f["time_to_target_s"] is None else f"{f['time_to_target_s']:.1f}s"
        ess = "-" if f["ess_mean"] is None else f"{f['ess_mean']:.3f}"
        print(
            f"{name:<16}{hit:>11}{f['final_reward']:>8.3f}{f['staleness_mean']:>11.2f}{ess:>7}{f['wall_s']:>7.1f}s"
        )
    ratios = auto_against_fixed(results)
    if ratios["final_ratio"] is not None:
        print(
            f"auto / best fixed bound: time to target {ratios['time_ratio']}, final reward {ratios['final_ratio']}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--target", type=float, default=0.5)
    ap.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    ap.add_argument(
        "--shapes",
        default="base",
        help=f"comma-separated workload shapes: {', '.join(SHAPES)} (default: base)",
    )
    ap.add_argument("overrides", nargs="*", help="key=value overrides for every variant")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or list(VARIANTS)
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = sorted(set(names) - set(VARIANTS)) + sorted(set(shapes) - set(SHAPES))
    if unknown:
        ap.error(f"unknown {unknown}; variants: {', '.join(VARIANTS)}; shapes: {', '.join(SHAPES)}")
    results: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-algorithms-") as tmp:
        for shape in shapes:
            results[shape] = {}
            for name in names:
                overrides = SHAPES[shape] + args.overrides
                run_dir = run_variant(name, args.config, args.steps, Path(tmp) / shape, overrides)
                results[shape][name] = figures(read_history(run_dir, "learner"), args.target)
    for shape, by_variant in results.items():
        print_table(shape, by_variant)
    print(
        json.dumps(
            {
                "bench": "algorithms",
                "config": args.config,
                "steps": args.steps,
                "target": args.target,
                "shapes": {
                    shape: {
                        "overrides": SHAPES[shape],
                        "variants": v,
                        "auto_vs_best_fixed": auto_against_fixed(v),
                    }
                    for shape, v in results.items()
                },
            }
        )
    )


if __name__ == "__main__":
    main()
