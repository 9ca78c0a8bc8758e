"""One restart policy per role, the same under every backend (docs/design.md §6.3).

A role (``redis``, ``learner``, ``server-i``) that crashes is restarted after an exponential backoff;
more than its limit of restarts within ``supervision.window_s`` seconds stops the run with a message
naming the role. Pure bookkeeping over timestamps: the backends and the driver do the restarting.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import redis

from tandem.config import Config


@dataclass(frozen=True)
class RestartPolicy:
    limit: int  # restarts allowed within window_s
    window_s: float
    backoff_s: float
    backoff_max_s: float

    @classmethod
    def for_role(cls, cfg: Config, role: str) -> RestartPolicy:
        s = cfg.supervision
        limit = {"redis": s.redis_restarts, "learner": s.learner_restarts}.get(role, s.server_restarts)
        return cls(limit, s.window_s, s.backoff_s, s.backoff_max_s)

    def describe(self) -> str:
        return f"{self.limit} restarts within {self.window_s:g}s"


@dataclass
class Restarts:
    """The restarts of one role: when each happened, and the backoff before the next."""

    role: str
    policy: RestartPolicy
    times: deque[float] = field(default_factory=deque)  # restarts within the window
    total: int = 0

    def after_crash(self, now: float) -> float | None:
        """Seconds to wait before restarting a role that crashed at ``now``; None: over the limit."""
        while self.times and now - self.times[0] > self.policy.window_s:
            self.times.popleft()
        if len(self.times) >= self.policy.limit:
            return None
        return min(self.policy.backoff_max_s, self.policy.backoff_s * 2.0 ** len(self.times))

    def restarted(self, now: float) -> None:
        self.times.append(now)
        self.total += 1

    def refusal(self) -> str:
        return (
            f"{self.role} crashed more than supervision allows ({self.policy.describe()}; "
            f"{self.total} restarts in all): the run stops"
        )


def forget_dead_publisher(client: redis.Redis, run: str) -> None:
    """A restarted learner's servers must not join the crashed learner's last ``dist`` offer: its store is
    gone (a connect would wait out ``weightsync.timeout_s``) and its ``go`` names versions past the
    checkpoint (joiners of the resumed versions would think they came too late). The new learner offers
    afresh."""
    from weightsync.base import weights_key

    client.delete(weights_key(run, "offer"), weights_key(run, "go"))
