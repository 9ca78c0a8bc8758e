"""``algorithm.max_staleness: auto``: the admission bound steered by the learner's importance weights
(docs/design.md §3.7).

A larger staleness bound lets generation run further ahead of the learner (more overlap, fewer idle
servers) at the price of staler data, whose importance weights ``exp(prox_logp − behav_logp)`` drift from 1
and lose effective sample size. The controller raises the bound one version at a time while the weights'
normalised effective sample size ``(Σw)² / (N·Σw²)`` (``policy/ess``, in (0, 1]) stays at or above a
target for ``patience`` steps in a row, and lowers it at once by one when a step falls below it: additive
increase, immediate decrease, always within ``[low, high]``.

:func:`next_bound` is the whole rule, a pure function of its state and one measurement; the learner calls it
after each step and publishes the bound it returns (:meth:`buffer.admission.Admission.set_bound`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class StalenessTarget:
    """The controller's settings: the bound stays in ``[low, high]``; ``ess_min`` is the lowest healthy
    ``policy/ess``; ``patience`` healthy steps in a row raise the bound by one."""

    low: int
    high: int
    ess_min: float
    patience: int

    def __post_init__(self) -> None:
        if not 0 <= self.low <= self.high:
            raise ValueError(f"staleness bounds must satisfy 0 <= low <= high, got [{self.low}, {self.high}]")
        if not 0 < self.ess_min <= 1:
            raise ValueError(f"ess_min must be in (0, 1], got {self.ess_min}")
        if self.patience < 1:
            raise ValueError(f"patience must be >= 1, got {self.patience}")


@dataclass(frozen=True)
class StalenessState:
    """The bound in force and how many steps in a row the measurement has been healthy at it."""

    bound: int
    healthy: int = 0


def next_bound(
    state: StalenessState, ess: float, target: StalenessTarget
) -> tuple[StalenessState, str | None]:
    """The state after one step whose importance weights had normalised effective sample size ``ess``, and
    the reason when the bound changed (None when it did not).

    Below ``ess_min`` the bound falls by one (not below ``low``) and the count of healthy steps restarts; at or
    above it the count grows, and reaching ``patience`` raises the bound by one (not above ``high``) and
    restarts the count. A non-finite ``ess`` (a step with no valid token) changes nothing.
    """
    bound = min(max(state.bound, target.low), target.high)  # a bound from other settings, clamped
    if not math.isfinite(ess):
        return StalenessState(bound, state.healthy), None
    if ess < target.ess_min:
        if bound > target.low:
            return StalenessState(bound - 1, 0), (
                f"policy/ess {ess:.3f} < {target.ess_min}: max_staleness {bound} -> {bound - 1}"
            )
        return StalenessState(bound, 0), None
    healthy = state.healthy + 1
    if healthy >= target.patience and bound < target.high:
        return StalenessState(bound + 1, 0), (
            f"policy/ess >= {target.ess_min} for {healthy} steps (last {ess:.3f}): max_staleness "
            f"{bound} -> {bound + 1}"
        )
    return StalenessState(bound, min(healthy, target.patience)), None
