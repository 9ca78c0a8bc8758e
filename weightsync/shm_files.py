"""What the ``shm`` transport's two sides share about the files (:mod:`weightsync.shm`): checksums, the
manifest's entries, mappings that outlive a version, and zero-copy tensor views.

Why files are recycled and stay mapped: on tmpfs a fresh file pays for allocating and zeroing every page,
``pwrite`` pays a syscall and page-cache lookup per page (about half of memcpy speed here), and a fresh
mapping pays a page fault per 4 KiB (mapping 100 MB with ``MAP_POPULATE`` costs as much as copying it).
Only a mapping whose page tables are already filled runs at memory-copy speed. So a retired version's
files are rewritten in place rather than deleted, and both sides keep their mappings of shard files
across versions, keyed by inode (:class:`Mappings`): in the steady state the publisher's write is one
memcpy into pages the subscribers already have mapped, and a subscriber's load is (what is left of) its
checksum pass.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from weightsync.base import WeightSyncError

try:
    import xxhash
except ImportError:  # pragma: no cover - xxhash ships with wandb; crc32 keeps us working without it
    xxhash = None

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


def checksum(buf: memoryview, algo: str = CHECKSUM_ALGO) -> str:
    digest = Digest(algo)
    digest.update(buf)
    return digest.hexdigest()


class Digest:
    """A streaming checksum, ``"<algo>:<hex>"``; fed in pieces it equals the one-shot digest."""

    def __init__(self, algo: str = CHECKSUM_ALGO) -> None:
        if algo == "xxh3_64" and xxhash is None:
            raise WeightSyncError("manifest uses xxh3_64 checksums but the xxhash package is not installed")
        if algo not in ("xxh3_64", "crc32"):
            raise WeightSyncError(f"unknown checksum algorithm {algo!r}")
        self._xxh = xxhash.xxh3_64() if algo == "xxh3_64" else None
        self._crc = 0

    def update(self, buf: memoryview) -> None:
        if self._xxh is not None:
            self._xxh.update(buf)
        else:
            self._crc = zlib.crc32(buf, self._crc)

    def hexdigest(self) -> str:
        return f"xxh3_64:{self._xxh.hexdigest()}" if self._xxh is not None else f"crc32:{self._crc:08x}"


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview((t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)).numpy()).cast("B")


@dataclass(frozen=True)
class Entry:
    """Where one tensor lives: manifest order, file and absolute byte range, digest."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    begin: int
    end: int
    checksum: str


class Mappings:
    """Shared mappings of shard files that outlive a version, keyed by inode (a recycled file keeps its own).

    ``get`` reuses a mapping while the file has the size it was mapped at and maps afresh otherwise; a
    mapping is only ever read or written within the size just checked, so a file shrunk behind our back
    cannot fault (SIGBUS) through a stale one. A mapping pins its pages, so one of a deleted file would
    hold its memory: ``retain_existing`` drops those. ``grew`` says a file was mapped since the last
    ``retain_existing``: in the steady state (recycled files, the same inodes) nothing is mapped afresh, and
    the directory scan can be skipped.
    """

    def __init__(self, writable: bool) -> None:
        self.writable = writable
        self._maps: dict[tuple[int, int], mmap.mmap] = {}
        self.grew = False

    def get(self, path: Path, size: int | None = None) -> tuple[tuple[int, int], mmap.mmap]:
        """Map ``path`` whole. A writer passes ``size`` (the file is resized to it); a reader checks it."""
        # Never through a link: a shard is a file our publisher made in its private folder.
        flags = (os.O_RDWR if self.writable else os.O_RDONLY) | os.O_NOFOLLOW
        try:
            fd = os.open(path, flags)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise WeightSyncError(f"{path} is a symbolic link; refusing it") from None
        try:
            if self.writable and size is not None:
                os.ftruncate(fd, size)  # a no-op when a recycled file already has this size
            st = os.fstat(fd)
            if size is not None and st.st_size != size:
                raise WeightSyncError(f"{path} has {st.st_size} bytes, the manifest says {size} (truncated?)")
            if st.st_size == 0:
                raise WeightSyncError(f"{path} is empty")
            key = (st.st_dev, st.st_ino)
            mm = self._maps.get(key)
            if mm is None or len(mm) != st.st_size:
                prot = mmap.PROT_READ | (mmap.PROT_WRITE if self.writable else 0)
                mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=prot)
                self._maps[key] = mm
                self.grew = True
            return key, mm
        finally:
            os.close(fd)

    def retain_existing(self, root: Path) -> None:
        """Drop mappings of files gone from ``root`` (kept ones cost no memory: the file holds the pages)."""
        keep = set()
        for d in _entries(root):
            if d.name.startswith("v") or d.name == ".free":
                keep |= {(f.stat().st_dev, f.stat().st_ino) for f in _entries(Path(d.path))}
        for key in [k for k in self._maps if k not in keep]:
            del self._maps[key]  # unmapped once no tensor view refers to it
        self.grew = False


def _entries(path: Path) -> list[os.DirEntry]:
    """The entries of ``path`` that still exist, stat cached: the other side renames and deletes meanwhile."""
    out = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError), os.scandir(path) as it:
        for entry in it:
            with contextlib.suppress(FileNotFoundError):
                entry.stat()  # DirEntry caches it
                out.append(entry)
    return out


COPY_CHUNK = 1 << 20  # fits in L2, so each chunk is checksummed while it is still in cache


def copy_with_checksum(out: memoryview, offset: int, src: memoryview) -> str:
    """Copy ``src`` into ``out`` at ``offset`` and checksum it in the same pass.

    Chunk by chunk, the checksum reads what the copy just brought into cache: the pair costs about 1.2
    memcpys here, where a separate checksum pass (even on a second thread) adds about half of one.
    """
    if len(src) <= COPY_CHUNK:
        out[offset : offset + len(src)] = src
        return checksum(src)
    digest = Digest()
    for begin in range(0, len(src), COPY_CHUNK):
        chunk = src[begin : begin + COPY_CHUNK]
        out[offset + begin : offset + begin + len(chunk)] = chunk
        digest.update(chunk)
    return digest.hexdigest()


def tensor_views(entries: list[Entry], maps: dict[str, mmap.mmap]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for each entry: read-only views into the mapped files, no copy."""
    typed: dict[tuple[str, torch.dtype], torch.Tensor] = {}  # one flat view per file and dtype
    for e in entries:
        dtype = TORCH_DTYPES[e.dtype]
        if e.end == e.begin:
            yield e.name, torch.empty(e.shape, dtype=dtype)
            continue
        flat = typed.get((e.file, dtype))
        if flat is None:  # frombuffer costs several times an as_strided, so once per file and dtype
            with warnings.catch_warnings():  # read-only by design: engines copy out of these views
                warnings.simplefilter("ignore", UserWarning)
                mm = maps[e.file]
                flat = typed[e.file, dtype] = torch.frombuffer(
                    mm, dtype=dtype, count=len(mm) // dtype.itemsize
                )
        # The writer orders tensors by element size, so every offset is a whole number of elements.
        yield e.name, flat.as_strided(e.shape, _contiguous_strides(e.shape), e.begin // dtype.itemsize)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))
