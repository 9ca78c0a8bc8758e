"""The learner process: take a batch, score it, estimate advantages, run PPO epochs, publish, checkpoint.

``python -m learner.train --config FILE [key.sub=value ...] --run-dir DIR [--resume]``; several ranks
through ``torchrun --nproc-per-node N -m learner.train ...``. :meth:`Learner.step` is the whole
algorithm, top to bottom; everything else here is plumbing around it.

Design decisions:

- **Three policies** (AReaL's decoupled PPO, docs/design.md §4.2): ``behav_logp`` comes with the trajectory,
  ``prox_logp`` is the actor recomputed once at the start of the step (no grad), ``logp`` is the actor
  with gradient inside the PPO epochs. Math lives in ``learner/advantages.py`` and ``learner/losses.py``;
  the estimator is chosen once at setup from ``ADVANTAGE_ESTIMATORS``.
- **Losses are token-level means over each minibatch**, however it is split: every micro-batch's loss is
  divided by the minibatch's token count (all ranks know it: every rank holds the whole batch), and
  multiplied by the world size because DeepSpeed averages gradients over ranks. One rank and N ranks
  compute the same update.
- **Multi-rank: rank 0 reads, everyone trains.** Rank 0 alone talks to Redis (buffer, telemetry, weight
  publisher) under the stable consumer name ``learner-0``, and broadcasts each batch as msgpack bytes
  (``learner/batch.py``; no pickle) over a gloo group; an empty broadcast means stop. Every rank then
  holds the whole batch, so advantages (group statistics, batch whitening) need no extra communication.
  The no-grad passes are split by rows (length-balanced) and assembled with one all-reduce; each
  minibatch is split the same way. All ranks run the same number of forward passes, which ZeRO-3 needs.
  This puts one reader on the stream, so exactly-once stays a single-consumer problem
  (``learner/checkpoint.py``).
- **Order after the optimizer step** (synchronous equivalence, docs/design.md §3.5, §3.6): version ``v += 1``; publish
  version-``v`` weights if ``v % sync_interval == 0``; *then* ``buffer.set_version(v)``, which opens
  admission, so no server starts a group for ``v`` before its weights exist. At start-up (and on resume)
  the current weights are published before anything waits for them, so a broken weight path fails at
  step 0.
- **Sync mode is the same code**: ``run.mode == "sync"`` only makes ``Config.max_staleness`` 0; with servers
  honouring admission the learner then trains only on data of its current version.
- **Stopping**: after ``learner.total_steps``, on ``Telemetry.stop_requested()``, or on SIGTERM/SIGINT: the
  current step finishes, then a final checkpoint (and the final actor as a HF directory).
- **Audit trail**: rank 0 appends ``{"version", "ids"}`` per step to ``<run dir>/trained.jsonl``; after a
  resume the last line of each version is the one the surviving model contains.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import TextIO

import redis
import torch
import torch.distributed as dist
from torch import Tensor

import weightsync
from buffer.schema import Trajectory
from buffer.streams import ReplayBuffer, Taken
from learner import checkpoint
from learner.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs, masked_mean, token_rewards
from learner.batch import (
    Batch,
    Layout,
    MicroBatch,
    decode_batch,
    encode_batch,
    make_batch,
    micro_batches,
    response_view,
    trajectory_problem,
)
from learner.losses import KL_ESTIMATORS, entropy_from_logits, logprobs_from_logits, policy_loss, value_loss
from learner.models import (
    Models,
    init_distributed,
    load_models,
    policy_logits,
    resolve_device,
    values,
    visiting,
)
from tandem.config import Config, load_config, redact
from tandem.telemetry import Telemetry, setup_logging

log = logging.getLogger("learner")

CONSUMER = "learner-0"  # stable across restarts: the buffer re-delivers this consumer's pending entries
POLL_S = 1.0  # how often a wait for data re-checks for a stop request


class Stats:
    """Weighted means accumulated over micro-batches and reduced over ranks once per step."""

    def __init__(self) -> None:
        self.sums: dict[str, Tensor] = {}
        self.weights: dict[str, Tensor] = {}

    def add(self, key: str, total: Tensor, weight: Tensor) -> None:
        total, weight = total.detach().float(), weight.detach().float()
        finite = torch.isfinite(total)  # not e.g. the explained variance of constant returns
        self.sums[key] = self.sums.get(key, 0.0) + torch.where(finite, total, 0.0)
        self.weights[key] = self.weights.get(key, 0.0) + torch.where(finite, weight, 0.0)

    def add_means(self, metrics: dict[str, Tensor], weight: Tensor) -> None:
        for key, mean in metrics.items():
            self.add(key, mean * weight, weight)

    def reduce(self) -> dict[str, float]:
        """One all-reduce for every metric; only the keys with weight (a metric of no token is left out)."""
        keys = sorted(self.sums)  # the same keys on every rank: the same code ran
        if not keys:
            return {}
        packed = torch.stack([torch.stack([self.sums[k], self.weights[k]]) for k in keys])  # (K, 2)
        if dist.get_world_size() > 1:
            dist.all_reduce(packed)
        return {k: s / w for k, (s, w) in zip(keys, packed.tolist(), strict=True) if w > 0}


def reward_part_means(trajs: list[Trajectory]) -> dict[str, float]:
    """``reward/<part>``: the batch mean of each named reward part (e.g. exact match, format)."""
    totals: dict[str, float] = {}
    for t in trajs:
        for name, value in t.reward_parts.items():
            totals[name] = totals.get(name, 0.0) + value
    return {f"reward/{name}": total / len(trajs) for name, total in totals.items()}


class Learner:
    """One learner rank: the models, and on rank 0 the buffer, the weight publisher and telemetry."""

    def __init__(
        self, cfg: Config, run_dir: str | Path, *, resume: bool = False, layout: Layout = "pad"
    ) -> None:
        self.cfg, self.run_dir, self.resume, self.layout = cfg, Path(run_dir), resume, layout
        a = cfg.algorithm
        self.estimate = ADVANTAGE_ESTIMATORS[a.advantage]
        self.kl_estimator = KL_ESTIMATORS[a.kl_estimator]
        self.ckpt_dir = Path(cfg.learner.checkpoint_dir or self.run_dir / "checkpoints")
        self.device = resolve_device(cfg)
        self.ctrl = init_distributed(self.device)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.lead = self.rank == 0
        for name, size in (
            ("algorithm.batch_size", a.batch_size),
            ("algorithm.minibatch_size", a.minibatch_size),
        ):
            if size % self.world:
                raise ValueError(f"{name} ({size}) must be a multiple of the learner ranks ({self.world})")
        torch.manual_seed(cfg.run.seed + self.rank)
        # One optimizer step per batch starts from the proximal policy, so its forward pass is the
        # actor's own (detached) and a separate no-grad pass would compute the same numbers again. Not
        # when the KL is folded into the reward: advantages need it before the first backward.
        self.prox_is_current = (
            a.prox_forward == "auto"
            and a.ppo_epochs == 1
            and a.minibatch_size == a.batch_size
            and not (a.kl_in_reward and a.kl_coef > 0)
        )
        self.version = 0
        self.pending: list[str] = []  # trained on, not yet in a committed checkpoint, so not acked
        self.checkpointed_version = -1
        self.acked_through = 0  # trajectories (counted over versions) whose ids are acked
        self._signalled = False
        self._old_handlers: dict[int, object] = {}
        self.client: redis.Redis | None = None
        self.buffer: ReplayBuffer | None = None
        self.publisher: weightsync.Publisher = weightsync.DrainPublisher()
        self.trained_log: TextIO | None = None
        quiet = cfg.model_copy(update={"logging": cfg.logging.model_copy(update={"wandb_mode": "disabled"})})
        self.telemetry = Telemetry(quiet, f"learner-{self.rank}")  # a null object off rank 0
        self.models: Models | None = None

    # ----------------------------------------------------------------------------------------- start-up

    def start(self) -> None:
        """Fail here, not at step 1,000: Redis answers, every model loads and runs, weights publish."""
        if self.lead:
            self.client = connect(self.cfg)
            self.buffer = ReplayBuffer.from_config(self.client, self.cfg, CONSUMER)
            self.publisher = weightsync.make_publisher(self.cfg, self.client, run_dir=str(self.run_dir))
            self.telemetry = Telemetry(self.cfg, "learner", self.client, run_dir=str(self.run_dir))
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.trained_log = open(self.run_dir / "trained.jsonl", "a")  # noqa: SIM115 (closed in close())
        self.models = load_models(self.cfg, self.device)
        self.smoke_test()
        state = checkpoint.load(self.ckpt_dir, self.models) if self.resume else None
        if state is not None:
            self.version = self.checkpointed_version = state.version
            self.acked_through = self.version * self.cfg.algorithm.batch_size
            if self.lead:  # their update is in the checkpoint: never train on them again
                self.buffer.ack(state.trained_ids)
                a = self.cfg.algorithm
                self.buffer.recount_admission(
                    self.version, batch_size=a.batch_size, n_samples=self.cfg.rollout.n_samples
                )
            log.info("resumed at version %d from %s", self.version, self.ckpt_dir)
        elif self.resume:
            log.warning("--resume: no checkpoint in %s, starting fresh", self.ckpt_dir)
        self.sync_weights(force=True)
        self.telemetry.mark_ready(version=self.version)
        self._old_handlers = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)
        }

    def smoke_test(self) -> None:
        """One tiny forward of every model (on every rank: a collective under ZeRO-3)."""
        tok = self.models.tokenizer
        token = tok.eos_token_id if tok.eos_token_id is not None else 0
        dummy = Trajectory(
            traj_id="smoke", group_id="smoke", prompt_id="smoke", prompt_tokens=[token], response_tokens=[token],
            behav_logp=[0.0], token_versions=[0], reward=0.0,
        )  # fmt: skip
        prox_logp, ref_logp, old_values = self.score(make_batch([dummy] * self.world, 0).to(self.device))
        for name, t in (("actor", prox_logp), ("reference", ref_logp), ("critic", old_values)):
            if t is not None and not torch.isfinite(t).all():
                raise RuntimeError(f"start-up forward of the {name} gave non-finite outputs")

    def _on_signal(self, signum: int, frame: object) -> None:
        log.info("signal %d: finishing the current step, then a final checkpoint", signum)
        self._signalled = True

    # --------------------------------------------------------------------------------------------- loop

    def run(self) -> None:
        self.start()
        try:
            while self.version < self.cfg.learner.total_steps and self.step():
                pass
            self.finish()
        finally:
            self.close()

    def step(self) -> bool:
        """One learner step; False when asked to stop before a batch arrived."""
        t0 = time.perf_counter()
        taken = self.take_batch()  # rank 0 reads the buffer; every rank receives the batch
        if taken is None:
            return False
        batch = make_batch([t.traj for t in taken], self.version).to(self.device)
        t1 = time.perf_counter()
        stats = self.train(batch)  # no-grad passes, advantages, PPO epochs, optimizer steps
        self.version += 1
        t2 = time.perf_counter()
        self.sync_weights()  # publish version v, then open admission for it
        t3 = time.perf_counter()
        self.commit([t.id for t in taken])  # checkpoint when due, then ack what it contains
        t4 = time.perf_counter()
        stats.update(
            {
                "reward/mean": float(batch.rewards.mean()),
                **reward_part_means(batch.trajs),
                "staleness/mean": float(batch.staleness.float().mean()),
                "staleness/max": float(batch.staleness.max()),
                "time/wait_for_data": t1 - t0,
                "time/train": t2 - t1,
                "time/weight_sync": t3 - t2,
                "time/checkpoint": t4 - t3,
                "throughput/train_tokens_per_s": batch.num_tokens / (t2 - t1),
                "learner/version": self.version,
            }
        )
        if self.version % self.cfg.logging.log_interval == 0:
            self.telemetry.log({**stats, **self.buffer_metrics()}, step=self.version)
        return True

    def train(self, batch: Batch) -> dict[str, float]:
        """Everything between a batch and its optimizer steps; every rank, the same code."""
        a = self.cfg.algorithm
        # (B, R) each; ref/values None without a reference/critic, prox None when it would equal logp
        prox_logp, ref_logp, old_values = self.score(batch, actor=not self.prox_is_current)
        kl_reward = None
        if a.kl_in_reward and ref_logp is not None:
            kl_reward = self.kl_estimator(prox_logp, ref_logp)  # (B, R)
        rewards = token_rewards(batch.rewards, batch.mask, kl_reward, a.kl_coef)  # (B, R)
        adv, returns = self.estimate(
            AdvantageInputs(
                rewards,
                batch.mask,
                batch.group_index,
                old_values,
                a.gamma,
                a.lam,
                a.normalize_std,
                a.whiten_advantages,
            )
        )
        return self.ppo_update(batch, prox_logp, ref_logp, adv, returns, old_values)

    # ------------------------------------------------------------------------------------- data and math

    def take_batch(self) -> list[Taken] | None:
        """Exactly ``batch_size`` trajectories, or None when a stop is requested first (on every rank)."""
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

    def take_from_buffer(self) -> list[Taken] | None:
        need, taken = self.cfg.algorithm.batch_size, []
        timeout = self.cfg.learner.take_timeout_s
        deadline = time.monotonic() + timeout
        while len(taken) < need:
            if self.stop_requested():
                return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"learner: {len(taken)}/{need} trajectories arrived within learner.take_timeout_s={timeout:g}s "
                    f"at version {self.version}: are rollout servers running and receiving weights?"
                )
            taken += self.buffer.take(
                need - len(taken),
                min(remaining, POLL_S),
                max_staleness=self.cfg.max_staleness,
                validate=self.unusable,
            )
        return taken

    def unusable(self, t: Trajectory) -> str | None:
        return trajectory_problem(t, self.models.vocab_size)

    def micro(self, batch: Batch, rows: Tensor) -> list[MicroBatch]:
        """This rank's micro-batches of ``rows``: sorted by length and dealt round-robin, so shares balance."""
        rows = rows[torch.argsort(batch.seq_lens[rows], descending=True, stable=True)][
            self.rank :: self.world
        ]
        return micro_batches(batch, rows, self.cfg.learner.micro_batch_size, self.layout, self.device)

    @torch.no_grad()
    def score(
        self, batch: Batch, *, actor: bool = True
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """``prox_logp`` (None unless ``actor``), reference logprobs and critic values of every response
        token. Shape: (B, R) each."""
        m, temperature = self.models, self.models.temperature
        prox_logp = torch.zeros_like(batch.behav_logp) if actor else None
        ref_logp = None if m.reference is None else torch.zeros_like(batch.behav_logp)
        old_values = None if m.critic is None else torch.zeros_like(batch.behav_logp)
        m.actor.eval()
        if m.critic is not None:
            m.critic.eval()
        for mb in self.micro(batch, torch.arange(len(batch))):
            if prox_logp is not None:
                prox_logp[mb.rows] = logprobs_from_logits(
                    response_view(policy_logits(m.actor, mb, temperature), mb), mb.targets
                )
            if ref_logp is not None:
                with visiting(m.reference, self.device, m.reference_on_cpu) as ref:
                    ref_logp[mb.rows] = logprobs_from_logits(
                        response_view(policy_logits(ref, mb, temperature), mb), mb.targets
                    )
            if old_values is not None:
                old_values[mb.rows] = response_view(values(m.critic, mb), mb)
        # Each row was filled by exactly one rank (zeros elsewhere): a sum assembles the whole batch.
        return tuple(
            None if t is None else self.all_sum(t * batch.mask) for t in (prox_logp, ref_logp, old_values)
        )

    def all_sum(self, t: Tensor) -> Tensor:
        if self.world > 1:
            dist.all_reduce(t)
        return t

    def ppo_update(
        self,
        batch: Batch,
        prox_logp: Tensor | None,
        ref_logp: Tensor | None,
        adv: Tensor,
        returns: Tensor | None,
        old_values: Tensor | None,
    ) -> dict[str, float]:
        """``ppo_epochs`` passes over shuffled minibatches; one optimizer step per minibatch per model."""
        a, m, stats = self.cfg.algorithm, self.models, Stats()
        # Same permutation on every rank; a function of (seed, version), so a resumed run repeats it.
        order = torch.Generator().manual_seed(self.cfg.run.seed * 1_000_003 + self.version)
        m.actor.train()
        if m.critic is not None:
            m.critic.train()
        for _ in range(a.ppo_epochs):
            for rows in torch.randperm(len(batch), generator=order).split(a.minibatch_size):
                num_tokens = batch.mask[rows].sum()  # the whole minibatch's, on all ranks
                for mb in self.micro(batch, rows):
                    self.actor_backward(mb, batch, prox_logp, ref_logp, adv, num_tokens, stats)
                    if m.critic is not None:
                        self.critic_backward(mb, batch, old_values, returns, num_tokens, stats)
                m.actor.step()
                if m.critic is not None:
                    m.critic.step()
        return stats.reduce()

    def actor_backward(
        self,
        mb: MicroBatch,
        batch: Batch,
        prox_logp: Tensor | None,
        ref_logp: Tensor | None,
        adv: Tensor,
        num_tokens: Tensor,
        stats: Stats,
    ) -> None:
        a, rows = self.cfg.algorithm, mb.rows
        mask = batch.mask[rows]  # (b, R)
        logits = response_view(policy_logits(self.models.actor, mb, self.models.temperature), mb)  # (b, R, V)
        logp = logprobs_from_logits(logits, mb.targets)  # (b, R)
        # The batch's only optimizer step starts from the proximal policy: logp *is* prox_logp here.
        prox = logp.detach() if prox_logp is None else prox_logp[rows]
        loss, metrics = policy_loss(
            logp, prox, batch.behav_logp[rows], adv[rows], mask,
            eps_clip_low=a.eps_clip_low, eps_clip_high=a.eps_clip_high, is_cap=a.is_cap,
            dual_clip=a.dual_clip, num_tokens=num_tokens,
        )  # fmt: skip
        n = mask.sum()
        stats.add("loss/policy", loss * num_tokens, n)
        stats.add_means(metrics, n)
        with torch.set_grad_enabled(a.entropy_coef > 0):
            entropy = masked_mean(entropy_from_logits(logits), mask, num_tokens)
        stats.add("policy/entropy", entropy * num_tokens, n)
        loss = loss - a.entropy_coef * entropy if a.entropy_coef > 0 else loss
        if ref_logp is not None:
            kl = masked_mean(self.kl_estimator(prox, ref_logp[rows]), mask, num_tokens)
            stats.add("policy/kl", kl * num_tokens, n)
        if ref_logp is not None and not a.kl_in_reward:
            kl_loss = masked_mean(self.kl_estimator(logp, ref_logp[rows]), mask, num_tokens)
            stats.add("loss/kl", kl_loss * num_tokens, n)
            loss = loss + a.kl_coef * kl_loss
        # DeepSpeed averages gradients over ranks; the loss is already a mean over the whole minibatch.
        self.models.actor.backward(loss * self.world)

    def critic_backward(
        self,
        mb: MicroBatch,
        batch: Batch,
        old_values: Tensor,
        returns: Tensor,
        num_tokens: Tensor,
        stats: Stats,
    ) -> None:
        a, rows = self.cfg.algorithm, mb.rows
        mask = batch.mask[rows]
        v = response_view(values(self.models.critic, mb), mb)  # (b, R)
        loss, metrics = value_loss(
            v, old_values[rows], returns[rows], mask, value_clip=a.value_clip, num_tokens=num_tokens
        )
        stats.add("loss/value", loss * num_tokens, mask.sum())
        stats.add_means(metrics, mask.sum())
        self.models.critic.backward(a.vf_coef * loss * self.world)

    # ------------------------------------------------------------------------------ weights and commits

    def sync_weights(self, *, force: bool = False) -> None:
        """Publish version ``v`` (when due), *then* announce it: admission opens only once weights exist."""
        if force or self.version % self.cfg.algorithm.sync_interval == 0:
            # A collective under ZeRO-3: every rank gathers; ranks other than 0 hold a draining publisher.
            try:
                self.publisher.publish(weightsync.named_full_parameters(self.models.actor), self.version)
            except weightsync.WeightSyncError as e:
                if force:  # at start-up a broken weight path fails at step 0
                    raise
                # A server died during the hand-off (docs/design.md §6.3): the launcher restarts it and it
                # joins the next version; the live servers keep generating meanwhile.
                log.warning("weights v%d did not reach every server: %s", self.version, e)
        if self.lead:
            self.buffer.set_version(self.version)

    def commit(self, ids: list[str]) -> None:
        """Record the step's ids; checkpoint when due and only then ack (exactly-once, learner/checkpoint.py)."""
        if self.lead:
            self.pending.extend(ids)
            self.trained_log.write(json.dumps({"version": self.version, "ids": ids}) + "\n")
            self.trained_log.flush()
        interval = self.cfg.learner.checkpoint_interval
        # Unacked ids occupy the stream (ack deletes): checkpoint early rather than let producers block.
        crowded = (
            self.version * self.cfg.algorithm.batch_size - self.acked_through
        ) * 2 > self.cfg.redis.stream_maxlen
        if (interval and self.version % interval == 0) or crowded:
            self.save_checkpoint()

    def save_checkpoint(self) -> None:
        checkpoint.save(self.ckpt_dir, self.models, checkpoint.LearnerState(self.version, list(self.pending)))
        if self.lead:
            self.buffer.ack(self.pending)
            self.pending.clear()
        self.checkpointed_version = self.version
        self.acked_through = self.version * self.cfg.algorithm.batch_size

    def finish(self) -> None:
        """Final checkpoint and, when configured, the final actor as a Hugging Face directory."""
        if self.checkpointed_version != self.version or self.pending:
            self.save_checkpoint()
        if self.cfg.learner.save_hf_final:
            self.save_hf(self.run_dir / "final")

    def save_hf(self, out: Path) -> None:
        state = dict(weightsync.named_full_parameters(self.models.actor))  # collective under ZeRO-3
        if self.lead:
            self.models.actor.module.save_pretrained(out, state_dict=state)
            self.models.tokenizer.save_pretrained(out)
            log.info("final actor (version %d) saved to %s", self.version, out)
        dist.barrier()

    # ------------------------------------------------------------------------------------------- helpers

    def stop_requested(self) -> bool:
        return self._signalled or self.telemetry.stop_requested()

    def buffer_metrics(self) -> dict[str, float]:
        if self.buffer is None:
            return {}
        return {k: v for k, v in self.buffer.metrics().items() if k.startswith("buffer/")}

    def close(self) -> None:
        for sig, handler in self._old_handlers.items():
            if handler is not None:  # None: installed outside Python, nothing to restore
                signal.signal(sig, handler)
        self.publisher.close()
        if self.trained_log is not None:
            self.trained_log.close()
        self.telemetry.close()
        if self.client is not None:
            self.client.close()


def connect(cfg: Config) -> redis.Redis:
    if cfg.redis.url is None:
        raise ValueError(
            "redis.url is not set: launch.py writes the embedded Redis URL into the learner's config"
        )
    client = redis.Redis.from_url(cfg.redis.url, socket_timeout=30, socket_connect_timeout=10)
    try:
        client.ping()
    except redis.RedisError as e:
        raise ConnectionError(f"learner: Redis at {redact(cfg.redis.url)} does not answer: {e}") from None
    return client


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m learner.train", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="YAML config (launch.py writes the resolved one)")
    p.add_argument("--run-dir", required=True, help="run directory: checkpoints, trained.jsonl, final/")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint, if any")
    p.add_argument("--layout", choices=["pad", "pack"], default="pad", help="see learner/batch.py")
    p.add_argument("overrides", nargs="*", help="key.sub=value")
    args = p.parse_intermixed_args(argv)
    cfg = load_config(args.config, args.overrides)
    setup_logging(cfg.logging.level)
    Learner(cfg, args.run_dir, resume=args.resume, layout=args.layout).run()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
