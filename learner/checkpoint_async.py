"""Asynchronous checkpoints: the learner stalls for a copy to host memory, a writer thread persists it
(``learner.checkpoint_async``, docs/design.md §6.2).

DeepSpeed's ``save_checkpoint`` stays in charge of *what* a checkpoint holds (module, ZeRO partitions,
scheduler, every rank's own files, its collectives): for its duration each engine's checkpoint engine is
swapped for :class:`HostSnapshot`, whose ``save(state_dict, path)`` copies the state dict's tensors to host
memory instead of writing them. The learner then trains on; a writer thread hands each copy to DeepSpeed's
own engine (``torch.save`` as the run's DeepSpeed config asks), writes the RNG and learner JSON, and fsyncs.
The files are those of a synchronous save, so ``learner/checkpoint.py``'s ``load`` reads either.

**Commit only once durable.** The thread never commits: ``latest.json`` and the acks are a collective
(every rank's files must be durable first), so they happen on the training thread, at a step boundary where
every rank has seen its own writer finish (:meth:`AsyncCheckpointer.poll`). Until then the snapshot's ids
stay pending, exactly as between two synchronous checkpoints: a crash during the write loses the snapshot's
update with them, and resume falls back to the previous ``latest.json``, re-delivering them once.

**One write in flight.** A checkpoint due while the previous one still writes waits for it (and commits it)
first; the wait is counted in ``checkpoint/wait_s``.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from learner import checkpoint
from learner.checkpoint import LearnerState

# Seconds the writer sleeps before writing: tests use it to kill a learner in the middle of a write.
WRITE_DELAY_ENV = "TANDEM_CHECKPOINT_WRITE_DELAY_S"
# While the learner waits for a write, progress is logged this often; a write still going after ``timeout_s``
# (learner.checkpoint_timeout_s) is taken as hung, and the learner stops with an error naming the folder.
PROGRESS_S = 60.0

log = logging.getLogger(__name__)


def to_host(obj: Any, reuse: Sequence[torch.Tensor] = (), out: list[torch.Tensor] | None = None) -> Any:
    """A copy of a state dict whose tensors are host-memory copies: training may change the originals in
    place the moment this returns. Containers are rebuilt; other leaves deep-copied.

    ``reuse``: the host tensors of the previous snapshot of the same file, in the same walk order; each
    whose shape and dtype still match is copied into rather than allocated (fresh memory costs a page
    fault per page, more than the copy). ``out`` collects the host tensors of this copy, for the next."""
    out = [] if out is None else out
    if isinstance(obj, torch.Tensor):
        src, i = obj.detach(), len(out)
        old = reuse[i] if i < len(reuse) else None
        if old is not None and old.shape == src.shape and old.dtype == src.dtype:
            host = old.copy_(src)
        else:  # pinned for a GPU tensor: a faster device-to-host copy
            host = torch.empty_like(src, device="cpu", pin_memory=src.is_cuda).copy_(src)
        out.append(host)
        return host
    if isinstance(obj, dict):
        copied = copy.copy(obj)  # keeps an OrderedDict's type and attributes
        for k, v in obj.items():
            copied[k] = to_host(v, reuse, out)
        return copied
    if isinstance(obj, list):
        return [to_host(v, reuse, out) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(to_host(v, reuse, out) for v in obj)
    return copy.deepcopy(obj)


class HostSnapshot(CheckpointEngine):
    """A DeepSpeed checkpoint engine that keeps each file's state dict in host memory instead of writing it;
    ``inner`` (the engine's own) writes them later, from the writer thread."""

    def __init__(self, inner: CheckpointEngine, buffers: dict[str, list[torch.Tensor]]) -> None:
        super().__init__()
        self.name = "HostSnapshot"
        self.inner = inner
        self.buffers = buffers  # host tensors by file name, kept from one snapshot to the next
        self.files: list[tuple[str, Any]] = []

    def create(self, info: CheckpointCommitInfo) -> None:
        self.inner.create(info)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.inner.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: Any, path: str) -> None:
        key = f"{Path(path).parent.parent.name}/{Path(path).name}"  # <engine>/<file>, whatever the tag
        out: list[torch.Tensor] = []
        self.files.append((path, to_host(state_dict, self.buffers.get(key, []), out)))
        self.buffers[key] = out

    def load(self, path: str, map_location: Any = None) -> Any:
        return self.inner.load(path, map_location=map_location)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        return True  # the writer thread's files are committed by latest.json, not here

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        return self.inner.is_data_parallel_writer(dp_rank)


def snapshot_engine(
    engine: Any, save_dir: Path, tag: str, buffers: dict[str, list[torch.Tensor]]
) -> tuple[CheckpointEngine, list[tuple[str, Any]]]:
    """Run DeepSpeed's ``save_checkpoint`` (a collective) with :class:`HostSnapshot` in place of the engine's
    checkpoint engine; returns that engine and the files it would have written, in host memory."""
    inner = engine.checkpoint_engine
    host = HostSnapshot(inner, buffers)
    engine.checkpoint_engine = host
    try:
        # save_latest=False: DeepSpeed would write its own ``latest`` before the files exist.
        engine.save_checkpoint(str(save_dir), tag=tag, save_latest=False)
    finally:
        engine.checkpoint_engine = inner
    return inner, host.files


