"""The ``dist`` transport: a torch.distributed broadcast from learner rank 0 to the rollout servers.

The group is private to weight sync: a ``TCPStore`` served by the publisher and a ``ProcessGroupGloo`` /
``ProcessGroupNCCL`` built directly on it (the StatelessProcessGroup approach of vLLM), so it never touches
the learner's default DeepSpeed group. gloo on CPU, NCCL on GPU (``weightsync.backend``).

Join protocol, one group per *round* ``(version, seq)`` (so servers may come, go and die between rounds)::

    publisher (learner rank 0)                       subscriber (each rollout server)
    ─────────────────────────                        ────────────────────────────────
    expected = live registered subscribers           heartbeat {run}:weights:sub:{id} on every poll
      (a repeat of the last version: those in want)
    SET offer {v, round, host, port, backend}        poll sees offer v > held version, round not tried
    announce v
    BLPOP join:{round} until every expected id       RPUSH join:{round} id
      joined or timeout_s (the missing are
      deregistered)
    SET go {v, round, ids in rank order}; announce   wait for go of round (timeout_s); absent from it,
                                                     or go already names a newer round: too late, poll
                                                     returns None
    ProcessGroup(PrefixStore(round), 0, 1 + n)       ProcessGroup(PrefixStore(round), rank, 1 + n)
    per bucket: broadcast [header_len, payload_len], header (msgpack: name, dtype, shape, offset), payload
    broadcast [0, 0]: end of version                 the Update's tensors() yields as buckets arrive

**Joiners get the current version at once** (docs/design.md §5.7). A subscriber that holds no version yet
and finds no offer it can join adds itself to ``{run}:weights:want``; the learner checks
:meth:`DistPublisher.joiners_waiting` between steps and while it waits for data, and publishes its current
weights again. A repeat of the version it last published is offered to the wanting subscribers only
(everyone else already holds it), in a new round, so nobody mistakes it for the round they came too late to.

A registered server that does not join within ``timeout_s`` makes ``publish`` raise
:class:`~weightsync.base.PeersMissing` naming it, after the others received the version; a peer that dies
mid-broadcast fails the broadcast within ``timeout_s`` with the version and the group's peers named.

Because the broadcast is collective, iterate ``Update.tensors()`` promptly and to the end: a stream left
unfinished is drained by the next ``poll``, and the learner waits at most ``timeout_s`` for it. Run
``poll`` where it is not stuck behind a long generation call (a thread, or between decode steps).
Tensors are bucketed (``bucket_mb``) to amortise per-collective latency; a tensor larger than a bucket is
sent from its own memory. Receive buffers are reused across versions, hence "valid until the next poll".
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Iterator
from datetime import timedelta

import msgpack
import redis
import torch
import torch.distributed as dist

from tandem.net import local_address
from weightsync.base import (
    PeersMissing,
    Publisher,
    RegisteredSubscriber,
    Registry,
    TensorMeta,
    Update,
    WeightSyncError,
    weights_key,
)
from weightsync.base import announce as announce_latest

log = logging.getLogger(__name__)

ALIGN = 16  # bucket offsets are aligned so every dtype can be viewed in place
TORCH_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


def resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def default_host() -> str:
    """Address the servers reach the learner at: $TANDEM_WEIGHTSYNC_HOST, else the learner's MASTER_ADDR."""
    return os.environ.get("TANDEM_WEIGHTSYNC_HOST") or os.environ.get("MASTER_ADDR") or "127.0.0.1"


