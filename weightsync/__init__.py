"""Versioned actor-weight broadcast from the learner to every rollout server.

Learner (every rank; only rank 0 sends, the others drain the ZeRO-3 gather)::

    pub = make_publisher(cfg, client, run_dir=run_dir)
    pub.publish(named_full_parameters(actor_engine), version, announce=admission.queue_version)

Rollout server::

    sub = make_subscriber(cfg, client, server_id)
    if (upd := sub.poll(timeout=0)) is not None:
        engine.update_weights(upd)  # copies upd.tensors() in; poll already recorded upd.version as held
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import redis
import torch
import torch.distributed as torch_dist  # not `dist`: the weightsync.dist submodule takes that name

from tandem.config import Config
from weightsync.base import (
    Announce,
    PeersMissing,
    Publisher,
    Subscriber,
    TensorMeta,
    Update,
    WeightSyncError,
    latest_version,
    wait_for,
)
from weightsync.source import named_full_parameters

__all__ = [
    "Announce",
    "DrainPublisher",
    "PeersMissing",
    "Publisher",
    "Subscriber",
    "TensorMeta",
    "Update",
    "WeightSyncError",
    "latest_version",
    "make_publisher",
    "make_subscriber",
    "named_full_parameters",
    "wait_for",
]


class DrainPublisher(Publisher):
    """The publisher of learner ranks other than 0: consumes the (collective) iterator and sends nothing."""

    def _send(self, it: Iterator[tuple[str, torch.Tensor]], version: int) -> None:
        return None  # publish drains ``it``; rank 0 announces


def make_publisher(
    cfg: Config, client: redis.Redis, *, run_dir: str | os.PathLike[str] | None = None
) -> Publisher:
    """The weight path's publisher on rank 0 of the default group (or without one); else a drain."""
    if torch_dist.is_initialized() and torch_dist.get_rank() != 0:
        return DrainPublisher()
    ws, run, lora = cfg.weightsync, cfg.run.name, cfg.learner.lora
    if cfg.weight_path == "engine":
        # The engines receive over their own NCCL groups, driven from here (weightsync/engine_push.py).
        from weightsync.engine_push import EnginePublisher

        return EnginePublisher(cfg, client, run, backend="nccl" if ws.backend == "auto" else ws.backend)
    if cfg.weight_path == "shm":
        from weightsync.shm import ShmPublisher, default_root

        return ShmPublisher(
            client,
            run,
            ws.shm_dir or default_root(run, run_dir),
            config_dir=cfg.model.actor,
            shard_bytes=ws.bucket_mb << 20,
            # A run that releases memory keeps only what its servers hold (docs/placement.md §11.1).
            keep_versions=ws.keep_versions or (1 if cfg.releases_memory else 2),
            recycle=not cfg.releases_memory,
            live_s=ws.timeout_s,
            peft_adapter=cfg.rollout.engine == "vllm" and lora.rank > 0 and lora.sync == "adapter",
        )
    from weightsync.dist import DistPublisher

    return DistPublisher(
        client,
        run,
        backend=ws.backend,
        bucket_bytes=ws.bucket_mb << 20,
        timeout_s=ws.timeout_s,
        live_s=ws.timeout_s,
    )


def make_subscriber(
    cfg: Config, client: redis.Redis, server_id: str, *, run_dir: str | os.PathLike[str] | None = None
) -> Subscriber:
    """The weight path's subscriber; it registers ``server_id`` in Redis at once.

    ``run_dir`` is accepted for symmetry: shm subscribers find the files through the manifest's path.
    """
    ws, run = cfg.weightsync, cfg.run.name
    if cfg.weight_path == "engine":
        # The learner pushes straight into the engine; the server only learns which version it holds.
        from weightsync.engine_push import EngineVersionSubscriber

        return EngineVersionSubscriber(client, run, server_id)
    if cfg.weight_path == "shm":
        from weightsync.shm import ShmSubscriber

        return ShmSubscriber(
            client, run, server_id, timeout_s=ws.timeout_s, verify=ws.checksum, live_s=ws.timeout_s
        )
    from weightsync.dist import DistSubscriber

    return DistSubscriber(client, run, server_id, timeout_s=ws.timeout_s, live_s=ws.timeout_s)
