"""Admission and staleness: how far generation may run ahead of the learner (docs/design.md §3).

One home for the whole concept, AReaL's staleness manager moved into Redis so K servers share one counter:

- **the policy version**: ``{run}:version``, the learner's optimizer steps, and ``{run}:version:changed``,
  the channel announcing each new one (:meth:`Admission.set_version`, :meth:`Admission.queue_version`);
- **the three staleness rules**, side by side below as pure functions: the *admission bound* (how many
  trajectories may be admitted at version v), the *freshness floor* (the oldest weights a server may
  generate with) and the *take-time screen* (the stalest trajectory the learner still trains on);
- **the admit script**: one Lua call INCRBYs ``{run}:admitted`` only if the groups fit under the bound, and
  records them as the server's unspent credits in ``{run}:credits`` in the same step: a server killed
  before it takes prompts for them leaves them there, and its next life adopts them;
- **per-server credits**: adopt, spend on prompts, give back on a clean stop;
- **the charge**: an agent episode's later segments (§10.6 of docs/environments.md) take admission as
  they are appended, beyond the group's ``n_samples``;
- **the refund**: a trajectory dead-lettered or refused as stale gives its slot back (queued by
  ``buffer/streams.py`` in the transaction that moves it), as does a group dropped by dynamic sampling;
- **the recount**: a restarted learner (or Redis) rebuilds ``{run}:admitted`` from what truly holds
  admission.

Sizes come from the config once (:meth:`Admission.from_config`); no call repeats them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import redis

if TYPE_CHECKING:
    from buffer.schema import Trajectory
    from buffer.streams import ReplayBuffer
    from tandem.config import Config

POLL_S = 0.5  # wait() re-checks this often even without a version message

# ------------------------------------------------------------------------------------ the three rules


def admission_bound(version: int, *, batch_size: int, max_staleness: int) -> int:
    """Trajectories that may have been admitted, in all, while the learner is at ``version``: every one
    then lands at most ``max_staleness`` versions behind the learner that trains on it. ``_ADMIT_LUA``
    computes the same in Redis."""
    return (version + max_staleness + 1) * batch_size


def freshness_floor(version: int, *, max_staleness: int) -> int:
    """The oldest weights a server may generate with while the learner is at ``version``."""
    return version - max_staleness


def stale_reason(staleness: int, version: int, *, max_staleness: int) -> str | None:
    """The take-time screen: why a trajectory ``staleness`` versions old is refused at ``version``, or None."""
    if staleness > max_staleness:
        return f"staleness {staleness} > max_staleness {max_staleness} at version {version}"
    return None


def largest_group(*, batch_size: int, max_staleness: int) -> int:
    """A larger group could only start once the learner had trained on data this very group is part of:
    it would wait forever."""
    return (max_staleness + 1) * batch_size


def extra_segments(group: Sequence[Trajectory]) -> int:
    """Trajectories of a group beyond its ``n_samples`` episodes: the later segments of agent episodes whose
    prompts rewrote their history (docs/environments.md §10.6). They are charged when the group is appended
    (:meth:`Admission.charge`), since admission counts trajectories."""
    return sum(1 for t in group if t.meta.get("segment", 0) > 0)


def recounted(
    version: int,
    *,
    batch_size: int,
    n_samples: int,
    trajectories: int,
    claimed: int,
    credits: int,
    trained_unacked: int = 0,
) -> int:
    """What truly holds admission (see :meth:`Admission.recount`): trained trajectories, those still in the
    stream (less those already trained), and the claimed prompts and unspent credits, ``n_samples`` each."""
    return version * batch_size + trajectories - trained_unacked + (claimed + credits) * n_samples


# KEYS[1] admitted, KEYS[2] version, KEYS[3] credits, KEYS[4] the published bound; ARGV: n, batch_size,
# max_staleness, groups, consumer. Admits as many groups of n (up to ``groups``) as fit under
# admission_bound, at the bound the learner published (max_staleness auto) or else ARGV[3], records them as
# the consumer's unspent credits; returns {groups admitted, admitted, bound}.
_ADMIT_LUA = """
local v = tonumber(redis.call('GET', KEYS[2]) or '0')
local s = math.min(tonumber(redis.call('GET', KEYS[4]) or ARGV[3]), tonumber(ARGV[3]))
local bound = (v + s + 1) * tonumber(ARGV[2])
local admitted = tonumber(redis.call('GET', KEYS[1]) or '0')
local n = tonumber(ARGV[1])
local k = math.min(tonumber(ARGV[4]), math.floor((bound - admitted) / n))
if k < 1 then return {0, admitted, bound} end
redis.call('HINCRBY', KEYS[3], ARGV[5], k)
return {k, redis.call('INCRBY', KEYS[1], k * n), bound}
"""


def version_key(run: str) -> str:
    return f"{run}:version"


def admitted_key(run: str) -> str:
    return f"{run}:admitted"


def bound_key(run: str) -> str:
    """The admission bound the learner publishes under ``max_staleness: auto`` (buffer/auto_staleness.py)."""
    return f"{run}:max_staleness"


def read_version(client: redis.Redis, run: str) -> int:
    """The learner's policy version (optimizer steps); 0 until the learner sets one."""
    v = client.get(version_key(run))
    return int(v) if v is not None else 0


