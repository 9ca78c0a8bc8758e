"""The ``shm`` transport: each version is a Hugging Face-loadable safetensors directory in shared memory.

Layout under the root (default ``/dev/shm/tandem-<run>-<random>``, mode 0700, else ``<run dir>/weights``)::

    v00000007/model.safetensors            (or model-0000i-of-0000N.safetensors + model.safetensors.index.json)
    v00000007/config.json, tokenizer ...   copied from ``config_dir`` so vLLM/SGLang can reload from disk
    .tmp-v00000008-<pid>/                  the version being written; renamed into place when complete
    .free/                                 shard files of retired versions, rewritten in place next time

A reader never sees a half-written version: the directory appears by one ``rename`` and only then is the
version announced in Redis (``{run}:weights:manifest:{v}`` with per-tensor offsets and checksums, then
``latest`` and a pub/sub message). Subscribers map the shard files read-only (no copy), check sizes and
xxh3 checksums (crc32 without the ``xxhash`` package), and hand out views; on a mismatch they log, keep the
weights they have and wait for a newer version.

Verification overlaps the write: while writing, the publisher posts progress notes
(``{run}:weights:writing`` names the version and a token, ``{run}:weights:progress:{token}`` lists the
byte ranges that are final), and a subscriber blocked in ``poll`` checksums those ranges in the meantime.
When the manifest lands it compares them with the manifest's checksums and hashes only what is left, so a
waiting server holds a new version almost as soon as it is written. The publisher computes its checksums
in the same pass as its copy (chunk by chunk, while the bytes are in cache).

Retired versions' files are rewritten in place and both sides keep their mappings across versions
(:mod:`weightsync.shm_files` says why). A version is retired once it is not among the newest ``keep_versions`` and every live subscriber holds a
newer one: a subscriber names the version it was handed in the registry only once its caller has applied it
(``applied``, or at the latest its next poll), so no decode step still reads pages that get rewritten.

safetensors is written by hand (an 8-byte header length, a JSON header, the raw bytes) so tensors go from
their own memory straight into the file with one copy; tensors are ordered by element size within a shard
so every offset is aligned for zero-copy views.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import logging
import mmap
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import msgpack
import redis
import torch

from weightsync.adapters import PEFT_DIR, is_adapter_tensor, write_peft_adapter
from weightsync.base import (
    Publisher,
    RegisteredSubscriber,
    Registry,
    TensorMeta,
    Update,
    WeightSyncError,
    weights_key,
)
from weightsync.base import announce as announce_latest
from weightsync.shm_files import (
    SAFETENSORS_DTYPES,
    Entry,
    Mappings,
    checksum,
    copy_with_checksum,
    raw_bytes,
    tensor_views,
)

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".index.json")


ROOT_NOTE = "shm_root"  # in the run directory: the path of the run's folder in /dev/shm


def default_root(run: str, run_dir: str | os.PathLike[str] | None) -> Path:
    """The run's folder in /dev/shm: made once under a random name (``tandem-<run>-XXXXXXXX``, mode 0700)
    and noted in ``<run dir>/shm_root``, where a restarted learner and the launcher find it again; a noted
    folder is reopened only if it is still this user's private folder. Without /dev/shm, the run dir's
    ``weights/``."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        if run_dir is None:
            raise WeightSyncError(
                "shm transport: /dev/shm is unavailable; pass run_dir or set weightsync.shm_dir"
            )
        return Path(run_dir) / "weights"
    if (root := noted_root(run_dir)) is not None and os.path.lexists(root):
        check_private(root)
        return root
    root = Path(tempfile.mkdtemp(prefix=f"tandem-{run}-", dir=shm))
    if run_dir is not None:
        from tandem.config import write_private

        write_private(Path(run_dir) / ROOT_NOTE, f"{root}\n")
    return root


def noted_root(run_dir: str | os.PathLike[str] | None) -> Path | None:
    """The /dev/shm folder that ``default_root`` made for the run in ``run_dir``, if it made one."""
    note = Path(run_dir) / ROOT_NOTE if run_dir is not None else None
    if note is None or not note.is_file():
        return None
    return Path(note.read_text().strip())


