"""The weights a rollout server's engine holds, and every change to them (docs/design.md §1.3, §5, docs/placement.md §11.1).

Several threads want new weights: the loop before a batch, the engine's decode steps (in-flight
updates), an episode between turns, the admission wait. One :class:`EngineWeights` serves them all, one
poll-and-apply at a time:

- **the freshness rule** (:meth:`EngineWeights.ensure_fresh`): before a batch, hold
  ``version >= learner version - max_staleness``, blocking on the subscriber if not, so
  ``max_staleness = 0`` is exactly the synchronous algorithm;
- **in-flight updates** (:meth:`EngineWeights.poll_inflight`): a cheap, throttled poll between decode
  steps (PipelineRL); later tokens carry the new version;
- **colocated sleep and wake** (``placement.release_memory``): while admission is closed the learner
  trains, so the engine frees its memory (:meth:`EngineWeights.sleep_while_waiting`) and wakes for the
  next version in vLLM's order, weights, then the update, then the KV cache.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rollout.engines.base import Engine
from rollout.metrics import ServerMetrics
from tandem.config import Config
from tandem.timing import Timers, timed
from weightsync.base import Subscriber, Update, wait_for

log = logging.getLogger(__name__)

INFLIGHT_POLL_S = 0.05  # how often the decode loop asks the subscriber for a new version


class EngineWeights:
    """The engine's weights: applied from the subscriber, kept fresh, released and restored."""

    def __init__(
        self,
        cfg: Config,
        engine: Engine,
        subscriber: Subscriber,
        *,
        metrics: ServerMetrics,
        timers: Timers,
        should_stop: Callable[[], bool],
        idle: Callable[[], bool],
        server_index: int,
        release_also: Callable[[], None] | None = None,
    ) -> None:
        """``idle``: no batch is generating (the engine may sleep); ``timers`` takes ``time/weight_sync``,
        ``time/sleep`` and ``time/wake``; ``release_also`` frees another model's memory with the engine's
        (the server's reference, which comes back when it next scores)."""
        self.cfg, self.engine, self.subscriber = cfg, engine, subscriber
        self.metrics, self.timers, self.should_stop, self.idle = metrics, timers, should_stop, idle
        self.server_index, self.release_also = server_index, release_also
        self.lock = threading.Lock()  # one poll-and-apply at a time (main and generation threads)
        self._last_poll = 0.0
        self.release = cfg.releases_memory and getattr(engine, "supports_sleep", False)
        self.asleep = False  # the engine's memory is freed until the next version (colocated runs)
        self.held_path = cfg.model.actor  # where the weights the engine holds can be read again

    def ensure_fresh(self, floor: Callable[[], int]) -> bool:
        """Apply any pending update, then block until ``version >= floor()`` (admission's freshness floor).

        The learner publishes version v before it sets the Redis version to v, so this never deadlocks.
        False only when a stop was requested while waiting. An update applied here while other batches
        generate is an in-flight update for them (their later tokens carry its version).
        """
        with timed() as span, self.lock:
            self.apply(self.subscriber.poll(0.0))
            self.wait_for(floor, self.cfg.weightsync.timeout_s)
            if self.should_stop() and self.engine.version < floor():
                return False  # a stop's wait is no weight sync
            self.wake_held()
        self.timers.add("time/weight_sync", span.seconds)
        return True

    def wait_for(self, version: Callable[[], int], timeout_s: float) -> None:
        """Apply every version the subscriber hands out until the engine holds ``version()`` (re-read at
        each poll); returns early on a stop, raises WeightSyncError after ``timeout_s``."""
        wait_for(
            self.subscriber,
            version,
            timeout_s,
            run=self.cfg.run.name,
            apply=self.apply,
            held=lambda: self.engine.version,
            should_stop=self.should_stop,
        )

    def apply(self, update: Update | None) -> None:
        """The one path every weight update takes (between batches and in flight): apply, time, count."""
        if update is None:
            return
        with timed() as span:
            if self.asleep:
                self._wake(update)
            else:
                self.engine.update_weights(update)
            self.subscriber.applied()  # the previous version's files may be retired now
            self.held_path = update.path or self.held_path
        self.metrics.weight_update_seconds.observe(span.seconds)
        log.info("server-%d: weights v%d applied in %.3fs", self.server_index, update.version, span.seconds)

    def poll(self, *, block: bool = True) -> None:
        """Apply a new version if one is on offer, without waiting for one. ``block=False``: not at all
        while another thread polls (it applies whatever is on offer)."""
        with timed() as span:
            if not self.lock.acquire(blocking=block):
                return
            try:
                self.apply(self.subscriber.poll(0.0))
            finally:
                self.lock.release()
        self.timers.add("time/weight_sync", span.seconds)

    def poll_inflight(self) -> None:
        """The engine's ``between_steps`` hook: a cheap, throttled poll for a new version mid-generation.
        Never waits on another thread's poll: that one may be applying an update that waits for this very
        generation's decode step (``hf``)."""
        now = time.perf_counter()
        if now - self._last_poll >= INFLIGHT_POLL_S:
            self._last_poll = now
            self.poll(block=False)

    @contextmanager
    def held(self) -> Iterator[None]:
        """The weights held now, awake, and no update applied until the block ends (an evaluation)."""
        with self.lock:
            self.wake_held()
            yield

    # ------------------------------------------------------------- colocated: sleep and wake (§11.1)

    def sleep_while_waiting(self) -> None:
        """The admission wait's hook: take weights on offer; then, colocated with ``placement.release_memory``,
        free the engine's memory until admission reopens, since the learner trains meanwhile. An engine
        asleep takes no weights here: it wakes for the next batch (:meth:`ensure_fresh`), once admitted, so
        never while the learner still holds its training states (it opens admission after offloading them)."""
        if self.asleep:
            return
        self.poll()
        if self.release and not self.asleep and self.idle():
            with self.timers("time/sleep"):
                self.engine.sleep()
                if self.release_also is not None:
                    self.release_also()
                self.subscriber.release()  # its mappings would pin files the learner now deletes
                self.asleep = True

    def wake_held(self) -> None:
        """Wake with the version the engine held: admission reopened for it (a group dropped, a server gone)
        before a newer one arrived. Its files are still in shm, which keeps every version a live server holds
        (docs/design.md §5.3); before any update, the checkpoint the engine was loaded from. Unless the
        learner freed them while it trains (``Publisher.trim(held_too=True)``, §11.1): then the next
        version, which that training makes, wakes the engine."""
        if not self.asleep:
            return
        if not any(Path(self.held_path).glob("*.safetensors")):
            held = self.engine.version
            self.wait_for(lambda: held + 1, self.cfg.weightsync.timeout_s)
            return
        self.apply(Update.from_directory(self.held_path, self.engine.version))

    def _wake(self, update: Update) -> None:
        """Wake for ``update`` in vLLM's order: weights, then the update fills them, then the KV cache (so
        the cache is never allocated beside a second copy of the weights). ``time/wake`` excludes the update."""
        with timed() as weights:
            self.engine.wake_up(["weights"])
        self.engine.update_weights(update)
        with timed() as kv_cache:
            self.engine.wake_up(["kv_cache"])
            self.asleep = False
        self.timers.add("time/wake", weights.seconds + kv_cache.seconds)
