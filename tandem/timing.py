"""Spans of wall time: ``with timed() as span: ...`` sets ``span.seconds`` on exit, and phase timers,
``with timers("time/generate"): ...``, add the span to that phase's total.

Every process reports where its time goes as ``time/<phase>`` seconds (the rollout loop per logged
batch, the learner per step); the placement planner fits its laws to these (docs/placement.md §11.2).
:class:`BusyClock` measures the union of overlapping spans (a rollout server's engine busy time), and
:class:`Waits` how long each of many items waited between two moments (a group between its last sample and
its append).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class Span:
    seconds: float = 0.0  # set when the ``with`` block exits, whether or not it raised


@contextmanager
def timed() -> Iterator[Span]:
    """Measure the ``with`` block: its :class:`Span` holds the seconds it took once it is over."""
    span = Span()
    start = time.perf_counter()
    try:
        yield span
    finally:
        span.seconds = time.perf_counter() - start


class Timers(defaultdict):
    """Seconds spent in each named phase since the last :meth:`clear` (or :meth:`take`); several threads
    may time phases at once."""

    def __init__(self) -> None:
        super().__init__(float)
        self._lock = threading.Lock()

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        try:
            with timed() as span:
                yield
        finally:
            self.add(name, span.seconds)

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self[name] += seconds

    def take(self) -> dict[str, float]:
        """The totals so far, cleared in the same step (a phase ending meanwhile counts in the next)."""
        with self._lock:
            out = dict(self)
            self.clear()
        return out


class BusyClock:
    """Wall time during which at least one generation runs (``with clock:`` around each engine call)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._busy = 0.0
        self._since = self._lap_at = time.perf_counter()

    def __enter__(self) -> BusyClock:
        with self._lock:
            if self._running == 0:
                self._since = time.perf_counter()
            self._running += 1
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._running -= 1
            if self._running == 0:
                self._busy += time.perf_counter() - self._since

    def lap(self) -> tuple[float, float]:
        """(busy seconds, wall seconds) since the last lap."""
        with self._lock:
            now = time.perf_counter()
            busy = self._busy + (now - self._since if self._running else 0.0)
            wall = now - self._lap_at
            self._busy, self._since, self._lap_at = 0.0, now, now
        return busy, wall


class Waits:
    """Seconds each item waited, from the moment it was ready (``time.perf_counter()``) to :meth:`since`'s
    call: several threads add, the logger takes. ``total_s`` and ``count`` run over the object's life."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds: list[float] = []
        self.total_s, self.count = 0.0, 0

    def since(self, ready: list[float]) -> None:
        """Record, for each moment in ``ready``, the seconds from it to now."""
        now = time.perf_counter()
        waited = [now - t for t in ready]
        with self._lock:
            self._seconds += waited
            self.total_s += sum(waited)
            self.count += len(waited)

    def take(self) -> list[float]:
        """The waits recorded since the last take, cleared in the same step."""
        with self._lock:
            out, self._seconds = self._seconds, []
        return out
