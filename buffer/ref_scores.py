"""Reference log-probabilities scored beside the stream, by a worker of their own (``placement.reference:
own``, docs/design.md §11.1).

The reference worker reads ``{run}:traj`` through a consumer group of its own, ``"reference"``: Redis gives
every group every entry, so it scores each trajectory as soon as a server appends it, while the learner's
group still holds it in the queue. It writes log π_ref of the response tokens to the hash
``{run}:ref_logp``, keyed by the entry's stream id, and acknowledges the entry to its own group only (XACK
without XDEL: the entry is the learner's to delete). The learner fills each taken trajectory's ``ref_logp``
from the hash, waiting for any not yet scored.

- **Exactly once is the learner's**, unchanged: the worker never deletes, and scoring an entry twice writes
  the same numbers twice (a frozen model, no sampling).
- **A crash of the worker** leaves its read-but-unscored entries pending in its group; its next life reads
  its own pending entries first. The hash write and the group's ack are one transaction, so Redis keeps
  both or neither.
- **Cleaning up.** A field outlives its entry only until the learner's next checkpoint: every entry older
  than the stream's oldest is gone (trained and acked, or dead-lettered), and so are its scores
  (:meth:`RefScores.drop_gone`).

Values are float32 little-endian, one per response token (0 on environment tokens, as the learner's mask).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import redis

from buffer.group_stream import create_group

GROUP = "reference"  # the worker's consumer group on {run}:traj
CONSUMER = "reference"  # one worker: its pending entries survive its restarts under this name
POLL_S = 0.005  # the learner's re-read of scores still missing


def scores_key(run: str) -> str:
    return f"{run}:ref_logp"


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


class RefScores:
    """The ``{run}:ref_logp`` hash: written by the reference worker, read and dropped by the learner."""

    def __init__(self, client: redis.Redis, run: str) -> None:
        self.client, self.run, self.key = client, run, scores_key(run)
        self.traj_key = f"{run}:traj"

    # --------------------------------------------------------------------------------- worker side

    def ensure_group(self) -> None:
        """The worker's group, from the stream's start (idempotent): entries appended before it existed
        are scored too."""
        create_group(self.client, self.traj_key, GROUP)

    def read(self, count: int, block_ms: int, *, pending: bool) -> list[tuple[str, bytes | None]]:
        """Up to ``count`` entries as (id, payload): the worker's own pending entries (``pending``; an
        earlier life read them and died before scoring) or new ones, waiting up to ``block_ms``. A payload
        is None for an entry the learner deleted meanwhile."""
        cursor = "0" if pending else ">"
        got = self.client.xreadgroup(
            GROUP, CONSUMER, {self.traj_key: cursor}, count=count, block=None if pending else block_ms
        )
        out = []
        for _, entries in got or ():
            for entry_id, fields in entries:
                i = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                out.append((i, (fields or {}).get(b"d")))
        return out

    def write(self, scored: Sequence[tuple[str, np.ndarray]], done: Sequence[str]) -> None:
        """Store each ``(entry id, ref_logp)`` and acknowledge ``done`` (the scored ids and any the worker
        skipped) to the worker's group: one transaction."""
        pipe = self.client.pipeline(transaction=True)
        if scored:
            pipe.hset(self.key, mapping={i: np.asarray(v, dtype="<f4").tobytes() for i, v in scored})
        if done:
            pipe.xack(self.traj_key, GROUP, *done)
        pipe.execute()

    # -------------------------------------------------------------------------------- learner side

    def fetch(self, ids: Sequence[str]) -> dict[str, np.ndarray]:
        """The scores present now for ``ids`` (the missing ones are absent)."""
        if not ids:
            return {}
        values = self.client.hmget(self.key, list(ids))
        # None is missing; b"" is an empty response's scores.
        return {
            i: np.frombuffer(v, dtype="<f4").copy() for i, v in zip(ids, values, strict=True) if v is not None
        }

    def wait(
        self, ids: Sequence[str], *, timeout_s: float, stop: Callable[[], bool] = lambda: False
    ) -> dict[str, np.ndarray] | None:
        """Every id's scores, polling until the worker has written them; None when ``stop`` says so first.
        Raises TimeoutError after ``timeout_s`` naming how many are missing."""
        deadline = time.monotonic() + timeout_s
        have = self.fetch(ids)
        while len(have) < len(ids):
            if stop():
                return None
            if time.monotonic() > deadline:
                missing = [i for i in ids if i not in have]
                raise TimeoutError(
                    f"{len(missing)} of {len(ids)} trajectories (e.g. {missing[0]}) have no reference "
                    f"log-probabilities after {timeout_s:g}s: placement.reference=own has a reference "
                    "worker score them; is it running (logs/reference.log)?"
                )
            time.sleep(POLL_S)
            have |= self.fetch([i for i in ids if i not in have])
        return have

    def drop_gone(self) -> int:
        """Delete the scores of entries no longer in the stream (older than its oldest): trained and acked,
        or dead-lettered. Returns how many."""
        # The fields first, then the oldest entry: a field written after this read is never dropped, and
        # one read here whose entry is still in the stream is at or after the oldest entry.
        fields = [f.decode() if isinstance(f, bytes) else f for f in self.client.hkeys(self.key)]
        first = self.client.xrange(self.traj_key, count=1)
        if first:
            oldest = _id_key(first[0][0].decode() if isinstance(first[0][0], bytes) else first[0][0])
            fields = [f for f in fields if _id_key(f) < oldest]
        if fields:
            self.client.hdel(self.key, *fields)
        return len(fields)

    def pending(self) -> int:
        """Entries the worker read and has not scored yet (its group's pending count)."""
        try:
            return int(self.client.xpending(self.traj_key, GROUP)["pending"])
        except redis.ResponseError:  # no group yet
            return 0
