"""The online learner runtime: batches from the replay buffer, weights to the rollout servers, exactly-once.

What PPO (``learner/ppo.py``) and any future online recipe share, around their own ``train(batch)``:

- **Multi-rank: rank 0 reads, everyone trains.** Rank 0 alone talks to Redis (buffer, telemetry, weight
  publisher) under the stable consumer name ``learner-0``, and broadcasts each batch as msgpack bytes
  (``learner/batch.py``; no pickle) over a gloo group; an empty broadcast means stop. Every rank then
  holds the whole batch, so advantages (group statistics, batch whitening) need no extra communication.
  This puts one reader on the stream, so exactly-once stays a single-consumer problem
  (``learner/checkpoint.py``).
- **Order after the optimizer step** (synchronous equivalence, docs/design.md §3.5, §3.6): version ``v += 1``;
  publish version-``v`` weights if ``v % sync_interval == 0``; *then* ``admission.set_version(v)``, which opens
  admission, so no server starts a group for ``v`` before its weights exist. The publisher runs
  ``admission.queue_version`` in its own transaction that announces the weights (``publish(announce=)``);
  the learner sets the version itself only when no version was published or its publish failed. At start-up
  (and on resume) the current weights are published before anything waits for them, so a broken weight path
  fails at step 0.
- **Sync mode is the same code**: ``run.mode == "sync"`` only makes ``Config.max_staleness`` 0; with servers
  honouring admission the learner then trains only on data of its current version.
- **Stopping**: after ``learner.total_steps``, on ``Telemetry.stop_requested()``, or on SIGTERM/SIGINT: the
  current step finishes, then a final checkpoint (and the final actor as a HF directory).
- **What is published**: the actor's full weights; for a LoRA actor only its adapter tensors
  (``learner.lora.sync: adapter``, applied by the hf engine, ``weightsync/adapters.py``) or its merged
  weights. ``weightsync/bytes`` logs the size of each sync.
- **Redis restarts** (docs/design.md §6.6): every Redis call reconnects under bounded retries
  (``buffer/retry.py``); before each take, rank 0 checks whether Redis was restarted and if so repairs
  what the lost tail of its append-only file can hold: it re-acks what it acked lately, re-sets the version
  and recounts admission.
- **Joiners** (docs/design.md §5.7): before each take from the buffer, rank 0 publishes its current weights
  again when a ``dist`` server that holds none asks for them, so a joiner starts at the current version.
- **Audit trail**: rank 0 appends ``{"version", "ids", "prompts"}`` per step to ``<run dir>/trained.jsonl``; after a
  resume the last line of each version is the one the surviving model contains.
"""

from __future__ import annotations

import json
import logging
import resource
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import redis
import torch
import torch.distributed as dist

import weightsync
from buffer.admission import Admission, bound_key
from buffer.auto_staleness import StalenessState, StalenessTarget, next_bound
from buffer.retry import Incarnation, RedisUnavailable, connect_run
from buffer.schema import Trajectory
from buffer.stream_scores import RULES_REWARD, StreamScores
from buffer.streams import ReplayBuffer, Taken
from learner import acked_ranges, checkpoint, lora
from learner.batch import (
    Batch,
    Layout,
    MicroBatch,
    decode_batch,
    encode_batch,
    trajectory_problem,
    with_row_vision,
)
from learner.checkpoint_async import AsyncCheckpointer
from learner.models import Models
from learner.runtime import Runtime
from learner.samples import CompletionSamples
from tandem import fleet
from tandem.config import Config
from tandem.rewards import total_reward
from tandem.telemetry import Telemetry
from tandem.timing import timed
from tandem.vision import placeholder_ids
from weightsync.source import is_zero3, unwrap

log = logging.getLogger("learner")

CONSUMER = "learner-0"  # stable across restarts: the buffer re-delivers this consumer's pending entries
POLL_S = 1.0  # how often a wait for data re-checks for a stop request


