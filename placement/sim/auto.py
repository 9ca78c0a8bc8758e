"""SIMULATION: ``placement.mode: auto`` on a :class:`~placement.sim.engine.SimRun` (docs/placement.md §11.4).

:func:`run_auto` runs a profile window of probe plans, fits the cost model to what they measured, applies
the best plan, then re-plans with hysteresis as the workload drifts. The re-planner runs in its own
process beside the run, as the driver would, and judges from the run's recent phase times only.
"""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field

from placement.cost import CostModel, Sample, Workload
from placement.planner import Decision, Replanner, observed_ratio, rank, relative_error
from placement.plans import Plan, Roles, validate
from placement.sim.engine import SimRun, step_time, within


@dataclass
class Switch:
    step: int
    plan: Plan
    predicted_s: float
    measured_s: float = float("nan")  # filled when the plan has run long enough to measure


@dataclass
class AutoResult:
    steps: int
    seconds: float
    switches: list[Switch] = field(default_factory=list)
    model: CostModel | None = None
    observed: dict[Plan, float] = field(default_factory=dict)  # measured / predicted of each plan run

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds


def probe_plans(roles: Roles, devices: int) -> list[Plan]:
    """The profile window's plans: every phase timed on all devices and on half of them (the second
    also offloads the reference, so its reload is timed), and split scoring where there is any."""
    half = max(1, devices // 2)
    ref = "learner_cpu" if roles.reference else "learner"
    probes = [Plan("colocate", devices, devices), Plan("separate", half, devices - half, reference=ref)]
    split = Plan("colocate", devices, devices, scoring="split")
    if validate(split, roles, devices) is None:  # and how scoring forwards side by side slow each other
        probes.append(split)
    return probes


@dataclass(frozen=True)
class Snapshot:
    """What the planner reads from a run: its recent phase times and memory, the phase times of the
    current plan's steps, and the work now and next."""

    samples: list[Sample]
    memory: list[Sample]
    own: list[Sample]
    work_now: Workload
    work_next: Workload


Judgement = tuple[Decision, float | None]  # the decision, and the current plan's measured / predicted


def _judge(
    snap: Snapshot,
    roles: Roles,
    devices: int,
    capacity: tuple[float, float],
    observed: dict[Plan, float],
    replanner: Replanner,
    at: tuple[Plan, float | None, int, float, float],
) -> Judgement:
    """One re-planning decision, in the planner's process: refit, correct, rank, apply hysteresis."""
    current, measured, remaining, switch_s, noise = at
    model = CostModel.from_samples(snap.samples, snap.memory)
    ratio = None if measured is None else observed_ratio(current, roles, measured, snap.own, snap.work_now)
    if ratio is not None:
        observed[current] = ratio
    ranked = rank(
        roles,
        devices,
        model,
        snap.work_next,
        device_bytes=capacity[0],
        host_bytes=capacity[1],
        observed=observed,
    )
    return replanner.decide(current, ranked, remaining, switch_s, noise), ratio


def _ready() -> bool:
    return True


def _start_planner() -> ProcessPoolExecutor:
    """The planner beside the run in its own process, as the driver would: its fit and ranking are
    milliseconds of Python that, in a thread here, would hold the GIL and delay the phases it judges. It
    starts with the run, before any step: started at its first judgement, its imports would take the cores
    from the very steps it then measures."""
    planner = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    planner.submit(_ready).result()
    return planner


@dataclass
class _Auto:
    """One auto run: the simulated run, the planner's process, and what every plan run so far measured."""

    sim: SimRun
    steps: int
    replan_every: int
    window: int
    replanner: Replanner
    planner: ProcessPoolExecutor
    # Measured / predicted step time of every plan run so far, the probes included, each against its own
    # steps' phase times (observed_ratio): with several, their median is what composing phases generally
    # misses, and a plan's own ratio against it is what it missed for that plan.
    observed: dict[Plan, float] = field(default_factory=dict)

    def profile(self, profile_steps: int) -> int:
        """The profile window: each probe plan in turn, then each one's ratio; the steps it ran."""
        sim, step = self.sim, 0
        probed: dict[Plan, tuple[float, list[Sample], Workload]] = {}  # step time, phase times, work
        for probe in probe_plans(sim.roles, sim.cluster.size):
            n0, s0 = len(sim.ends), len(sim.samples)
            # Two steady steps at least: a separated probe's first step ends once the pipeline has filled
            # (already past its warm-up) and its last ones are the drain.
            drain = sim.drain(probe)
            step += sim.run(probe, step, max(4, profile_steps // 2) + max(0, drain - 1))
            steady = sim.ends[n0 : len(sim.ends) - drain]
            own = within(sim.samples[s0:], steady[0], steady[-1])
            probed[probe] = (step_time(steady, 0), own, sim.work_at(step - 1))
        for plan, (measured, own, work) in probed.items():
            if (ratio := observed_ratio(plan, sim.roles, measured, own, work)) is not None:
                self.observed[plan] = ratio
        return step

    def refit(self) -> CostModel:
        return CostModel.from_samples(self.sim.samples[-self.window :], self.sim.memory[-self.window :])

    def ranked_at(self, i: int) -> list:
        cluster = self.sim.cluster
        return rank(
            self.sim.roles,
            cluster.size,
            self.refit(),
            self.sim.work_at(i),
            device_bytes=cluster.capacity,
            host_bytes=cluster.host_capacity,
            observed=self.observed,
        )

    def judge(
        self, i: int, current: Plan, since: tuple[int, int], done: int, switch_s: float
    ) -> Future[Judgement]:
        """Hand the planner's process a snapshot of the run after step ``i`` to judge."""
        sim, (ends_from, samples_from) = self.sim, since
        # Mid-run, the last step ended waiting for its next batch: no drain to leave out.
        ends = sim.ends[ends_from:]
        measured = step_time(ends, warmup=0) if done > 3 else None
        noise = relative_error(ends) if done > 3 else 0.0
        return self.planner.submit(
            _judge,
            Snapshot(
                sim.samples[-self.window :],
                sim.memory[-self.window :],
                within(sim.samples[samples_from:], ends[0], ends[-1]),
                sim.work_at(i),
                sim.work_at(i + 1),
            ),
            sim.roles,
            sim.cluster.size,
            (sim.cluster.capacity, sim.cluster.host_capacity),
            dict(self.observed),
            self.replanner,
            (current, measured, self.steps - i - 1, switch_s, noise),
        )

    def run_plan(self, current: Plan, step: int, switch_s: float) -> tuple[int, Decision | None]:
        """Run ``current`` from ``step``, judged every ``replan_every`` steps, until a judgement says move or
        the run ends: the steps it ran, and the decision to move if there was one."""
        sim, run_from, since = self.sim, step, (len(self.sim.ends), len(self.sim.samples))
        decision = None
        pending: list[Future[Judgement]] = []  # at most one judgement in flight for this plan

        def stop(i: int) -> bool:
            nonlocal decision
            if pending and pending[0].done():
                d, ratio = pending.pop().result()
                if ratio is not None:
                    self.observed[current] = ratio
                if d.switch and i + 1 < self.steps:
                    decision = d
                    return True
            done = i - run_from + 1
            if not pending and done % self.replan_every == 0 and i + 1 < self.steps:
                pending.append(self.judge(i, current, since, done, switch_s))
            return False

        return sim.run(current, step, self.steps - step, stop), decision


def _measure(
    sim: SimRun, switch: Switch, ends: list[float], switched_at: float | None, switch_s: float
) -> float:
    """Fill in ``switch``'s measured step time from its plan's step ends; the cost of moving, raised to what
    the move into it cost (restart plus the first step's lost overlap) where that was more."""
    if len(ends) > 3 + sim.drain(switch.plan):
        switch.measured_s = step_time(ends, 2, sim.drain(switch.plan))
        if switched_at is not None:
            switch_s = max(switch_s, ends[0] - switched_at - switch.measured_s)
    return switch_s


def run_auto(
    sim: SimRun,
    steps: int,
    *,
    profile_steps: int = 6,
    replan_every: int = 5,
    window: int = 400,
    replanner: Replanner | None = None,
) -> AutoResult:
    """``placement.mode: auto`` in simulation: profile, fit, pick, then re-plan with hysteresis."""
    auto = _Auto(sim, steps, replan_every, window, replanner or Replanner(), _start_planner())
    t0 = time.perf_counter()
    step = auto.profile(profile_steps)
    best = auto.ranked_at(step)[0]
    result = AutoResult(0, 0.0, [Switch(step, best.plan, best.step_s)])
    current = best.plan
    switch_s, switched_at = sim.truth.replace_s, None  # the cost of moving, as last measured
    while step < steps:
        ends_from = len(sim.ends)
        ran, decision = auto.run_plan(current, step, switch_s)
        step += ran
        switch_s = _measure(sim, result.switches[-1], sim.ends[ends_from:], switched_at, switch_s)
        switched_at = None
        if decision is not None:
            switched_at = sim.ends[-1]
            time.sleep(sim.truth.replace_s)  # restart the roles under the new plan
            current = decision.plan
            result.switches.append(Switch(step, current, decision.predicted_s))
    auto.planner.shutdown(wait=True)
    result.steps, result.seconds, result.model = step, time.perf_counter() - t0, auto.refit()
    result.observed = auto.observed
    return result
