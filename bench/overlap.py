"""Async vs sync on the same config, in one invocation: does overlapping generation and training pay off?

    python bench/overlap.py [--config configs/tiny.yaml] [--steps 120] [--target 0.5] [key=value ...]

Runs ``launch.py`` twice (``--mode sync`` then ``--mode async``) and prints, from the learners' and servers'
logged histories:
  (a) trained samples per second in each mode and their ratio (the speedup);
  (b) the ideal speedup ``(T_gen + T_train) / max(T_gen, T_train)`` from the per-step busy times of the
      servers and the learner measured in the sync run (wall time minus waiting on the other side), and how
      close async comes to it (efficiency = speedup / ideal);
  (c) wall time to reach ``--target`` reward (5-step moving average) in each mode, and the final rewards.
Writes ``reward_vs_time.png`` and ``reward_vs_samples.png`` next to the runs. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from tandem.telemetry import history_procs, read_history

ROOT = Path(__file__).resolve().parent.parent


def run_mode(mode: str, config: str, steps: int, out_dir: Path, overrides: list[str]) -> Path:
    cmd = [
        sys.executable,
        str(ROOT / "launch.py"),
        config,
        f"learner.total_steps={steps}",
        f"run.output_dir={out_dir}",
        "logging.wandb_mode=disabled",
        *overrides,
        "--mode",
        mode,
        "--no-console",
    ]
    print(f"[overlap] {mode}: {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    (run_dir,) = [p for p in out_dir.iterdir() if p.is_dir()]
    return run_dir


def run_histories(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """Learner rows (from the run summary) and every server's rows (from Redis history dumped by launch)."""
    learner = read_history(run_dir, "learner")
    servers: list[dict] = []
    for proc in history_procs(run_dir, "server-*"):
        servers += [{**row, "_server": proc} for row in read_history(run_dir, proc)]
    return learner, servers


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def _fmt_s(x: float | None) -> str:
    return "not reached" if x is None else f"{x:.0f}s"


def _busy(rows: list[dict], wait_key: str) -> float:
    """Seconds a process was working over its logged rows (the first row only marks the start)."""
    return sum(b["time"] - a["time"] - b.get(wait_key, 0.0) for a, b in itertools.pairwise(rows))


def _by_server(rows: list[dict]) -> list[list[dict]]:
    servers: dict[str, list[dict]] = {}
    for r in rows:
        servers.setdefault(r["_server"], []).append(r)
    return list(servers.values())


def moving_average(xs: list[float], k: int = 5) -> list[float]:
    return [sum(xs[max(0, i - k + 1) : i + 1]) / len(xs[max(0, i - k + 1) : i + 1]) for i in range(len(xs))]


def figures(
    learner: list[dict], servers: list[dict], batch_size: int, target: float
) -> dict[str, float | None]:
    t0 = learner[0]["time"]
    span = learner[-1]["time"] - t0
    samples_per_s = (len(learner) - 1) * batch_size / span if span > 0 else float("nan")
    rewards = moving_average([r["reward/mean"] for r in learner])
    hit = next((r["time"] - t0 for r, m in zip(learner, rewards, strict=True) if m >= target), None)
    k = max(1, len(learner) // 10)
    # Busy time per learner step: wall time between logged rows minus the time spent waiting on the other
    # side (the learner for data, a server for admission). This counts every cost a step really pays
    # (Redis, weight sync, scoring), not just the forward passes.
    t_train = _busy(learner, "time/wait_for_data") / (len(learner) - 1)
    t_gen = sum(_busy(rows, "time/wait_admission") for rows in _by_server(servers)) / (len(learner) - 1)
    return {
        "samples_per_s": samples_per_s,
        "time_to_target_s": hit,
        "final_reward": sum(r["reward/mean"] for r in learner[-k:]) / k,
        "t_gen": t_gen,
        "t_train": t_train,
    }


def plot(runs: dict[str, list[dict]], batch_size: int, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for x_name, xs in (
        ("time", lambda rows: [r["time"] - rows[0]["time"] for r in rows]),
        ("samples", lambda rows: [i * batch_size for i in range(len(rows))]),
    ):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for mode, rows in runs.items():
            ax.plot(xs(rows), moving_average([r["reward/mean"] for r in rows]), label=mode)
        ax.set_xlabel("wall time (s)" if x_name == "time" else "trained samples")
        ax.set_ylabel("reward/mean (5-step avg)")
        ax.legend()
        fig.tight_layout()
        path = out / f"reward_vs_{x_name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--target", type=float, default=0.5, help="reward to reach for time-to-target")
    ap.add_argument(
        "--out", type=Path, default=None, help="directory for the runs and plots (default: a temp dir)"
    )
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    sys.path.insert(0, str(ROOT))
    from tandem.config import load_config
    from toy.tiny import ensure_demo_assets

    ensure_demo_assets(ROOT)  # a fresh checkout has no assets/ until `make assets`

    batch_size = load_config(ROOT / args.config, args.overrides).algorithm.batch_size
    out = args.out or Path(tempfile.mkdtemp(prefix="tandem-overlap-"))
    out.mkdir(parents=True, exist_ok=True)
    results, histories = {}, {}
    for mode in ("sync", "async"):
        run_dir = run_mode(mode, args.config, args.steps, out / mode, args.overrides)
        learner, servers = run_histories(run_dir)
        histories[mode] = learner
        results[mode] = figures(learner, servers, batch_size, args.target)

    s, a = results["sync"], results["async"]
    speedup = a["samples_per_s"] / s["samples_per_s"]
    ideal = (s["t_gen"] + s["t_train"]) / max(s["t_gen"], s["t_train"])
    for mode, r in results.items():
        print(
            f"[overlap] {mode:5s}: {r['samples_per_s']:.1f} samples/s, T_gen {1000 * r['t_gen']:.0f} ms + T_train {1000 * r['t_train']:.0f} ms per step,"
            f" time to reward {args.target}: {_fmt_s(r['time_to_target_s'])}, final reward {r['final_reward']:.3f}"
        )
    print(
        f"[overlap] speedup async/sync {speedup:.2f}x; ideal {ideal:.2f}x; efficiency {speedup / ideal:.2f}"
    )
    for p in plot(histories, batch_size, out):
        print(f"[overlap] plot: {p}")
    print(
        json.dumps(
            {
                "samples_per_s_sync": round(s["samples_per_s"], 3),
                "samples_per_s_async": round(a["samples_per_s"], 3),
                "speedup": round(speedup, 3),
                "ideal_speedup": round(ideal, 3),
                "efficiency": round(speedup / ideal, 3),
                "time_to_target_s_sync": _round(s["time_to_target_s"]),
                "time_to_target_s_async": _round(a["time_to_target_s"]),
                "final_reward_sync": round(s["final_reward"], 3),
                "final_reward_async": round(a["final_reward"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
