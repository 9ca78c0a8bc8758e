"""Phase timers: ``with timers("time/generate"): ...`` adds the span to that phase's total.

Every process reports where its time goes as ``time/<phase>`` seconds (the rollout loop per logged
batch, the learner per step); the placement planner fits its laws to these (docs/design.md §11.2).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager


class Timers(defaultdict):
    """Seconds spent in each named phase since the last :meth:`clear`."""

    def __init__(self) -> None:
        super().__init__(float)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self[name] += time.perf_counter() - start