@dataclass
class Written:
    """A checkpoint in flight: its state, the writer thread, and what that thread ran into."""

    state: LearnerState
    thread: threading.Thread
    error: list[BaseException] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return not self.thread.is_alive()


class AsyncCheckpointer:
    """Snapshot now, write on a thread, commit at a later step boundary; one write in flight at a time."""

    def __init__(self, ckpt_dir: Path, *, timeout_s: float, keep: int = 2, group: Any = None) -> None:
        self.ckpt_dir, self.keep, self.group, self.timeout_s = ckpt_dir, keep, group, timeout_s
        self.in_flight: Written | None = None
        self.engine_names: list[str] = []
        self.write_delay_s = float(os.environ.get(WRITE_DELAY_ENV, "0") or 0)
        # Reused by the next snapshot once the writer is done with them: one write in flight makes it safe.
        self.buffers: dict[str, list[torch.Tensor]] = {}

    def snapshot(self, engines: dict[str, Any], state: LearnerState) -> None:
        """Collective. Copy every engine's checkpoint and this rank's JSON files to host memory and start the
        writer. The caller waits for (:meth:`wait`) any write in flight first."""
        if self.in_flight is not None:
            raise RuntimeError("a checkpoint write is still in flight: wait for it before the next snapshot")
        tag = f"v{state.version:08d}"
        self.engine_names = [*engines]
        files = [
            snapshot_engine(engine, self.ckpt_dir / name, tag, self.buffers)
            for name, engine in engines.items()
        ]
        own = checkpoint.state_files(state)
        error: list[BaseException] = []
        thread = threading.Thread(
            target=self._write,
            args=(files, own, tag, error),
            name=f"checkpoint-{tag}",
            daemon=True,  # a crash mid-write leaves an uncommitted folder, which nothing reads
        )
        thread.start()
        self.in_flight = Written(state, thread, error)

    def _write(
        self, files: list[tuple[CheckpointEngine, list[tuple[str, Any]]]], own: dict, tag: str, error: list
    ) -> None:
        try:
            if self.write_delay_s:
                time.sleep(self.write_delay_s)
            for inner, saved in files:
                for path, state_dict in saved:
                    inner.save(state_dict, path)
            checkpoint.write_state(self.ckpt_dir, own)
            checkpoint.make_durable(self.ckpt_dir, self.engine_names, tag)
        except BaseException as e:  # raised on the training thread at the commit
            error.append(e)

    def poll(self) -> LearnerState | None:
        """Collective, at a step boundary: commit the write in flight if every rank's writer is done; returns
        the committed state, or None (nothing in flight, or a rank still writing)."""
        if self.in_flight is None:
            return None
        done = torch.tensor([int(self.in_flight.done)])
        if dist.get_world_size() > 1:
            dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self.group)
        return self._commit() if int(done) else None

    def wait(self, clock: Callable[[], float] = time.monotonic) -> tuple[LearnerState | None, float]:
        """Collective: wait for the write in flight and commit it; returns the committed state (None when
        nothing was in flight) and the seconds waited for the writer."""
        if self.in_flight is None:
            return None, 0.0
        start, written = clock(), self.in_flight
        while written.thread.is_alive():
            written.thread.join(timeout=min(PROGRESS_S, self.timeout_s))
            waited = clock() - start
            if written.thread.is_alive() and waited >= self.timeout_s:
                raise TimeoutError(
                    f"checkpoint v{written.state.version}: still writing to {self.ckpt_dir} after "
                    f"{waited:.0f} s; the previous committed checkpoint stays the one to resume from"
                )
            if written.thread.is_alive():
                log.warning(
                    "checkpoint v%d: waiting for its write to %s (%.0f s)",
                    written.state.version,
                    self.ckpt_dir,
                    waited,
                )
        return self._commit(), clock() - start

    def _commit(self) -> LearnerState:
        written, self.in_flight = self.in_flight, None
        failed = torch.tensor([int(bool(written.error))])
        if dist.get_world_size() > 1:  # no rank commits a checkpoint another rank failed to write
            dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.group)
        if written.error:
            raise RuntimeError(
                f"checkpoint v{written.state.version} could not be written"
            ) from written.error[0]
        if int(failed):
            raise RuntimeError(f"checkpoint v{written.state.version}: another rank could not write its files")
        version = written.state.version
        checkpoint.commit(self.ckpt_dir, self.engine_names, version, keep=self.keep, prune_now=False)
        # Removing a superseded checkpoint (an rmtree of gigabytes) is off the training thread too.
        threading.Thread(
            target=checkpoint.prune,
            args=(self.ckpt_dir, self.engine_names, version, self.keep),
            name=f"checkpoint-prune-v{version}",
            daemon=True,  # a crash mid-prune leaves old folders, which the next prune removes
        ).start()
        if dist.get_rank() == 0:  # DeepSpeed's own pointer, for its tools (ours is latest.json)
            for name in self.engine_names:
                (self.ckpt_dir / name / "latest").write_text(f"v{version:08d}")
        return written.state
