"""``placement.mode: auto``: profile, fit, pick a placement, run it, and re-plan (docs/placement.md §11.3).

1. **Profile window.** Two short probe runs of ``placement.profile_steps`` learner steps each, under
   ``<output_dir>/<name>-auto-probes/``: colocated (``run.mode: sync``, every core to each phase in turn)
   and separated (``run.mode: async``, the cores split). Between them every phase is timed on two device
   counts, which is what the planner's laws need, and each start-up is timed: what moving a run costs.
2. **Fit and pick.** The laws are fitted to both probes' phase times (``placement/profile.py``) and every
   plan the processes can run on this machine's cores is predicted; the fastest feasible one wins.
3. **Run.** The run starts under the chosen plan, its config saying it concretely (a resumed run keeps
   it).
4. **Re-plan** (``placement.replan_every``). Every that many steps a :class:`Mover` refits the laws to the
   run's latest steps and asks the :class:`~placement.planner.Replanner` whether another plan clearly pays
   over the steps left. If so, the run stops cleanly (a final checkpoint) and resumes under that plan, in
   the same run directory, whose config then says it.

After the run, predicted and measured step time are printed for each plan it ran. The probes' training is
thrown away: the profile costs ``2 x profile_steps`` steps and two start-ups.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis

from launcher import driver
from launcher.backends import Backend
from launcher.feeder import PromptSet
from placement.configured import configured_plan, roles_of
from placement.cost import CostModel, Prediction, Sample
from placement.planner import Decision, Replanner, observed_ratio, rank
from placement.plans import Plan, Roles, candidates
from placement.profile import RunProfile, learner_steps, profiled_workload, read_recent, read_run
from tandem import fleet
from tandem.config import RUNNABLE_PLACEMENT, Config, dump_config, load_config, write_private
from tandem.telemetry import HISTORY_SUFFIX, history_key

ROOT = Path(__file__).resolve().parent.parent
log = logging.getLogger("launch")
SAMPLES = 400  # phase times the re-planner fits to: the probes', then the run's latest
MARKER = "placement_auto.json"  # in the run directory of a run auto placed: where its probes are


class ProbeFailed(RuntimeError):
    """A profile-window probe run did not finish; its run directory holds the reason."""


def runnable(plan: Plan, cfg: Config) -> bool:
    """Plans the processes run today for ``cfg`` (the planner predicts more; docs/placement.md §11.1). A
    reward model on its own worker cannot feed dynamic sampling, which drops groups on the servers; the
    critic's own threads and split scoring share one CPU learner's threads."""
    if plan.reward_model == "own" and cfg.algorithm.dynamic_sampling:
        return False
    one_cpu_learner = cfg.run.device != "cuda" and cfg.learner.num_ranks == 1
    if (plan.critic == "own" or plan.scoring == "split") and not one_cpu_learner:
        return False
    return all(getattr(plan, k) in v for k, v in RUNNABLE_PLACEMENT.items())


def applied(cfg: Config, plan: Plan) -> Config:
    """``cfg`` running ``plan``: colocated takes turns (sync), separated overlaps (async) at its share."""
    colocate = plan.mode == "colocate"
    placement = cfg.placement.model_copy(
        update={
            "mode": plan.mode,
            "generation_share": None if colocate else plan.generation / plan.devices,
            "aux_share": plan.aux / plan.devices if plan.aux else None,
            "reference": plan.reference,
            "critic": plan.critic,
            "reward_model": plan.reward_model,
            "scoring": plan.scoring,
        }
    )
    run = cfg.run.model_copy(update={"mode": "sync" if colocate else "async"})
    return cfg.model_copy(update={"placement": placement, "run": run})


def probe(cfg: Config, mode: str, out: Path) -> Config:
    """A probe of ``profile_steps`` steps, written under ``out``, saving no checkpoint."""
    plan = Plan("colocate", 2, 2) if mode == "sync" else Plan("separate", 1, 1)
    c = applied(cfg, plan)
    if mode == "async":
        c = c.model_copy(update={"placement": c.placement.model_copy(update={"generation_share": None})})
    learner = c.learner.model_copy(
        update={"total_steps": cfg.placement.profile_steps, "checkpoint_interval": 0, "save_hf_final": False}
    )
    run = c.run.model_copy(
        update={"output_dir": str(out), "dir": None, "name": f"{cfg.run.name}-probe-{mode}"}
    )
    logging = c.logging.model_copy(update={"wandb_mode": "disabled", "console": False})
    return c.model_copy(update={"learner": learner, "run": run, "logging": logging})


def choose(cfg: Config, profiles: list[RunProfile], cores: int) -> list[Prediction]:
    """Every runnable plan on ``cores`` predicted from the probes' phase times, fastest first."""
    model = CostModel.from_samples([s for p in profiles for s in p.samples])
    work = profiled_workload(profiles, cfg.algorithm.batch_size)
    roles = roles_of(cfg)
    plans = [p for p in candidates(roles, cores) if runnable(p, cfg)]
    return rank(roles, cores, model, work, plans=plans)