def check_private(root: Path) -> None:
    """Refuse a weights folder that another user could have made or could write: it must be a folder
    (not a link) of this user with no access for anyone else. Its files are then what our publisher wrote."""
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        raise WeightSyncError(f"shm: {root} does not exist") from None
    if not stat.S_ISDIR(st.st_mode):
        raise WeightSyncError(f"shm: {root} is not a folder (a link?); refusing it")
    if st.st_uid != os.getuid():
        raise WeightSyncError(f"shm: {root} belongs to uid {st.st_uid}, not this user ({os.getuid()})")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise WeightSyncError(f"shm: {root} has mode {stat.S_IMODE(st.st_mode):o}; it must be 700")


def make_private_root(root: Path) -> None:
    """Create ``root`` (mode 0700) or take an existing folder of this user private; refuse anyone else's."""
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.lstat(root)
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(root, 0o700)  # a configured weightsync.shm_dir made with the default umask
    check_private(root)


def version_dir(root: Path, version: int) -> Path:
    return root / f"v{version:08d}"


# A progress note per this many bytes written, and at the end of each shard at least this big. A smaller
# shard gets none: its manifest follows within a millisecond, and a note costs a Redis round trip.
PROGRESS_BYTES = 32 << 20
INLINE_VERIFY_BYTES = 1 << 20  # fewer bytes than this are checksummed on the caller's thread
RETAIN_S = 1.0  # a subscriber drops mappings of deleted files at least this often


# ---------------------------------------------------------------------------------------------- publisher


