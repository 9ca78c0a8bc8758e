"""Local vs Ray backend on the same config, in one invocation: what does running on Ray cost?

    python bench/launcher.py [--config configs/tiny.yaml] [--steps 100] [key=value ...]

Runs ``launch.py`` with the ``local`` backend, then with ``--ray local`` (a simulated cluster: the learner
and the server on their own Ray nodes on this machine), both with ``weightsync.transport=dist`` so the
weight path is the same. From each run: (a) time from starting launch.py to the learner's first step,
(b) the mean wall time per learner step after the first, and the Ray/local ratios of both. The Ray run's
time includes starting the simulated cluster; a real cluster is already up. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tandem.telemetry import read_history

ROOT = Path(__file__).resolve().parent.parent


def run(backend: list[str], config: str, steps: int, out: Path, overrides: list[str]) -> dict[str, float]:
    cmd = [
        sys.executable, str(ROOT / "launch.py"), config, f"learner.total_steps={steps}",
        f"run.output_dir={out}", "weightsync.transport=dist", "logging.wandb_mode=disabled",
        "rollout.threads=1", *overrides, "--no-console", *backend,
    ]  # fmt: skip
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(
            f"{' '.join(backend) or 'local'} run failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        )
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    rows = read_history(run_dir, "learner")
    times = [r["time"] for r in rows if "reward/mean" in r]
    return {
        "first_step_s": times[0] - t0,
        "step_ms": 1000 * (times[-1] - times[0]) / (len(times) - 1),
        "reward_last": rows[-1].get("reward/mean", float("nan")),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs/tiny.yaml"))
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        local = run([], args.config, args.steps, Path(tmp) / "local", args.overrides)
        ray = run(["--ray", "local"], args.config, args.steps, Path(tmp) / "ray", args.overrides)
    for name, r in (("local", local), ("ray", ray)):
        print(f"{name:5s}: first learner step after {r['first_step_s']:.1f} s; {r['step_ms']:.1f} ms/step")
    ratio_first = ray["first_step_s"] / local["first_step_s"]
    ratio_step = ray["step_ms"] / local["step_ms"]
    print(f"ray/local: time to first step x{ratio_first:.2f}, time per step x{ratio_step:.2f}")
    print(
        json.dumps(
            {
                "steps": args.steps,
                "local": local,
                "ray": ray,
                "first_step_ratio": ratio_first,
                "step_ratio": ratio_step,
            }
        )
    )


if __name__ == "__main__":
    main()
