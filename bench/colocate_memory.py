"""Colocated peak memory with and without ``placement.release_memory`` (docs/placement.md §11.1), measured.

Two runs of ``configs/tiny.yaml`` through ``launch.py --mode sync placement.mode=colocate``, one per setting,
on a tiny model made larger (``python -m toy make-tiny --hidden --layers --vocab-size``) so that weights,
not the interpreters, dominate each process. A sampler reads, every ``--interval`` seconds, the
proportional set size (PSS: shared pages split between the processes that map them, so the sum over
processes is what they hold together) of the run's processes from ``/proc/PID/smaps``:

- **server**: ``rollout.server`` (the hf engine in-process); **learner**: ``learner.train``;
- **shm**: the run's weight directory in ``/dev/shm`` (tmpfs blocks), counted once: the processes'
  mappings of those files are left out of their PSS. A deleted file that a process still maps holds its
  pages too; their PSS is counted here;
- Redis and the launch driver are reported apart (``other``), in neither side.

Each sample is tagged with the phase the CPU time says is running: ``generate`` (the server uses more CPU
than the learner), ``train`` (the other way) or ``switch`` (neither uses a fifth of a core: the hand-off,
the weight sync, sleep and wake). Samples before the learner's first step (loading, DeepSpeed start-up)
are ``startup``, those after launch.py says it is stopping ``shutdown``; both are left out of the peaks.

Reported per run: the peak of the sum (server + learner + shm, and server + learner alone), each side's
own peak, the ratio peak / max(side peaks) (target: at most 1.2 with release on), the peaks per phase
with each side's cores in use, and the server's ``time/sleep`` / ``time/wake`` means. Ends with one JSON
line.

    .venv/bin/python bench/colocate_memory.py [--steps 12] [--hidden 512] [--layers 4] [--vocab-size 32000]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

# bench/buffer.py and bench/weightsync.py would shadow the packages of the same name.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

ROOT = Path(__file__).resolve().parents[1]
MB = 2**20
STEP = re.compile(r"\] step [1-9]\d*/")
IDLE_CORES = 0.2  # below this many cores each, neither side runs: a switch


# ------------------------------------------------------------------------------------------- sampling


def pss(pid: int, exclude_prefix: str) -> tuple[int, int]:
    """PSS bytes of ``pid`` leaving out mappings of files under ``exclude_prefix`` (counted as shm), and
    the PSS of its mappings of such files that were deleted: pages no file on disk accounts for any more."""
    total = excluded = deleted = 0
    skip = gone = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                parts = line.split(None, 5)
                skip = len(parts) == 6 and parts[5].startswith(exclude_prefix)
                gone = skip and parts[5].rstrip().endswith("(deleted)")
            elif line.startswith("Pss:"):
                kb = int(line.split()[1])
                total += kb
                excluded += kb if skip else 0
                deleted += kb if gone else 0
    return (total - excluded) * 1024, deleted * 1024


def tmpfs_bytes(root: Path) -> int:
    """Blocks the files under ``root`` occupy (tmpfs: memory)."""
    n = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                n += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return n


def role(p: psutil.Process) -> str:
    cmd = " ".join(p.cmdline())
    if "rollout.server" in cmd:
        return "server"
    if "learner.train" in cmd:
        return "learner"
    return "other"


@dataclass
class Sample:
    t: float
    phase: str
    mem: dict[str, int]  # server, learner, shm, other (bytes)
    cores: dict[str, float]  # server, learner: CPU seconds per second since the last sample


@dataclass
class Sampler:
    driver: psutil.Process
    shm: Path
    log: Path  # launch.py's output: its first "step k/N" line (k >= 1) ends start-up
    samples: list[Sample] = field(default_factory=list)
    cpu: dict[int, float] = field(default_factory=dict)
    last: float = 0.0
    started: bool = False
    stopping: bool = False

    def sample(self) -> None:
        now = time.monotonic()
        mem = {"server": 0, "learner": 0, "other": 0}
        pinned = 0  # deleted weight files still mapped: shm memory, though no longer on disk
        used = {"server": 0.0, "learner": 0.0}
        try:
            procs = [self.driver, *self.driver.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for p in procs:
            try:
                r = role(p)
                own, deleted = pss(p.pid, str(self.shm))
                mem[r] += own
                pinned += deleted
                t = p.cpu_times()
                cpu = t.user + t.system
            except (psutil.NoSuchProcess, psutil.AccessDenied, FileNotFoundError, ProcessLookupError):
                continue
            if r in used:
                used[r] += cpu - self.cpu.get(p.pid, cpu)
            self.cpu[p.pid] = cpu
        mem["shm"] = tmpfs_bytes(self.shm) + pinned
        dt = max(now - self.last, 1e-3) if self.last else 0.0
        self.last = now
        cores = {k: (v / dt if dt else 0.0) for k, v in used.items()}
        self.samples.append(Sample(now, self.phase(cores), mem, cores))

    def phase(self, cores: dict[str, float]) -> str:
        if not self.started or not self.stopping:
            text = self.log.read_text(errors="replace")
            self.started = self.started or STEP.search(text) is not None
            self.stopping = "[launch] stopping" in text
        if not self.started:
            return "startup"
        if self.stopping:
            return "shutdown"
        if max(cores.values()) < IDLE_CORES:
            return "switch"
        return "generate" if cores["server"] > cores["learner"] else "train"


# ------------------------------------------------------------------------------------------------ runs


def make_model(out: Path, args: argparse.Namespace) -> Path:
    if not (out / "actor" / "config.json").exists():
        cmd = [sys.executable, "-m", "toy", "make-tiny", str(out), "--hidden", str(args.hidden),
               "--layers", str(args.layers), "--vocab-size", str(args.vocab_size)]  # fmt: skip
        subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True)
    return out


def run(release: bool, model: Path, out: Path, args: argparse.Namespace) -> dict:
    name = f"colocate-{'release' if release else 'resident'}"
    shm = Path("/dev/shm") / f"tandem-bench-{name}-{os.getpid()}"
    run_out = out / name
    cmd = [
        sys.executable, "launch.py", "configs/tiny.yaml", "--mode", "sync", "--no-console",
        "placement.mode=colocate", f"placement.release_memory={str(release).lower()}",
        f"model.actor={model / 'actor'}", f"model.critic={model / 'critic'}",
        f"learner.total_steps={args.steps}", f"run.output_dir={run_out}", f"weightsync.shm_dir={shm}",
        "logging.wandb_mode=disabled",
    ]  # fmt: skip
    print(f"[colocate_memory] {name}: {' '.join(cmd[1:])}", flush=True)
    log = open(out / f"{name}.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    sampler = Sampler(psutil.Process(proc.pid), shm, out / f"{name}.log")
    start = time.monotonic()
    try:
        while proc.poll() is None:
            sampler.sample()
            time.sleep(args.interval)
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # a launch that ignores SIGTERM must not hold the bench
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(shm, ignore_errors=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: launch.py exited {proc.returncode}; see {out / f'{name}.log'}")
    return summarise(name, sampler.samples, run_dir(run_out), time.monotonic() - start)


def run_dir(run_out: Path) -> Path | None:
    dirs = [p for p in run_out.iterdir() if p.is_dir()] if run_out.is_dir() else []
    return dirs[0] if len(dirs) == 1 else None


def server_means(d: Path | None, keys: tuple[str, ...]) -> dict[str, float | None]:
    """Means of ``keys`` over the server's logged rows (its history file in the run directory)."""
    rows = []
    for f in sorted(d.glob("server*history*.jsonl")) if d is not None else []:
        rows += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    out: dict[str, float | None] = {}
    for k in keys:
        xs = [r[k] for r in rows if isinstance(r.get(k), int | float)]
        out[k] = round(sum(xs) / len(xs), 4) if xs else None
    return out


