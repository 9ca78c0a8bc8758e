"""The weight-sync boundary: a Publisher on learner rank 0, a Subscriber on each rollout server (docs/design.md §5).

Transports subclass :class:`Publisher` (it owns the frame of ``publish``) and implement the
:class:`Subscriber` Protocol on :class:`BaseSubscriber`, and pass the same tests; ``Config.weight_path`` chooses one:
``shm``, ``dist``, or ``engine`` (the learner pushes into vLLM/SGLang, ``weightsync/engine_push.py``). An :class:`Update` is what a subscriber hands to an engine's ``update_weights``: the version, the
manifest and an iterator of ``(name, tensor)`` in manifest order.

This module also owns the control plane both transports share, all under ``{run}:weights:``:

- ``latest``           the newest version a subscriber can fetch (shm: files in place; dist: offered);
- ``announce``         pub/sub channel, one message per version (a wake-up only: the keys are the truth);
- ``writing``, ``progress:{token}``  shm only: the version being written and its finished byte ranges;
- ``subs``             set of subscriber ids that registered;
- ``sub:{id}``         the version that subscriber holds, with a TTL refreshed by its polls (heartbeat):
                       a subscriber whose key expired is not live, so it neither pins old versions (shm)
                       nor is waited for (dist).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import msgpack
import redis
import torch
from safetensors import safe_open


class WeightSyncError(RuntimeError):
    """A failed or timed-out sync; the message names the peer and the version."""


class PeersMissing(WeightSyncError):
    """Raised by a dist publish after it delivered the version to every peer that did join.

    ``peers`` registered but did not join within the timeout; they are deregistered, so the next publish
    does not wait for them again. A learner may log this and carry on.
    """

    def __init__(self, message: str, version: int, peers: list[str]) -> None:
        super().__init__(message)
        self.version = version
        self.peers = peers


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32", "bfloat16"
    shape: tuple[int, ...]
    checksum: str | None = (
        None  # "<algo>:<hex digest>" of the raw bytes (shm); None where the transport has none
    )


@dataclass
class Update:
    """One version of the actor's weights, ready to apply.

    ``tensors()`` yields ``(name, tensor)`` in manifest order. The tensors are read-only views into the
    subscriber's receive buffers, valid until that subscriber's next ``poll()``: copy them (an engine's
    ``update_weights`` copies into its parameters). With ``dist`` the tensors arrive while you iterate (the
    broadcast is collective), so iterate promptly, and ``manifest`` fills as they arrive.
    """

    version: int
    manifest: list[TensorMeta]
    _iter: Callable[[], Iterator[tuple[str, torch.Tensor]]] = field(repr=False)
    # Where the weights also exist as a HF-loadable directory (shm); lets vLLM/SGLang reload from disk.
    path: str | None = None

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._iter()

    @classmethod
    def from_directory(cls, path: str, version: int) -> Update:
        """The weights of a HF directory (a shm version, a checkpoint) as ``version``, read lazily: what a
        woken engine reloads when no newer version arrived while it slept."""
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise WeightSyncError(f"{path} holds no *.safetensors files to wake the engine with (v{version})")

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for f in files:
                with safe_open(str(f), framework="pt") as sf:
                    for name in sf.keys():  # noqa: SIM118 (safe_open has no __iter__)
                        yield name, sf.get_tensor(name)

        return cls(version, [], tensors, path=path)


# Queues writes on the publisher's own announce transaction, given the version: the learner's
# ``Admission.queue_version``, so the version that opens admission is set with the weights' announcement.
Announce = Callable[[redis.client.Pipeline, int], None]


class Publisher:
    """Sends each version from learner rank 0; every transport's publisher is one of these.

    The frame of ``publish`` is shared: the tensors are consumed to the end whatever happens, and a version
    is announced only once it has reached every subscriber. A transport implements :meth:`_send`.
    """

    def publish(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        announce: Announce | None = None,
    ) -> None:
        """Send one version. Returns when every live subscriber can read it (shm) or has received it (dist).

        ``named_tensors`` is always consumed to the end, even on error, so a ZeRO-3 gather that every rank
        iterates stays matched. A publisher may keep a yielded tensor until its shard or bucket is written.
        ``announce`` runs inside the transaction that announces the version once it has reached every
        subscriber; not when publish raises.
        """
        it = iter(named_tensors)
        try:
            pipe = self._send(it, version)
        finally:
            for _ in it:
                pass
        if pipe is None:
            return
        if announce is not None:
            announce(pipe, version)
        pipe.execute()
        self._announced(version)

    def _send(self, it: Iterator[tuple[str, torch.Tensor]], version: int) -> redis.client.Pipeline | None:
        """Deliver the version; returns a transaction holding the writes that announce it (None: nothing
        to announce). Raises on failure; ``publish`` then drains what ``it`` has left."""
        raise NotImplementedError

    def _announced(self, version: int) -> None:
        """After the announcement's transaction ran."""

    def trim(self, *, held_too: bool = False) -> None:
        """Free now what no live subscriber holds and the transport need not keep; with ``held_too``, the
        versions the subscribers hold as well. A run that releases memory calls it while it waits for a
        batch, and with ``held_too`` once it has one: its servers then sleep with their weights released
        until the next version, which the learner is about to make (docs/placement.md §11.1). Only ``shm``
        keeps anything to free."""

    def joiners_waiting(self) -> bool:
        """Whether a subscriber that holds no version waits for one: the learner then publishes its current
        weights again (docs/design.md §5.7). Only ``dist`` subscribers ask; the others answer False."""
        return False

    def close(self) -> None:
        pass


