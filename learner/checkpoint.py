"""Learner checkpoints and the exactly-once contract with the trajectory stream (docs/design.md §6.2).

A checkpoint at version ``v`` is: the DeepSpeed checkpoints of the recipe's trained engines (PPO's actor and
critic, an offline trainer's one model; ``engine.save_checkpoint``,
tag ``v{v:08d}``, optimizer state included), each rank's RNG states (torch, numpy, python; JSON, no
pickle), and rank 0's learner state: the version and the stream ids trained on since the previous
checkpoint. ``latest.json`` names the newest complete checkpoint; it is replaced atomically (write, fsync,
rename) only after every file of the checkpoint is written and fsynced, so it is the commit point.

**Exactly once, relative to the surviving model state.** Acknowledging a trajectory right after the
optimizer step that used it is not enough when checkpoints are every K steps: a crash would lose the
update while the data is gone. So the learner keeps the ids of every trained trajectory *pending* (taken
under a stable consumer name, ``learner-0``, never acked) until a checkpoint containing their update is
committed, and only then acks them. After a crash at any point:

- ids trained after the last committed checkpoint are still pending on ``learner-0``; the update they
  made is lost with the process, and the buffer re-delivers them to the restarted ``learner-0``, which
  trains on them again: once, as far as the surviving model is concerned;
- ids of the committed checkpoint may or may not have been acked before the crash (the crash can fall
  between commit and ack); the checkpoint records them and resume acks them (XACK is idempotent) before
  taking anything, so they are never trained on twice.
- acks of *older* checkpoints can be lost too, when Redis itself loses its last writes (``appendfsync
  everysec``, a host crash, an older AOF restored). So each checkpoint also carries ``acked``: ranges
  covering every id trained into the whole lineage up to it (``learner/acked_ranges.py``), and resume
  re-acks all of them (docs/design.md §6.7).

Because ack deletes, pending ids occupy the stream; the learner checkpoints early whenever they would
fill half of ``redis.stream_maxlen`` (so ``checkpoint_interval: 0`` cannot stall producers). While they
wait for the checkpoint, pending ids may be claimed back by the buffer's own idle-entry
recovery; the buffer never hands an id to the consumer instance already holding it.
"""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from learner.acked_ranges import Range, from_json, merge, parse, to_json

LATEST = "latest.json"


@dataclass
class LearnerState:
    version: int
    trained_ids: list[str]  # stream ids whose update this checkpoint contains and that may be unacked
    extra: dict[str, Any] = field(default_factory=dict)  # recipe state (JSON-able)
    # Every id trained into this checkpoint's lineage, as inclusive ranges (learner/acked_ranges.py).
    acked: list[Range] = field(default_factory=list)


def _tag(version: int) -> str:
    return f"v{version:08d}"


