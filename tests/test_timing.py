"""tandem/timing.py: a span's seconds are set on exit, raise or not; phase totals add up across threads;
waits run from each item's own moment."""

from __future__ import annotations

import threading
import time

import pytest

from tandem.timing import Timers, Waits, timed


def test_timed_sets_the_span_on_exit_even_when_the_block_raises() -> None:
    with timed() as span:
        assert span.seconds == 0.0  # not before the block is over
        time.sleep(0.02)
    assert 0.02 <= span.seconds < 5.0
    with pytest.raises(ValueError), timed() as failed:
        time.sleep(0.01)
        raise ValueError("boom")
    assert failed.seconds >= 0.01


def test_timers_add_every_span_and_take_clears() -> None:
    timers = Timers()
    spans = []

    def work() -> None:
        for _ in range(50):
            with timed() as span:
                pass
            timers.add("time/a", span.seconds)
            spans.append(span.seconds)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with pytest.raises(RuntimeError), timers("time/b"):
        raise RuntimeError  # a phase that fails still spent its time
    got = timers.take()
    assert got["time/a"] == pytest.approx(sum(spans)) and len(spans) == 200
    assert got["time/b"] > 0.0
    assert not timers and timers["time/c"] == 0.0  # cleared; an unseen phase reads 0


def test_waits_run_from_each_moment_to_now_and_take_clears_but_totals_run_on() -> None:
    waits = Waits()
    now = time.perf_counter()
    waits.since([now - 2.0, now - 0.5])
    first = waits.take()
    assert len(first) == 2 and 2.0 <= first[0] < 3.0 and 0.5 <= first[1] < 1.5
    assert waits.take() == []  # cleared
    waits.since([time.perf_counter() - 1.0])
    (again,) = waits.take()
    assert waits.count == 3 and waits.total_s == pytest.approx(sum(first) + again)