def peak_memory_gb(device: torch.device) -> float:
    """This process's peak memory since the previous call, in GiB: ``memory/peak_gb`` of a learner step.

    On GPU the allocator's peak (``max_memory_allocated``), then reset. On CPU the resident set's
    high-water mark (``VmHWM``), then reset through ``/proc/self/clear_refs``, so each step reports its
    own peak; where that is not possible, ``getrusage``'s peak over the process's lifetime.
    """
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 2**30
    try:
        with open("/proc/self/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: reset the high-water mark to the current resident set
        return kib / 2**20
    except (OSError, StopIteration, ValueError):
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        return rss / (2**30 if sys.platform == "darwin" else 2**20)


class OnlineRuntime(Runtime):
    """A learner rank fed by the replay buffer; on rank 0 the buffer, the weight publisher and telemetry."""

    models: Models

    def __init__(
        self, cfg: Config, run_dir: str | Path, *, resume: bool = False, layout: Layout = "pad"
    ) -> None:
        super().__init__(cfg, run_dir, resume=resume, layout=layout)
        # (layers, k, experts) of a MoE actor's routers, to screen recorded routing; None for a dense one
        self.routing_shape: tuple[int, int, int] | None = None
        self.pending: list[str] = []  # trained on, not yet in a committed checkpoint, so not acked
        self.acked: list[acked_ranges.Range] = []  # every id trained into the checkpoint lineage
        self.acked_through = 0  # trajectories (counted over versions) whose ids are acked
        self.client: redis.Redis | None = None
        self.redis_incarnation: Incarnation | None = None
        self.buffer: ReplayBuffer | None = None
        self.admission: Admission | None = None  # the policy version, admission and its recount
        self.publisher: weightsync.Publisher = weightsync.DrainPublisher()
        self.trained_log: TextIO | None = None
        self.samples: CompletionSamples | None = None  # logging.samples_interval, on rank 0
        self.sync_bytes = 0  # bytes of the last published version (weightsync/bytes)
        self.admission_due = False  # a published version whose admission opens at the next take_batch
        self.switch: dict[str, float] = {}  # time/offload, time/reload of the last wait (colocated, GPU)
        # Scores of the roles on workers of their own (placement.reference / reward_model: own), by role.
        self.stream_scores: dict[str, StreamScores] = {}
        self.score_waits: dict[str, float] = {}  # time/<role>_wait: the last batch's wait for each worker
        # learner.checkpoint_async: the write in flight, and checkpoint/stall_s, checkpoint/wait_s of a step
        self.writer = (
            AsyncCheckpointer(self.ckpt_dir, group=self.ctrl, timeout_s=cfg.learner.checkpoint_timeout_s)
            if cfg.learner.checkpoint_async
            else None
        )
        self.ckpt_stats: dict[str, float] = {}
        # algorithm.max_staleness auto: the bound admission uses, steered by each step's policy/ess
        a = cfg.algorithm
        self.staleness = StalenessState(a.first_staleness_bound) if cfg.auto_staleness else None
        self.staleness_target = StalenessTarget(
            a.staleness_min, a.staleness_max, a.staleness_ess_target, a.staleness_patience
        )

    def load_models(self) -> Models:
        raise NotImplementedError

    def micro(self, batch: Batch, rows: torch.Tensor) -> list[MicroBatch]:
        """:meth:`Runtime.micro`, and for a vision-language actor each micro-batch with its rows' images
        (``learner.batch.with_vision``; a row dropped over the token budget reads no image) and the
        placeholder ids its policy never samples."""
        mbs = super().micro(batch, rows)
        config = self.vision_config
        return mbs if config is None else with_row_vision(mbs, batch, config)

    @property
    def vision_config(self) -> Any:
        """The actor's model config when it is a vision-language model, else None (also before the models
        are loaded: a learner built for its batch arithmetic alone, as tests build one)."""
        if self.models is None:
            return None
        config = getattr(self.models.actor.module, "config", None)
        return config if config is not None and placeholder_ids(config) else None

    def check_layout(self) -> None:
        """A vision-language actor trains in the ``pad`` layout only (learner/batch.py with_vision)."""
        if self.layout == "pack" and self.vision_config is not None:
            raise ValueError(
                f"learner/train.py --layout pack: {self.cfg.model.actor} is a vision-language model, whose "
                "3-D positions are computed per padded row; use --layout pad"
            )

    def smoke_test(self) -> None:
        """A tiny forward of every model, so a broken checkpoint fails at start-up."""

    # ------------------------------------------------------------------------------------------ start-up

    def start(self) -> None:
        """Fail here, not at step 1,000: Redis answers, every model loads and runs, weights publish."""
        if self.lead:
            self.client = connect(self.cfg)
            self.redis_incarnation = Incarnation(self.client)
            self.buffer = ReplayBuffer.from_config(self.client, self.cfg, CONSUMER)
            self.admission = Admission.from_config(self.client, self.cfg, CONSUMER)
            self.publish_bound()  # before any version opens admission
            self.publisher = weightsync.make_publisher(self.cfg, self.client, run_dir=str(self.run_dir))
            self.stream_scores = {
                r: StreamScores(self.client, self.cfg.run.name, r) for r in self.cfg.own_scorers
            }
            self.telemetry = Telemetry(self.cfg, "learner", self.client, run_dir=str(self.run_dir))
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.trained_log = open(self.run_dir / "trained.jsonl", "a")  # noqa: SIM115 (closed in close())
        self.models = self.load_models()
        self.check_layout()
        if self.lead and self.cfg.logging.samples_interval:
            self.samples = CompletionSamples(self.cfg, self.models.tokenizer, self.telemetry, self.run_dir)
        self.smoke_test()
        state = checkpoint.load(self.ckpt_dir, self.engines()) if self.resume else None
        if state is not None:
            self.version = self.checkpointed_version = state.version
            self.acked_through = self.version * self.cfg.algorithm.batch_size
            self.acked = state.acked
            self.restore_recipe_state(state.extra)
            if self.lead:  # their update is in the checkpoint: never train on them again
                self.reack_lineage()
                self.admission.recount(self.version, self.buffer)
                self.publish_bound()  # the checkpoint's bound, before any version opens admission
            log.info("resumed at version %d from %s", self.version, self.ckpt_dir)
        elif self.resume:
            log.warning("--resume: no checkpoint in %s, starting fresh", self.ckpt_dir)
        self.sync_weights(force=True)
        self.telemetry.mark_ready(version=self.version)
        self.install_signal_handlers()

    def publish_bound(self) -> None:
        """The staleness bound admission uses (``max_staleness: auto``, docs/design.md §3.7); without auto,
        no published bound (one left in Redis by an earlier run of the same name is dropped)."""
        if self.staleness is not None:
            self.admission.set_bound(self.staleness.bound)
        else:
            self.client.delete(bound_key(self.cfg.run.name))

    def steer_staleness(self, stats: dict[str, float]) -> dict[str, float]:
        """``max_staleness: auto``: the next bound from this step's ``policy/ess`` (buffer/auto_staleness.py),
        logged with its reason when it changes and published (every step: a restarted Redis may have lost
        it) before the next version opens admission. Returns ``staleness/bound``; nothing without auto.
        Every rank computes it from the same reduced stats; rank 0 publishes."""
        if self.staleness is None:
            return {}
        ess = stats.get("policy/ess", float("nan"))
        self.staleness, reason = next_bound(self.staleness, ess, self.staleness_target)
        if reason is not None and self.lead:
            log.info("auto staleness at version %d: %s", self.version, reason)
        if self.lead:
            self.publish_bound()
        return {"staleness/bound": float(self.staleness.bound)}

    def recipe_state(self) -> dict[str, Any]:
        """What a resumed run continues from besides weights, optimizer and acks (JSON, in the checkpoint):
        under ``max_staleness: auto`` the bound in force and its count of healthy steps, so a resume does
        not fall back to ``staleness_min``."""
        if self.staleness is None:
            return {}
        return {"staleness": {"bound": self.staleness.bound, "healthy": self.staleness.healthy}}

    def restore_recipe_state(self, extra: dict[str, Any]) -> None:
        """The inverse of :meth:`recipe_state`, from a checkpoint; a key this run does not use is ignored
        (a checkpoint of a run with other settings)."""
        if self.staleness is not None and "staleness" in extra:
            self.staleness = StalenessState(**extra["staleness"])

    def engines(self) -> dict[str, object]:
        """The trained engines a checkpoint holds, by name."""
        m = self.models
        return {"actor": m.actor} | ({"critic": m.critic} if m.critic is not None else {})

    # ---------------------------------------------------------------------------------------------- loop

    def run(self) -> None:
        self.start()
        try:
            while self.version < self.cfg.learner.total_steps and self.step():
                pass
            self.finish()
        finally:
            self.close()

    def step(self) -> bool:
        raise NotImplementedError

    # ---------------------------------------------------------------------------------------------- data

    def take_batch(self) -> list[Taken] | None:
        """Exactly ``batch_size`` trajectories, or None when a stop is requested first (on every rank).

        Colocated, the servers generate them meanwhile, so the trained engines' states wait in host memory
        (:meth:`states_offloaded`); with the batch in, every version's weight files are freed while it
        trains (``Publisher.trim``): the sleeping servers hold none, and the next version comes from it."""
        with self.states_offloaded():
            self.open_admission()
            taken = self._take_batch()
        if self.cfg.releases_memory:  # the servers generated this batch with the newest version and sleep
            self.publisher.trim(held_too=True)
        return taken

    def _take_batch(self) -> list[Taken] | None:
        taken = self.take_from_buffer() if self.lead else None
        if self.world == 1:
            return taken
        data = (
            encode_batch([t.traj for t in taken]) if taken is not None else torch.empty(0, dtype=torch.uint8)
        )
        size = torch.tensor([data.numel()])
        dist.broadcast(size, 0, group=self.ctrl)
        if not self.lead:
            data = torch.empty(int(size), dtype=torch.uint8)
        if int(size) == 0:
            return None
        dist.broadcast(data, 0, group=self.ctrl)
        return taken if self.lead else [Taken("", t) for t in decode_batch(data)]

    @contextmanager
    def states_offloaded(self) -> Iterator[None]:
        """Colocated (``placement.release_memory``): each trained engine's optimizer state, gradients and
        master weights go to host memory while the servers generate, and come back before training
        (DeepSpeed ``offload_states`` / ``reload_states``, docs/placement.md §11.1). Only where they can go
        somewhere (:func:`offloads_states`); the published weights went out before."""
        if not offloads_states(self.cfg, self.device):
            yield
            return
        with timed() as offload:
            for engine in self.engines().values():
                engine.offload_states()
        try:
            yield
        finally:
            with timed() as reload:
                for engine in self.engines().values():
                    engine.reload_states()
            self.switch = {"time/offload": offload.seconds, "time/reload": reload.seconds}

    def take_from_buffer(self) -> list[Taken] | None:
        need, taken = self.cfg.algorithm.batch_size, []
        timeout = self.cfg.learner.take_timeout_s
        deadline = time.monotonic() + timeout
        while len(taken) < need:
            self.heal_redis()
            if self.stop_requested():
                return None
            self.serve_joiners()
            if self.cfg.releases_memory:  # the old version's files go once every server holds the new one
                self.publisher.trim()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"learner: {len(taken)}/{need} trajectories arrived within learner.take_timeout_s={timeout:g}s "
                    f"at version {self.version}: are rollout servers running and receiving weights?"
                )
            taken += self.buffer.take(
                need - len(taken),
                min(remaining, POLL_S),
                admission=self.admission,
                validate=self.unusable,
            )
        return self.with_stream_scores(taken) if self.stream_scores else taken

    def with_stream_scores(self, taken: list[Taken]) -> list[Taken] | None:
        """Fill each trajectory from the workers of their own (``buffer/stream_scores.py``), waiting for any
        score not yet written; None on a stop request. The reference's are its ``ref_logp``; the reward
        model's is added to the rules' total the server recorded, as the server would have added it."""
        for role, scores in self.stream_scores.items():
            with timed() as waited:
                wanted = [t for t in taken if role != "reward_model" or RULES_REWARD in t.traj.meta]
                got = scores.wait(
                    [t.id for t in wanted],
                    timeout_s=self.cfg.learner.take_timeout_s,
                    stop=self.stop_requested,
                )
                if got is None:
                    return None
                for t in wanted:
                    if role == "reference":
                        t.traj.ref_logp = got[t.id]
                    else:
                        self.add_reward_model_score(t.traj, float(got[t.id][0]))
            self.score_waits[f"time/{role}_wait"] = waited.seconds
        return taken

    def add_reward_model_score(self, traj: Trajectory, score: float) -> None:
        """The worker's score as the part ``reward_model``, and the reward summed as the servers sum it."""
        traj.reward_parts["reward_model"] = score
        traj.reward = total_reward(
            traj.meta[RULES_REWARD],
            self.cfg.reward,
            model=score,
            overlong=traj.reward_parts.get("overlong"),
        )

    def heal_redis(self) -> None:
        """After a Redis restart, undo what the lost tail of its AOF (or a retried command) can have done
        (docs/design.md §6.6): an ack lost (ack again), a version bump lost (set it again), an admission
        increment lost or repeated (recount it, not counting trained ids awaiting their checkpoint twice)."""
        if not self.redis_incarnation.changed():
            return
        reacked = self.buffer.reack()
        self.reack_lineage()  # and every checkpointed id: the restart may have reloaded an older AOF (§6.7)
        self.admission.set_version(self.version)
        admitted = self.admission.recount(self.version, self.buffer, trained_unacked=len(self.pending))
        log.warning(
            "Redis was restarted: re-acked %d recent ids, version %d set again, admission recounted to %d",
            reacked,
            self.version,
            admitted,
        )

    def unusable(self, t: Trajectory) -> str | None:
        return trajectory_problem(t, self.models.vocab_size, self.routing_shape)

    # ------------------------------------------------------------------------------ weights and commits

    def sync_weights(self, *, force: bool = False) -> None:
        """Publish version ``v`` (when due), *then* announce it: admission opens only once weights exist.

        Colocated with offloaded states, admission for ``v`` opens later, in :meth:`take_batch` once the
        learner's states are in host memory: the servers wake to generate only then, never beside them."""
        self.sync_bytes = 0
        announced = False  # the publisher sets the version in its own announce transaction
        self.admission_due = offloads_states(self.cfg, self.device)
        if force or self.version % self.cfg.algorithm.sync_interval == 0:
            # A collective under ZeRO-3: every rank gathers; ranks other than 0 hold a draining publisher.
            counted = Counted(self.published_tensors())
            announce = self.admission.queue_version if self.lead and not self.admission_due else None
            try:
                self.publisher.publish(counted, self.version, announce=announce)
                announced = True
            except weightsync.WeightSyncError as e:
                if force:  # at start-up a broken weight path fails at step 0
                    raise
                # A server died during the hand-off (docs/design.md §6.3): the launcher restarts it and it
                # joins the next version; the live servers keep generating meanwhile.
                log.warning("weights v%d did not reach every server: %s", self.version, e)
            self.sync_bytes = counted.bytes
        if self.lead and not announced and not self.admission_due:
            self.admission.set_version(self.version)

    def open_admission(self) -> None:
        """Open admission for the version :meth:`sync_weights` published but left closed (colocated: the
        learner's states are in host memory now)."""
        if self.admission_due and self.lead:
            self.admission.set_version(self.version)
        self.admission_due = False

    def serve_joiners(self) -> None:
        """Publish the current weights again when a server that holds none waits for them (a ``dist``
        joiner, docs/design.md §5.7), so it generates at the current version rather than the next one.

        Rank 0 alone, between steps and while waiting for data; not under ZeRO-3 with several ranks, where
        gathering the weights is a collective (such a joiner receives the next publish)."""
        if not self.publisher.joiners_waiting():
            return
        if self.world > 1 and is_zero3(unwrap(self.models.actor)):
            return
        try:
            self.publisher.publish(self.published_tensors(), self.version)
            log.info("weights v%d published again for a joining server", self.version)
        except weightsync.WeightSyncError as e:
            log.warning("weights v%d did not reach a joining server: %s", self.version, e)

    def published_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The actor's full weights, or for a LoRA actor its adapters (or merged weights), by HF name."""
        named = weightsync.named_full_parameters(self.models.actor)
        module = self.models.actor.module
        if not lora.is_lora(module):
            return named
        if self.cfg.learner.lora.sync == "adapter":
            return lora.adapter_tensors(module, named)
        return lora.merged_tensors(module, named)

    def commit(self, ids: list[str], prompts: list[str] | None = None) -> None:
        """Record the step's ids (and the prompt ids they answer, for audits); checkpoint when due and only
        then ack (exactly-once, learner/checkpoint.py). An asynchronous write in flight commits here once
        every rank has written it."""
        self.ckpt_stats = {}
        if self.writer is not None:
            with timed() as polled:
                self.committed(self.writer.poll())
            self.count_stall(polled.seconds)
        if self.lead:
            self.pending.extend(ids)
            line = {"version": self.version, "ids": ids} | ({"prompts": prompts} if prompts else {})
            self.trained_log.write(json.dumps(line) + "\n")
            self.trained_log.flush()
        interval = self.cfg.learner.checkpoint_interval
        # Unacked ids occupy the stream (ack deletes): checkpoint early rather than let producers block.
        crowded = (
            self.version * self.cfg.algorithm.batch_size - self.acked_through
        ) * 2 > self.cfg.redis.stream_maxlen
        if (interval and self.version % interval == 0) or crowded:
            self.save_checkpoint()
        snapshot = self.cfg.learner.save_hf_interval
        if snapshot and self.version % snapshot == 0:  # written aside, then renamed: a reader sees it whole
            out = self.run_dir / "snapshots" / f"v{self.version:08d}"
            self.save_hf(self.models.actor, out.with_suffix(".tmp"), self.models.tokenizer)
            if self.lead and not out.exists():  # exists: this version was trained before a resume
                out.with_suffix(".tmp").rename(out)

    def reack_lineage(self) -> int:
        """Ack every id trained into the checkpoint lineage: Redis may have lost acks of *any* checkpoint
        (its last second of AOF, an older AOF restored), not only of the latest (docs/design.md §6.7)."""
        ranges = acked_ranges.to_json(self.acked)
        touched = self.buffer.ack_ranges(ranges)
        log.info("re-acked the lineage: %d range(s), %d id(s) still in Redis", len(ranges), touched)
        return touched

    def save_checkpoint(self) -> None:
        """Checkpoint the current version. Synchronous: written, committed, then acked before this returns.
        Asynchronous: wait for (and commit) the write in flight, snapshot to host memory, start the writer;
        its ids are acked at the commit (:meth:`committed`). ``checkpoint/stall_s`` is the time this held
        the learner, ``checkpoint/wait_s`` the part of it spent waiting for the previous write."""
        start = time.monotonic()
        if self.writer is not None:
            state, waited = self.writer.wait()
            self.committed(state)
            self.count_stall(0.0, waited)
        acked = self.acked
        if self.lead and self.pending:
            # Ranges may join across any gap except an entry still waiting to be trained (a barrier).
            ids = [acked_ranges.parse(i) for i in self.pending]
            top = max([*ids, *(hi for _, hi in self.acked)])
            waiting = self.buffer.trajectory_ids(acked_ranges.fmt(top))
            acked = acked_ranges.merge(self.acked, ids, map(acked_ranges.parse, waiting))
        state = checkpoint.LearnerState(self.version, list(self.pending), self.recipe_state(), acked=acked)
        if self.writer is None:
            checkpoint.save(self.ckpt_dir, self.engines(), state)
            self.committed(state)
        else:
            self.writer.snapshot(self.engines(), state)
        self.count_stall(time.monotonic() - start)

    def count_stall(self, stall_s: float, wait_s: float = 0.0) -> None:
        """Add to this step's ``checkpoint/stall_s`` (the learner held by checkpointing: a synchronous save, or
        a snapshot, a commit and any wait) and ``checkpoint/wait_s`` (waiting for the previous write)."""
        for key, seconds in (("checkpoint/stall_s", stall_s), ("checkpoint/wait_s", wait_s)):
            self.ckpt_stats[key] = self.ckpt_stats.get(key, 0.0) + seconds

    def committed(self, state: checkpoint.LearnerState | None) -> None:
        """Checkpoint ``state`` is committed: ack the ids it holds (the ones trained since stay pending)."""
        if state is None:
            return
        if self.lead:
            self.buffer.ack(state.trained_ids)
            del self.pending[: len(state.trained_ids)]  # pending grows at its end only
            for scores in self.stream_scores.values():  # the scores of every entry gone from the stream
                scores.drop_gone()
        self.acked = state.acked
        self.checkpointed_version = state.version
        self.acked_through = state.version * self.cfg.algorithm.batch_size

    def finish(self) -> None:
        """Final checkpoint and, when configured, the final actor as a Hugging Face directory."""
        if self.writer is not None:  # a write in flight commits first: it may be of this very version
            self.committed(self.writer.wait()[0])
        if self.checkpointed_version != self.version or self.pending:
            self.save_checkpoint()
        if self.writer is not None:  # and the last one before the run ends
            self.committed(self.writer.wait()[0])
        if self.cfg.learner.save_hf_final:
            self.save_hf(self.models.actor, self.run_dir / "final", self.models.tokenizer)

    # ------------------------------------------------------------------------------------------- helpers

    def buffer_metrics(self) -> dict[str, float]:
        """Buffer gauges, and ``fleet/servers``: rollout servers connected now (the summary's fleet size)."""
        if self.buffer is None:
            return {}
        out = {k: v for k, v in self.buffer.metrics().items() if k.startswith("buffer/")}
        out["fleet/servers"] = float(len(fleet.members(self.client, self.cfg.run.name)))
        return out

    def close(self) -> None:
        self.restore_signal_handlers()
        self.publisher.close()
        if self.trained_log is not None:
            self.trained_log.close()
        self.telemetry.close()
        if self.client is not None:
            self.client.close()


def offloads_states(cfg: Config, device: torch.device) -> bool:
    """Whether the learner offloads its training states while colocated servers generate: with
    ``placement.release_memory`` (``Config.releases_memory``), on GPU, and with a ZeRO optimizer.

    DeepSpeed 0.19's ``offload_states`` is a method of its ZeRO stage 1-2 and 3 optimizers only (stage 0
    keeps the torch optimizer, which has none), and it moves states to ``cpu``, the only device it accepts:
    on a CPU run the states already live there, so there is nothing to free."""
    return cfg.releases_memory and device.type == "cuda" and cfg.learner.zero_stage >= 1


class Counted:
    """An iterable of named tensors that counts the bytes that went through it."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.named, self.bytes = named, 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.named:
            self.bytes += t.numel() * t.element_size()
            yield name, t


def connect(cfg: Config) -> redis.Redis:
    if cfg.redis.url is None:
        raise ValueError(
            "redis.url is not set: launch.py writes the embedded Redis URL into the learner's config"
        )
    try:
        return connect_run(cfg.redis.url, reconnect_s=cfg.supervision.reconnect_s)
    except RedisUnavailable as e:
        raise ConnectionError(f"learner: {e}") from None