def bound_store(host: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """The master side of a ``TCPStore`` that listens on ``host`` only (``port`` 0: a free one).

    A master ``TCPStore`` listens on every interface, and torch 2.13's constructor takes no bind address;
    it does take a listening socket (``master_listen_fd``), which it then owns and closes.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        port = sock.getsockname()[1]
        store = dist.TCPStore(
            host, port, None, True, timeout, wait_for_workers=False, master_listen_fd=sock.fileno()
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store closes it
    return store


def _new_group(store: dist.Store, rank: int, world: int, backend: str, host: str, timeout_s: float):
    """A process group on ``store`` only; rendezvous (waiting for every rank) happens here."""
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(store, rank, world, opts)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world, opts)


def _broadcast(group, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    group.broadcast([tensor], opts).wait()  # bounded by the group's timeout (weightsync.timeout_s)


def _shutdown(group) -> None:
    with contextlib.suppress(RuntimeError):
        group.shutdown()


def _prefix(rnd: list[int] | tuple[int, ...]) -> str:
    """The store prefix of one round's group: a repeat of a version rendezvous afresh."""
    return f"v{rnd[0]}.{rnd[1]}"


def _round(offer: dict) -> tuple[int, int]:
    return tuple(offer.get("round") or (offer["version"], 0))


def _device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def forget_dead_publisher(client: redis.Redis, run: str) -> None:
    """Before a learner (re)starts: its servers must not join a crashed learner's last offer. Its store is
    gone (a connect would wait out ``weightsync.timeout_s``) and its ``go`` names versions past the
    checkpoint (joiners of the resumed versions would think they came too late). The new learner offers
    afresh."""
    client.delete(weights_key(run, "offer"), weights_key(run, "go"))


# ---------------------------------------------------------------------------------------------- publisher


class DistPublisher(Publisher):
    """Serves the rendezvous store and broadcasts each version to the subscribers that join it."""

    def __init__(
        self,
        client: redis.Redis,
        run: str,
        *,
        backend: str = "auto",
        bucket_bytes: int = 256 << 20,
        timeout_s: float = 300.0,
        live_s: float = 300.0,
        host: str | None = None,
    ) -> None:
        self.client = client
        self.run = run
        self.backend = resolve_backend(backend)
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.host = host or default_host()
        self.registry = Registry(client, run, live_s)
        self.device = _device(self.backend)
        # On the address the servers dial, not every interface (its clients are the run's servers only).
        self._store = bound_store(self.host, 0, timedelta(seconds=timeout_s))
        self._bucket: torch.Tensor | None = None
        self._seq = 0  # rounds published, so a repeat of a version gets keys of its own
        self._last_version: int | None = None

    def joiners_waiting(self) -> bool:
        """Whether a subscriber holding no version waits for one (publish the current weights again)."""
        return self._last_version is not None and bool(self.client.scard(weights_key(self.run, "want")))

    def close(self) -> None:
        self._bucket = None
        self._store = None

    def _send(self, it: Iterator[tuple[str, torch.Tensor]], version: int) -> redis.client.Pipeline:
        """Offer, await the joiners, broadcast. ``latest`` went out with the offer; the caller's announce
        follows in a transaction of its own, once every live subscriber holds the version."""
        self._deliver(it, version)
        return self.client.pipeline()

    def _deliver(self, it: Iterator[tuple[str, torch.Tensor]], version: int) -> None:
        live = self.registry.live()
        want = weights_key(self.run, "want")
        wanting = {m.decode() for m in self.client.smembers(want)}
        if wanting - set(live):
            self.client.srem(want, *(wanting - set(live)))  # died while waiting
        # A repeat of the last version serves the joiners only: everyone else holds it already.
        expected = [s for s in live if s in wanting] if version == self._last_version else list(live)
        if version == self._last_version and not expected:
            return
        self._seq += 1
        rnd = [version, self._seq]
        offer = {
            "version": version,
            "round": rnd,
            "host": self.host,
            "port": self._store.port,
            "backend": self.backend,
        }
        self.client.delete(weights_key(self.run, "join", *rnd))
        pipe = self.client.pipeline()
        pipe.set(weights_key(self.run, "offer"), msgpack.packb(offer))
        announce_latest(pipe, self.run, version)
        pipe.execute()

        joined = self._await_joiners(rnd, expected)
        missing = sorted(set(expected) - set(joined))
        for peer in missing:
            self.registry.leave(peer)
        pipe = self.client.pipeline()
        # One key, overwritten per round: a server reading an old offer learns at once it came too late.
        pipe.set(
            weights_key(self.run, "go"), msgpack.packb({"version": version, "round": rnd, "ranks": joined})
        )
        pipe.publish(weights_key(self.run, "announce"), version)
        if joined or missing:
            pipe.srem(want, *joined, *missing)
        pipe.execute()
        self._last_version = version
        if joined:
            self._broadcast_version(it, rnd, joined)
        if missing:
            raise PeersMissing(
                f"dist v{version}: subscriber(s) {missing} registered but did not join within "
                f"{self.timeout_s:.1f}s; sent to {joined} and deregistered the missing",
                version,
                missing,
            )

    def _await_joiners(self, rnd: list[int], expected: list[str]) -> list[str]:
        """Who joined round ``rnd``; drops from ``expected`` (in place) the subscribers that left meanwhile."""
        key = weights_key(self.run, "join", *rnd)
        joined: list[str] = []
        deadline = time.monotonic() + self.timeout_s
        while not set(expected) <= set(joined) and (left := deadline - time.monotonic()) > 0:
            item = self.client.blpop([key], timeout=min(left, 1.0))
            if item is not None and item[1].decode() not in joined:
                joined.append(item[1].decode())
            elif item is None:  # a server that left cleanly meanwhile deregistered: stop waiting for it
                live = self.registry.live()
                expected[:] = [e for e in expected if e in live or e in joined]
        while (item := self.client.lpop(key)) is not None:  # those who joined meanwhile come along
            if item.decode() not in joined:
                joined.append(item.decode())
        return joined

    def _broadcast_version(
        self, it: Iterator[tuple[str, torch.Tensor]], rnd: list[int], peers: list[str]
    ) -> None:
        version = rnd[0]
        where = f"dist v{version} to {peers} via {self.host}:{self._store.port}"
        store = dist.PrefixStore(_prefix(rnd), self._store)
        try:
            group = _new_group(store, 0, 1 + len(peers), self.backend, self.host, self.timeout_s)
        except (RuntimeError, dist.DistError) as e:
            raise WeightSyncError(f"{where}: rendezvous failed within {self.timeout_s:.1f}s: {e}") from e
        try:
            for header, payload in self._buckets(it):
                _broadcast(group, torch.tensor([len(header), payload.numel()], device=self.device))
                _broadcast(group, torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self.device))
                _broadcast(group, payload)
            _broadcast(group, torch.zeros(2, dtype=torch.int64, device=self.device))
        except (RuntimeError, dist.DistError) as e:
            raise WeightSyncError(f"{where}: broadcast failed (timeout {self.timeout_s:.1f}s): {e}") from e
        finally:
            _shutdown(group)

    def _buckets(self, it: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[bytes, torch.Tensor]]:
        """``(msgpack header, uint8 payload)`` per bucket; the bucket buffer is reused once broadcast."""
        if self._bucket is None:
            self._bucket = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.device)
        entries: list[list] = []
        used = 0
        for name, tensor in it:
            t = tensor.detach().to(self.device).contiguous()
            data = t.reshape(-1).view(torch.uint8)
            meta = [name, str(t.dtype).removeprefix("torch."), list(t.shape)]
            if t.nbytes > self.bucket_bytes:  # too big to pack: send it from its own memory
                if entries:
                    yield msgpack.packb(entries), self._bucket[:used]
                    entries, used = [], 0
                yield msgpack.packb([[*meta, 0, t.nbytes]]), data
                continue
            offset = -(-used // ALIGN) * ALIGN
            if offset + t.nbytes > self.bucket_bytes:
                yield msgpack.packb(entries), self._bucket[:used]
                entries, offset = [], 0
            self._bucket[offset : offset + t.nbytes].copy_(data)
            entries.append([*meta, offset, t.nbytes])
            used = offset + t.nbytes
        if entries:
            yield msgpack.packb(entries), self._bucket[:used]


# --------------------------------------------------------------------------------------------- subscriber


class DistSubscriber(RegisteredSubscriber):
    """Joins the group of each new version and receives it bucket by bucket."""

    def __init__(
        self,
        client: redis.Redis,
        run: str,
        server_id: str,
        *,
        timeout_s: float = 300.0,
        live_s: float = 300.0,
        heartbeat_s: float = 1.0,
    ) -> None:
        super().__init__(client, run, server_id, live_s=live_s, heartbeat_s=heartbeat_s)
        self.timeout_s = timeout_s
        self._skipped: set[tuple[int, int]] = set()  # rounds tried: each is joined at most once
        self._stream: Iterator[tuple[str, torch.Tensor]] | None = None
        self._stores: dict[tuple[str, int], dist.TCPStore] = {}
        self._buffers: list[torch.Tensor] = []  # receive buffer per bucket index, reused across versions

    def poll(self, timeout: float = 0.0) -> Update | None:
        self._drain()
        deadline = time.monotonic() + timeout
        while True:
            self._heartbeat(self._version)
            raw = self.client.get(weights_key(self.run, "offer"))
            offer = msgpack.unpackb(raw) if raw is not None else None
            if offer is not None and offer["version"] > self._version and _round(offer) not in self._skipped:
                upd = self._join(offer)
                if upd is not None:
                    return upd
            elif offer is not None and self._version < 0:
                # Holding nothing and nothing to join: ask the learner to publish its weights again.
                self.client.sadd(weights_key(self.run, "want"), self.server_id)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._announcements.wait(left)

    def close(self) -> None:
        self._drain()
        self._stores.clear()
        super().close()

    def _drain(self) -> None:
        """Finish a stream the caller left unconsumed (the publisher is blocked on it); not applied."""
        if self._stream is not None:
            log.warning("%s: an update was not consumed before the next poll; draining it", self.server_id)
            self._stream.close()

    def _join(self, offer: dict) -> Update | None:
        v, host, port, rnd = offer["version"], offer["host"], offer["port"], _round(offer)
        publisher = f"publisher {host}:{port}"
        if self._started(rnd):
            # The round began before this process asked to join. Its ranks may still name this server: an
            # earlier incarnation that crashed and was restarted. That rendezvous is over; ask for a new one.
            self._skipped.add(rnd)
            log.info(
                "%s: dist v%d had started before this process joined; waiting for a new round",
                self.server_id,
                v,
            )
            return None
        pipe = self.client.pipeline()
        pipe.rpush(weights_key(self.run, "join", *rnd), self.server_id)
        pipe.pexpire(weights_key(self.run, "join", *rnd), int(self.timeout_s * 4000))
        pipe.execute()
        ranks = self._await_go(rnd)
        self._skipped.add(rnd)  # whatever happens next, this round is not joined twice
        if ranks is None:
            raise WeightSyncError(
                f"{self.server_id}: {publisher} did not start dist v{v} within {self.timeout_s:.1f}s"
            )
        if self.server_id not in ranks:
            log.info("%s: joined dist v%d too late; waiting for the next version", self.server_id, v)
            return None
        rank, world = 1 + ranks.index(self.server_id), 1 + len(ranks)
        try:
            store = self._store(host, port)
            group = _new_group(
                dist.PrefixStore(_prefix(rnd), store),
                rank,
                world,
                offer["backend"],
                local_address(host),
                self.timeout_s,
            )
        except (RuntimeError, dist.DistError) as e:
            self._stores.pop((host, port), None)  # the publisher may have restarted elsewhere
            raise WeightSyncError(
                f"{self.server_id}: rendezvous for dist v{v} with {publisher} failed within {self.timeout_s:.1f}s: {e}"
            ) from e
        manifest: list[TensorMeta] = []
        stream = _Stream(self, group, v, publisher, manifest, _device(offer["backend"]))
        self._stream = stream
        return Update(v, manifest, stream.tensors)

    def _go(self) -> dict | None:
        """The newest round's start signal (its round and rank order), or None before any round started."""
        raw = self.client.get(weights_key(self.run, "go"))
        return msgpack.unpackb(raw) if raw is not None else None

    def _started(self, rnd: tuple[int, int]) -> bool:
        return (go := self._go()) is not None and _round(go) >= rnd

    def _await_go(self, rnd: tuple[int, int]) -> list[str] | None:
        """The rank order of round ``rnd`` ([] if a newer round has started), or None on timeout."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            if (go := self._go()) is not None and _round(go) >= rnd:
                return go["ranks"] if _round(go) == rnd else []
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._heartbeat(self._version)
            self._announcements.wait(left)

    def _store(self, host: str, port: int) -> dist.TCPStore:
        if (host, port) not in self._stores:
            self._stores[(host, port)] = dist.TCPStore(
                host, port, None, False, timedelta(seconds=self.timeout_s), wait_for_workers=False
            )
        return self._stores[(host, port)]

    def _buffer(self, index: int, size: int, device: torch.device) -> torch.Tensor:
        if index == len(self._buffers):
            self._buffers.append(torch.empty(0, dtype=torch.uint8, device=device))
        if self._buffers[index].numel() < size or self._buffers[index].device != device:
            self._buffers[index] = torch.empty(size, dtype=torch.uint8, device=device)
        return self._buffers[index][:size]


class _Stream:
    """One version arriving bucket by bucket; the subscriber holds the version once it was all yielded."""

    def __init__(
        self,
        sub: DistSubscriber,
        group,
        version: int,
        publisher: str,
        manifest: list[TensorMeta],
        device: torch.device,
    ) -> None:
        self.sub, self.group, self.version, self.publisher = sub, group, version, publisher
        self.manifest, self.device = manifest, device
        self._index = 0
        self._open = True

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        if not self._open:
            raise WeightSyncError(f"{self.sub.server_id}: dist v{self.version} can be iterated only once")
        try:
            while (bucket := self._next_bucket()) is not None:
                for meta, tensor in bucket:
                    self.manifest.append(meta)
                    yield meta.name, tensor
        except GeneratorExit:
            self.close()  # the caller stopped early: finish the collective, do not claim the version
            raise
        self._finish(held=True)

    def close(self) -> None:
        """Receive and drop whatever is left, so the publisher's broadcast completes."""
        if self._open:
            while self._next_bucket() is not None:
                pass
            self._finish(held=False)

    def _finish(self, *, held: bool) -> None:
        self._open = False
        _shutdown(self.group)
        self.sub._stream = None
        if held:
            self.sub._version = self.version
            self.sub._heartbeat(self.version, force=True)

    def _next_bucket(self) -> list[tuple[TensorMeta, torch.Tensor]] | None:
        try:
            sizes = torch.empty(2, dtype=torch.int64, device=self.device)
            _broadcast(self.group, sizes)
            header_len, payload_len = sizes.tolist()
            if header_len == 0:
                return None
            header = torch.empty(header_len, dtype=torch.uint8, device=self.device)
            _broadcast(self.group, header)
            payload = self.sub._buffer(self._index, payload_len, self.device)
            _broadcast(self.group, payload)
        except (RuntimeError, dist.DistError) as e:
            self._open = False
            _shutdown(self.group)
            self.sub._stream = None
            raise WeightSyncError(
                f"{self.sub.server_id}: dist v{self.version} from {self.publisher} failed "
                f"(timeout {self.sub.timeout_s:.1f}s): {e}"
            ) from e
        self._index += 1
        return [
            (
                TensorMeta(name, dtype, tuple(shape)),
                payload[offset : offset + nbytes].view(TORCH_DTYPES[dtype]).view(shape),
            )
            for name, dtype, shape, offset, nbytes in msgpack.unpackb(header.cpu().numpy().tobytes())
        ]