@dataclass
class Resolved:
    """What the profile window chose, and what the re-planner starts from."""

    cfg: Config  # the config under the chosen plan
    best: Prediction
    probes: list[RunProfile]
    startup_s: float  # the probes' mean start-up: launch to the end of the first step, less that step


def probes_dir(cfg: Config) -> Path:
    """Where ``cfg``'s probes run and its choice is written (``choice.json``)."""
    return (ROOT / cfg.run.output_dir / f"{cfg.run.name}-auto-probes").resolve()


def resolve(cfg: Config, prompts: PromptSet, make_backend: Callable[[], Backend]) -> Resolved:
    """Run both probes through the driver (each on a fresh backend), and apply the best plan."""
    cores = os.cpu_count() or 1
    out = probes_dir(cfg)
    profiles, startups, probe_dirs = [], [], {}
    for mode in ("sync", "async"):
        c = probe(cfg, mode, out / mode)
        print(f"[launch] placement auto: profiling {cfg.placement.profile_steps} steps {mode}", flush=True)
        launched = time.time()
        if (code := driver.run(c, prompts, make_backend(), resume=None, console_enabled=False)) != 0:
            raise ProbeFailed(
                f"placement auto: the {mode} probe run failed (exit {code}); its logs: {out / mode}"
            )
        (run_dir,) = sorted(p for p in (out / mode).iterdir() if p.is_dir())[-1:]
        profiles.append(read_probe(cfg, run_dir, cores))
        probe_dirs[mode] = str(run_dir)
        startups.append(max(0.0, profiles[-1].first_step_at - launched - profiles[-1].window_step_s))
    ranked = choose(cfg, profiles, cores)
    roles = roles_of(cfg)
    for p in ranked:
        print(f"[launch] placement auto:   {p.plan.label(roles):<50} {p.step_s * 1e3:8.1f} ms/step predicted")
    best = ranked[0]
    print(f"[launch] placement auto: chose {best.plan.label(roles)}", flush=True)
    choice = {
        "plan": best.plan.label(roles),
        "predicted_step_s": best.step_s,
        "probes_step_s": {p.plan.label(roles): p.window_step_s for p in profiles},
        "startup_s": startups,
        "probes": probe_dirs,  # read again by a resumed run that re-plans (reload)
    }
    (out / "choice.json").write_text(json.dumps(choice) + "\n")
    return Resolved(applied(cfg, best.plan), best, profiles, statistics.mean(startups))


