"""Learner side of the ``dist`` weight path into vLLM and SGLang servers: one Publisher feeds a mix of both.

The split (docs/design.md §5.5, docs/engines.md §5). An engine receives weights inside its own worker processes, through its own NCCL
group, while its HTTP ``update`` route blocks; so the sender must drive that route and broadcast at the same
time. :class:`EnginePublisher` (learner rank 0) therefore owns the whole update sequence against each
engine's control URL, pause and resume included. The rollout server's adapter never touches the data: with
``update.path`` None it only confirms the engine reports the new version and records it
(``VLLMEngine/SGLangEngine.update_weights``). :class:`EngineVersionSubscriber` is the Subscriber such a server
polls; it reads the shared ``{run}:weights:latest`` key, which the publisher announces after each update.

Discovery. Each rollout server registers ``{server_index, kind, url, world_size}`` (JSON, never pickle) in the
hash ``{run}:engines:servers`` (:func:`register_engine`). At each ``publish`` the publisher forms one group per
engine kind from the servers it has not met yet: learner rank 0, then each server's workers at a rank offset
(``1, 1+w0, 1+w0+w1, ...``), world size ``1 + Σ w``. A server that registers later gets its own group at the
next publish, so servers may join during a run; a failed update drops that group and raises, and its
surviving members are re-grouped at the next publish.

Per engine (API facts read from the vLLM 0.33.0 and SGLang 0.5.23 sources, checked by ``tests/test_engines_contract.py``):

- vLLM 0.33.0 (``--weight-transfer-config '{"backend": "nccl"}'``): ``/init_weight_transfer_engine
  {init_info: {master_address, master_port, rank_offset, world_size, packed: false}}`` while the learner opens
  ``vllm.distributed.weight_transfer.nccl_common.trainer_init`` (a ``PyNcclCommunicator`` over vLLM's
  ``StatelessProcessGroup``; so the learner needs ``vllm`` importable, i.e. ``.venv-vllm``). Each update:
  ``/pause?mode=`` → ``/start_weight_update`` → per bucket ``/update_weights {update_info: {names,
  dtype_names, shapes}}`` + one broadcast per tensor → ``/finish_weight_update {weight_version}`` →
  ``/reset_prefix_cache`` → ``/resume``. Unpacked mode: the engine receives tensor by tensor, so a bucket
  bounds how much the learner holds, not how the engine receives.
- SGLang 0.5.23: ``/init_weights_update_group {master_address, master_port, rank_offset, world_size,
  group_name, backend}`` while the learner joins with :func:`init_custom_process_group` (a copy of SGLang's, so
  the learner needs only torch). Each update: ``/pause_generation {mode}`` → ``/begin_weight_update`` → per
  bucket ``/update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache: false}`` + one
  broadcast per tensor → ``/end_weight_update`` → ``/update_weight_version`` → ``/flush_cache`` (skipped for
  ``in_place``, which keeps the KV) → ``/continue_generation``.

ZeRO-3: ``publish`` consumes ``named_tensors`` lazily and copies each tensor into the current bucket before
asking for the next, so a generator that gathers one parameter at a time inside
``deepspeed.zero.GatheredParameters`` (on every rank; only rank 0 calls ``publish``) holds one parameter plus
one bucket. Timeouts: every HTTP call has one; a gloo/torch group has the process-group timeout; a PyNccl
broadcast cannot be interrupted, but the engine's HTTP reply (which fails first when a server dies) is
awaited with a timeout and named in the error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit

import redis
import torch

from tandem.config import Config
from tandem.net import EngineClient, EngineHTTPError, free_port, local_address, to_json
from weightsync.base import BaseSubscriber, Publisher, TensorMeta, Update, WeightSyncError
from weightsync.base import announce as announce_latest

EngineKind = Literal["vllm", "sglang"]


def servers_key(run: str) -> str:
    return f"{run}:engines:servers"


@dataclasses.dataclass(frozen=True)
class EngineEndpoint:
    """What a rollout server registers so the learner can feed its engine."""

    server_index: int
    kind: EngineKind
    url: str  # the engine's control URL (VLLMEngine.url / SGLangEngine.url)
    world_size: int  # ranks it adds to the group (VLLMEngine.world_size() / SGLangEngine.world_size())


def register_engine(client: redis.Redis, run: str, endpoint: EngineEndpoint) -> None:
    client.hset(servers_key(run), str(endpoint.server_index), json.dumps(dataclasses.asdict(endpoint)))


def unregister_engine(client: redis.Redis, run: str, server_index: int) -> None:
    client.hdel(servers_key(run), str(server_index))


def registered_engines(client: redis.Redis, run: str) -> list[EngineEndpoint]:
    rows = client.hgetall(servers_key(run))
    return sorted((EngineEndpoint(**json.loads(v)) for v in rows.values()), key=lambda e: e.server_index)


# ----------------------------------------------------------------------------------- learner-side groups


class Broadcaster(Protocol):
    """The learner's end (rank 0) of one weight-transfer group."""

    def broadcast(self, tensor: torch.Tensor) -> None: ...

    def synchronize(self) -> None: ...

    def close(self) -> None: ...