class Subscriber(Protocol):
    server_id: str

    @property
    def version(self) -> int:
        """The version last handed out by ``poll`` (-1 before the first)."""
        ...

    def latest_version(self) -> int:
        """The newest version available to fetch (-1 if none): one Redis GET."""
        ...

    def poll(self, timeout: float = 0.0) -> Update | None:
        """The newest version above ``version``, or None if none arrived within ``timeout`` s.

        Handing out an Update makes its version this subscriber's; the registry (GC, the console) names it
        once ``applied`` says the caller holds it, or at the latest at the next poll.
        """
        ...

    def applied(self) -> None:
        """The caller holds the version handed out last: the one before may be retired."""
        ...

    def release(self) -> None:
        """Let go of what the transport keeps for fast reloads (``shm``: its mappings of the files), for a
        server that sleeps while the learner trains. The next ``poll`` maps afresh."""
        ...

    def close(self) -> None: ...


# ------------------------------------------------------------------------------------------ control plane


def weights_key(run: str, *parts: object) -> str:
    return ":".join([run, "weights", *map(str, parts)])


def latest_version(client: redis.Redis, run: str) -> int:
    raw = client.get(weights_key(run, "latest"))
    return int(raw) if raw is not None else -1


def announce(pipe: redis.client.Pipeline, run: str, version: int) -> None:
    """Queue ``latest = version`` and the wake-up message on a pipeline (the caller executes it)."""
    pipe.set(weights_key(run, "latest"), version)
    pipe.publish(weights_key(run, "announce"), version)


class Registry:
    """Who subscribes and which version each holds; liveness is a key TTL refreshed by heartbeats."""

    def __init__(self, client: redis.Redis, run: str, live_s: float) -> None:
        self.client = client
        self.run = run
        self.live_ms = max(1, int(live_s * 1000))

    def heartbeat(self, server_id: str, version: int) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.sadd(weights_key(self.run, "subs"), server_id)
        pipe.set(weights_key(self.run, "sub", server_id), msgpack.packb(version), px=self.live_ms)
        pipe.execute()

    def leave(self, server_id: str) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.srem(weights_key(self.run, "subs"), server_id)
        pipe.delete(weights_key(self.run, "sub", server_id))
        pipe.execute()

    def live(self) -> dict[str, int]:
        """``{server_id: held version}`` of live subscribers; forgets the ones whose heartbeat expired."""
        ids = sorted(m.decode() for m in self.client.smembers(weights_key(self.run, "subs")))
        if not ids:
            return {}
        held = self.client.mget([weights_key(self.run, "sub", i) for i in ids])
        dead = [i for i, h in zip(ids, held, strict=True) if h is None]
        if dead:
            self.client.srem(weights_key(self.run, "subs"), *dead)
        return {i: msgpack.unpackb(h) for i, h in zip(ids, held, strict=True) if h is not None}


class Announcements:
    """Blocks until the next ``announce`` message or a deadline; callers re-check Redis keys after waking."""

    # Pub/sub may drop a message on reconnect; waking at least this often bounds the cost of a lost one.
    MAX_NAP_S = 0.5

    def __init__(self, client: redis.Redis, run: str) -> None:
        self._pubsub = client.pubsub(ignore_subscribe_messages=True)
        self._pubsub.subscribe(weights_key(run, "announce"))

    def wait(self, seconds: float) -> None:
        if seconds > 0:
            self._pubsub.get_message(timeout=min(seconds, self.MAX_NAP_S))

    def close(self) -> None:
        with contextlib.suppress(redis.RedisError):
            self._pubsub.close()