def read_probe(cfg: Config, run_dir: Path, cores: int) -> RunProfile:
    """A probe's profile: the first steps warm up (allocator, first optimizer step), the window is after."""
    skip = max(2, cfg.placement.profile_steps // 3)
    return read_run(run_dir, cores, skip=skip, window=cfg.placement.profile_steps)


def started_by_auto(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a run that ``placement.mode: auto`` placed (its saved config names the plan
    it runs, not auto)."""
    return (run_dir / MARKER).is_file()


def reload(current: Config, run_dir: Path) -> Resolved | None:
    """What a resumed run re-plans from: its probes' profiles, read again from the run directories
    ``choice.json`` names, under ``current``, the config its saved plan applied (:func:`adopt`). None,
    saying why, when they are gone."""
    cores = os.cpu_count() or 1
    try:
        probes = (
            Path(json.loads((run_dir / MARKER).read_text())["probes"]) if started_by_auto(run_dir) else None
        )
        choice = json.loads(((probes or probes_dir(current)) / "choice.json").read_text())
        profiles = [read_probe(current, Path(d), cores) for d in choice["probes"].values()]
    except (OSError, KeyError, ValueError) as e:
        print(
            f"[launch] placement auto: the resumed run keeps its plan without re-planning: its probes "
            f"cannot be read ({e})",
            flush=True,
        )
        return None
    plan = configured_plan(current, cores)
    best = next((p for p in choose(current, profiles, cores) if p.plan == plan), None)
    if best is None:
        print(
            f"[launch] placement auto: the resumed run's plan {plan.label(roles_of(current))} is not one "
            "the planner ranks here; it keeps it without re-planning",
            flush=True,
        )
        return None
    return Resolved(current, best, profiles, statistics.mean(choice["startup_s"]))


@dataclass
class Segment:
    """A stretch of the run under one plan: its prediction and, once over, its measured step time."""

    plan: Plan
    after_step: int  # the step the stretch started after
    predicted_s: float
    measured_s: float = float("nan")


class Mover:
    """Re-planning from the run's own steps, every ``placement.replan_every`` of them (a driver watch).

    It reads the latest steps' phase times, step time and noise from the run's Redis histories, refits the
    laws to them beside the probes', ranks every runnable plan (each plan run so far scaled by what it
    measured against its prediction, :func:`~placement.planner.rank`), and asks the
    :class:`~placement.planner.Replanner` whether moving pays: a gain beyond the noise, saving more than
    twice a move's cost over the steps left. A move's cost is the probes' start-up until one is measured.
    """

    def __init__(self, cfg: Config, resolved: Resolved, cores: int) -> None:
        self.cfg, self.cores, self.every = cfg, cores, cfg.placement.replan_every
        self.roles = roles_of(cfg)
        self.plans = [p for p in candidates(self.roles, cores) if runnable(p, cfg)]
        self.plan, self.move_s = resolved.best.plan, resolved.startup_s
        self.samples: list[Sample] = [s for p in resolved.probes for s in p.samples]
        self.observed: dict[Plan, float] = {}
        for p in resolved.probes:
            work = profiled_workload([p], cfg.algorithm.batch_size)
            if (r := observed_ratio(p.plan, self.roles, p.window_step_s, p.samples, work)) is not None:
                self.observed[p.plan] = r
        self.replanner = Replanner()
        self.decision: Decision | None = None
        self.decided_at = 0.0  # wall time of the last decision to move
        self.start(0, self.plan)

    def start(self, after_step: int, plan: Plan) -> None:
        """A stretch under ``plan`` begins after ``after_step``: judge it once it has ``every`` steps of its own
        past a warm-up step."""
        self.plan, self.decision = plan, None
        self.next_at = after_step + 1 + self.every

    def __call__(self, step: int, client: redis.Redis, run: str) -> str | None:
        remaining = self.cfg.learner.total_steps - step
        if step < self.next_at or remaining <= self.every:
            return None
        self.next_at = step + self.every
        try:
            recent = self.recent(client, run)
        except (ValueError, KeyError, redis.RedisError) as e:  # too few rows yet, a Redis restart
            log.info("placement auto: no re-plan at step %d: %s", step, e)
            return None
        work = profiled_workload([recent], self.cfg.algorithm.batch_size)
        ratio = observed_ratio(self.plan, self.roles, recent.window_step_s, recent.samples, work)
        if ratio is not None:
            self.observed[self.plan] = ratio
        self.samples = (self.samples + recent.samples)[-SAMPLES:]
        ranked = rank(
            self.roles,
            self.cores,
            CostModel.from_samples(self.samples),
            work,
            plans=self.plans,
            observed=self.observed,
        )
        d = self.replanner.decide(self.plan, ranked, remaining, self.move_s, recent.noise)
        verdict = f"move to {d.plan.label(self.roles)}" if d.switch else "stay"
        print(
            f"[launch] placement auto: step {step}: {recent.window_step_s * 1e3:.1f} ms/step measured under "
            f"{self.plan.label(self.roles)}; {verdict} ({d.reason})",
            flush=True,
        )
        if not d.switch:
            return None
        self.decision, self.decided_at = d, time.time()
        return f"{d.plan.label(self.roles)}, {d.reason}"

    def recent(self, client: redis.Redis, run: str) -> RunProfile:
        """The latest ``every`` steps of the running run, from its Redis histories."""
        rows = 4 * self.every + 8
        learner = _rows(client.lrange(history_key(run, "learner"), -rows, -1))
        servers = [
            r
            for s in fleet.seen(client, run)
            for r in _rows(client.lrange(history_key(run, s), -rows * 4, -1))
        ]
        run_cfg = applied(self.cfg, self.plan)  # the plan this stretch runs, as its processes see it
        return read_recent(
            run_cfg, [r for r in learner if "batch/tokens" in r], servers, self.cores, self.every
        )


def run(
    cfg: Config,
    prompts: PromptSet,
    make_backend: Callable[[], Backend],
    *,
    console_enabled: bool,
    fresh: bool = False,
    resume: Path | None = None,
    make_mover: Callable[[Config, Resolved, int], Mover] | None = None,
) -> int:
    """Profile, pick and run; with ``placement.replan_every``, move the run whenever its own steps say
    another plan clearly pays. Prints predicted against measured step time for each plan it ran.
    ``resume``: a run directory to go on with, under the plan it last ran, re-planning from its probes
    (:func:`reload`) without profiling again. ``make_mover``: the re-planner (a :class:`Mover` unless given)."""
    cores = os.cpu_count() or 1
    if resume is None:
        resolved: Resolved | None = resolve(cfg, prompts, make_backend)
        current, after = started(resolved.cfg, probes_dir(cfg), fresh=fresh), 0
        fresh = False  # done: the run directory is new
    else:
        current = adopt(cfg, resume)
        resolved = reload(current, resume) if cfg.placement.replan_every else None
        after = driver.checkpointed_version(current, resume) or 0  # the step the learner goes on from
    plan = configured_plan(current, cores)
    segments = [Segment(plan, after, resolved.best.step_s if resolved else float("nan"))]
    mover = None
    if cfg.placement.replan_every and resolved is not None:
        mover = (make_mover or Mover)(current, resolved, cores)
        mover.start(after, plan)
    moved = False  # the stretch now starting follows a move, whose cost its first steps measure
    while True:
        code = driver.run(
            current,
            prompts,
            make_backend(),
            resume=resume,
            console_enabled=console_enabled,
            fresh=fresh and resume is None,
            watch=mover,
        )
        if code not in (0, driver.MOVED):
            return code
        run_dir = latest_run_dir(current)
        rows = learner_steps(run_dir)
        if mover is not None and moved:  # what this move cost: stop, restart, first step
            after = [r["time"] for r in rows if r["step"] > segments[-1].after_step]
            if len(after) >= 2:
                mover.move_s = max(mover.move_s, after[0] - mover.decided_at - (after[1] - after[0]))
        segments[-1].measured_s = _step_s(rows, segments[-1].after_step)
        print(f"[launch] {_report(segments[-1], roles_of(cfg))}", flush=True)
        if code != driver.MOVED or mover is None or mover.decision is None:
            return code
        stopped = max(r["step"] for r in rows)
        current = applied(current, mover.decision.plan)
        # The run directory's config says the plan it now runs, for this resume and any later --resume.
        saved = load_config(run_dir / "config.public.yaml")
        write_private(run_dir / "config.public.yaml", dump_config(applied(saved, mover.decision.plan)))
        segments.append(Segment(mover.decision.plan, stopped, mover.decision.predicted_s))
        mover.start(stopped, mover.decision.plan)
        resume, moved = run_dir, True


def started(cfg: Config, probes: Path, *, fresh: bool) -> Config:
    """``cfg`` with its run directory made now and fixed (``run.dir``), marked as placed by auto with where its
    probes are, so that ``launch.py --resume`` of it re-plans too (:func:`reload`)."""
    run_dir = driver.prepare_run_dir(cfg, None, fresh=fresh)
    (run_dir / MARKER).write_text(json.dumps({"probes": str(probes)}) + "\n")
    return cfg.model_copy(update={"run": cfg.run.model_copy(update={"dir": str(run_dir)})})


def adopt(cfg: Config, run_dir: Path) -> Config:
    """A resumed auto run keeps the placement it chose when it started (its saved config says it)."""
    saved = load_config(run_dir / "config.public.yaml")
    return cfg.model_copy(
        update={"placement": saved.placement, "run": cfg.run.model_copy(update={"mode": saved.run.mode})}
    )


def latest_run_dir(cfg: Config) -> Path:
    """The run directory the last run of ``cfg`` wrote (its fixed ``run.dir``, or the newest of its name)."""
    if cfg.run.dir:
        return (ROOT / cfg.run.dir).resolve()
    parent = (ROOT / cfg.run.output_dir).resolve()
    return max(
        parent.glob(f"{cfg.run.name}-*/learner{HISTORY_SUFFIX}"), key=lambda p: p.stat().st_mtime
    ).parent


def _rows(raw: list[bytes]) -> list[dict]:
    return [json.loads(r) for r in raw]


def _step_s(rows: list[dict], after_step: int, warmup: int = 2) -> float:
    """Mean seconds per step of the steps after ``after_step``, less the first ``warmup`` of them."""
    times = [r["time"] for r in rows if r["step"] > after_step][warmup:]
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) >= 2 else float("nan")


def _report(seg: Segment, roles: Roles) -> str:
    """Predicted against measured seconds per step of one stretch of the run."""
    predicted = seg.predicted_s == seg.predicted_s  # nan: a resumed run that could not re-plan
    head = f"placement auto: {seg.plan.label(roles)} after step {seg.after_step}: " + (
        f"predicted {seg.predicted_s * 1e3:.1f} ms/step" if predicted else "no prediction"
    )
    if seg.measured_s != seg.measured_s:
        return f"{head}; too few steps to measure"
    ratio = f" ({seg.measured_s / seg.predicted_s:.2f}x)" if predicted else ""
    return f"{head}, measured {seg.measured_s * 1e3:.1f}{ratio}"