def init_custom_process_group(
    backend: str, init_method: str, timeout: timedelta, world_size: int, rank: int, group_name: str
) -> Any:
    """A torch.distributed group outside the default one, rendezvousing exactly like SGLang's engine side.

    Copy of ``sglang.srt.utils.common.init_custom_process_group`` (SGLang 0.5.23): the store is wrapped in
    ``PrefixStore(group_name, ...)``, so a plain ``new_group`` would never meet the engine's ranks.
    """
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    if rank == 0 and init_method.startswith("tcp://"):
        # The master's store listens on the address the engines dial only, not on every interface.
        from weightsync.dist import bound_store

        where = urlsplit(init_method)
        store = bound_store(where.hostname or "127.0.0.1", where.port or 0, timeout)
    else:
        store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        store,
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class TorchGroup:
    """SGLang's group: torch.distributed (nccl on GPU; gloo is allowed and is what CPU tests use)."""

    def __init__(
        self, address: str, port: int, world_size: int, *, backend: str, group_name: str, timeout: float
    ) -> None:
        self.pg = init_custom_process_group(
            backend, f"tcp://{address}:{port}", timedelta(seconds=timeout), world_size, 0, group_name
        )
        self._pending: list[Any] = []

    def broadcast(self, tensor: torch.Tensor) -> None:
        # The engine receives with async_op=True per tensor; matching async sends keep the bucket pipelined.
        self._pending.append(torch.distributed.broadcast(tensor, src=0, group=self.pg, async_op=True))

    def synchronize(self) -> None:
        for work in self._pending:
            work.wait()  # bounded by the group's timeout, set at creation
        self._pending.clear()

    def close(self) -> None:
        torch.distributed.destroy_process_group(self.pg)


class PyNcclGroup:
    """vLLM's group: ``PyNcclCommunicator`` over ``StatelessProcessGroup`` (needs vllm and a CUDA device)."""

    def __init__(self, address: str, port: int, world_size: int) -> None:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        info = {"master_address": address, "master_port": port, "world_size": world_size}
        self.comm = trainer_init(info, rank=0)

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.comm.broadcast(tensor, src=0, stream=torch.cuda.current_stream())

    def synchronize(self) -> None:
        torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        self.comm.destroy()


OpenGroup = Callable[[EngineKind, str, int, int, str], Broadcaster]


# ----------------------------------------------------------------------------------- per-engine routes


@dataclasses.dataclass(frozen=True)
class GroupRendezvous:
    """Where a server's ranks join the trainer's group and which ranks they take: what both engines'
    group-init requests start with."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int


@dataclasses.dataclass(frozen=True)
class VLLMInitInfo(GroupRendezvous):
    """``vllm.distributed.weight_transfer.nccl_common.NCCLWeightTransferInitInfo`` (the fields we send)."""

    packed: bool


@dataclasses.dataclass(frozen=True)
class VLLMUpdateInfo:
    """``vllm.distributed.weight_transfer.nccl_engine.NCCLWeightTransferUpdateInfo``."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


