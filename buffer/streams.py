"""The replay buffer: Redis Streams carrying prompts to the rollout servers and trajectories to the learner.

Owns the stream keys of a run (docs/design.md §1.6, §3, §6)::

    {run}:traj           trajectories, consumer group "learner"     {run}:traj:dead     malformed entries
    {run}:traj:stale     entries refused as too stale               {run}:prompts       prompts, group "rollout"
    {run}:prompts:dead   malformed prompts                          {run}:counts        dead/stale counters (hash)

Admission and the policy version (``{run}:admitted``, ``{run}:credits``, ``{run}:version``) are
:mod:`buffer.admission`'s. Each stream is a :class:`buffer.group_stream.GroupStream` (at-least-once delivery,
capacity, claims of dead consumers' entries); what one refuses goes to :mod:`buffer.dead_letters`.

- ``put`` appends a prompt's group and acknowledges that prompt in one atomic step, so each prompt's group
  enters the stream once.
- A refused trajectory held admission: its refund (:func:`buffer.admission.queue_refund`) is queued in the
  transaction that moves it, and the take-time screen is :meth:`buffer.admission.Admission.screen`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis

from buffer.admission import Admission, admitted_key, queue_refund, read_version
from buffer.dead_letters import letters_key
from buffer.group_stream import BLOCK_CAP_MS, GroupStream, Screen
from buffer.schema import (
    PromptRecord,
    Trajectory,
    decode_prompt,
    decode_trajectory,
    encode_prompt,
    encode_trajectory,
)

if TYPE_CHECKING:
    from tandem.config import Config

# KEYS[1] prompt stream, KEYS[2] feeder position hash; ARGV: the position expected (epoch, index), the
# position after these prompts, then the payloads. Compare-and-set, so a retry of a call that ran before a
# Redis crash (its reply lost) appends nothing twice; one script, so the AOF keeps both writes or neither.
_FEED_LUA = """
local pos = redis.call('HMGET', KEYS[2], 'epoch', 'index')
if (pos[1] or '0') ~= ARGV[1] or (pos[2] or '0') ~= ARGV[2] then return -1 end
for i = 5, #ARGV do redis.call('XADD', KEYS[1], '*', 'd', ARGV[i]) end
redis.call('HSET', KEYS[2], 'epoch', ARGV[3], 'index', ARGV[4])
return #ARGV - 4
"""

log = logging.getLogger(__name__)


@dataclass
class Taken:
    """A trajectory taken from the stream, with the id to ack once the optimizer step that used it is done."""

    id: str
    traj: Trajectory
    # Delivered before: own pending after a restart, or claimed from a dead consumer.
    redelivered: bool = False


@dataclass
class TakenPrompt:
    """A prompt taken by a rollout server; ack it with the trajectories that answer it (``put(ack_prompts=)``)."""

    id: str
    prompt: PromptRecord
    redelivered: bool = False


class ReplayBuffer:
    """The two streams of one run: trajectories ({run}:traj, group "learner") and prompts ({run}:prompts,
    group "rollout"). Admission and the policy version are :class:`buffer.admission.Admission`'s.

    One instance per consumer (process or thread); the client must use ``decode_responses=False``.
    """

    def __init__(
        self,
        client: redis.Redis,
        run: str,
        *,
        consumer: str,
        maxlen: int = 100_000,
        claim_idle_ms: int = 60_000,
        put_timeout_s: float = 300.0,
        max_traj_bytes: int = 64 << 20,
    ) -> None:
        kwargs = client.connection_pool.connection_kwargs
        if kwargs.get("decode_responses"):
            raise ValueError("ReplayBuffer needs a client with decode_responses=False (payloads are binary)")
        socket_timeout = kwargs.get("socket_timeout")
        # A blocking read must return before the socket gives up on it.
        block_cap_ms = min(BLOCK_CAP_MS, int(socket_timeout * 500)) if socket_timeout else BLOCK_CAP_MS
        self.client, self.run, self.consumer = client, run, consumer
        self.maxlen, self.put_timeout_s, self.max_traj_bytes = maxlen, put_timeout_s, max_traj_bytes
        common = dict(
            claim_idle_ms=claim_idle_ms,
            max_bytes=max_traj_bytes,
            counts_key=f"{run}:counts",
            block_cap_ms=max(1, block_cap_ms),
        )
        self._traj: GroupStream[Trajectory] = GroupStream(
            client,
            f"{run}:traj",
            "learner",
            consumer,
            decode=decode_trajectory,
            on_reject=lambda pipe, n: queue_refund(pipe, run, n),
            **common,
        )
        self._prompts: GroupStream[PromptRecord] = GroupStream(
            client, f"{run}:prompts", "rollout", consumer, decode=decode_prompt, **common
        )
        self._feed = client.register_script(_FEED_LUA)
        self._staleness: Counter[int] = Counter()  # of trajectories taken since the last metrics()
        self._put_count = self._take_count = 0
        self._metrics_at = time.monotonic()

    @classmethod
    def from_config(cls, client: redis.Redis, cfg: Config, consumer: str) -> ReplayBuffer:
        r = cfg.redis
        return cls(
            client,
            cfg.run.name,
            consumer=consumer,
            maxlen=r.stream_maxlen,
            claim_idle_ms=r.claim_idle_ms,
            put_timeout_s=r.put_timeout_s,
            max_traj_bytes=r.max_traj_bytes,
        )

    # ---------------------------------------------------------------------- trajectories (rollout -> learner)

    def put(self, trajs: Sequence[Trajectory], *, ack_prompts: Sequence[str] = ()) -> list[str]:
        """Append trajectories contiguously, waiting up to put_timeout_s for room (then TimeoutError).

        ``ack_prompts``: ids of the prompts these trajectories answer, acknowledged in the same atomic step.
        If one of them was already answered (another server claimed it and appended first), nothing is
        appended and [] is returned: each prompt's group enters the stream once.
        """
        payloads = [self._encode_checked(t) for t in trajs]
        ids = self._traj.append(
            payloads, maxlen=self.maxlen, timeout_s=self.put_timeout_s, ack=(self._prompts, ack_prompts)
        )
        self._put_count += len(ids)
        return ids

    def put_groups(self, groups: Sequence[tuple[Sequence[Trajectory], str]]) -> list[list[str]]:
        """``put(group, ack_prompts=[prompt id])`` for each ``(group, prompt id)``, in one round trip; a
        group whose prompt was already answered is refused alone (``[]``)."""
        encoded = [([self._encode_checked(t) for t in trajs], [prompt]) for trajs, prompt in groups]
        got = self._traj.append_groups(
            encoded, maxlen=self.maxlen, timeout_s=self.put_timeout_s, ack_stream=self._prompts
        )
        self._put_count += sum(map(len, got))
        return got

    def _encode_checked(self, t: Trajectory) -> bytes:
        payload = encode_trajectory(t)
        if len(payload) > self.max_traj_bytes:
            raise ValueError(
                f"trajectory {t.traj_id}: {len(payload)} bytes exceeds max_traj_bytes {self.max_traj_bytes}"
            )
        return payload

    def take(
        self,
        n: int,
        timeout_s: float,
        *,
        admission: Admission | None = None,
        validate: Callable[[Trajectory], str | None] | None = None,
    ) -> list[Taken]:
        """Up to n (blocks until n arrive or timeout). With ``admission``, moves entries its take-time screen
        refuses at the current learner version to {run}:traj:stale (acked and counted). ``validate`` returns
        why a well-formed trajectory is still unusable by this consumer (e.g. a token id outside the
        model's vocabulary): such a poison pill is dead-lettered and counted, never handed out, so a
        restarted consumer cannot crash on it again. Own pending entries come first, then entries idle >
        claim_idle_ms on other consumers, then new ones."""
        v = read_version(self.client, self.run)
        stale = admission.screen(v) if admission is not None else None

        def screen(t: Trajectory) -> tuple[str, str] | None:
            problem = validate(t) if validate is not None else None
            if problem:
                return "dead", problem
            if stale is not None and (why := stale(t)):
                return "stale", why
            self._staleness[t.staleness(v)] += 1  # accepted: exactly the entries take returns
            return None

        got = self._traj.take(n, timeout_s, screen)
        self._take_count += len(got)
        return [Taken(i, t, r) for i, t, r in got]

    def ack(self, ids: Sequence[str]) -> None:
        """Acknowledge (and delete) trajectories whose optimizer step is done. Idempotent."""
        self._traj.ack(ids)

    def ack_ranges(self, ranges: Sequence[tuple[str, str]]) -> int:
        """Acknowledge (and delete) every trajectory id in the inclusive ``(lo, hi)`` ranges: the replay of
        a checkpoint lineage's acks (``learner/acked_ranges.py``). Idempotent; returns the ids touched."""
        return sum(self._traj.ack_range(lo, hi) for lo, hi in ranges)

    def trajectory_ids(self, upto: str) -> list[str]:
        """Ids of the trajectories in the stream (undelivered or pending) at or below ``upto``."""
        return self._traj.entry_ids(upto)

    def trim(self) -> int:
        """Compact both streams: drop entries before the oldest one a group still needs. Returns how many."""
        return self._traj.trim() + self._prompts.trim()

    def trajectories_pending(self) -> int:
        """Trajectories not yet acknowledged (undelivered + taken-but-unacked)."""
        return self._traj.length()

    # ------------------------------------------------------------------------------ prompts (dataset -> rollout)

    def put_prompts(self, prompts: Sequence[PromptRecord]) -> list[str]:
        """Queue prompts (unbounded: launch.py keeps the depth with prompts_pending())."""
        return self._prompts.append(
            [encode_prompt(p) for p in prompts], maxlen=0, timeout_s=self.put_timeout_s
        )

    def feed_prompts(
        self, prompts: Sequence[PromptRecord], *, position_key: str, at: tuple[int, int], to: tuple[int, int]
    ) -> int:
        """Queue prompts and move the feeder's position hash from ``at`` to ``to`` in one atomic step, only
        if it is still at ``at``: -1 (nothing appended) when it is not, e.g. a retried call that already ran."""
        args = [*map(str, (*at, *to)), *(encode_prompt(p) for p in prompts)]
        return int(self._feed(keys=[self._prompts.key, position_key], args=args))

    def take_prompts(
        self, n: int, timeout_s: float, screen: Screen[PromptRecord] | None = None
    ) -> list[TakenPrompt]:
        """Up to n prompts; one that ``screen`` refuses (or that fails the schema) goes to
        ``{run}:prompts:dead`` with its reason, acknowledged, instead of being handed out."""
        return [TakenPrompt(i, p, r) for i, p, r in self._prompts.take(n, timeout_s, screen)]

    def reclaim_prompts(self, n: int, screen: Screen[PromptRecord] | None = None) -> list[TakenPrompt]:
        """Up to n prompts that already hold admission, without waiting: those this consumer held in an
        earlier life and those idle on a dead server. Never a new prompt, which would need admission."""
        return [TakenPrompt(i, p, r) for i, p, r in self._prompts.reclaim(n, screen)]

    def keep_prompts(self, ids: Sequence[str]) -> None:
        """Heartbeat of a server still generating for these prompts: they stay its own (not reclaimed)."""
        self._prompts.keep_claimed(ids)

    def return_prompts(self, ids: Sequence[str] | None = None) -> int:
        """A server leaving gracefully hands back the prompts it holds (or those of ``ids``, a batch its
        engine failed): a server claims them at once (with the admission they carry) instead of after
        ``claim_idle_ms``. Returns how many."""
        return self._prompts.hand_back(ids)

    @property
    def claim_idle_ms(self) -> int:
        return self._prompts.claim_idle_ms

    def ack_prompts(self, ids: Sequence[str]) -> None:
        """Acknowledge prompts whose trajectories are appended (``put(ack_prompts=)`` does it atomically)."""
        self._prompts.ack(ids)

    def prompts_pending(self) -> int:
        """Prompts not yet acknowledged (undelivered + being generated)."""
        return self._prompts.length()

    def prompts_claimed(self) -> int:
        """Prompts a server has taken and not yet answered (they hold admission)."""
        return self._prompts.pending()

    def reack(self) -> int:
        """Re-acknowledge the trajectories this instance acked lately (after a Redis restart; idempotent)."""
        return self._traj.reack()

    # ------------------------------------------------------------------------------------------- metrics

    def metrics(self) -> dict[str, float]:
        """Buffer depth, dead/stale counts (run-wide) and this instance's rates and staleness since the last call."""
        pipe = self.client.pipeline(transaction=False)
        pipe.xlen(self._traj.key)
        pipe.xlen(self._prompts.key)
        pipe.hgetall(f"{self.run}:counts")
        pipe.get(admitted_key(self.run))
        traj_len, prompts_len, counts, admitted = pipe.execute()
        counts = {k.decode(): int(v) for k, v in counts.items()}
        pending = self._traj.pending()
        now = time.monotonic()
        elapsed = max(now - self._metrics_at, 1e-9)
        out = {
            "buffer/length": float(traj_len),
            "buffer/pending": float(pending),
            "buffer/undelivered": float(traj_len - pending),
            "buffer/dead": float(counts.get(letters_key(self._traj.key, "dead"), 0)),
            "buffer/stale_rejected": float(counts.get(letters_key(self._traj.key, "stale"), 0)),
            "buffer/prompts": float(prompts_len),
            "buffer/prompts_dead": float(counts.get(letters_key(self._prompts.key, "dead"), 0)),
            "buffer/admitted": float(int(admitted or 0)),
            "buffer/put_per_s": self._put_count / elapsed,
            "buffer/take_per_s": self._take_count / elapsed,
            **self._staleness_metrics(),
        }
        self._put_count = self._take_count = 0
        self._staleness.clear()
        self._metrics_at = now
        return out

    def _staleness_metrics(self) -> dict[str, float]:
        total = sum(self._staleness.values())
        out = {
            "staleness/count": float(total),
            "staleness/mean": sum(s * c for s, c in self._staleness.items()) / total if total else 0.0,
            "staleness/max": float(max(self._staleness, default=0)),
        }
        out.update({f"staleness/hist_{s}": float(c) for s, c in sorted(self._staleness.items())})
        return out


class ClaimHeartbeat:
    """While a server works on claimed prompts, re-claims them every ``claim_idle_ms / 3`` (XCLAIM JUSTID).

    Without it, a generation that outlasts ``redis.claim_idle_ms`` looks like a dead server's, and another
    server claims the prompt and generates it again. The buffer's put refuses the second answer anyway;
    the heartbeat saves the work.
    """

    def __init__(self, buffer: ReplayBuffer, ids: list[str]) -> None:
        self.buffer, self.ids = buffer, ids
        self.every_s = buffer.claim_idle_ms / 3000
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="claim-heartbeat", daemon=True)

    def __enter__(self) -> ClaimHeartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.buffer.keep_prompts(self.ids)
            except redis.RedisError as e:  # a missed beat only risks a duplicate, which put refuses
                log.warning("could not refresh the claim on %d prompts: %s", len(self.ids), e)