def _write_json(path: Path, obj: Any) -> None:
    """Atomically replace ``path`` with ``obj`` as JSON, durable on disk before it becomes visible."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                with open(os.path.join(dirpath, name), "rb") as f:
                    os.fsync(f.fileno())
            except FileNotFoundError:  # another rank's _write_json renamed its temporary file away; that
                continue  # write fsyncs its own file and folder, so nothing is left to make durable here
        _fsync_dir(Path(dirpath))


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": [py_version, list(py_internal), py_gauss],
    }
    if torch.cuda.is_available():
        state["cuda"] = [
            base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()
        ]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    py_version, py_internal, py_gauss = state["python"]
    random.setstate((py_version, tuple(py_internal), py_gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(
            [torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8) for s in state["cuda"]]
        )


def save(ckpt_dir: Path, engines: dict[str, Any], state: LearnerState, *, keep: int = 2) -> None:
    """Collective: every rank calls it. Returns once the checkpoint is committed (``latest.json``).

    ``engines`` are the DeepSpeed engines by name (their sub-directory); ``state.extra`` is recipe state
    stored with the version (e.g. an offline trainer's best validation metric). No shared filesystem is
    needed (docs/ray.md §4): every rank writes its own files on its node (DeepSpeed's
    ``checkpoint.use_node_local_storage`` makes each node's first rank write the model states too);
    rank 0's ``latest.json`` is the commit point, and each other node's first rank then writes its copy.
    ``learner/checkpoint_async.py`` splits the same two phases around a writer thread.
    """
    tag = _tag(state.version)
    for name, engine in engines.items():
        engine.save_checkpoint(str(ckpt_dir / name), tag=tag)
    write_state(ckpt_dir, state_files(state))
    make_durable(ckpt_dir, [*engines], tag)
    commit(ckpt_dir, [*engines], state.version, keep=keep)


def state_files(state: LearnerState) -> dict[str, Any]:
    """This rank's own JSON files of the checkpoint by name: its RNG states, and on rank 0 the learner state
    (a copy: the caller's lists may change once this returns)."""
    rank = dist.get_rank()
    files: dict[str, Any] = {f"rng_rank{rank}.json": rng_state()}
    if rank == 0:
        files["learner.json"] = {
            "version": state.version,
            "trained_ids": list(state.trained_ids),
            "acked": to_json(state.acked),
            "extra": json.loads(json.dumps(state.extra)),
        }
    return {"tag": _tag(state.version), "files": files}


def write_state(ckpt_dir: Path, written: dict[str, Any]) -> None:
    """Write :func:`state_files`' files under ``state/<tag>``, each durable before it becomes visible."""
    state_dir = ckpt_dir / "state" / written["tag"]
    state_dir.mkdir(parents=True, exist_ok=True)
    for name, obj in written["files"].items():
        _write_json(state_dir / name, obj)


def _node_lead() -> bool:
    return dist.get_rank() == 0 or int(os.environ.get("LOCAL_RANK", "0")) == 0


def make_durable(ckpt_dir: Path, engine_names: list[str], tag: str) -> None:
    """Fsync every file of checkpoint ``tag`` on this node (its node-leading rank walks the folders). Not a
    collective: the asynchronous writer calls it from its thread."""
    if _node_lead():
        for sub in [*engine_names, "state"]:
            if (ckpt_dir / sub / tag).exists():
                _fsync_tree(ckpt_dir / sub / tag)


def commit(
    ckpt_dir: Path, engine_names: list[str], version: int, *, keep: int = 2, prune_now: bool = True
) -> None:
    """Collective, once every rank's files of ``version`` are durable: rank 0 replaces ``latest.json`` (the
    commit point), then each other node's first rank writes its copy and old checkpoints are pruned, here
    or (``prune_now=False``) by the caller, with :func:`prune`."""
    tag, rank = _tag(version), dist.get_rank()
    dist.barrier()
    if rank == 0:
        _write_json(ckpt_dir / LATEST, {"tag": tag, "version": version})
    dist.barrier()
    if _node_lead():
        if rank != 0:
            _write_json(ckpt_dir / LATEST, {"tag": tag, "version": version})
        if prune_now:
            prune(ckpt_dir, engine_names, version, keep)
    dist.barrier()


def prune(ckpt_dir: Path, engine_names: list[str], committed: int, keep: int) -> None:
    """On a node's first rank: remove all but the ``keep`` newest checkpoints up to ``committed``. Newer
    folders (a write in flight) are never counted, so the committed one is never removed."""
    if not _node_lead():
        return
    tags = sorted(p.name for p in (ckpt_dir / "state").iterdir() if p.name.startswith("v"))
    for old in [t for t in tags if t <= _tag(committed)][:-keep]:
        for sub in [*engine_names, "state"]:
            shutil.rmtree(ckpt_dir / sub / old, ignore_errors=True)


def _committed_version(ckpt_dir: Path) -> int:
    """The committed version by rank 0's ``latest.json`` (-1: none), told to every rank, so all load
    the same tag even where a node's own copy lags (a crash between the commit and the copies)."""
    latest = ckpt_dir / LATEST
    version = json.loads(latest.read_text())["version"] if dist.get_rank() == 0 and latest.exists() else -1
    if dist.get_world_size() == 1:
        return version
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    t = torch.tensor([version], dtype=torch.int64, device=device)
    dist.broadcast(t, 0)
    return int(t.item())


def load(ckpt_dir: Path, engines: dict[str, Any]) -> LearnerState | None:
    """Restore the newest committed checkpoint into ``engines`` and the RNGs; None when there is none."""
    version = _committed_version(ckpt_dir)
    if version < 0:
        return None
    tag = _tag(version)
    for name, engine in engines.items():
        path, _ = engine.load_checkpoint(str(ckpt_dir / name), tag=tag)
        if path is None:
            raise FileNotFoundError(f"checkpoint {ckpt_dir / name / tag} is missing or unreadable")
    state_dir = ckpt_dir / "state" / tag
    rng_file = state_dir / f"rng_rank{dist.get_rank()}.json"
    if rng_file.exists():  # absent when resuming with more ranks than the checkpoint had
        set_rng_state(json.loads(rng_file.read_text()))
    learner = json.loads((state_dir / "learner.json").read_text())
    trained_ids = list(learner["trained_ids"])
    # A checkpoint written before the lineage was recorded covers its own ids only.
    acked = from_json(learner["acked"]) if "acked" in learner else merge([], map(parse, trained_ids))
    return LearnerState(
        version=int(learner["version"]),
        trained_ids=trained_ids,
        extra=learner.get("extra") or {},
        acked=acked,
    )