def summarise(name: str, samples: list[Sample], d: Path | None, wall: float) -> dict:
    steady = [s for s in samples if s.phase not in ("startup", "shutdown")]
    if not steady:
        raise SystemExit(f"{name}: no sample after the learner's first step (a run too short?)")

    def peak(key) -> int:
        return max(key(s) for s in steady)

    side = {r: peak(lambda s, r=r: s.mem[r]) for r in ("server", "learner")}
    total = peak(lambda s: s.mem["server"] + s.mem["learner"] + s.mem["shm"])
    procs = peak(lambda s: s.mem["server"] + s.mem["learner"])
    larger = max(side.values())
    phases = {}
    for ph in ("generate", "train", "switch"):
        xs = [s for s in steady if s.phase == ph]
        if xs:
            phases[ph] = {
                "samples": len(xs),
                "peak_total_mb": round(
                    max(s.mem["server"] + s.mem["learner"] + s.mem["shm"] for s in xs) / MB
                ),
                "peak_server_mb": round(max(s.mem["server"] for s in xs) / MB),
                "peak_learner_mb": round(max(s.mem["learner"] for s in xs) / MB),
                "min_server_mb": round(min(s.mem["server"] for s in xs) / MB),
                "min_learner_mb": round(min(s.mem["learner"] for s in xs) / MB),
                "server_cores": round(sum(s.cores["server"] for s in xs) / len(xs), 2),
                "learner_cores": round(sum(s.cores["learner"] for s in xs) / len(xs), 2),
            }
    return {
        "name": name,
        "samples": len(samples),
        "wall_s": round(wall, 1),
        "peak_total_mb": round(total / MB),
        "peak_processes_mb": round(procs / MB),
        "peak_server_mb": round(side["server"] / MB),
        "peak_learner_mb": round(side["learner"] / MB),
        "peak_shm_mb": round(peak(lambda s: s.mem["shm"]) / MB),
        "peak_other_mb": round(peak(lambda s: s.mem["other"]) / MB),
        "startup_peak_total_mb": round(
            max((s.mem["server"] + s.mem["learner"] + s.mem["shm"] for s in samples), default=0) / MB
        ),
        "ratio_total": round(total / larger, 3),
        "ratio_processes": round(procs / larger, 3),
        "phases": phases,
        **server_means(d, ("time/sleep", "time/wake", "time/generate")),
    }


