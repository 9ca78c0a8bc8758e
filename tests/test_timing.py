"""tandem/timing.py: a span's seconds are set on exit, raise or not; phase totals add up across threads."""

from __future__ import annotations

import threading
import time

import pytest

from tandem.timing import Timers, timed


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
