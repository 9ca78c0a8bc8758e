"""SFT and the reward model at once, each on its share of the cores (docs/stages.md §4.5).

With ``rm_from: base`` and pairs that are not samples of the SFT model, the rm stage needs nothing from the
sft stage, so the two can train side by side. On CPU a stage's share is a thread budget (``OMP_NUM_THREADS``
of its child, recorded as ``learner.threads``); on CUDA a device each would be the analogue.

- ``schedule: serial``: sft, then rm, each with every core (the pipeline's own loop);
- ``schedule: parallel``: both children at once, ``split.sft_threads`` : the rest (an even split by
  default); the first to fail stops the other;
- ``schedule: auto``: a profile window first. Each stage runs ``split.profile_steps`` steps with every
  core and as many again with half of them; these are real steps (the runs stop with a checkpoint and
  the stage resumes from it), so only the extra start-ups are lost, and those are measured. Per stage
  two laws over the thread count ``g`` are fitted with the placement planner's fit
  (:func:`placement.cost.CostModel.from_samples`, ``t = alpha + beta * W / g`` with ``W`` one step):
  seconds per step (a run's median gap between step rows), and a run's start-up, warm-up, validations
  and finish (what it spent beyond its steps at that pace). Serial is priced as the sum of the two stages at
  every core, a split ``a : N - a`` as the slower of the two on its share, each with its steps left; the
  cheapest is run, and its predicted wall time is recorded beside the measured one (``schedule.json``,
  and the pipeline's ``summary.json``). What the laws leave out (two stages contending for memory
  bandwidth, a loaded machine) is what that pair shows.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import statistics
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from placement.cost import CostModel, Law, Sample
from stages.report import headline
from tandem.config import Config, ConfigError, Section
from tandem.telemetry import read_rows

if TYPE_CHECKING:
    from stages.pipeline import Pipeline

REPO = Path(__file__).resolve().parents[1]
OFFLINE = ("sft", "rm")


class Split(Section):
    """The cores ``schedule: parallel | auto`` divides between the sft and rm stages."""

    cores: int = Field(0, ge=0, description="Threads sft and rm share (0: os.cpu_count()).")
    sft_threads: int | None = Field(
        None, ge=1, description="parallel: the sft stage's threads (rm has the rest); null: an even split."
    )
    profile_steps: int = Field(
        6,
        ge=2,
        description="auto: steps each stage trains with every core, then as many with half, before the"
        " plan (real steps: the stage resumes from them).",
    )


def check_schedule(mode: str, rm_from: str, pairs_source: str | None) -> None:
    """Refuse a schedule whose rm stage needs the SFT model (``pairs_source`` None: no generated data)."""
    if mode == "serial":
        return
    if rm_from != "base":
        raise ValueError(
            f"schedule: {mode} needs rm_from: base (rm_from: {rm_from} starts the reward model from the SFT"
            " model, so rm cannot start before sft has finished)"
        )
    if pairs_source == "policy":
        raise ValueError(
            f"schedule: {mode} needs pairs.source: task (pairs.source: policy labels samples of the SFT"
            " model, so rm cannot start before sft has finished)"
        )


# ------------------------------------------------------------------------------------------- the cost model


@dataclass(frozen=True)
class ProfileRun:
    """One profile run of a stage: its thread count, the gaps between its step rows, the whole child's
    seconds, and the steps it trained."""

    threads: int
    step_s: tuple[float, ...]
    wall_s: float
    steps: int


@dataclass(frozen=True)
class StageCost:
    """A stage's fitted laws over its thread count and the steps it has left."""

    stage: str
    step: Law  # seconds of a typical step (a run's median)
    overhead: Law  # the rest of a run: start-up, warm-up, validations, final checkpoint and export
    steps_left: int

    def wall(self, threads: int) -> float:
        return self.overhead.time(1.0, threads) + self.steps_left * self.step.time(1.0, threads)


