"""The ``shm`` transport: each version is a Hugging Face-loadable safetensors directory in shared memory.

Layout under the root (default ``/dev/shm/tandem-<run>``, else ``<run dir>/weights``)::

    v00000007/model.safetensors            (or model-0000i-of-0000N.safetensors + model.safetensors.index.json)
    v00000007/config.json, tokenizer ...   copied from ``config_dir`` so vLLM/SGLang can reload from disk
    .tmp-v00000008-<pid>/                  the version being written; renamed into place when complete
    .free/                                 shard files of retired versions, rewritten in place next time

A reader never sees a half-written version: the directory appears by one ``rename`` and only then is the
version announced in Redis (``{run}:weights:manifest:{v}`` with per-tensor offsets and checksums, then
``latest`` and a pub/sub message). Subscribers map the shard files read-only (no copy), check sizes and
xxh3 checksums (crc32 without the ``xxhash`` package), and hand out views; on a mismatch they log, keep the
weights they have and wait for a newer version.

Why files are recycled: on tmpfs, writing into pages that already exist runs at memory-copy speed while a
fresh file pays for allocating and zeroing every page (about 3x slower here), so a retired version's files
are rewritten in place rather than deleted. A version is retired once it is not among the newest
``keep_versions`` and every live subscriber holds a newer one (their views are only valid until their
next poll, see :class:`~weightsync.base.Update`).

safetensors is written by hand (an 8-byte header length, a JSON header, the raw bytes) so tensors go from
their own memory straight into the file with one copy; tensors are ordered by element size within a shard
so every offset is aligned for zero-copy views.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import shutil
import time
import warnings
import zlib
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import msgpack
import redis
import torch

from weightsync.base import (
    Announcements,
    Heartbeat,
    Registry,
    TensorMeta,
    Update,
    WeightSyncError,
    announce,
    latest_version,
    weights_key,
)

try:
    import xxhash
except ImportError:  # pragma: no cover - xxhash ships with wandb; crc32 keeps us working without it
    xxhash = None

log = logging.getLogger(__name__)

CHECKSUM_ALGO = "xxh3_64" if xxhash is not None else "crc32"
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
TORCH_DTYPES = {str(d).removeprefix("torch."): d for d in SAFETENSORS_DTYPES}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".index.json")


def checksum(buf: memoryview, algo: str = CHECKSUM_ALGO) -> str:
    if algo == "xxh3_64":
        if xxhash is None:
            raise WeightSyncError("manifest uses xxh3_64 checksums but the xxhash package is not installed")
        return f"xxh3_64:{xxhash.xxh3_64_hexdigest(buf)}"
    if algo == "crc32":
        return f"crc32:{zlib.crc32(buf):08x}"
    raise WeightSyncError(f"unknown checksum algorithm {algo!r}")


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def default_root(run: str, run_dir: str | os.PathLike[str] | None) -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm / f"tandem-{run}"
    if run_dir is None:
        raise WeightSyncError(
            "shm transport: /dev/shm is unavailable; pass run_dir or set weightsync.shm_dir"
        )
    return Path(run_dir) / "weights"


def version_dir(root: Path, version: int) -> Path:
    return root / f"v{version:08d}"


@dataclass(frozen=True)
class _Entry:
    """Where one tensor lives: manifest order, file and absolute byte range, digest."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    begin: int
    end: int
    checksum: str


def _pwrite_all(fd: int, buf: memoryview | bytes, offset: int) -> None:
    view = memoryview(buf).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


# ---------------------------------------------------------------------------------------------- publisher


