"""A run's profile window, read back: per-phase samples for the planner from a run directory's histories.

Every learner step logs ``time/<phase>`` for its scoring forwards, its training passes and the weight sync,
and ``batch/tokens``; every server batch logs ``time/generate``, ``time/reward_model``, ``time/reference``
(with ``placement.reference: server``; ``tandem/timing.py``) and ``rollout/longest_response``, generation's
``L`` (``placement/cost.py``). The devices each phase ran on follow from the run's config and the cores it
had (``placement/configured.py``). The colocated switch has no timer of its own: it is what a colocated step
spends outside every phase (the hand-off through admission and weight sync), measured as the step's wall
time less the two sides' busy time.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from placement.configured import configured_plan, roles_of
from placement.cost import Sample, Workload, split_devices
from placement.planner import relative_error
from placement.plans import Plan
from tandem.config import Config, load_config
from tandem.telemetry import history_procs, read_history

LEARNER_PHASES = ("actor_logp", "reference", "critic_values", "actor_train", "critic_train")
SERVER_PHASES = ("generate", "reward_model", "reference")  # reference: placement.reference server


@dataclass
class RunProfile:
    plan: Plan  # the plan the run used, on ``cores`` devices
    samples: list[Sample]  # per-phase times of the profile window
    step_s: float  # measured seconds per learner step over the steps after the window (nan if none)
    window_step_s: float  # the same over the window itself
    tokens: float  # mean tokens per learner batch (prompt + response)
    generated: float  # mean generated tokens per learner batch
    noise: float = 0.0  # the window's step time: standard error of its mean, relative to it
    first_step_at: float = float("nan")  # wall time the run's first learner step ended


def profiled_workload(profiles: list[RunProfile], batch_size: int) -> Workload:
    """The profiled runs' mean step in the planner's units: whole rows for scoring and training,
    generated tokens for decode."""
    tokens = statistics.mean(p.tokens for p in profiles)
    generated = statistics.mean(p.generated for p in profiles)
    return Workload(batch_size, (tokens - generated) / batch_size, generated / batch_size)


def _seconds_per_step(rows: list[dict]) -> float:
    if len(rows) < 2:
        return float("nan")
    return (rows[-1]["time"] - rows[0]["time"]) / (len(rows) - 1)


def _generated(row: dict) -> float:
    """A server batch's generated tokens (histories written before ``rollout/tokens`` was logged: the
    batch's rate times its generation time, which held while one batch was in flight at a time)."""
    if "rollout/tokens" in row:
        return row["rollout/tokens"]
    return row["rollout/tokens_per_s"] * row["time/generate"]


def read_run(run_dir: Path, cores: int, *, skip: int = 2, window: int = 10) -> RunProfile:
    """The profile of ``run_dir``: its first ``window`` steps after ``skip`` warm-up steps are the window;
    the steps after it are what the window predicts."""
    cfg, learner, servers = _histories(run_dir)
    if len(learner) < skip + 2:
        raise ValueError(
            f"{run_dir}: {len(learner)} learner steps logged; the profile needs at least {skip + 2}"
        )
    win, rest = learner[skip : skip + window], learner[skip + window :]
    srv = servers[skip : skip + max(1, round(window / _batches_per_step(cfg)))]
    profile = _profile(cfg, configured_plan(cfg, cores), win, srv, rest)
    profile.first_step_at = learner[0]["time"]
    return profile


def read_recent(cfg: Config, learner: list[dict], servers: list[dict], cores: int, steps: int) -> RunProfile:
    """A run in progress, profiled over its last ``steps`` learner steps and the server batches that ended
    within them (rows of its histories, one per step and per batch): what re-planning reads (docs/placement.md
    §11.3). ``cfg`` is the run's config."""
    if len(learner) < steps + 1:
        raise ValueError(f"{len(learner)} learner steps logged; need {steps + 1}")
    win = learner[-steps:]
    start, end = learner[-steps - 1]["time"], win[-1]["time"]
    srv = [r for r in servers if start < r["time"] <= end]
    if not srv:
        raise ValueError(f"no server batch ended within the last {steps} learner steps")
    return _profile(cfg, configured_plan(cfg, cores), win, srv, [])


def learner_steps(run_dir: Path) -> list[dict]:
    """The learner's step rows of ``run_dir``, from the history the driver writes when a run ends (none
    for a run that is running or was killed)."""
    return [r for r in read_history(run_dir, "learner") if "batch/tokens" in r]


def _histories(run_dir: Path) -> tuple[Config, list[dict], list[dict]]:
    cfg: Config = load_config(run_dir / "config.public.yaml")
    learner = learner_steps(run_dir)
    servers = [r for name in history_procs(run_dir, "server-*") for r in read_history(run_dir, name)]
    return cfg, learner, servers


def _batches_per_step(cfg: Config) -> float:
    """A server batch of prompts_per_batch groups is this fraction of a learner step's samples."""
    return cfg.algorithm.batch_size / (cfg.rollout.prompts_per_batch * cfg.rollout.n_samples)


def _profile(cfg: Config, plan: Plan, win: list[dict], srv: list[dict], rest: list[dict]) -> RunProfile:
    """Per-phase samples from the learner steps ``win`` and the server batches ``srv`` of the same span."""
    per_step = _batches_per_step(cfg)
    tokens = statistics.mean(r["batch/tokens"] for r in win)
    generated = statistics.mean(_generated(r) for r in srv) * per_step
    # Split scoring ran each forward on its share of the learning devices, in the planner's order.
    forwards = plan.learner_scoring(roles_of(cfg)) if plan.scoring == "split" else []
    on = {f: max(1, n) for f, n in zip(forwards, split_devices(plan.learning, len(forwards)), strict=True)}
    if plan.critic == "own":  # its pass and its training ran on the critic's own threads
        on |= {"critic_values": plan.aux, "critic_train": plan.aux}
    samples: list[Sample] = []
    for r in win:
        for phase in LEARNER_PHASES:
            if f"time/{phase}" in r:
                samples.append(
                    Sample(phase, r["batch/tokens"], on.get(phase, plan.learning), r[f"time/{phase}"])
                )
        sync = "sync_local" if plan.mode == "colocate" else "sync"
        samples.append(Sample(sync, r["batch/tokens"], plan.learning, r["time/weight_sync"]))
    for r in srv:
        for phase in SERVER_PHASES:
            if f"time/{phase}" in r:
                w = generated if phase == "generate" else tokens
                # per_step batches one after another: their longest responses' decode steps add up
                longest = r.get("rollout/longest_response", 0.0) * per_step if phase == "generate" else 0.0
                samples.append(Sample(phase, w, plan.generation, r[f"time/{phase}"] * per_step, longest))
    window_step = _seconds_per_step(win)
    if plan.mode == "colocate":
        busy = sum(
            statistics.mean(s.value for s in samples if s.name == n) for n in {s.name for s in samples}
        )
        samples.append(Sample("switch", tokens, plan.generation, max(0.0, window_step - busy)))
    noise = relative_error([r["time"] for r in win])
    return RunProfile(plan, samples, _seconds_per_step(rest), window_step, tokens, generated, noise)
