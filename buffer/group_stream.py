"""One Redis stream read through one consumer group: append with capacity, take, ack-and-delete.

:class:`buffer.streams.ReplayBuffer` holds two of these (trajectories and prompts; docs/design.md §1.6, §3,
§6). Delivery is at-least-once, acknowledged only once the effect is durable: a trajectory after the
optimizer step that used it, a prompt when its trajectories are appended. Choices, and why:

- ``ack`` is XACK + XDEL, so a stream holds exactly its unconsumed entries (undelivered + pending). XLEN is
  then the exact queue depth on any Redis >= 6.2 (the group ``lag`` field needs 7.0), and capacity is
  checked against it: ``append`` waits for room (backpressure) and never trims unconsumed data.
- ``append`` is one Lua script: capacity check, every XADD, and optionally the acks of the entries (prompts)
  the new ones answer. One prompt's group stays contiguous, racing producers cannot overshoot ``maxlen``,
  and a server that dies cannot leave a prompt unacknowledged after its group was appended (which would
  generate the group twice).
- Reading order: this consumer's own pending entries (re-delivered after a restart under the same name),
  then entries idle longer than ``claim_idle_ms`` on other consumers (XAUTOCLAIM: those consumers died),
  then new ones. ``claim_idle_ms`` must therefore exceed the longest take-to-ack interval (one learner step).
- Entries that fail to decode, or that the caller's screen refuses, are moved aside by
  :mod:`buffer.dead_letters`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import redis

from buffer.dead_letters import Reject, queue_moves
from buffer.schema import SchemaError

log = logging.getLogger(__name__)

FIELD = b"d"  # the one field of a stream entry: the encoded record
BLOCK_CAP_MS = 1_000  # longest single XREADGROUP BLOCK, so claims and deadlines are re-checked
ACK_MEMORY_S = 300.0  # acked ids are remembered this long, to re-ack what a Redis restart lost (§6.6)

R = TypeVar("R")  # the record type of a stream
T = TypeVar("T")
_Raw = tuple[str, dict[bytes, bytes], bool]  # (id, fields, redelivered) as read, before decoding
# A screen refuses a decoded record with (kind, reason): kind "dead" (unusable) or "stale".
Screen = Callable[[R], "tuple[str, str] | None"]

# KEYS[1] stream to append to, KEYS[2] stream whose entries to acknowledge.
# ARGV: maxlen (0: unbounded), group of KEYS[2], number of ids to ack, the ids, then the payloads.
# Returns the new ids; false when full (retry); 0 when an entry to ack is no longer pending: another
# consumer claimed it and answered first, so this answer is a duplicate and is refused whole.
_PUT_LUA = """
local nack = tonumber(ARGV[3])
local first = 4 + nack
local maxlen = tonumber(ARGV[1])
for i = 4, 3 + nack do
  if #redis.call('XPENDING', KEYS[2], ARGV[2], ARGV[i], ARGV[i], 1) == 0 then return 0 end