@dataclass(frozen=True)
class Candidate:
    """A schedule of the two stages: serial (each with every core) or a split of the cores."""

    sft_threads: int
    rm_threads: int
    serial: bool
    wall_s: float  # predicted

    @property
    def name(self) -> str:
        return "serial" if self.serial else f"split {self.sft_threads}:{self.rm_threads}"


def fit_stage(stage: str, runs: Sequence[ProfileRun], steps_left: int) -> StageCost:
    """The stage's two laws from its profile runs (the planner's fit: non-negative ``alpha``, ``beta``).

    A run's typical step is the median gap: a process's first steps can take several times longer
    (warm-up), and a validation lands on some steps. What the run spent beyond ``steps`` typical steps
    (start-up, warm-up, validations, the final checkpoint and export) is its overhead, which the stage's
    next run pays again."""
    samples = []
    for r in runs:
        step = statistics.median(r.step_s)
        samples += [Sample("step", 1.0, r.threads, step)]
        samples += [Sample("overhead", 1.0, r.threads, max(0.0, r.wall_s - r.steps * step))]
    laws = CostModel.from_samples(samples).time
    return StageCost(stage, laws["step"], laws["overhead"], steps_left)


def candidates(sft: StageCost, rm: StageCost, cores: int) -> list[Candidate]:
    """Every schedule on ``cores`` threads, cheapest first: serial, and each split ``a : cores - a``."""
    out = [Candidate(cores, cores, True, sft.wall(cores) + rm.wall(cores))]
    out += [Candidate(a, cores - a, False, max(sft.wall(a), rm.wall(cores - a))) for a in range(1, cores)]
    return sorted(out, key=lambda c: (c.wall_s, not c.serial))


# ------------------------------------------------------------------------------------------- the children