class ShmPublisher(Publisher):
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
        recycle: bool = True,
        live_s: float = 300.0,
        peft_adapter: bool = False,
    ) -> None:
        self.client = client
        # Also write an adapter-only update as a peft directory (``<version>/adapter``), which vLLM loads
        # as a LoRA (rollout/engines/vllm.py); a full update is written as before.
        self.peft_adapter = peft_adapter
        self.run = run
        self.root = Path(root)
        self.config_dir = Path(config_dir) if config_dir is not None else None
        self.shard_bytes = shard_bytes
        self.keep_versions = keep_versions
        # Rewrite retired files in place (fast: their pages stay allocated and mapped), or delete them, for
        # a run whose memory is the point: colocated with placement.release_memory, on one host.
        self.recycle = recycle
        self.registry = Registry(client, run, live_s)
        make_private_root(self.root)
        self._free = self.root / ".free"
        self._free.mkdir(exist_ok=True)
        self._maps = Mappings(writable=True)
        # Progress notes go out on a thread so the copy never waits for Redis; publish joins them before
        # it announces the version.
        self._notifier = ThreadPoolExecutor(1, thread_name_prefix="shm-progress")
        self._notes: list[Future[None]] = []
        self._writing: bytes | None = None  # ``[version, token]``, sent with the version's first note
        self._config_files: list[Path] | None = None  # under ``.config``, linked into every version
        for stale in self.root.glob(".tmp-*"):  # a crashed publisher's half-written version
            shutil.rmtree(stale, ignore_errors=True)
        # What is on disk, kept in memory from here on: rescanning the root on every publish cost a tiny
        # model a quarter of its publish. ``_shards`` is the newest version's shard count (the free pool's
        # bound); ``_dropped`` says a shard file was deleted, so our mappings of it must go.
        self._versions = self.versions_on_disk()
        self._shards = 0
        self._dropped = False

    def _send(self, it: Iterator[tuple[str, torch.Tensor]], version: int) -> redis.client.Pipeline:
        """Write the version's files; their manifest and ``latest`` go in the transaction that carries the
        caller's ``announce`` (the learner's version, so admission opens in the round trip that announces
        its weights)."""
        tmp = self.root / f".tmp-v{version:08d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        token = os.urandom(8).hex()  # names this one write in its progress notes and its manifest
        self._progress_key = weights_key(self.run, "progress", token)
        self._writing = msgpack.packb([version, token])  # set with the first note, off the copy's path
        adapter: dict[str, torch.Tensor] = {}
        if self.peft_adapter:
            it = _collect_adapter(it, adapter)
        try:
            entries = self._write_shards(it, tmp)
            self._join_notes()
            if adapter:
                base = str(self.config_dir) if self.config_dir is not None else None
                write_peft_adapter(adapter, tmp / PEFT_DIR, base)
        except BaseException:  # publish drains ``it``
            with contextlib.suppress(Exception):
                self._join_notes()
            self._writing = None
            shutil.rmtree(tmp, ignore_errors=True)
            self._maps.retain_existing(self.root)
            self.client.delete(weights_key(self.run, "writing"), self._progress_key)
            raise
        entries = self._name_shards(tmp, entries)
        self._copy_config(tmp)
        final = version_dir(self.root, version)
        self._shards = len({e.file for e in entries})
        self._replace_dir(tmp, final)
        if version not in self._versions:
            bisect.insort(self._versions, version)
        manifest = {
            "version": version,
            "token": token,
            "dir": str(final),
            "files": {f: (final / f).stat().st_size for f in {e.file for e in entries}},
            "tensors": [
                [e.name, e.dtype, list(e.shape), e.file, e.begin, e.end, e.checksum] for e in entries
            ],
        }
        pipe = self.client.pipeline()
        pipe.set(weights_key(self.run, "manifest", version), msgpack.packb(manifest))
        pipe.delete(weights_key(self.run, "writing"), self._progress_key)
        announce_latest(pipe, self.run, version)
        return pipe

    def _announced(self, version: int) -> None:
        self.trim()

    def trim(self, *, held_too: bool = False) -> None:
        self._collect(held_too=held_too)
        if self._dropped:  # our mappings would pin the deleted files' pages
            self._maps.retain_existing(self.root)
            self._dropped = False

    def close(self) -> None:
        """Files stay for subscribers; the launcher removes the root at the end of the run."""
        self._notifier.shutdown()

    # -- writing

    def _write_shards(self, it: Iterator[tuple[str, torch.Tensor]], tmp: Path) -> list[Entry]:
        entries: list[Entry] = []
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

    def _write_shard(self, path: Path, shard: list[tuple[str, torch.Tensor]]) -> list[Entry]:
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
        self._claim_file(path)
        _, mm = self._maps.get(path, start + offset)
        digests: dict[int, str] = {}
        written: list[tuple[int, int, str]] = []  # spans not yet in a progress note
        with memoryview(mm) as out:  # released on exit: an exported buffer would keep the mapping open
            out[:start] = len(text).to_bytes(8, "little") + text
            for i in order:
                begin, end = start + spans[i][0], start + spans[i][1]
                digests[i] = copy_with_checksum(out, begin, raw_bytes(shard[i][1]))
                written.append((begin, end, digests[i]))
                if end - written[0][0] >= PROGRESS_BYTES or (i == order[-1] and offset >= PROGRESS_BYTES):
                    self._note_progress(path, written)
                    written = []
        return [
            Entry(
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

    def _note_progress(self, path: Path, spans: list[tuple[int, int, str]]) -> None:
        """Tell waiting subscribers which byte ranges of ``path`` are final, so they verify while we write."""
        pipe = self.client.pipeline(transaction=False)
        if self._writing is not None:  # the version's first note names it to subscribers
            pipe.set(weights_key(self.run, "writing"), self._writing)
            self._writing = None
        pipe.rpush(self._progress_key, msgpack.packb([str(path), spans]))
        pipe.expire(self._progress_key, 3600)  # only a crashed publisher leaves one behind
        pipe.publish(weights_key(self.run, "announce"), "progress")
        self._notes.append(self._notifier.submit(pipe.execute))

    def _join_notes(self) -> None:
        notes, self._notes = self._notes, []
        for note in notes:
            note.result()

    def _claim_file(self, path: Path) -> None:
        """Create ``path`` from a retired shard file when one is free (its pages and our mapping are reused)."""
        for free in sorted(self._free.iterdir()):
            with contextlib.suppress(FileNotFoundError):
                os.rename(free, path)
                return
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))

    @staticmethod
    def _name_shards(tmp: Path, entries: list[Entry]) -> list[Entry]:
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
        return [Entry(e.name, e.dtype, e.shape, names[e.file], e.begin, e.end, e.checksum) for e in entries]

    def _copy_config(self, tmp: Path) -> None:
        """Give the version the checkpoint's other files (config, tokenizer), so it loads as a checkpoint.

        They are copied once per publisher into ``.config`` and hard-linked into each version: a link
        costs a fraction of a copy, which a tiny model pays on every step.
        """
        if self._config_files is None:
            self._config_files = []
            if self.config_dir is not None and self.config_dir.is_dir():
                stable = self.root / ".config"
                shutil.rmtree(stable, ignore_errors=True)
                stable.mkdir()
                for src in self.config_dir.iterdir():
                    if src.is_file() and not src.name.endswith(WEIGHT_SUFFIXES):
                        shutil.copyfile(src, stable / src.name)
                        self._config_files.append(stable / src.name)
        for src in self._config_files:
            try:
                os.link(src, tmp / src.name)
            except OSError:  # a filesystem without hard links
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

    def _collect(self, *, held_too: bool = False) -> None:
        """Retire versions outside the newest ``keep_versions`` that every live subscriber has moved past;
        with ``held_too``, every version (a subscriber that wakes without a newer one finds none, and a
        joiner waits for the next)."""
        old = list(self._versions) if held_too else self._versions[: -self.keep_versions]
        if not old:
            return
        floor = float("inf") if held_too else min(self.registry.live().values(), default=self._versions[-1])
        for v in old:
            if v < floor:
                self.client.delete(weights_key(self.run, "manifest", v))
                self._retire_dir(version_dir(self.root, v))
                self._versions.remove(v)

    def _retire_dir(self, path: Path) -> None:
        if self.recycle:
            for f in path.glob("*.safetensors"):
                with contextlib.suppress(FileNotFoundError):
                    os.rename(f, self._free / f"{path.name}-{f.name}")
        else:
            self._dropped = True
        shutil.rmtree(path, ignore_errors=True)
        # Keep no more free files than one version has shards: enough to recycle, bounded in memory.
        for f in sorted(self._free.iterdir())[self._shards if self.recycle else 0 :]:
            f.unlink(missing_ok=True)
            self._dropped = True