# ---------------------------------------------------------------------------------------------- report


def report(runs: dict[str, dict]) -> None:
    print("\n| run | peak server+learner+shm MB | peak server+learner MB | server peak | learner peak | shm peak "
          "| ratio (with shm) | ratio (processes) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in runs.values():
        print(f"| {r['name']} | {r['peak_total_mb']} | {r['peak_processes_mb']} | {r['peak_server_mb']} "
              f"| {r['peak_learner_mb']} | {r['peak_shm_mb']} | {r['ratio_total']} | {r['ratio_processes']} |")  # fmt: skip
    for r in runs.values():
        print(f"\n{r['name']}: per phase (peak MB, mean cores in use): {json.dumps(r['phases'])}")
        print(f"{r['name']}: time/sleep {r['time/sleep']} s, time/wake {r['time/wake']} s, "
              f"time/generate {r['time/generate']} s (server means per batch)")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12, help="learner steps per run")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab-size", type=int, default=32000, help="embedding/head rows (weights dominate)")
    ap.add_argument("--interval", type=float, default=0.05, help="seconds between samples")
    ap.add_argument("--out", type=Path, default=None, help="where runs and logs go (default: a temp dir)")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="colocate-memory-"))
    out.mkdir(parents=True, exist_ok=True)
    model = make_model(out / "model", args)
    runs = {"release": run(True, model, out, args), "resident": run(False, model, out, args)}
    report(runs)
    rel, res = runs["release"], runs["resident"]
    print(json.dumps({
        "bench": "colocate_memory",
        "model": {"hidden": args.hidden, "layers": args.layers, "vocab_size": args.vocab_size},
        "steps": args.steps,
        "release_peak_total_mb": rel["peak_total_mb"],
        "resident_peak_total_mb": res["peak_total_mb"],
        "release_ratio_total": rel["ratio_total"],
        "resident_ratio_total": res["ratio_total"],
        "release_ratio_processes": rel["ratio_processes"],
        "resident_ratio_processes": res["ratio_processes"],
        "release_over_resident_peak": round(rel["peak_total_mb"] / res["peak_total_mb"], 3),
        "target_ratio": 1.2,
        "runs": runs,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