def child_env(threads: int | None = None) -> dict[str, str]:
    """A stage child's environment: its own rendezvous and, given ``threads``, its share of the cores."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(var, None)  # a child learner makes its own rendezvous
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)  # torch reads it at start-up
    return env


@dataclass
class Job:
    stage: str
    cmd: list[str]
    log_path: Path
    threads: int
    stop_at: int | None = None  # profile: SIGINT once history.jsonl shows this step (a clean stop)
    proc: subprocess.Popen | None = None
    signalled: bool = False
    started: float = 0.0
    wall_s: float = 0.0


def run_together(jobs: Sequence[Job]) -> None:
    """Run the jobs' children at once and wait for all. The first to fail stops the others (SIGINT: a
    checkpoint to resume from; killed after 60 s) and raises naming its stage."""
    outs = [open(j.log_path, "ab") for j in jobs]  # noqa: SIM115 (closed below)
    try:
        for j, out in zip(jobs, outs, strict=True):
            j.started = time.time()
            j.proc = subprocess.Popen(
                j.cmd, cwd=REPO, env=child_env(j.threads), stdout=out, stderr=subprocess.STDOUT
            )
        failed = _wait(jobs)
    finally:
        _stop(jobs)
        for out in outs:
            out.close()
    if failed is not None:
        others = [j.stage for j in jobs if j is not failed]
        tail = failed.log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(
            f"{failed.stage}: {' '.join(failed.cmd[:4])} ... exited with {failed.proc.returncode}"
            + (f"; stopped {', '.join(others)}" if others else "")
            + f"; log {failed.log_path}:\n{tail}"
        )


def _wait(jobs: Sequence[Job]) -> Job | None:
    """Poll until every child has exited (None) or one has failed (that job)."""
    while True:
        running = 0
        for j in jobs:
            rc = j.proc.poll()
            if rc is None:
                running += 1
                if j.stop_at is not None and not j.signalled and last_step(j.log_path.parent) >= j.stop_at:
                    j.proc.send_signal(signal.SIGINT)
                    j.signalled = True
            elif not j.wall_s:
                j.wall_s = time.time() - j.started
                if rc != 0 and not j.signalled:  # stopped by us: perhaps while finishing; the resume checks
                    return j
        if not running:
            return None
        time.sleep(0.05 if any(j.stop_at is not None for j in jobs) else 0.2)  # a profile's steps are short


def _stop(jobs: Sequence[Job]) -> None:
    """No child outlives the schedule: SIGINT the ones still running, then kill any that linger."""
    alive = [j for j in jobs if j.proc is not None and j.proc.poll() is None]
    for j in alive:
        j.proc.send_signal(signal.SIGINT)
    deadline = time.time() + 60
    for j in alive:
        try:
            j.proc.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            j.proc.kill()
            j.proc.wait()


def history(stage_dir: Path) -> list[dict[str, Any]]:
    return read_rows(stage_dir / "history.jsonl")


def last_step(stage_dir: Path) -> int:
    return max((int(r["step"]) for r in history(stage_dir) if "step" in r), default=0)


def step_seconds(rows: Sequence[dict[str, Any]]) -> tuple[float, ...]:
    """Each step's seconds from one run's history rows (every step logged): the gaps between rows."""
    return tuple(b["time"] - a["time"] for a, b in itertools.pairwise(rows) if b["step"] > a["step"])


def total_steps(cfg: Config) -> int:
    """The steps the offline runtime trains (docs/stages.md §3.4); early stop may end it sooner."""
    a = cfg.algorithm
    with open(a.train_file) as f:
        n = sum(1 for line in f if line.strip())
    return min(cfg.learner.total_steps, a.epochs * (n // a.batch_size))


# -------------------------------------------------------------------------------------------- the schedule


def with_threads(cfg: Config, threads: int, log_every_step: bool = False) -> Config:
    update: dict[str, Any] = {"learner": cfg.learner.model_copy(update={"threads": threads})}
    if log_every_step:  # the profile times each step from its row
        update["logging"] = cfg.logging.model_copy(update={"log_interval": 1})
    return cfg.model_copy(update=update)


def run_offline_stages(p: Pipeline, cfgs: dict[str, Config]) -> None:
    """The sft and rm stages under ``schedule: parallel | auto``; each ends with its ``done.json``."""
    cores = p.pc.split.cores or os.cpu_count() or 1
    pending = [s for s in OFFLINE if not _skip(p, s, cfgs[s])]
    if not pending:
        return
    for s in pending:
        (p.dir / s).mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"mode": p.pc.schedule, "cores": cores}
    spent = dict.fromkeys(pending, 0.0)  # each stage's child seconds, profile included
    t0 = time.time()
    plan = choose(p, cfgs, cores, pending, spent, record)
    t1 = time.time()
    for group in plan:  # serial: one stage a group; a split: both in one
        for s, secs in _run(p, group, cfgs).items():
            spent[s] += secs
    record["threads"] = {s: t for group in plan for s, t in group}
    record["measured_s"] = time.time() - t1
    record["total_s"] = time.time() - t0
    if "predicted_s" in record:
        print(
            f"[pipeline] schedule: {record['plan']}: predicted {record['predicted_s']:.1f}s, measured"
            f" {record['measured_s']:.1f}s (profile before it {record['profile_s']:.1f}s)",
            flush=True,
        )
    (p.dir / "schedule.json").write_text(json.dumps(record, indent=2))
    for s in pending:
        _finish(p, s, cfgs[s], spent[s])


Plan = list[list[tuple[str, int]]]  # groups run one after the other; a group's (stage, threads) at once


def choose(
    p: Pipeline,
    cfgs: dict[str, Config],
    cores: int,
    pending: list[str],
    spent: dict[str, float],
    record: dict[str, Any],
) -> Plan:
    """The plan: the one stage left alone; parallel's split; or auto's pick after its profile window."""
    if len(pending) == 1:
        record["plan"] = f"{pending[0]} alone"  # nothing to overlap with
        return [[(pending[0], cores)]]
    if p.pc.schedule == "parallel":
        if cores < 2:
            raise ConfigError(f"split.cores: schedule: parallel needs at least 2 threads, not {cores}")
        a = p.pc.split.sft_threads or cores // 2
        if not 1 <= a < cores:
            raise ConfigError(f"split.sft_threads: {a} leaves the rm stage none of the {cores} threads")
        record["plan"] = f"split {a}:{cores - a}"
        return [[("sft", a), ("rm", cores - a)]]
    t0 = time.time()
    costs = {s: profile(p, s, cfgs[s], cores, spent) for s in OFFLINE}
    ranking = candidates(costs["sft"], costs["rm"], cores)
    best = ranking[0]
    print("[pipeline] schedule: plans ranked by predicted seconds for sft + rm after the profile:")
    for c in ranking:
        print(f"[pipeline]   {c.name:12s} {c.wall_s:7.1f}s")
    record.update(
        profile_s=time.time() - t0,
        plan=best.name,
        predicted_s=best.wall_s,
        ranking=[{"plan": c.name, "predicted_s": c.wall_s} for c in ranking],
        laws={
            s: {"step": vars(c.step), "overhead": vars(c.overhead), "steps_left": c.steps_left}
            for s, c in costs.items()
        },
    )
    if best.serial:
        return [[("sft", cores)], [("rm", cores)]]
    return [[("sft", best.sft_threads), ("rm", best.rm_threads)]]


def _skip(p: Pipeline, stage: str, cfg: Config) -> bool:
    if p.done_before(stage, cfg):
        print(f"[pipeline] {stage}: done before, skipped ({p.dir / stage})", flush=True)
        return True
    return False


def _run(p: Pipeline, plan: list[tuple[str, int]], cfgs: dict[str, Config]) -> dict[str, float]:
    """Train the stages of ``plan`` (stage, threads) to the end, at once; each one's child seconds."""
    jobs = []
    for s, threads in plan:
        print(f"[pipeline] {s}: starting in {p.dir / s} with {threads} threads", flush=True)
        cmd = p.offline_cmd(s, with_threads(cfgs[s], threads))
        jobs.append(Job(s, cmd, p.dir / s / "train.log", threads))
    run_together(jobs)
    return {j.stage: j.wall_s for j in jobs}


