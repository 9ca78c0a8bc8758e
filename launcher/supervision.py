"""One restart policy per role, the same under every backend (docs/design.md §6.3).

A role (``redis``, ``learner``, ``server-i``) that crashes is restarted after an exponential backoff;
more than its limit of restarts within ``supervision.window_s`` seconds *without progress* stops the run
with a message naming the role. A budget counts crash loops, not crashes: when a role can tell its
progress (the learner: its published version or its newest checkpoint), a restart after which it made
progress wipes its count and its backoff, as Kubernetes resets CrashLoopBackOff after a healthy interval.
Pure bookkeeping over timestamps: :meth:`Restarts.tend` is the state machine every keeper (the driver's
Redis keeper, the backends, ``--attach``) runs for a role that is down; they do the restarting.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import redis

from tandem.config import Config

log = logging.getLogger("launch")

Step = Literal["wait", "restart", "refused"]
# A role's progress, a number that only grows while it works (None: not known right now).
Progress = Callable[[], "int | None"]


@dataclass(frozen=True)
class RestartPolicy:
    limit: int  # restarts allowed within window_s without progress in between
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
    """The restarts of one role: when each happened, the backoff before the next, and its progress."""

    role: str
    policy: RestartPolicy
    progress: Progress | None = None  # None: the role's progress is not observed (window counting only)
    times: deque[float] = field(default_factory=deque)  # restarts within the window since progress
    total: int = 0
    resets: int = 0  # budgets wiped by progress
    restart_at: float | None = None  # a crash noticed, its restart due then
    mark: int | None = None  # the role's progress when it was last restarted

    def tend(self, now: float, why: str = "exited") -> Step:
        """For a role that is down: ``"wait"`` while its backoff runs (the first call, on noticing the
        crash, logs ``why`` and schedules the restart), ``"restart"`` once it is over (counted: start the
        role again now), ``"refused"`` past the role's budget (the run stops; see :meth:`refusal`)."""
        if self.restart_at is None:
            delay = self.after_crash(now)
            if delay is None:
                return "refused"
            self.restart_at = now + delay
            log.warning("%s: %s; restarting in %.1fs", self.role, why, delay)
            if delay > 0:
                return "wait"
        if now < self.restart_at:
            return "wait"
        self.restart_at = None
        self.restarted(now)
        return "restart"

    def after_crash(self, now: float) -> float | None:
        """Seconds to wait before restarting a role that crashed at ``now``; None: over the limit."""
        self._forgive_after_progress()
        while self.times and now - self.times[0] > self.policy.window_s:
            self.times.popleft()
        if len(self.times) >= self.policy.limit:
            return None
        return min(self.policy.backoff_max_s, self.policy.backoff_s * 2.0 ** len(self.times))

    def restarted(self, now: float) -> None:
        self.times.append(now)
        self.total += 1
        self.mark = self._progress()

    def _progress(self) -> int | None:
        if self.progress is None:
            return None
        try:
            return self.progress()
        except (redis.RedisError, OSError, ValueError) as e:  # Redis down, a file mid-replace: unknown
            log.debug("%s: progress unknown (%s)", self.role, e)
            return None

    def _forgive_after_progress(self) -> None:
        """A restart after which the role moved on was no crash loop: its count and backoff start over."""
        if not self.times or self.mark is None:
            return
        now = self._progress()
        if now is not None and now > self.mark:
            log.warning(
                "%s progressed since its last restart (%d -> %d): its restart budget is whole again",
                self.role,
                self.mark,
                now,
            )
            self.times.clear()
            self.resets += 1

    def refusal(self) -> str:
        return (
            f"{self.role} crashed more than supervision allows ({self.policy.describe()} without"
            f" progress; {self.total} restarts in all): the run stops"
        )


def learner_progress(client: redis.Redis, run: str, ckpt_dir: Path) -> Progress:
    """The learner's progress: the newest of its published version (``{run}:version``) and its newest
    committed checkpoint (``latest.json``), whichever can be read now."""

    def read() -> int | None:
        seen = []
        with contextlib.suppress(redis.RedisError, ValueError):
            raw = client.get(f"{run}:version")
            if raw is not None:
                seen.append(int(raw))
        latest = ckpt_dir / "latest.json"  # learner/checkpoint.py LATEST (no torch import here)
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            seen.append(int(json.loads(latest.read_text())["version"]))
        return max(seen) if seen else None

    return read