def _collect_adapter(
    it: Iterator[tuple[str, torch.Tensor]], into: dict[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass ``it`` on, keeping a CPU copy of its adapter tensors (small: ``r·(in + out)`` per layer)."""
    for name, t in it:
        if is_adapter_tensor(name):
            into[name] = t.detach().to("cpu", copy=True)
        yield name, t


# --------------------------------------------------------------------------------------------- subscriber


class ShmSubscriber(RegisteredSubscriber):
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
        super().__init__(client, run, server_id, live_s=live_s, heartbeat_s=heartbeat_s)
        self.timeout_s = timeout_s
        self.verify = verify
        self._rejected: set[int] = set()
        self.rejected = 0  # versions refused (checksum or size), for metrics
        self._maps = Mappings(writable=False)
        self._checked: set[Path] = set()  # weight folders found private (check_private)
        self._retained_at = 0.0
        # xxhash releases the GIL, so verification spreads over a few cores, leaving one to the engine and
        # (on a shared host) the publisher; one thread already outpaces a writer (hashing is ~2x memcpy).
        threads = max(1, min(4, (os.cpu_count() or 1) - 1))
        self._verifier = ThreadPoolExecutor(threads, thread_name_prefix="shm-verify")
        # Checksums of byte ranges verified while the publisher was still writing (see _verify_progress):
        # (write token, inode, begin, end) -> digest; the manifest then only needs the ranges left over.
        self._early: dict[tuple[str, tuple[int, int], int, int], str] = {}
        self._early_token: str | None = None
        self._early_notes = 0  # progress notes of that write consumed so far
        self.early_bytes = 0  # of the version handed out last, bytes verified while it was being written
        self._unreported = False  # a version handed out that the registry does not name yet

    def poll(self, timeout: float = 0.0) -> Update | None:
        """The newest version, if one is out; meanwhile, checksum what a publisher has finished writing.

        So a server's cheap between-steps ``poll(0)`` does the verification a slice at a time while the
        learner writes, instead of all of it in one stall after, and a blocked ``poll`` overlaps it.
        """
        deadline = time.monotonic() + timeout
        while True:
            # The version handed out last is in use from here on (its caller applied it before this poll),
            # so its predecessor may now be retired: say so at once.
            self._heartbeat(self._version, force=self._unreported)
            self._unreported = False
            latest, writing = self.client.mget(
                weights_key(self.run, "latest"), weights_key(self.run, "writing")
            )
            v = int(latest) if latest is not None else -1
            if v > self._version and v not in self._rejected:
                upd = self._load(v)
                if upd is not None:
                    return upd
            verified = writing is not None and self._verify_progress(*msgpack.unpackb(writing))
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if not verified:
                self._announcements.wait(left)

    def applied(self) -> None:
        if self._unreported:
            self._heartbeat(self._version, force=True)
            self._unreported = False

    def release(self) -> None:
        """Unmap every file: a sleeping server's mappings would pin retired versions' pages (a publisher
        that deletes rather than recycles them). Views handed out before become invalid."""
        self._maps = Mappings(writable=False)
        self._early.clear()

    def close(self) -> None:
        self._verifier.shutdown()
        super().close()

    def _load(self, version: int) -> Update | None:
        raw = self.client.get(weights_key(self.run, "manifest", version))
        if raw is None:
            return None
        manifest = msgpack.unpackb(raw)
        root = Path(manifest["dir"])
        if not os.path.lexists(root.parent):
            # Removed when the run stopped cleanly: the announcement outlived the folder. A resumed learner
            # publishes this version again in a new folder, so wait for that rather than refuse the number.
            return None
        try:
            if root.parent not in self._checked:  # another user's folder, or a link, is never read
                check_private(root.parent)
                self._checked.add(root.parent)
            maps = {f: self._maps.get(root / f, size) for f, size in manifest["files"].items()}
        except FileNotFoundError:
            return None
        except WeightSyncError as e:
            return self._reject(version, str(e))
        entries = [Entry(n, d, tuple(s), f, b, e, c) for n, d, s, f, b, e, c in manifest["tensors"]]
        if self.verify:
            token = manifest.get("token")
            inode = {f: key for f, (key, _) in maps.items()}
            left = [e for e in entries if (token, inode[e.file], e.begin, e.end) not in self._early]
            self.early_bytes = sum(e.end - e.begin for e in entries) - sum(e.end - e.begin for e in left)
            digests = dict(
                zip(left, self._checksums(left, {f: mm for f, (_, mm) in maps.items()}), strict=True)
            )
            for e in entries:
                digest = digests.get(e) or self._early[(token, inode[e.file], e.begin, e.end)]
                if digest != e.checksum:
                    return self._reject(version, f"checksum mismatch in {root / e.file} for tensor {e.name}")
            self._early.clear()
        # Drop mappings of deleted files when a new file appeared (a recycled one keeps its inode), else
        # at most every RETAIN_S: a scan of the root costs a tiny model a tenth of its load.
        if self._maps.grew or time.monotonic() - self._retained_at > RETAIN_S:
            self._maps.retain_existing(root.parent)
            self._retained_at = time.monotonic()
        # The registry keeps naming the version held before until the caller has applied this one
        # (``applied``, or at the latest the next poll): a decode step on another thread may still read the
        # old views, and a publisher that retired them now could rewrite those pages under that step.
        self._version, self._unreported = version, True
        metas = [TensorMeta(e.name, e.dtype, e.shape, e.checksum) for e in entries]
        views = {f: mm for f, (_, mm) in maps.items()}
        return Update(version, metas, lambda: tensor_views(entries, views), path=str(root))

    def _checksums(self, entries: list[Entry], maps: dict[str, mmap.mmap]) -> Iterator[str]:
        def one(e: Entry) -> str:
            return checksum(memoryview(maps[e.file])[e.begin : e.end], e.checksum.split(":", 1)[0])

        if sum(e.end - e.begin for e in entries) < INLINE_VERIFY_BYTES:  # a thread hop per tensor costs more
            return map(one, entries)
        return self._verifier.map(one, entries)

    def _verify_progress(self, version: int, token: str) -> bool:
        """Checksum the ranges the publisher of ``version`` (this ``token``) has finished writing.

        The verification overlaps the write instead of following it, so once the manifest lands only the
        last few ranges are left to check. The ranges
        are keyed by the write's token and the file's inode (a rename keeps it), and compared with the
        manifest's checksums in :meth:`_load`. True if it verified anything.
        """
        if not self.verify:
            return False
        if version <= self._version or version in self._rejected:
            return False
        if token != self._early_token:
            self._early.clear()
            self._early_token, self._early_notes = token, 0
        notes = self.client.lrange(weights_key(self.run, "progress", token), self._early_notes, -1)
        self._early_notes += len(notes)
        todo: list[tuple[tuple[int, int], Entry]] = []
        maps: dict[str, mmap.mmap] = {}
        for note in notes:
            path, spans = msgpack.unpackb(note)
            try:
                key, maps[path] = self._maps.get(Path(path))
            except (FileNotFoundError, WeightSyncError):  # renamed or retired meanwhile: _load checks it
                continue
            todo += [(key, Entry("", "", (), path, b, e, c)) for b, e, c in spans]
        for (key, e), digest in zip(todo, self._checksums([e for _, e in todo], maps), strict=True):
            self._early[(token, key, e.begin, e.end)] = digest
        return bool(todo)

    def _reject(self, version: int, why: str) -> None:
        log.error("%s: rejected weights v%d (%s); keeping v%d", self.server_id, version, why, self._version)
        self._rejected.add(version)
        self.rejected += 1
        return None
