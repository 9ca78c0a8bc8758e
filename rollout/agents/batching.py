"""The engine front of agents' calls and independent episodes' turns (docs/environments.md §10.9).

Every agent episode calls the API on its own, one request at a time, and every independent episode sends
its own turns. :class:`BatchingEngine` stands between them and the engine and applies the run's rules to
each call: the run's sampling where it says so (``sampling``: the learner scores the tokens at the run's
temperature, whatever an agent asks), a cap on ``max_new_tokens``, and the run's hooks, which apply
weight updates between decode steps (in flight) and between batches.

An engine whose running batch takes in concurrent calls (``Engine.continuous_batching``: vLLM's and
SGLang's schedulers, the hf engine's :mod:`~rollout.engines.hf_batch`) gets each call at once: queueing it
would hold a call that is ready until the batch before it is done. The run's between-batches hook then
runs before each call, one caller at a time.

For an engine that decodes each call on its own, the front gathers: a call waits in a queue; a worker
thread takes every call that arrives within ``gather_s`` of the first, and runs those with the same
sampling settings as one engine call (``n`` of each kept), handing each caller its rows. Calls that
arrive meanwhile form the next batch. A caller's ``between_steps`` hook (the API's client-disconnect
check) runs on every decode step of its batch, and every ``WAIT_POLL_S`` while the caller waits; one that
raises drops that caller only (it gets the hook's exception, and a call still queued is withdrawn), and
the batch goes on while any caller still waits. So a caller that is gone never waits on an engine that
has stopped taking steps. A streamed call (``on_token``) goes to the engine directly.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from rollout.engines.base import BetweenSteps, Completion, Engine, EngineExited, OnToken, SamplingParams
from weightsync.base import Update

log = logging.getLogger(__name__)

WAIT_POLL_S = 0.2  # how often a waiting caller's own hook is asked whether it is still there


class _AllGone(Exception):
    """Every caller of a batch went away: the rest of its decoding is dropped."""


@dataclass
class _Call:
    prompts: list[list[int]]
    sampling: SamplingParams
    between_steps: BetweenSteps | None
    done: threading.Event = field(default_factory=threading.Event)
    out: list[list[Completion]] | None = None
    error: BaseException | None = None

    def key(self) -> tuple[object, ...]:
        s = self.sampling
        return (
            s.n,
            s.max_new_tokens,
            s.temperature,
            s.top_p,
            s.top_k,
            tuple(s.stop_token_ids),
            tuple(s.stop),
            s.seed,
            s.constraint,  # a constrained call is never batched with a free one
        )

    def finish(self, out: list[list[Completion]] | None = None, error: BaseException | None = None) -> None:
        if not self.done.is_set():
            self.out, self.error = out, error
            self.done.set()


class BatchingEngine:
    """An :class:`~rollout.engines.base.Engine` front that gathers concurrent calls into batches."""

    continuous_batching = True  # concurrent calls through the front share engine calls

    def __init__(
        self,
        engine: Engine,
        *,
        gather_s: float,
        between_steps: BetweenSteps | None = None,
        between_batches: Callable[[], None] | None = None,
        sampling: dict[str, Any] | None = None,
        max_new_tokens: int | None = None,
    ) -> None:
        self.engine, self.gather_s, self.hook = engine, gather_s, between_steps
        self.between_batches, self.override, self.max_new_tokens = (
            between_batches,
            sampling or {},
            max_new_tokens,
        )
        self.batches = self.calls = 0  # engine calls made, and the agents' calls they served
        # The engine's process died under a call: its callers heard of it as a failed call, and the
        # runner ends the rollout loop with it, since no later call can succeed (rollout/engines/base.py).
        self.exited: EngineExited | None = None
        self._queue: list[_Call] = []
        self._cv = threading.Condition()
        self._closed = False
        self._direct = engine.continuous_batching
        self._hook_lock = threading.Lock()
        self._worker = threading.Thread(target=self._run, name="agent-batcher", daemon=True)
        self._worker.start()

    @property
    def version(self) -> int:
        return self.engine.version

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        *,
        between_steps: BetweenSteps | None = None,
        on_token: OnToken | None = None,
    ) -> list[list[Completion]]:
        if on_token is not None:
            return self.engine.generate(prompts, sampling, between_steps=between_steps, on_token=on_token)
        sampling = replace(sampling, **self.override)
        if self.max_new_tokens is not None and sampling.max_new_tokens > self.max_new_tokens:
            sampling = replace(sampling, max_new_tokens=self.max_new_tokens)
        if self._direct:
            return self._generate_now(prompts, sampling, between_steps)
        call = _Call([list(p) for p in prompts], sampling, between_steps)
        with self._cv:
            if self._closed:
                raise RuntimeError("the agents' engine front is closed")
            self._queue.append(call)
            self._cv.notify()
        self._wait(call)
        if call.error is not None:
            raise call.error
        assert call.out is not None
        return call.out

    def _wait(self, call: _Call) -> None:
        """Wait for ``call``, asking its own hook every ``WAIT_POLL_S``: a caller that is gone (its client
        disconnected, its episode timed out) stops waiting even while the engine takes no step at all (a
        hung batch ahead of it), and a call still queued is withdrawn."""
        while not call.done.wait(WAIT_POLL_S):
            if call.between_steps is None:
                continue
            try:
                call.between_steps()
            except Exception as e:
                with self._cv:
                    if call in self._queue:
                        self._queue.remove(call)
                call.finish(error=e)

    def update_weights(self, update: Update) -> None:
        self.engine.update_weights(update)

    def pause(self) -> None:
        self.engine.pause()

    def resume(self) -> None:
        self.engine.resume()

    def close(self) -> None:
        """Stop the worker (the engine itself belongs to the server); calls still queued fail."""
        with self._cv:
            self._closed = True
            pending, self._queue = self._queue, []
            self._cv.notify()
        for call in pending:
            call.finish(error=RuntimeError("the agents' engine front is closed"))
        self._worker.join(timeout=30)

    def _generate_now(
        self, prompts: list[list[int]], sampling: SamplingParams, between_steps: BetweenSteps | None
    ) -> list[list[Completion]]:
        """One call straight into an engine that batches concurrent calls itself."""
        if self._closed:
            raise RuntimeError("the agents' engine front is closed")
        if self.between_batches is not None:
            with self._hook_lock:
                self.between_batches()

        def hooks() -> None:
            if self.hook is not None:
                self.hook()
            if between_steps is not None:
                between_steps()

        with self._hook_lock:
            self.batches += 1
            self.calls += 1
        try:
            return self.engine.generate([list(p) for p in prompts], sampling, between_steps=hooks)
        except EngineExited as e:
            self.exited = e
            raise

    # ------------------------------------------------------------------------------------------- worker

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
            time.sleep(self.gather_s)  # let the other agents' calls of this moment arrive
            if self.between_batches is not None:
                try:
                    self.between_batches()  # a weight update lands between two batches
                except Exception:
                    log.exception("agents' engine front: between_batches failed")
            with self._cv:
                calls, self._queue = self._queue, []
            groups: dict[tuple[object, ...], list[_Call]] = {}
            for call in calls:
                groups.setdefault(call.key(), []).append(call)
            for group in groups.values():
                self._serve(group)

    def _serve(self, group: list[_Call]) -> None:
        try:
            self._batch(group)
        except ValueError as e:  # the engine refused a prompt (too long): serve each call alone to say whose
            if len(group) == 1:
                group[0].finish(error=e)
                return
            for call in group:
                if not call.done.is_set():
                    self._serve([call])

    def _batch(self, group: list[_Call]) -> None:
        live = list(group)

        def between_steps() -> None:
            if self.hook is not None:
                self.hook()
            for call in list(live):
                if call.between_steps is None:
                    continue
                try:
                    call.between_steps()
                except Exception as e:  # this caller is gone; the others' rows go on
                    live.remove(call)
                    call.finish(error=e)
            if not live:
                raise _AllGone

        prompts = [p for call in group for p in call.prompts]
        self.batches += 1
        self.calls += len(group)
        try:
            out = self.engine.generate(prompts, group[0].sampling, between_steps=between_steps)
        except _AllGone:
            return
        except ValueError:
            raise
        except Exception as e:  # the engine failed: every caller hears of it
            if isinstance(e, EngineExited):
                self.exited = e
            for call in group:
                call.finish(error=e)
            return
        at = 0
        for call in group:
            call.finish(out[at : at + len(call.prompts)])
            at += len(call.prompts)