@dataclasses.dataclass(frozen=True)
class SGLangInitGroup(GroupRendezvous):
    """``sglang.srt.managers.io_struct.InitWeightsUpdateGroupReqInput``."""

    group_name: str
    backend: str


@dataclasses.dataclass(frozen=True)
class SGLangDistUpdate:
    """``sglang.srt.managers.io_struct.UpdateWeightsFromDistributedReqInput`` (the fields we send)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str
    flush_cache: bool


def tensor_columns(metas: list[TensorMeta]) -> tuple[list[str], list[str], list[list[int]]]:
    """A bucket's names, dtypes and shapes, the three lists both engines' update requests carry."""
    return [t.name for t in metas], [t.dtype for t in metas], [list(t.shape) for t in metas]


@dataclasses.dataclass
class _Member:
    endpoint: EngineEndpoint
    client: EngineClient
    rank_offset: int


class _VLLMRoutes:
    def __init__(self, pause_mode: str) -> None:
        self.pause_mode = pause_mode

    def init(self, m: _Member, address: str, port: int, world: int, group_name: str) -> None:
        info = VLLMInitInfo(address, port, m.rank_offset, world, packed=False)
        m.client.post("/init_weight_transfer_engine", {"init_info": to_json(info)})

    def begin(self, m: _Member, version: int) -> None:
        m.client.post("/pause", params={"mode": self.pause_mode}, context=f"version {version}")
        m.client.post("/start_weight_update", context=f"version {version}")

    def send(self, m: _Member, metas: list[TensorMeta], group_name: str, version: int) -> None:
        info = VLLMUpdateInfo(*tensor_columns(metas))
        m.client.post("/update_weights", {"update_info": to_json(info)}, context=f"version {version}")

    def end(self, m: _Member, version: int) -> None:
        ctx = f"version {version}"
        m.client.post("/finish_weight_update", {"weight_version": str(version)}, context=ctx)
        m.client.post("/reset_prefix_cache", params={"reset_running_requests": "true"}, context=ctx)
        m.client.post("/resume", context=ctx)


class _SGLangRoutes:
    def __init__(self, pause_mode: str, backend: str) -> None:
        self.pause_mode = pause_mode
        self.backend = backend

    def init(self, m: _Member, address: str, port: int, world: int, group_name: str) -> None:
        body = SGLangInitGroup(address, port, m.rank_offset, world, group_name, self.backend)
        m.client.post("/init_weights_update_group", to_json(body))

    def begin(self, m: _Member, version: int) -> None:
        m.client.post("/pause_generation", {"mode": self.pause_mode}, context=f"version {version}")
        m.client.post("/begin_weight_update", {}, context=f"version {version}")

    def send(self, m: _Member, metas: list[TensorMeta], group_name: str, version: int) -> None:
        body = SGLangDistUpdate(*tensor_columns(metas), group_name, False)
        m.client.post("/update_weights_from_distributed", to_json(body), context=f"version {version}")

    def end(self, m: _Member, version: int) -> None:
        ctx = f"version {version}"
        m.client.post("/end_weight_update", {}, context=ctx)
        m.client.post(
            "/update_weight_version", {"new_version": str(version), "abort_all_requests": False}, context=ctx
        )
        if self.pause_mode != "in_place":  # in_place keeps the old KV; SGLang refuses to flush it
            m.client.post("/flush_cache", context=ctx)
        m.client.post("/continue_generation", {"torch_empty_cache": True}, context=ctx)


@dataclasses.dataclass
class _Group:
    kind: EngineKind
    name: str
    members: list[_Member]
    comm: Broadcaster
    routes: _VLLMRoutes | _SGLangRoutes


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, device: torch.device
) -> Iterator[list[tuple[TensorMeta, torch.Tensor]]]:
    """Group tensors into buckets of at most ``bucket_bytes`` (a larger tensor travels alone).

    Each tensor is copied to ``device`` before the next is requested, so the source may free or re-partition
    it (ZeRO-3 ``GatheredParameters``) as soon as it resumes.
    """
    bucket: list[tuple[TensorMeta, torch.Tensor]] = []
    size = 0
    for name, t in named_tensors:
        copy = t.detach().to(device, copy=True).contiguous()
        nbytes = copy.numel() * copy.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((TensorMeta(name, _dtype_name(copy), tuple(copy.shape)), copy))
        size += nbytes
    if bucket:
        yield bucket


class EnginePublisher(Publisher):
    """Publisher (``weightsync.base.Publisher``) that feeds every registered vLLM and SGLang server directly.

    ``backend`` is the SGLang group's torch backend (``nccl`` on GPU; ``gloo`` works with SGLang's CPU build
    and in tests); vLLM's group is always PyNccl. ``open_group`` replaces the learner end of a group; tests use
    it to stand gloo in for vLLM's PyNccl, which cannot run without a GPU.
    """

    def __init__(
        self,
        cfg: Config,
        client: redis.Redis,
        run: str,
        *,
        master_address: str | None = None,
        backend: Literal["nccl", "gloo"] = "nccl",
        open_group: OpenGroup | None = None,
    ) -> None:
        self.cfg = cfg
        self.redis = client
        self.run = run
        self.master_address = master_address
        self.backend = backend
        self.timeout = cfg.weightsync.timeout_s
        self.bucket_bytes = cfg.weightsync.bucket_mb << 20
        self.device = (
            torch.device("cpu") if backend == "gloo" else torch.device("cuda", torch.cuda.current_device())
        )
        self._open_group = open_group or self._default_open_group
        self.groups: list[_Group] = []
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="engine-publisher")
        self._n_groups = 0

    # ------------------------------------------------------------------ Publisher
    def _send(self, tensors: Iterator[tuple[str, torch.Tensor]], version: int) -> redis.client.Pipeline:
        """Send one version to every registered engine; returns when each reports it and generates again,
        with ``latest`` queued for the transaction that carries the caller's ``announce``."""
        self._join_new_servers()
        if not self.groups:
            raise WeightSyncError(
                f"no vLLM/SGLang server registered under {servers_key(self.run)} for version {version}"
            )
        group = self.groups[0]
        try:
            for group in self.groups:
                self._each(group, lambda m, g=group: g.routes.begin(m, version), f"begin version {version}")
            for bucket in buckets(tensors, self.bucket_bytes, self.device):
                metas = [m for m, _ in bucket]
                for group in self.groups:
                    self._send_bucket(group, metas, [t for _, t in bucket], version)
            for group in self.groups:
                self._each(group, lambda m, g=group: g.routes.end(m, version), f"finish version {version}")
        except (EngineHTTPError, RuntimeError) as e:
            self._drop(group)  # publish drains ``tensors``
            raise WeightSyncError(
                f"weight version {version} to the {group.kind} group {group.name} "
                f"({', '.join(m.endpoint.url for m in group.members)}) failed: {e}"
            ) from e
        pipe = self.redis.pipeline()
        announce_latest(pipe, self.run, version)
        return pipe

    def close(self) -> None:
        for group in list(self.groups):
            self._drop(group)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ internals
    def _default_open_group(
        self, kind: EngineKind, address: str, port: int, world: int, name: str
    ) -> Broadcaster:
        if kind == "vllm":
            return PyNcclGroup(address, port, world)
        return TorchGroup(address, port, world, backend=self.backend, group_name=name, timeout=self.timeout)

    def _routes(self, kind: EngineKind) -> _VLLMRoutes | _SGLangRoutes:
        if kind == "vllm":
            return _VLLMRoutes(self.cfg.rollout.vllm.pause_mode)
        return _SGLangRoutes(self.cfg.rollout.sglang.pause_mode, self.backend)

    def _client(self, ep: EngineEndpoint) -> EngineClient:
        if ep.kind == "vllm":
            return EngineClient(
                ep.url, "vLLM 0.33.0", timeout=self.timeout, api_key=self.cfg.rollout.vllm.api_key
            )
        return EngineClient(
            ep.url, "SGLang 0.5.23", timeout=self.timeout, api_key=self.cfg.rollout.sglang.api_key
        )

    def _join_new_servers(self) -> None:
        known = {m.endpoint.server_index for g in self.groups for m in g.members}
        new = [ep for ep in registered_engines(self.redis, self.run) if ep.server_index not in known]
        for kind in ("vllm", "sglang"):
            eps = [ep for ep in new if ep.kind == kind]
            if eps:
                self.groups.append(self._form_group(kind, eps))

    def _form_group(self, kind: EngineKind, eps: list[EngineEndpoint]) -> _Group:
        members, offset = [], 1  # the learner is rank 0
        for ep in eps:
            members.append(_Member(ep, self._client(ep), offset))
            offset += ep.world_size
        # The learner's address on the route to the engine: what the engine dials for the rendezvous.
        address = self.master_address or local_address(urlsplit(eps[0].url).hostname or "127.0.0.1")
        port = free_port(address)  # the group's store listens there only (bound_store)
        self._n_groups += 1
        name = f"tandem-{self.run}-{self._n_groups}"
        routes = self._routes(kind)
        futures = [self._pool.submit(routes.init, m, address, port, offset, name) for m in members]
        try:
            comm = self._open_group(kind, address, port, offset, name)
        except (RuntimeError, ValueError) as e:  # torch's DistStoreError / timeouts are RuntimeErrors
            raise WeightSyncError(
                f"{kind} weight group {name} at {address}:{port} (world {offset}) did not form within "
                f"{self.timeout:.0f} s: {e}; members {[m.endpoint.url for m in members]}"
            ) from e
        group = _Group(kind, name, members, comm, routes)
        try:
            self._wait(futures, group, "init")
        except EngineHTTPError as e:
            self._drop(group)
            raise WeightSyncError(f"{kind} weight group {name}: {e}") from e
        return group

    def _send_bucket(
        self, group: _Group, metas: list[TensorMeta], tensors: list[torch.Tensor], version: int
    ) -> None:
        # The engines' update routes block until they have received the bucket: call them and broadcast together.
        futures = [self._pool.submit(group.routes.send, m, metas, group.name, version) for m in group.members]
        for t in tensors:
            group.comm.broadcast(t)
        group.comm.synchronize()
        self._wait(futures, group, f"update version {version}")

    def _each(self, group: _Group, fn: Callable[[_Member], None], what: str) -> None:
        self._wait([self._pool.submit(fn, m) for m in group.members], group, what)

    def _wait(self, futures: list[Future[None]], group: _Group, what: str) -> None:
        deadline = time.monotonic() + self.timeout + 5.0
        for m, fut in zip(group.members, futures, strict=True):
            try:
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                raise EngineHTTPError(
                    f"{m.endpoint.kind} server {m.endpoint.url}: {what} not done within {self.timeout:.0f} s"
                ) from None

    def _drop(self, group: _Group) -> None:
        """Forget a group: its members are re-grouped at the next publish if still registered."""
        if group in self.groups:
            self.groups.remove(group)
        with contextlib.suppress(RuntimeError):  # a broken communicator may refuse to close; it is abandoned
            group.comm.close()
        for m in group.members:
            m.client.close()


class EngineVersionSubscriber(BaseSubscriber):
    """Subscriber for a rollout server whose vLLM/SGLang engine the EnginePublisher feeds directly.

    ``poll`` hands out an :class:`Update` with no tensors and no path; the adapter then only confirms and
    records the version (see the module docstring).
    """

    def poll(self, timeout: float = 0.0) -> Update | None:
        deadline = time.monotonic() + timeout
        while True:
            latest = self.latest_version()
            if latest > self._version:
                self._version = latest
                return Update(version=latest, manifest=[], _iter=lambda: iter(()), path=None)
            if time.monotonic() >= deadline:
                return None
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
