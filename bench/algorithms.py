"""The policy-loss, importance-weight and staleness variants on one task, same seed, same steps.

    python bench/algorithms.py [--config configs/tiny.yaml] [--steps 120] [--target 0.5] [--only a,b]
                               [key=value ...]

Runs ``launch.py`` once per variant (docs/design.md §4.9 and §3.7): the default loss (ppo, token-level
truncated importance weights, ``max_staleness`` 1), ``algorithm.loss`` gspo and cispo, ``algorithm.importance``
masked and sequence-level, and ``max_staleness`` 0, 2, 4 and auto. For each it prints the wall time until the
5-step moving average of ``reward/mean`` first reaches ``--target`` (from the learner's first logged step),
the final reward (mean of the last tenth of the steps), the mean staleness and the mean ``policy/ess``. The
last line is one JSON object. The default (echo on the tiny model, 120 steps) runs nine launches, each with
its own start-up: 22 minutes on the loaded 2-core machine of docs/benchmarks.md §7; ``--only`` picks some.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--target", type=float, default=0.5)
    ap.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides for every variant")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or list(VARIANTS)
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-algorithms-") as tmp:
        for name in names:
            run_dir = run_variant(name, args.config, args.steps, Path(tmp), args.overrides)
            results[name] = figures(read_history(run_dir, "learner"), args.target)
    print(f"\n{'variant':<16}{'to target':>11}{'final':>8}{'staleness':>11}{'ess':>7}{'wall':>8}")
    for name, f in results.items():
        hit = "never" if f["time_to_target_s"] is None else f"{f['time_to_target_s']:.1f}s"
        ess = "-" if f["ess_mean"] is None else f"{f['ess_mean']:.3f}"
        print(
            f"{name:<16}{hit:>11}{f['final_reward']:>8.3f}{f['staleness_mean']:>11.2f}{ess:>7}{f['wall_s']:>7.1f}s"
        )
    print(
        json.dumps(
            {
                "bench": "algorithms",
                "config": args.config,
                "steps": args.steps,
                "target": args.target,
                "variants": results,
            }
        )
    )


if __name__ == "__main__":
    main()