def queue_refund(pipe: redis.client.Pipeline, run: str, n: int) -> None:
    """Queue the refund of ``n`` admitted trajectories that will never be trained on (dead-lettered or
    stale): the servers generate replacements instead of the learner starving (e.g. after a restart)."""
    pipe.decrby(admitted_key(run), n)


class Admission:
    """One run's admission, seen by one consumer (a rollout server or the learner).

    A server holds ``credits``: groups admitted and not yet spent on new prompts, mirrored in
    ``{run}:credits`` under its consumer name so that a next life of the server adopts them.
    """

    def __init__(
        self,
        client: redis.Redis,
        run: str,
        *,
        consumer: str,
        batch_size: int,
        max_staleness: int,
        n_samples: int,
    ) -> None:
        self.client, self.run, self.consumer = client, run, consumer
        self.batch_size, self.max_staleness, self.n_samples = batch_size, max_staleness, n_samples
        self.version_key, self.admitted_key = version_key(run), admitted_key(run)
        self.credits_key = f"{run}:credits"
        self.channel = f"{run}:version:changed"
        self.credits = 0  # groups this instance was admitted for and has not spent
        self._admit = client.register_script(_ADMIT_LUA)

    @classmethod
    def from_config(cls, client: redis.Redis, cfg: Config, consumer: str) -> Admission:
        """``max_staleness`` is the hard limit (``Config.max_staleness``); under ``auto`` admission reads the
        bound the learner publishes below it (:meth:`set_bound`)."""
        return cls(
            client,
            cfg.run.name,
            consumer=consumer,
            batch_size=cfg.algorithm.batch_size,
            max_staleness=cfg.max_staleness,
            n_samples=cfg.rollout.n_samples,
        )

    # ------------------------------------------------------------------------------------- the version

    def version(self) -> int:
        """The learner's policy version (optimizer steps); 0 until the learner sets one."""
        return read_version(self.client, self.run)

    def set_version(self, v: int) -> None:
        """Announce version v, which opens admission for it: only once its weights are published."""
        pipe = self.client.pipeline(transaction=True)
        self.queue_version(pipe, v)
        pipe.execute()

    def queue_version(self, pipe: redis.client.Pipeline, v: int) -> None:
        """Queue ``set_version(v)`` on the caller's pipeline: a publisher announces the weights and the
        version that opens admission in one transaction, one round trip fewer per step."""
        pipe.set(self.version_key, int(v))
        pipe.publish(self.channel, int(v))

    def set_bound(self, bound: int) -> None:
        """Publish the staleness bound admission uses from now on (``max_staleness: auto``; the learner
        calls it). Trajectories admitted under a higher bound before stay within ``max_staleness``, the
        hard limit the take-time screen holds."""
        if not 0 <= bound <= self.max_staleness:
            raise ValueError(f"admission bound {bound} outside 0..max_staleness={self.max_staleness}")
        self.client.set(bound_key(self.run), int(bound))

    def bound(self) -> int:
        """The staleness bound admission uses now: the published one, else ``max_staleness``."""
        published = self.client.get(bound_key(self.run))
        return self.max_staleness if published is None else min(int(published), self.max_staleness)

    def freshness_floor(self) -> int:
        """The oldest weights a server may generate with now (:func:`freshness_floor`)."""
        return freshness_floor(self.version(), max_staleness=self.max_staleness)

    def screen(self, version: int) -> Callable[[Trajectory], str | None]:
        """The take-time screen at ``version`` (:func:`stale_reason`)."""
        return lambda t: stale_reason(t.staleness(version), version, max_staleness=self.max_staleness)

    # ------------------------------------------------------------------------------------------ admit

    def try_admit(self, groups: int) -> int:
        """Atomically admit as many groups of ``n_samples`` as fit under the bound, at most ``groups``;
        returns how many, now added to this consumer's credits. One round trip for a whole batch."""
        n = self.n_samples
        if groups < 1:
            raise ValueError(f"admit: groups must be >= 1, got {groups}")
        if n < 1 or n > (top := largest_group(batch_size=self.batch_size, max_staleness=self.max_staleness)):
            raise ValueError(f"admit: group of {n} must be in 1..(max_staleness + 1) * batch_size = {top}")
        got, _, _ = self._admit(
            keys=[self.admitted_key, self.version_key, self.credits_key, bound_key(self.run)],
            args=[n, self.batch_size, self.max_staleness, groups, self.consumer],
        )
        self.credits += int(got)
        return int(got)

    def wait(
        self,
        groups: int,
        *,
        timeout_s: float,
        should_stop: Callable[[], bool] | None = None,
        while_waiting: Callable[[], None] | None = None,
        wake_channels: Sequence[str] = (),
    ) -> int:
        """Block until at least one group is admitted, taking up to ``groups`` at once; returns how many
        (0 when timeout_s passes or should_stop() is true first).

        Wakes on each version announcement (and on any of ``wake_channels``) and re-checks every POLL_S
        regardless. ``while_waiting`` runs at each wake-up: a rollout server takes new weights there, since
        the learner's next version may be waiting on it (a ``dist`` broadcast).
        """
        if got := self.try_admit(groups):
            return got
        deadline = time.monotonic() + timeout_s
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(self.channel, *wake_channels)
        try:
            while True:
                if got := self.try_admit(groups):
                    return got
                if while_waiting is not None:
                    while_waiting()
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (should_stop is not None and should_stop()):
                    return 0
                pubsub.get_message(timeout=min(remaining, POLL_S))
        finally:
            pubsub.close()

    def top_up(
        self,
        want: int,
        *,
        timeout_s: float,
        should_stop: Callable[[], bool] | None = None,
        while_waiting: Callable[[], None] | None = None,
        wake_channels: Sequence[str] = (),
    ) -> int:
        """Hold credits for ``want`` groups if the window allows: waits (as ``wait``) only when none are
        held, else takes what is free at once. Returns the credits held."""
        if (missing := want - self.credits) > 0:
            if self.credits:
                self.try_admit(missing)
            else:
                self.wait(
                    missing,
                    timeout_s=timeout_s,
                    should_stop=should_stop,
                    while_waiting=while_waiting,
                    wake_channels=wake_channels,
                )
        return self.credits

    # ---------------------------------------------------------------------------------------- credits

    def held_credits(self) -> int:
        """Groups this consumer was admitted for and has not spent, as Redis records them: left by an
        earlier life of this consumer that was killed, or 0."""
        held = int(self.client.hget(self.credits_key, self.consumer) or 0)
        return max(0, held)  # below 0 only after Redis lost a write

    def adopt(self) -> int:
        """Take over the credits an earlier life of this consumer left unspent; returns how many."""
        held = self.held_credits()
        self.credits += held
        return held

    def spend(self, groups: int) -> None:
        """Record that ``groups`` credits were spent on new prompts (which now carry that admission).

        Called right after the prompts are read: a kill in between leaves both the prompts (redelivered) and
        the credits, and the next life admits that many groups too many, which the take-time screen
        bounds. The other order would lose them, which can stall a small window."""
        if groups:
            self.client.hincrby(self.credits_key, self.consumer, -groups)
            self.credits -= groups

    def give_back(self) -> None:
        """Give back every unspent credit (a server stopping cleanly)."""
        if self.credits:
            pipe = self.client.pipeline(transaction=True)
            pipe.decrby(self.admitted_key, self.credits * self.n_samples)
            pipe.hincrby(self.credits_key, self.consumer, -self.credits)
            pipe.execute()
            self.credits = 0

    def charge(self, trajectories: int) -> None:
        """Take admission for trajectories appended beyond their groups' admitted ``n_samples`` (an agent
        episode's later segments, :func:`extra_segments`): the counter keeps counting what the stream holds,
        and the learner's steps of ``batch_size`` trajectories keep it bounded."""
        self.client.incrby(self.admitted_key, trajectories)

    def refund(self, trajectories: int) -> None:
        """Give back admission for trajectories that will never be appended (a group dropped as uniform)."""
        self.client.decrby(self.admitted_key, trajectories)

    def admitted(self) -> int:
        return int(self.client.get(self.admitted_key) or 0)

    # ---------------------------------------------------------------------------------------- recount

    def recount(self, version: int, streams: ReplayBuffer, *, trained_unacked: int = 0) -> int:
        """Rebuild the admission counter after a learner restart and return it.

        A resumed learner restarts at its checkpoint's version, below what the crashed run had admitted, so
        the old counter would hold every server until the learner caught up: a deadlock. What is truly
        admitted is what was trained (``version * batch_size``), plus the trajectories still in the stream
        (including trained-but-not-checkpointed ones, which will be trained again), plus the groups of
        prompts a server has claimed but not answered (they are redelivered and keep their admission), plus
        the credits servers hold unspent (a live server spends them, a restarted one adopts them). Call it
        before the restarted learner announces its version.

        A live learner recounting after a Redis restart (which can lose or repeat admission increments,
        docs/design.md §6.6) passes ``trained_unacked``: trajectories in ``version`` that are still in the
        stream, awaiting their checkpoint, so they are not counted twice.
        """
        claimed = streams.prompts_claimed()
        credits = sum(max(0, int(c)) for c in self.client.hvals(self.credits_key))
        admitted = recounted(
            version,
            batch_size=self.batch_size,
            n_samples=self.n_samples,
            trajectories=streams.trajectories_pending(),
            claimed=claimed,
            credits=credits,
            trained_unacked=trained_unacked,
        )
        self.client.set(self.admitted_key, admitted)
        return admitted