class ShmPublisher:
    """Writes each version as a safetensors directory and announces it in Redis."""

    def __init__(
        self,
        client: redis.Redis,
        run: str,
        root: str | os.PathLike[str],
        *,
        config_dir: str | os.PathLike[str] | None = None,
        shard_bytes: int = 1 << 30,
        keep_versions: int = 2,
        live_s: float = 300.0,
    ) -> None:
        self.client = client
        self.run = run
        self.root = Path(root)
        self.config_dir = Path(config_dir) if config_dir is not None else None
        self.shard_bytes = shard_bytes
        self.keep_versions = keep_versions
        self.registry = Registry(client, run, live_s)
        self.root.mkdir(parents=True, exist_ok=True)
        self._free = self.root / ".free"
        self._free.mkdir(exist_ok=True)
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="shm-checksum")
        for stale in self.root.glob(".tmp-*"):  # a crashed publisher's half-written version
            shutil.rmtree(stale, ignore_errors=True)

    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        tmp = self.root / f".tmp-v{version:08d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        it = iter(named_tensors)
        try:
            entries = self._write_shards(it, tmp)
        except BaseException:
            for _ in it:  # keep a ZeRO-3 gather matched on the other ranks
                pass
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        entries = self._name_shards(tmp, entries)
        self._copy_config(tmp)
        final = version_dir(self.root, version)
        self._replace_dir(tmp, final)
        manifest = {
            "version": version,
            "dir": str(final),
            "files": {f: (final / f).stat().st_size for f in {e.file for e in entries}},
            "tensors": [
                [e.name, e.dtype, list(e.shape), e.file, e.begin, e.end, e.checksum] for e in entries
            ],
        }
        pipe = self.client.pipeline()
        pipe.set(weights_key(self.run, "manifest", version), msgpack.packb(manifest))
        announce(pipe, self.run, version)
        pipe.execute()
        self._collect()

    def close(self) -> None:
        """Files stay for subscribers; the launcher removes the root at the end of the run."""
        self._hasher.shutdown()

    # -- writing

    def _write_shards(self, it: Iterator[tuple[str, torch.Tensor]], tmp: Path) -> list[_Entry]:
        entries: list[_Entry] = []
        shard: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in it:
            t = tensor.detach().to("cpu").contiguous()  # a copy only for GPU tensors
            shard.append((name, t))
            size += t.nbytes
            if size >= self.shard_bytes:
                entries += self._write_shard(tmp / f"shard-{len(entries):06d}", shard)
                shard, size = [], 0
        if shard or not entries:
            entries += self._write_shard(tmp / f"shard-{len(entries):06d}", shard)
        return entries

    def _write_shard(self, path: Path, shard: list[tuple[str, torch.Tensor]]) -> list[_Entry]:
        """One safetensors file; returns its entries in the caller's order."""
        order = sorted(range(len(shard)), key=lambda i: -shard[i][1].element_size())  # stable: aligned
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        spans: dict[int, tuple[int, int]] = {}
        for i in order:
            name, t = shard[i]
            if t.dtype not in SAFETENSORS_DTYPES:
                raise WeightSyncError(
                    f"shm: tensor {name} has dtype {t.dtype}, which safetensors cannot hold"
                )
            header[name] = {
                "dtype": SAFETENSORS_DTYPES[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [offset, offset + t.nbytes],
            }
            spans[i] = (offset, offset + t.nbytes)
            offset += t.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-(8 + len(text)) % 16)  # the spec allows space padding; aligns the data start
        start = 8 + len(text)
        fd = self._open_recycled(path)
        try:
            _pwrite_all(fd, len(text).to_bytes(8, "little") + text, 0)
            # Each tensor's checksum runs on a second thread while the next is written (pwrite and xxhash
            # both release the GIL), so checksums cost the publisher almost nothing on two cores.
            futures = {}
            for i in order:
                view = raw_bytes(shard[i][1])
                futures[i] = self._hasher.submit(checksum, view)
                _pwrite_all(fd, view, start + spans[i][0])
            digests = {i: f.result() for i, f in futures.items()}
            os.ftruncate(fd, start + offset)
        finally:
            os.close(fd)
        return [
            _Entry(
                name=name,
                dtype=str(t.dtype).removeprefix("torch."),
                shape=tuple(t.shape),
                file=path.name,
                begin=start + spans[i][0],
                end=start + spans[i][1],
                checksum=digests[i],
            )
            for i, (name, t) in enumerate(shard)
        ]

    def _open_recycled(self, path: Path) -> int:
        """Open ``path`` for writing, reusing a retired shard file's pages when one is free."""
        for free in sorted(self._free.iterdir()):
            with contextlib.suppress(FileNotFoundError):
                os.rename(free, path)
                return os.open(path, os.O_WRONLY)
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    @staticmethod
    def _name_shards(tmp: Path, entries: list[_Entry]) -> list[_Entry]:
        """Give shards Hugging Face's names (and an index when there are several)."""
        files = sorted({e.file for e in entries})
        if len(files) == 1:
            names = {files[0]: "model.safetensors"}
        else:
            names = {f: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, f in enumerate(files)}
            index = {
                "metadata": {"total_size": sum(e.end - e.begin for e in entries)},
                "weight_map": {e.name: names[e.file] for e in entries},
            }
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        for old, new in names.items():
            os.rename(tmp / old, tmp / new)
        return [_Entry(e.name, e.dtype, e.shape, names[e.file], e.begin, e.end, e.checksum) for e in entries]

    def _copy_config(self, tmp: Path) -> None:
        if self.config_dir is None or not self.config_dir.is_dir():
            return
        for src in self.config_dir.iterdir():
            if src.is_file() and not src.name.endswith(WEIGHT_SUFFIXES):
                shutil.copyfile(src, tmp / src.name)

    def _replace_dir(self, tmp: Path, final: Path) -> None:
        """Rename ``tmp`` to ``final``; a re-published version (after a learner restart) replaces the old."""
        if final.exists():
            trash = self.root / f".tmp-old-{final.name}-{os.getpid()}"
            os.rename(final, trash)
            os.rename(tmp, final)
            self._retire_dir(trash)
        else:
            os.rename(tmp, final)

    # -- garbage collection

    def versions_on_disk(self) -> list[int]:
        return sorted(int(p.name[1:]) for p in self.root.glob("v*") if p.name[1:].isdigit())

    def _collect(self) -> None:
        """Retire versions outside the newest ``keep_versions`` that every live subscriber has moved past."""
        on_disk = self.versions_on_disk()
        floor = min(self.registry.live().values(), default=on_disk[-1] if on_disk else 0)
        for v in on_disk[: -self.keep_versions]:
            if v < floor:
                self.client.delete(weights_key(self.run, "manifest", v))
                self._retire_dir(version_dir(self.root, v))

    def _retire_dir(self, path: Path) -> None:
        for f in path.glob("*.safetensors"):
            with contextlib.suppress(FileNotFoundError):
                os.rename(f, self._free / f"{path.name}-{f.name}")
        shutil.rmtree(path, ignore_errors=True)
        # Keep no more free files than one version has shards: enough to recycle, bounded in memory.
        spare = sorted(self._free.iterdir())
        newest = self.versions_on_disk()
        keep = len(list(version_dir(self.root, newest[-1]).glob("*.safetensors"))) if newest else 0
        for f in spare[keep:]:
            f.unlink(missing_ok=True)


