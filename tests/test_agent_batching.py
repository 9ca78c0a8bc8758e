"""The agents' engine front (``rollout/agents/batching.py``, docs/environments.md §10.9): concurrent calls share
one engine call, and a caller that is gone stops waiting even when the engine takes no step."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rollout.agents.batching import WAIT_POLL_S, BatchingEngine
from rollout.engines.base import EngineExited, SamplingParams
from rollout.engines.hf import HFEngine


class Gone(Exception):
    """The caller's client went away."""


@pytest.fixture(scope="module")
def hf(tiny_ckpt: dict[str, Path]) -> HFEngine:
    return HFEngine(str(tiny_ckpt["actor"]), device="cpu", seed=0)


def test_concurrent_calls_share_one_engine_call_and_each_gets_its_rows(hf: HFEngine) -> None:
    """The front's gathering path, for an engine that decodes each call on its own. The hf engine batches
    concurrent calls itself, so it is told that it does not; the front must then make one call of three."""
    hf.continuous_batching = False
    front = BatchingEngine(hf, gather_s=0.2)
    sampling = SamplingParams(n=2, max_new_tokens=4, temperature=0.0)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    try:
        with ThreadPoolExecutor(3) as pool:
            outs = list(pool.map(lambda p: front.generate([p], sampling), prompts))
    finally:
        front.close()
        del hf.continuous_batching  # the class's again
    assert (front.batches, front.calls) == (1, 3)
    for p, out in zip(prompts, outs, strict=True):
        (alone,) = hf.generate([p], sampling)  # greedy: the same rows as in the shared call
        assert [c.token_ids for c in out[0]] == [c.token_ids for c in alone]


class HungEngine:
    """An engine whose every call blocks until released, taking no decode step meanwhile."""

    continuous_batching = False
    version = 0

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def generate(self, prompts, sampling, **kw):
        self.calls += 1
        self.release.wait(30)
        raise RuntimeError("released")


def test_a_caller_that_is_gone_stops_waiting_on_a_hung_engine_and_leaves_the_queue() -> None:
    engine = HungEngine()
    front = BatchingEngine(engine, gather_s=0.0)
    sampling = SamplingParams(max_new_tokens=4)
    gone = threading.Event()

    def hook() -> None:
        if gone.is_set():
            raise Gone

    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(front.generate, [[1, 2]], sampling)  # the engine hangs in this one
            while engine.calls == 0:
                time.sleep(0.01)
            second = pool.submit(front.generate, [[3, 4]], sampling, between_steps=hook)  # queued behind it
            time.sleep(2 * WAIT_POLL_S)
            assert not second.done()
            gone.set()
            t0 = time.monotonic()
            with pytest.raises(Gone):
                second.result(timeout=5)
            assert time.monotonic() - t0 < 5 * WAIT_POLL_S
            assert front._queue == []  # withdrawn: the engine never sees it
            engine.release.set()
            with pytest.raises(RuntimeError, match="released"):
                first.result(timeout=5)
    finally:
        engine.release.set()
        front.close()
    assert engine.calls == 1


class DeadEngine:
    """An engine whose process has died (``exited``) or whose call failed, on every call."""

    version = 0

    def __init__(self, continuous_batching: bool, error: Exception) -> None:
        self.continuous_batching, self.error = continuous_batching, error

    def generate(self, prompts, sampling, **kw):
        raise self.error


@pytest.mark.parametrize("continuous_batching", [True, False], ids=["direct", "gathered"])
def test_the_front_remembers_an_engine_whose_process_died(continuous_batching: bool) -> None:
    """Its caller hears of it like any failed call; the front keeps it so the runner can end the loop."""
    sampling = SamplingParams(max_new_tokens=4)
    for error, kept in ((RuntimeError("one bad call"), False), (EngineExited("code -9"), True)):
        front = BatchingEngine(DeadEngine(continuous_batching, error), gather_s=0.0)
        try:
            with pytest.raises(type(error)):
                front.generate([[1, 2]], sampling)
        finally:
            front.close()
        assert (front.exited is error) is kept and (front.exited is None) is not kept