end
if maxlen > 0 and redis.call('XLEN', KEYS[1]) + (#ARGV - first + 1) > maxlen then return false end
local ids = {}
for i = first, #ARGV do ids[#ids + 1] = redis.call('XADD', KEYS[1], '*', 'd', ARGV[i]) end
if nack > 0 then
  redis.call('XACK', KEYS[2], ARGV[2], unpack(ARGV, 4, 3 + nack))
  redis.call('XDEL', KEYS[2], unpack(ARGV, 4, 3 + nack))
end
return ids
"""

# KEYS[1] stream; ARGV: group, lo, hi, count. XACK + XDEL up to count entries, and pending ids of deleted
# entries, in [lo, hi]; returns how many ids it touched (0: nothing left in the range).
_ACK_RANGE_LUA = """
local ids = {}
for _, e in ipairs(redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[3], 'COUNT', ARGV[4])) do ids[#ids + 1] = e[1] end
for _, p in ipairs(redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4])) do ids[#ids + 1] = p[1] end
if #ids == 0 then return 0 end
redis.call('XACK', KEYS[1], ARGV[1], unpack(ids))
redis.call('XDEL', KEYS[1], unpack(ids))
return #ids
"""

# KEYS[1] stream; ARGV: start, end, count. The ids (no payloads) of up to count entries in [start, end].
_IDS_LUA = """
local ids = {}
for _, e in ipairs(redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[2], 'COUNT', ARGV[3])) do ids[#ids + 1] = e[1] end
return ids
"""

ID_PAGE = 1_000  # ids per script call: keeps each call short and under Lua's unpack limit


def create_group(client: redis.Redis, key: str, group: str) -> None:
    """Consumer group ``group`` on stream ``key`` from its first entry, the stream made if missing;
    idempotent (an existing group is kept as it is)."""
    try:
        client.xgroup_create(key, group, id="0", mkstream=True)
    except redis.ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


def _str(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


def _successor(entry_id: str) -> str:
    ms, seq = entry_id.split("-")
    return f"{ms}-{int(seq) + 1}"


class GroupStream(Generic[R]):
    """One stream read through one consumer group: append with capacity, take, ack-and-delete, dead letters.

    Not thread-safe for ``take`` (it tracks what this consumer has handed out); use one per thread.
    """

    def __init__(
        self,
        client: redis.Redis,
        key: str,
        group: str,
        consumer: str,
        *,
        decode: Callable[[bytes], R],
        claim_idle_ms: int,
        max_bytes: int,
        counts_key: str,
        block_cap_ms: int,
        on_reject: Callable[[redis.client.Pipeline, int], None] | None = None,
    ) -> None:
        self.client, self.key, self.group, self.consumer = client, key, group, consumer
        self.on_reject = on_reject  # queued with every dead-lettering, in its transaction
        self.decode, self.claim_idle_ms, self.max_bytes = decode, claim_idle_ms, max_bytes
        self.counts_key, self.block_cap_ms = counts_key, block_cap_ms
        self._put = client.register_script(_PUT_LUA)
        self._ack_range = client.register_script(_ACK_RANGE_LUA)
        self._ids = client.register_script(_IDS_LUA)
        self._group_ready = False
        self._outstanding: set[str] = set()  # handed out by this instance, not yet acked
        # Acked by this instance lately: a Redis restart may have lost the ack (docs/design.md §6.6).
        self._acked: deque[tuple[float, list[str]]] = deque()
        self._acked_ids: set[str] = set()
        self._recovered = False  # own pending entries (left by an earlier life of this consumer) re-read
        self._pel_cursor = "0"
        self._claim_cursor = "0-0"
        self._next_claim = 0.0
        self._claim_every_s = max(0.05, min(1.0, claim_idle_ms / 2000))

    # -------------------------------------------------------------------------------------- writing

    def append(
        self,
        payloads: Sequence[bytes],
        *,
        maxlen: int,
        timeout_s: float,
        ack: tuple[GroupStream[Any], Sequence[str]] | None = None,
    ) -> list[str]:
        """XADD all payloads contiguously (and ack ``ack``'s ids in the same step) once they fit in maxlen.

        Returns [] without appending anything when an id in ``ack`` was already acknowledged (a duplicate).
        """
        if maxlen and len(payloads) > maxlen:
            raise ValueError(f"{self.key}: {len(payloads)} entries can never fit in maxlen {maxlen}")
        ack_stream, ack_ids = ack if ack else (self, ())
        argv = [maxlen, ack_stream.group, len(ack_ids), *ack_ids, *payloads]
        deadline = time.monotonic() + timeout_s
        pause = 0.01
        while True:
            ids = self._put(keys=[self.key, ack_stream.key], args=argv)
            if ids == 0:
                ack_stream._outstanding.difference_update(ack_ids)
                return []
            if ids is not None:
                ack_stream._outstanding.difference_update(ack_ids)
                return [_str(i) for i in ids]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"{self.key} stayed full ({self.client.xlen(self.key)} unconsumed of maxlen {maxlen}) for "
                    f"{timeout_s:g}s while appending {len(payloads)} entries: is the learner consuming?"
                )
            time.sleep(min(pause, remaining))
            pause = min(pause * 2, 0.2)

    def append_groups(
        self,
        groups: Sequence[tuple[Sequence[bytes], Sequence[str]]],
        *,
        maxlen: int,
        timeout_s: float,
        ack_stream: GroupStream[Any],
    ) -> list[list[str]]:
        """``append`` for several ``(payloads, ack_ids)`` groups in one round trip (a pipeline of the same
        script): each group is still its own atomic call, contiguous and refused alone as a duplicate
        (``[]``); a group the stream has no room for yet then waits for room as ``append`` does."""
        pipe = self.client.pipeline(transaction=False)
        for payloads, ack_ids in groups:
            if maxlen and len(payloads) > maxlen:
                raise ValueError(f"{self.key}: {len(payloads)} entries can never fit in maxlen {maxlen}")
            argv = [maxlen, ack_stream.group, len(ack_ids), *ack_ids, *payloads]
            self._put(keys=[self.key, ack_stream.key], args=argv, client=pipe)
        out = []
        for (payloads, ack_ids), ids in zip(groups, pipe.execute(), strict=True):
            if ids is None:  # no room yet
                out.append(
                    self.append(payloads, maxlen=maxlen, timeout_s=timeout_s, ack=(ack_stream, ack_ids))
                )
                continue
            ack_stream._outstanding.difference_update(ack_ids)
            out.append([] if ids == 0 else [_str(i) for i in ids])
        return out

    def keep_claimed(self, ids: Sequence[str]) -> None:
        """Reset the idle time of entries this consumer holds (XCLAIM ... JUSTID), so a long piece of work
        on them is not mistaken for a dead consumer's and claimed by another."""
        if ids:
            self.client.xclaim(self.key, self.group, self.consumer, 0, list(ids), justid=True)

    def hand_back(self, ids: Sequence[str] | None = None) -> int:
        """Mark every entry this consumer holds (or those of ``ids``) as idle past ``claim_idle_ms`` (XCLAIM
        ... IDLE), so the next XAUTOCLAIM of any consumer, this one included, takes it at once; returns how
        many. For a graceful leave, or a batch the engine failed."""
        if ids is None:
            held = self._with_group(
                self.client.xpending_range, self.key, self.group, "-", "+", 10_000, self.consumer
            )
            ids = [_str(p["message_id"]) for p in held]
        ids = list(ids)
        if ids:
            self.client.xclaim(
                self.key, self.group, self.consumer, 0, ids, idle=self.claim_idle_ms, justid=True
            )
        self._outstanding.difference_update(ids)
        return len(ids)

    def ack(self, ids: Sequence[str]) -> None:
        if not ids:
            return
        self._ack(ids)
        self._outstanding.difference_update(ids)
        now = time.monotonic()
        self._acked.append((now, list(ids)))
        self._acked_ids.update(ids)
        while self._acked and now - self._acked[0][0] > ACK_MEMORY_S:
            self._acked_ids.difference_update(self._acked.popleft()[1])

    def _ack(self, ids: Sequence[str]) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.xack(self.key, self.group, *ids)
        pipe.xdel(self.key, *ids)
        pipe.execute()

    def reack(self) -> int:
        """Ack again what this instance acked in the last ``ACK_MEMORY_S`` s (idempotent): after a Redis
        restart that lost the tail of its append-only file, those entries would be pending again."""
        ids = sorted(self._acked_ids)
        for start in range(0, len(ids), 1000):
            self._ack(ids[start : start + 1000])
        return len(ids)

    def ack_range(self, lo: str, hi: str) -> int:
        """XACK + XDEL every entry, and every pending id, from ``lo`` to ``hi``; how many ids it touched.

        Idempotent and cheap where nothing is left: acking an id no longer pending costs nothing."""
        touched = 0
        args = [self.group, lo, hi, ID_PAGE]
        while n := int(self._with_group(lambda: self._ack_range(keys=[self.key], args=args))):
            touched += n
        return touched

    def entry_ids(self, upto: str) -> list[str]:
        """Ids of the entries present (undelivered or pending) at or below ``upto``, without payloads."""
        out: list[str] = []
        start = "-"
        while page := [_str(i) for i in self._ids(keys=[self.key], args=[start, upto, ID_PAGE])]:
            out += page
            start = "(" + page[-1]  # exclusive: after the last one seen
        return out

    # -------------------------------------------------------------------------------------- reading

    def take(self, n: int, timeout_s: float, screen: Screen[R] | None = None) -> list[tuple[str, R, bool]]:
        """Up to n valid records as (id, record, redelivered); fewer only when timeout_s runs out.

        ``screen`` returns ``(kind, reason)`` to refuse a record (moved to ``:<kind>``, "dead" or "stale"),
        or None to accept it.
        """
        deadline = time.monotonic() + timeout_s
        out: list[tuple[str, R, bool]] = []
        while len(out) < n:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            block_ms = min(remaining_ms, self.block_cap_ms) if remaining_ms >= 1 else None
            out.extend(self._hand_out(self._with_group(self._fetch, n - len(out), block_ms), screen))
            if time.monotonic() >= deadline:
                break
        return out

    def _with_group(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn, creating the group first (idempotently) and again if the stream vanished (NOGROUP)."""
        if not self._group_ready:
            self.ensure_group()
        try:
            return fn(*args)
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            self.ensure_group()
            return fn(*args)

    def ensure_group(self) -> None:
        create_group(self.client, self.key, self.group)
        self._group_ready = True

    def reclaim(self, k: int, screen: Screen[R] | None = None) -> list[tuple[str, R, bool]]:
        """Up to k redelivered records only, as ``take`` returns them: this consumer's own pending entries
        from an earlier life, then entries idle on dead consumers. Never a new entry; never blocks."""
        out: list[tuple[str, R, bool]] = []
        while len(out) < k and (got := self._with_group(self._fetch_redelivered, k - len(out))):
            out.extend(self._hand_out(got, screen))
        return out

    def _hand_out(self, entries: list[_Raw], screen: Screen[R] | None) -> list[tuple[str, R, bool]]:
        accepted = self._screen(entries, screen)
        # Outstanding at once, so a re-scan of our pending list later in the same take skips them.
        self._outstanding.update(i for i, _, _ in accepted)
        return accepted

    def _fetch(self, k: int, block_ms: int | None) -> list[_Raw]:
        if redelivered := self._fetch_redelivered(k):
            return redelivered
        got = self.client.xreadgroup(self.group, self.consumer, {self.key: ">"}, count=k, block=block_ms)
        # After a Redis restart lost a delivery, an entry this instance holds can come back as new.
        return [(_str(i), f, False) for _, es in got for i, f in es if _str(i) not in self._outstanding]

    def _fetch_redelivered(self, k: int) -> list[_Raw]:
        if not self._recovered:
            if own := self._read_own_pending(k):
                return own
            self._recovered = True
        return self._claim(k)

    def _read_own_pending(self, k: int) -> list[_Raw]:
        """The next page of this consumer's pending entries (XREADGROUP from an id re-delivers them)."""
        while True:
            got = self.client.xreadgroup(self.group, self.consumer, {self.key: self._pel_cursor}, count=k)
            entries = [(_str(i), f) for _, es in got for i, f in es]
            if not entries:
                self._pel_cursor = "0"
                return []
            self._pel_cursor = entries[-1][0]
            fresh = [(i, f, True) for i, f in entries if i not in self._outstanding]
            if fresh:
                return fresh

    def _claim(self, k: int) -> list[_Raw]:
        """Entries pending longer than claim_idle_ms, whoever holds them (a holder that idle has died)."""
        now = time.monotonic()
        if now < self._next_claim:
            return []
        cursor, entries = self.client.xautoclaim(
            self.key, self.group, self.consumer, self.claim_idle_ms, self._claim_cursor, count=k
        )[:2]
        self._claim_cursor = _str(cursor)
        if self._claim_cursor == "0-0":
            self._next_claim = now + self._claim_every_s
        if any(i is None for i, _ in entries):
            # Redis 6.2 hides the ids of claimed entries that were deleted; they are now in our own pending
            # list, where the next scan finds them (empty) and dead-letters them.
            self._recovered = False
        claimed = [
            (_str(i), f, True) for i, f in entries if i is not None and _str(i) not in self._outstanding
        ]
        if claimed:
            log.warning("%s: claimed %d entries idle > %d ms", self.key, len(claimed), self.claim_idle_ms)
        return claimed

    def _screen(self, entries: list[_Raw], screen: Screen[R] | None) -> list[tuple[str, R, bool]]:
        """Decode entries; move the malformed and the refused out of the stream."""
        accepted: list[tuple[str, R, bool]] = []
        rejects: list[Reject] = []
        if self._acked_ids and (again := [e[0] for e in entries if e[0] in self._acked_ids]):
            # Acked before a Redis restart lost the ack: never hand it out again, ack it again.
            log.warning(
                "%s: %d entries acked before a Redis restart came back; acking again", self.key, len(again)
            )
            self._ack(again)
            entries = [e for e in entries if e[0] not in self._acked_ids]
        for entry_id, fields, redelivered in entries:
            fields = fields or {}  # Redis 7 answers nil for a pending entry deleted from the stream
            payload = fields.get(FIELD, b"")
            try:
                record = self.decode(self._payload(fields))
            except SchemaError as e:
                rejects.append(Reject(entry_id, payload, str(e), "dead"))
                continue
            verdict = screen(record) if screen else None
            if verdict:
                rejects.append(Reject(entry_id, payload, verdict[1], verdict[0]))
            else:
                accepted.append((entry_id, record, redelivered))
        if rejects:
            self._move(rejects)
        return accepted

    def _payload(self, fields: dict[bytes, bytes]) -> bytes:
        if not fields:
            raise SchemaError("entry", "deleted from the stream before it was acknowledged")
        if FIELD not in fields:
            raise SchemaError("entry", f"no {FIELD!r} field (fields: {sorted(fields)[:5]})")
        payload = fields[FIELD]
        if len(payload) > self.max_bytes:
            raise SchemaError("entry", f"{len(payload)} bytes exceeds the limit of {self.max_bytes}")
        return payload

    def _move(self, rejects: list[Reject]) -> None:
        """Dead-letter (or stale-letter) entries, ack and delete them, and count them: one transaction."""
        pipe = self.client.pipeline(transaction=True)
        queue_moves(pipe, self.key, self.group, self.counts_key, rejects)
        if self.on_reject is not None:  # the trajectories' admission refund
            self.on_reject(pipe, len(rejects))
        pipe.execute()

    # ---------------------------------------------------------------------------------------- state

    def length(self) -> int:
        """Unconsumed entries (undelivered + pending), exact because ack deletes."""
        return int(self.client.xlen(self.key))

    def pending(self) -> int:
        return int(self._with_group(self.client.xpending, self.key, self.group)["pending"])

    def trim(self) -> int:
        """XTRIM MINID up to the oldest entry the group still needs (pending, or the first undelivered)."""
        info = self._with_group(self.client.xinfo_groups, self.key)
        group = next(g for g in info if _str(g["name"]) == self.group)
        keep_from = _successor(_str(group["last-delivered-id"]))
        pending = self.client.xpending(self.key, self.group)
        if pending["pending"]:
            keep_from = min(keep_from, _str(pending["min"]), key=lambda i: tuple(map(int, i.split("-"))))
        return int(self.client.xtrim(self.key, minid=keep_from, approximate=False))
