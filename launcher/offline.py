"""``launch.py`` on an offline recipe (sft, rm, dpo): the learner alone on its fixed data set.

These recipes read no rollouts, so no Redis, prompt feeder or rollout servers start: the run is
``python -m learner.train`` in the run directory (learner/offline_runtime.py), its log on the console and in
``logs/learner.log``. The same command again resumes a fixed ``run.dir`` from its newest checkpoint.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import TextIO

from launcher import driver
from tandem.config import Config, dump_config, dump_public_config, write_private
from tandem.procs import driver_env

EXIT_GRACE_S = 60.0  # from the learner closing its output (or a Ctrl-C) to its exit, before it is killed


def command(config: Path, run_dir: Path, resume: bool) -> list[str]:
    argv = [sys.executable, "-m", "learner.train", "--config", str(config), "--run-dir", str(run_dir)]
    return argv + (["--resume"] if resume else [])


def run(cfg: Config, *, resume: Path | None, fresh: bool, dry_run: bool) -> int:
    if dry_run:
        run_dir = driver.fixed_run_dir(cfg) or driver.ROOT / cfg.run.output_dir / f"{cfg.run.name}-<time>"
        print(
            f"# learner ({cfg.recipe}: no rollout servers)\n{shlex.join(command(run_dir / 'config.yaml', run_dir, resume is not None))}"
        )
        print("# per-process config (config.yaml)\n" + dump_public_config(cfg))  # secrets redacted
        return 0
    run_dir = driver.prepare_run_dir(cfg, resume, fresh=fresh)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    if resume is None or cfg.run.dir is not None:
        write_private(run_dir / "config.public.yaml", dump_config(cfg))  # what the same command resumes
    config = driver.write_process_config(cfg, run_dir)
    print(
        f"[launch] run directory: {run_dir} ({cfg.recipe}: the learner alone, no rollout servers)", flush=True
    )
    with (run_dir / "logs" / "learner.log").open("a") as log:
        # The learner watches this process (driver_env): killed here, it stops soon after (tandem/procs.py).
        proc = subprocess.Popen(
            command(config, run_dir, resume is not None),
            cwd=driver.ROOT,
            env={**os.environ, **driver_env()},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        rc = follow(proc, log)
    summary = run_dir / "summary.json"
    if rc == 0 and summary.is_file():
        s = json.loads(summary.read_text())
        key = s.get("headline")
        before, after = s.get("before", {}).get(key), s.get("after", {}).get(key)
        trend = f"; {key} {before:.4g} -> {after:.4g}" if before is not None and after is not None else ""
        print(
            f"[launch] {cfg.recipe} finished after {s.get('steps')} steps{trend}; model in {run_dir / 'final'}"
        )
    else:
        print(
            f"[launch] the {cfg.recipe} learner exited with code {rc}; log in {run_dir / 'logs' / 'learner.log'}"
        )
    return 0 if rc == 0 else 1


def follow(proc: subprocess.Popen[str], log: TextIO) -> int:
    """Copy the learner's output to the console and its log until it exits; its exit code. A learner that
    closes its output but does not exit, or does not stop within ``EXIT_GRACE_S`` of a Ctrl-C (which reaches
    it too: it shares this terminal's process group), is killed, so the launcher never waits on it forever."""
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
        return proc.wait(timeout=EXIT_GRACE_S)
    except subprocess.TimeoutExpired:
        print(
            f"[launch] the learner did not exit within {EXIT_GRACE_S:g} s of closing its output: killing it"
        )
    except KeyboardInterrupt:
        try:
            return proc.wait(timeout=EXIT_GRACE_S)
        except subprocess.TimeoutExpired:
            print(f"[launch] the learner did not stop within {EXIT_GRACE_S:g} s of Ctrl-C: killing it")
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.wait()