class Heartbeat:
    """Rate-limited :meth:`Registry.heartbeat` so a server may poll every decode step cheaply."""

    def __init__(self, registry: Registry, server_id: str, every_s: float) -> None:
        self.registry = registry
        self.server_id = server_id
        self.every_s = every_s
        self._last = -float("inf")

    def __call__(self, version: int, *, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last >= self.every_s:
            self.registry.heartbeat(self.server_id, version)
            self._last = now


# ------------------------------------------------------------------------------- what subscribers share


class BaseSubscriber:
    """A subscriber's identity, the version it holds, and the run's ``latest`` key."""

    def __init__(self, client: redis.Redis, run: str, server_id: str) -> None:
        self.client = client
        self.run = run
        self.server_id = server_id
        self._version = -1

    @property
    def version(self) -> int:
        return self._version

    def latest_version(self) -> int:
        return latest_version(self.client, self.run)

    def applied(self) -> None:
        """The caller applied the version handed out last and no longer reads the views of the one before
        (a publisher that rewrites retired files in place may now retire it)."""

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


class RegisteredSubscriber(BaseSubscriber):
    """A subscriber the publisher counts: registered at once, its heartbeat refreshed by its polls, woken by
    announcements, deregistered on ``close``."""

    def __init__(
        self, client: redis.Redis, run: str, server_id: str, *, live_s: float, heartbeat_s: float
    ) -> None:
        super().__init__(client, run, server_id)
        self._heartbeat = Heartbeat(Registry(client, run, live_s), server_id, heartbeat_s)
        self._announcements = Announcements(client, run)
        self._heartbeat(self._version, force=True)

    def close(self) -> None:
        self._announcements.close()
        with contextlib.suppress(redis.RedisError):
            self._heartbeat.registry.leave(self.server_id)


WAIT_POLL_S = 1.0  # longest single poll of an applying wait, so a stop and a moving target are re-checked


def wait_for(
    sub: Subscriber,
    min_version: int | Callable[[], int],
    timeout: float,
    *,
    run: str,
    apply: Callable[[Update], None] | None = None,
    held: Callable[[], int] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> Update | None:
    """Block until ``sub`` hands out a version ≥ ``min_version``: a rollout server's "weights first".

    Returns None at once if the subscriber already holds such a version. Raises WeightSyncError naming
    the run's learner (the only publisher) and the version if none arrives within ``timeout`` s.

    With ``apply`` (a rollout server's engine), every version handed out meanwhile is applied at once,
    newer weights sooner, until ``held()`` (the engine's version; ``sub.version`` by default) reaches
    ``min_version``, which may be a callable re-read at each poll (a target that moves: the learner's
    version). Returns None, also when ``should_stop()`` turns true first (the caller checks which).
    """
    if apply is not None:
        _wait_applying(sub, min_version, timeout, run, apply, held or (lambda: sub.version), should_stop)
        return None
    assert isinstance(min_version, int), "a moving target needs apply"
    deadline = time.monotonic() + timeout
    while sub.version < min_version and (left := deadline - time.monotonic()) > 0:
        if sub.latest_version() < min_version:
            time.sleep(min(left, 0.05))  # a GET per nap: never hand out (and so record) an older version
            continue
        upd = sub.poll(timeout=left)
        if upd is not None:
            return upd
    if sub.version >= min_version:
        return None
    raise WeightSyncError(
        f"{sub.server_id}: no weights version >= {min_version} from the learner of run {run!r} "
        f"within {timeout:.1f}s (latest available: {sub.latest_version()})"
    )


def _wait_applying(
    sub: Subscriber,
    target: int | Callable[[], int],
    timeout: float,
    run: str,
    apply: Callable[[Update], None],
    held: Callable[[], int],
    should_stop: Callable[[], bool] | None,
) -> None:
    need_now = target if callable(target) else lambda: target
    deadline = time.monotonic() + timeout
    while held() < (need := need_now()):
        if should_stop is not None and should_stop():
            return
        if (left := deadline - time.monotonic()) <= 0:
            raise WeightSyncError(
                f"{sub.server_id}: holds weights v{held()} but needs >= v{need}; no new version arrived "
                f"from the learner of run {run!r} within {timeout:g}s. Is the learner publishing?"
            )
        if (upd := sub.poll(min(WAIT_POLL_S, left))) is not None:
            apply(upd)