# --------------------------------------------------------------------------------------------- subscriber


class ShmSubscriber:
    """Maps the newest version's files, verifies them, and hands out zero-copy views."""

    def __init__(
        self,
        client: redis.Redis,
        run: str,
        server_id: str,
        *,
        timeout_s: float = 300.0,
        verify: bool = True,
        live_s: float = 300.0,
        heartbeat_s: float = 1.0,
    ) -> None:
        self.client = client
        self.run = run
        self.server_id = server_id
        self.timeout_s = timeout_s
        self.verify = verify
        self._version = -1
        self._rejected: set[int] = set()
        self.rejected = 0  # versions refused (checksum or size), for metrics
        self._heartbeat = Heartbeat(Registry(client, run, live_s), server_id, heartbeat_s)
        self._announcements = Announcements(client, run)
        self._heartbeat(self._version, force=True)

    @property
    def version(self) -> int:
        return self._version

    def latest_version(self) -> int:
        return latest_version(self.client, self.run)

    def poll(self, timeout: float = 0.0) -> Update | None:
        deadline = time.monotonic() + timeout
        while True:
            self._heartbeat(self._version)
            v = self.latest_version()
            if v > self._version and v not in self._rejected:
                upd = self._load(v)
                if upd is not None:
                    return upd
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._announcements.wait(left)

    def close(self) -> None:
        self._announcements.close()
        with contextlib.suppress(redis.RedisError):
            self._heartbeat.registry.leave(self.server_id)

    def _load(self, version: int) -> Update | None:
        raw = self.client.get(weights_key(self.run, "manifest", version))
        if raw is None:
            return None
        manifest = msgpack.unpackb(raw)
        root = Path(manifest["dir"])
        try:
            maps = {f: _map(root / f, size) for f, size in manifest["files"].items()}
        except FileNotFoundError:
            return None
        except WeightSyncError as e:
            return self._reject(version, str(e))
        entries = [_Entry(n, d, tuple(s), f, b, e, c) for n, d, s, f, b, e, c in manifest["tensors"]]
        if self.verify:
            for e in entries:
                algo = e.checksum.split(":", 1)[0]
                if checksum(memoryview(maps[e.file])[e.begin : e.end], algo) != e.checksum:
                    return self._reject(version, f"checksum mismatch in {root / e.file} for tensor {e.name}")
        self._version = version
        self._heartbeat(version, force=True)
        metas = [TensorMeta(e.name, e.dtype, e.shape, e.checksum) for e in entries]
        return Update(version, metas, lambda: _views(entries, maps), path=str(root))

    def _reject(self, version: int, why: str) -> None:
        log.error("%s: rejected weights v%d (%s); keeping v%d", self.server_id, version, why, self._version)
        self._rejected.add(version)
        self.rejected += 1
        return None


def _map(path: Path, size: int) -> mmap.mmap:
    """Map a shard read-only; a size other than the manifest's means a truncated or foreign file."""
    with open(path, "rb") as f:
        actual = os.fstat(f.fileno()).st_size
        if actual != size:
            raise WeightSyncError(f"{path} has {actual} bytes, the manifest says {size} (truncated?)")
        if size == 0:
            raise WeightSyncError(f"{path} is empty")
        return mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)


def _views(entries: list[_Entry], maps: dict[str, mmap.mmap]) -> Iterator[tuple[str, torch.Tensor]]:
    for e in entries:
        dtype = TORCH_DTYPES[e.dtype]
        count = (e.end - e.begin) // dtype.itemsize
        if count == 0:
            yield e.name, torch.empty(e.shape, dtype=dtype)
            continue
        with warnings.catch_warnings():  # read-only by design: engines copy out of these views
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(maps[e.file], dtype=dtype, count=count, offset=e.begin)
        yield e.name, flat.view(e.shape)
