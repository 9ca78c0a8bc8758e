"""Acked ranges: an exact, compact record of the stream ids a checkpoint lineage trained (docs/design.md §6.7).

Stream ids are ``ms-seq`` pairs, ordered as pairs. A range ``(lo, hi)`` stands for *every* id from ``lo``
to ``hi``, including ids that never existed or no longer exist in the stream: XACK and XDEL of such an id
cost nothing. So two ranges can be joined across any gap that holds no entry the learner must still train:
what keeps them apart is a *barrier*, an entry present in the stream (undelivered or pending) that is not a
member. The learner reads the stream nearly in order, so a whole lineage of checkpoints collapses to a
handful of ranges, split only where an entry was still waiting when the checkpoint was taken.

Pure functions on ``StreamId`` tuples; ``parse``/``fmt`` convert from and to Redis' text form, and
``to_json``/``from_json`` to what ``learner.json`` stores.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence

StreamId = tuple[int, int]  # (milliseconds, sequence)
Range = tuple[StreamId, StreamId]  # inclusive


def parse(entry_id: str | bytes) -> StreamId:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    if not ms.isdigit() or not seq.isdigit():
        raise ValueError(f"not a stream id: {text!r} (want 'ms-seq')")
    return int(ms), int(seq)


def fmt(sid: StreamId) -> str:
    return f"{sid[0]}-{sid[1]}"


def merge(ranges: Iterable[Range], ids: Iterable[StreamId], barriers: Iterable[StreamId] = ()) -> list[Range]:
    """The fewest sorted, disjoint ranges covering ``ranges`` and ``ids`` and no barrier.

    A barrier already covered by ``ranges`` or ``ids`` is a member, not a barrier (ranges are the record's
    own word: a resurrected entry inside one was trained).
    """
    spans = sorted([*ranges, *((i, i) for i in ids)])
    unioned: list[list[StreamId]] = []
    for lo, hi in spans:
        if lo > hi:
            raise ValueError(f"range {fmt(lo)}..{fmt(hi)} is empty")
        if unioned and lo <= unioned[-1][1]:
            unioned[-1][1] = max(unioned[-1][1], hi)
        else:
            unioned.append([lo, hi])
    walls = sorted(set(barriers))  # one inside a range never lies *between* two: no filter needed
    out: list[Range] = []
    for lo, hi in unioned:
        # Join with the previous range unless a barrier lies strictly between its end and this start.
        if out and bisect_right(walls, out[-1][1]) == bisect_left(walls, lo):
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def contains(ranges: Sequence[Range], sid: StreamId) -> bool:
    """Whether ``sid`` lies in one of ``ranges`` (sorted and disjoint, as ``merge`` returns)."""
    i = bisect_right(ranges, (sid, (float("inf"), 0))) - 1
    return i >= 0 and ranges[i][0] <= sid <= ranges[i][1]


def to_json(ranges: Sequence[Range]) -> list[list[str]]:
    return [[fmt(lo), fmt(hi)] for lo, hi in ranges]


def from_json(raw: Sequence[Sequence[str]]) -> list[Range]:
    """Ranges as ``to_json`` wrote them; refuses any that are not sorted, disjoint and non-empty."""
    ranges = [(parse(lo), parse(hi)) for lo, hi in raw]
    for i, (lo, hi) in enumerate(ranges):
        if lo > hi or (i and ranges[i - 1][1] >= lo):
            raise ValueError(f"acked ranges: {fmt(lo)}..{fmt(hi)} is empty or out of order")
    return ranges
