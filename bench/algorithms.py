"""The policy-loss, importance-weight and staleness variants on one task, same seed, same steps.

    python bench/algorithms.py [--config configs/tiny.yaml] [--steps 120] [--target T] [--only a,b]
                               [--shapes base,generation-heavy,training-heavy] [--seeds 0,1,2] [key=value ...]

Runs ``launch.py`` once per variant (docs/design.md §4.9 and §3.7): the default loss (ppo, token-level
truncated importance weights, ``max_staleness`` 1), ``algorithm.loss`` gspo and cispo, ``algorithm.importance``
masked and sequence-level, and ``max_staleness`` 0, 2, 4 and auto (and, asked for, ``algorithm.stop_kl``). For each it prints the wall time until the
5-step moving average of ``reward/mean`` first reaches ``--target`` (from the learner's first logged step),
the final reward (mean of the last tenth of the steps), the mean staleness and the mean ``policy/ess``.
``--shapes`` repeats the variants on other workload shapes (:data:`SHAPES`) and, after each shape's table,
prints ``staleness-auto`` against the best of the fixed bounds run. ``--seeds`` runs every variant once per
``run.seed`` and compares medians (a run that never reaches the target counts as slower than any that does),
with a 90% bootstrap interval of each ratio over the seeds: one seed's spread between runs is as large as
the gaps between bounds on the echo task (docs/benchmarks.md).
The target is ``--target``, else the shape's own (:data:`TARGETS`). The last line is one JSON object. The
default (echo on the tiny model, 120 steps, one shape) runs nine launches, each with its own start-up: 22
minutes on the loaded 2-core machine of docs/benchmarks.md §7; ``--only`` picks some.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tandem.config import ConfigError, load_config
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
        "algorithm.staleness_start=1",
        "algorithm.staleness_patience=5",
        "algorithm.staleness_ess_target=0.9",
    ],
    # PPO's early stopping (docs/design.md §4.1): only a shape of several optimizer steps per batch has a
    # minibatch to skip, so it is run when asked for (--only) on such a shape (training-heavy).
    "stop-kl": ["algorithm.stop_kl=0.1"],
}
ASKED_ONLY = {"stop-kl"}

# The variants that fix the admission bound: "ppo" is the base config's bound of 1.
FIXED_BOUNDS = ("staleness-0", "ppo", "staleness-2", "staleness-4")

# Workload shapes, each added to every variant. The echo reward reads the first 8 characters, so 32 new
# tokens quadruple generation without changing the task; four PPO epochs quadruple training per batch.
SHAPES: dict[str, list[str]] = {
    "base": [],
    "generation-heavy": ["rollout.max_new_tokens=32"],
    "training-heavy": ["algorithm.ppo_epochs=4"],
}
# The reward each shape is timed to: echo with 32 new tokens does not reach 0.5 in 200 steps.
TARGETS: dict[str, float] = {"base": 0.5, "generation-heavy": 0.25, "training-heavy": 0.5}


def run_variant(name: str, config: str, steps: int, out: Path, overrides: list[str]) -> Path:
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


def median_figures(runs: list[dict]) -> dict[str, float | None]:
    """One variant's figures over its seeds: the median of each, a run that never reached the target
    counting as slower than every run that did (None when the median run is such a run)."""
    times = [math.inf if f["time_to_target_s"] is None else f["time_to_target_s"] for f in runs]
    t = statistics.median(times)
    out: dict[str, float | None] = {"time_to_target_s": None if math.isinf(t) else round(t, 1)}
    for key in ("final_reward", "staleness_mean", "ess_mean", "wall_s"):
        xs = [f[key] for f in runs if f.get(key) is not None]
        out[key] = round(statistics.median(xs), 3) if xs else None
    return out


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


def resampled_ratios(
    runs: dict[str, list[dict]], draws: int = 2000, seed: int = 0
) -> dict[str, list[float | None] | None]:
    """A 90% bootstrap interval of each ratio of :func:`auto_against_fixed`: every variant's seeds drawn
    again with replacement, ``draws`` times, its medians and the ratios taken anew each time. A draw where
    ``auto``'s median run never reached the target counts as an infinite time ratio. None without
    ``staleness-auto`` and a fixed bound, or with one seed (nothing to resample)."""
    if "staleness-auto" not in runs or not set(runs) & set(FIXED_BOUNDS) or len(runs["staleness-auto"]) < 2:
        return {"time_ratio": None, "final_ratio": None}
    rng = random.Random(seed)
    drawn: dict[str, list[float]] = {"time_ratio": [], "final_ratio": []}
    for _ in range(draws):
        medians = {n: median_figures([rng.choice(rs) for _ in rs]) for n, rs in runs.items()}
        ratios = auto_against_fixed(medians)
        if ratios["time_ratio"] is None and medians["staleness-auto"]["time_to_target_s"] is None:
            ratios["time_ratio"] = math.inf
        for key, value in ratios.items():
            if value is not None:
                drawn[key].append(value)

    def interval(xs: list[float]) -> list[float] | None:
        if not xs:
            return None
        xs = sorted(xs)
        ends = (xs[int(0.05 * (len(xs) - 1))], xs[int(0.95 * (len(xs) - 1))])
        return [x if math.isfinite(x) else None for x in ends]  # None: no bound (JSON has no infinity)

    return {key: interval(xs) for key, xs in drawn.items()}


def print_table(shape: str, target: float, results: dict[str, dict], runs: dict[str, list[dict]]) -> None:
    """Each variant's median figures, then each seed's time to target and final reward."""
    print(f"\n[{shape}, target {target}]")
    print(f"{'variant':<16}{'to target':>11}{'final':>8}{'staleness':>11}{'ess':>7}{'wall':>8}   per seed")
    for name, f in results.items():
        hit = "never" if f["time_to_target_s"] is None else f"{f['time_to_target_s']:.1f}s"
        ess = "-" if f["ess_mean"] is None else f"{f['ess_mean']:.3f}"
        seeds = " ".join(
            f"{'never' if r['time_to_target_s'] is None else r['time_to_target_s']}/{r['final_reward']:.3f}"
            for r in runs[name]
        )
        print(
            f"{name:<16}{hit:>11}{f['final_reward']:>8.3f}{f['staleness_mean']:>11.2f}{ess:>7}"
            f"{f['wall_s']:>7.1f}s   {seeds}"
        )
    ratios = auto_against_fixed(results)
    if ratios["final_ratio"] is not None:
        print(
            f"auto / best fixed bound: time to target {ratios['time_ratio']}, final reward {ratios['final_ratio']}"
        )
        spread = resampled_ratios(runs)
        if spread["final_ratio"] is not None:
            print(
                f"  90% bootstrap interval over the seeds: time to target {spread['time_ratio']}, "
                f"final reward {spread['final_ratio']}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--target", type=float, default=None, help="reward to time (default: the shape's)")
    ap.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    ap.add_argument(
        "--shapes",
        default="base",
        help=f"comma-separated workload shapes: {', '.join(SHAPES)} (default: base)",
    )
    ap.add_argument("--seeds", default="", help="comma-separated run.seed values (default: the config's)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides for every variant")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or [n for n in VARIANTS if n not in ASKED_ONLY]
    shapes = [s for s in args.shapes.split(",") if s]
    seeds: list[int | None] = [int(s) for s in args.seeds.split(",") if s] or [None]
    unknown = sorted(set(names) - set(VARIANTS)) + sorted(set(shapes) - set(SHAPES))
    if unknown:
        ap.error(f"unknown {unknown}; variants: {', '.join(VARIANTS)}; shapes: {', '.join(SHAPES)}")
    for shape in shapes:  # a variant the config refuses on a shape fails here, before any launch
        for name in names:
            try:
                load_config(args.config, [*VARIANTS[name], *SHAPES[shape], *args.overrides])
            except ConfigError as e:
                ap.error(f"variant {name} on shape {shape}: {e}")
    targets = {shape: args.target if args.target is not None else TARGETS[shape] for shape in shapes}
    runs: dict[str, dict[str, list[dict]]] = {shape: {n: [] for n in names} for shape in shapes}
    with tempfile.TemporaryDirectory(prefix="bench-algorithms-") as tmp:
        for shape in shapes:
            for seed in seeds:  # every variant at one seed before the next seed: drift hits them alike
                for name in names:
                    overrides = SHAPES[shape] + ([f"run.seed={seed}"] if seed is not None else [])
                    out = Path(tmp) / shape / f"{name}-seed{seed}"
                    run_dir = run_variant(name, args.config, args.steps, out, overrides + args.overrides)
                    runs[shape][name].append(figures(read_history(run_dir, "learner"), targets[shape]))
    results = {shape: {n: median_figures(r) for n, r in by_name.items()} for shape, by_name in runs.items()}
    for shape in shapes:
        print_table(shape, targets[shape], results[shape], runs[shape])
    print(
        json.dumps(
            {
                "bench": "algorithms",
                "config": args.config,
                "steps": args.steps,
                "seeds": seeds,
                "shapes": {
                    shape: {
                        "overrides": SHAPES[shape],
                        "target": targets[shape],
                        "medians": v,
                        "runs": runs[shape],
                        "auto_vs_best_fixed": auto_against_fixed(v),
                        "auto_vs_best_fixed_90": resampled_ratios(runs[shape]),
                    }
                    for shape, v in results.items()
                },
            }
        )
    )


if __name__ == "__main__":
    main()
