"""Entries a stream refuses to hand out, moved aside for inspection (docs/design.md §6).

An entry that fails :mod:`buffer.schema` goes to ``{key}:dead``; a trajectory staler than ``max_staleness``
goes to ``{key}:stale``, a separate stream because it is valid data and the two counts mean different
things. Both are acknowledged in the same transaction that moves them, counted exactly in the run's
``{run}:counts`` hash (field ``{key}:{kind}``), and capped (approximately) at ``DEAD_MAXLEN`` entries.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis

log = logging.getLogger(__name__)

DEAD_MAXLEN = 10_000  # entries kept in each dead-letter / stale stream (approximate MAXLEN)
DEAD_PAYLOAD_BYTES = 64 << 10  # payload prefix kept with a dead letter


@dataclass
class Reject:
    id: str
    payload: bytes
    reason: str
    kind: str  # "dead" | "stale": the suffix of the stream it moves to and its counter


def letters_key(key: str, kind: str) -> str:
    """The stream that ``kind`` letters of stream ``key`` move to, and their field in the counts hash."""
    return f"{key}:{kind}"


def queue_moves(
    pipe: redis.client.Pipeline, key: str, group: str, counts_key: str, rejects: list[Reject]
) -> None:
    """Queue on ``pipe`` (a transaction): each entry's letter and count, then its ack and delete."""
    for r in rejects:
        log.warning("%s: %s entry %s: %s", key, r.kind, r.id, r.reason)
        fields = {
            "reason": r.reason,
            "id": r.id,
            "size": len(r.payload),
            "data": r.payload[:DEAD_PAYLOAD_BYTES],
        }
        pipe.xadd(letters_key(key, r.kind), fields, maxlen=DEAD_MAXLEN, approximate=True)
        pipe.hincrby(counts_key, letters_key(key, r.kind), 1)
    ids = [r.id for r in rejects]
    pipe.xack(key, group, *ids)
    pipe.xdel(key, *ids)