def profile(p: Pipeline, stage: str, cfg: Config, cores: int, spent: dict[str, float]) -> StageCost:
    """Run ``split.profile_steps`` steps of the stage with every core, then as many with half; fit."""
    k, stage_dir, runs = p.pc.split.profile_steps, p.dir / stage, []
    for threads in dict.fromkeys((cores, max(1, cores // 2))):
        if (stage_dir / "summary.json").exists():
            break  # finished within the profile (its steps or an early stop)
        start, before = last_step(stage_dir), len(history(stage_dir))
        cmd = p.offline_cmd(stage, with_threads(cfg, threads, log_every_step=True))
        job = Job(stage, cmd, stage_dir / "train.log", threads, stop_at=start + k)
        print(f"[pipeline] {stage}: profile, {k} steps with {threads} threads", flush=True)
        run_together([job])
        spent[stage] += job.wall_s
        gaps = step_seconds(history(stage_dir)[before:])
        if gaps:
            runs.append(ProfileRun(threads, gaps, job.wall_s, last_step(stage_dir) - start))
    if not runs and (stage_dir / "summary.json").exists():  # finished before, its done.json not yet written
        return StageCost(stage, Law(0.0, 0.0), Law(0.0, 0.0), 0)
    if not runs:
        raise RuntimeError(f"{stage}: the profile window timed no step: see {stage_dir / 'train.log'}")
    done = (stage_dir / "summary.json").exists()
    return fit_stage(stage, runs, 0 if done else max(0, total_steps(cfg) - last_step(stage_dir)))


def _finish(p: Pipeline, stage: str, cfg: Config, wall_s: float) -> None:
    """What the serial loop does after a stage's child: the summary, the task score, ``done.json``."""
    result = json.loads((p.dir / stage / "summary.json").read_text())
    result["wall_s"] = wall_s
    p.add_scores(stage, cfg, result)
    (p.dir / stage / "done.json").write_text(json.dumps(result, indent=2))
    print(f"[pipeline] {stage}: {headline(stage, result)}", flush=True)
