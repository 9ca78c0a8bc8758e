"""The planner: rank every candidate plan by predicted step time, and switch only when it clearly pays.

:func:`rank` is exhaustive (a few hundred plans at 8 devices; each prediction is a handful of
multiplications). :class:`Replanner` adds hysteresis: a run moves to a better plan only when the time it
is predicted to save over the steps left beats the measured cost of moving by a margin, and the gain per
step is more than measurement noise. Plans therefore never flap between two near-equal choices.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from placement.cost import CostModel, Prediction, Sample, Workload, predict
from placement.plans import Plan, Roles, candidates


def rank(
    roles: Roles,
    devices: int,
    model: CostModel,
    work: Workload,
    *,
    device_bytes: float = float("inf"),
    host_bytes: float = float("inf"),
    plans: list[Plan] | None = None,
    observed: dict[Plan, float] | None = None,
) -> list[Prediction]:
    """Every plan's prediction: feasible ones first, fastest first; then the infeasible, fastest first.

    ``observed`` maps plans already run to measured/predicted step time: what the laws missed for that
    plan (contention, a straggler) scales its prediction, so a plan that disappointed is not chosen again
    on the strength of its formula. Plans not yet run get the ratio of those run like them
    (:func:`correction`): otherwise every untried plan would look better than a measured one by the laws'
    general optimism, and the run would flap.
    """
    preds = [
        predict(p, roles, model, work, device_bytes=device_bytes, host_bytes=host_bytes)
        for p in (plans if plans is not None else candidates(roles, devices))
    ]
    if observed:
        preds = [replace(p, step_s=p.step_s * correction(p.plan, observed)) for p in preds]
    return sorted(preds, key=lambda p: (not p.feasible, p.step_s, p.plan.label(roles)))


def correction(plan: Plan, observed: dict[Plan, float]) -> float:
    """measured/predicted for ``plan``: its own if it ran; else the median over plans that score the way
    it does (split scoring's contention is one thing the laws miss); else over every plan run."""
    if plan in observed:
        return observed[plan]
    alike = [r for p, r in observed.items() if p.scoring == plan.scoring]
    return statistics.median(alike or observed.values())


def observed_ratio(
    plan: Plan, roles: Roles, measured_s: float, own: Iterable[Sample], work: Workload
) -> float | None:
    """What composing the phases misses for ``plan``: its measured step time over its prediction from
    the phase times of the same steps (``own``), not from the laws.

    Both sides then carry the same draws: a batch held up by one long response slows the measured step
    and its own generate sample alike, so a few heavy-tailed steps do not read as a plan that is faster
    or slower than its formula. What is left is the composition's own error (the slower side's jitter in
    ``max``, the broadcast pausing the servers), which the laws cannot see. None when ``own`` lacks a
    phase the plan runs."""
    pred = predict(plan, roles, CostModel.from_samples(own), work)
    return measured_s / pred.step_s if pred.feasible and pred.step_s > 0 else None


def relative_error(ends: Sequence[float]) -> float:
    """The standard error of the mean step between step ``ends``, relative to that mean: the noise a gain
    must clear (:meth:`Replanner.decide`)."""
    steps = [b - a for a, b in itertools.pairwise(ends)]
    if len(steps) < 2 or (mean := statistics.fmean(steps)) <= 0:
        return 0.0
    return statistics.stdev(steps) / math.sqrt(len(steps)) / mean


@dataclass
class Decision:
    plan: Plan  # the plan to run next (the current one when staying)
    switch: bool
    predicted_s: float  # the chosen plan's predicted step time
    reason: str


@dataclass
class Replanner:
    """Hysteresis around :func:`rank`: move only for a clear, paid-for gain."""

    min_gain: float = 0.05  # the best plan must be predicted this fraction faster per step
    margin: float = 2.0  # and save this many times the switch cost over the remaining steps

    def decide(
        self,
        current: Plan,
        ranked: list[Prediction],
        remaining_steps: int,
        switch_s: float,
        noise: float = 0.0,
    ) -> Decision:
        """``noise``: the relative standard error of the current plan's measured step time. A gain within
        twice that is the luck of its last few batches (a heavy tail's few long ones), not the plan."""
        by_plan = {p.plan: p for p in ranked}
        best = ranked[0]
        now = by_plan.get(current)
        if now is None or not now.feasible:
            return Decision(best.plan, best.plan != current, best.step_s, "current plan infeasible")
        gain = now.step_s - best.step_s
        needed = max(self.min_gain, 2.0 * noise)
        if best.plan == current or gain < needed * now.step_s:
            return Decision(current, False, now.step_s, f"gain {gain / now.step_s:.1%} under {needed:.0%}")
        saved = gain * remaining_steps
        if saved < self.margin * switch_s:
            return Decision(
                current,
                False,
                now.step_s,
                f"saves {saved:.2f} s, under {self.margin}x the {switch_s:.2f} s switch",
            )
        return Decision(best.plan, True, best.step_s, f"saves {saved:.2f} s over {remaining_steps} steps")
