"""The PPO recipe (and its GRPO / RLOO / REINFORCE++ variants): score a batch, estimate advantages, PPO epochs.

:meth:`PPOLearner.step` is the whole algorithm, top to bottom; the buffer, weight sync and exactly-once
commits around it are ``learner/online.py``'s, the ranks and stopping ``learner/runtime.py``'s.

Design decisions:

- **Three policies** (AReaL's decoupled PPO, docs/design.md §4.2): ``behav_logp`` comes with the trajectory,
  ``prox_logp`` is the actor recomputed once at the start of the step (no grad), ``logp`` is the actor
  with gradient inside the PPO epochs. Math lives in ``learner/advantages.py`` and ``learner/losses.py``;
  the estimator is chosen once at setup from ``ADVANTAGE_ESTIMATORS``.
- **Losses are token-level means over each minibatch**, however it is split: every micro-batch's loss is
  divided by the minibatch's token count (all ranks know it: every rank holds the whole batch), and
  multiplied by the data-parallel world size because DeepSpeed averages gradients over data-parallel
  ranks (and sums a sequence-parallel group's, ``learner/sequence_parallel.py``). One rank and N ranks
  compute the same update.
- **No-grad passes are split by rows** (length-balanced) and assembled with one all-reduce; each minibatch
  is split the same way. All ranks run the same number of forward passes, which ZeRO-3 needs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from buffer.schema import Trajectory
from learner import moe
from learner.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs, masked_mean, token_rewards
from learner.batch import (
    Batch,
    Layout,
    MicroBatch,
    assemble_response,
    local_response_view,
    make_batch,
    response_view,
)
from learner.importance import importance_weights, mismatch_metrics
from learner.kl_control import AdaptiveKLController, make_kl_controller
from learner.lm_head import use_chunked_head
from learner.losses import (
    KL_ESTIMATORS,
    aggregation_units,
    distill_loss,
    distill_reverse_kl,
    distill_rewards,
    entropy_from_logits,
    kl_k3,
    logprobs_from_logits,
    policy_loss,
    value_loss,
)
from learner.models import Models, load_models, output_head, policy_logits, policy_logprobs, values, visiting
from learner.online import OnlineRuntime, peak_memory_gb
from learner.passes import Pass, beside, run_passes
from learner.routing_replay import RoutingReplay
from learner.runtime import Stats, grad_norm, log
from learner.sequence_parallel import check_models
from placement.configured import critic_threads
from tandem.config import Config
from tandem.timing import Timers, timed


def reward_part_means(trajs: list[Trajectory]) -> dict[str, float]:
    """``reward/<part>``: the batch mean of each named reward part (e.g. exact match, format)."""
    totals: dict[str, float] = {}
    for t in trajs:
        for name, value in t.reward_parts.items():
            totals[name] = totals.get(name, 0.0) + value
    return {f"reward/{name}": total / len(trajs) for name, total in totals.items()}


def episode_metric_means(trajs: list[Trajectory]) -> dict[str, float]:
    """``env/<name>``: the batch mean of each environment metric (e.g. the calculator's ``tool_used``, a
    tool-call rate) and of ``env/turns``, over the multi-turn episodes of the batch (docs/environments.md §10.3)."""
    sums: dict[str, list[float]] = {}
    for t in trajs:
        metrics = {k: v for k, v in t.meta.items() if k.startswith("env/")}
        if "turns" in t.meta:
            metrics["env/turns"] = t.meta["turns"]
        for name, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                sums.setdefault(name, []).append(float(value))
    return {name: sum(v) / len(v) for name, v in sums.items()}


def token_staleness(trajs: list[Trajectory], version: int, width: int) -> Tensor:
    """Learner ``version`` minus the policy version that generated each response token (``mismatch/kl_k3/s*``).

    Shape: (B, width) int64; 0 past a response's end (environment tokens, version -1, are off the mask)."""
    out = np.zeros((len(trajs), width), dtype=np.int64)
    for i, t in enumerate(trajs):
        out[i, : len(t.token_versions)] = version - t.token_versions
    return torch.from_numpy(out)


def served_ref_logp(batch: Batch) -> Tensor:
    """The reference logprobs scored outside the learner (``placement.reference`` server or own), 0 off
    the mask.

    Shape: (B, R). With ``server``, a trajectory without them came from a server that does not score the
    reference; with ``own``, the learner filled them from the reference worker before this.
    """
    if batch.ref_logp is None:
        t = next(t for t in batch.trajs if t.ref_logp is None)
        raise ValueError(
            f"trajectory {t.traj_id} (from {t.server_id or 'an unnamed producer'}) carries no ref_logp, but "
            "placement.reference=server has the learner read the reference's log-probabilities from the "
            "rollout servers: every server of the run must score them (placement.reference=server and "
            "kl_coef > 0 in its config)"
        )
    return batch.ref_logp * batch.mask


class PPOLearner(OnlineRuntime):
    """The PPO recipe on the online runtime: actor, optional critic (gae) and reference (kl_coef > 0)."""

    def __init__(
        self, cfg: Config, run_dir: str | Path, *, resume: bool = False, layout: Layout = "pad"
    ) -> None:
        super().__init__(cfg, run_dir, resume=resume, layout=layout)
        a = cfg.algorithm
        self.estimate = ADVANTAGE_ESTIMATORS[a.advantage]
        self.timers = Timers()
        self.kl_estimator = KL_ESTIMATORS[a.kl_estimator]
        self.kl_ctl = make_kl_controller(a.kl_coef, a.kl_target, a.kl_horizon)  # learner/kl_control.py
        # seq-mean-token-sum-norm's constant (Dr. GRPO): the longest response the servers may generate.
        self.agg_norm = a.loss_agg_norm or cfg.rollout.max_new_tokens
        self.require_multiple_of_ranks(
            **{"algorithm.batch_size": a.batch_size, "algorithm.minibatch_size": a.minibatch_size}
        )
        # One optimizer step per batch starts from the proximal policy, so its forward pass is the
        # actor's own (detached) and a separate no-grad pass would compute the same numbers again. Not
        # when the KL is folded into the reward: advantages need it before the first backward.
        self.prox_is_current = not a.proximal_pass
        # placement.reference server or own: the rollout servers or the reference worker score the
        # reference; each trajectory brings it.
        self.served_reference = cfg.reference_scorer in ("server", "own")
        if cfg.placement.scoring == "split" and self.device.type != "cpu":  # run.device auto found a GPU
            raise ValueError(
                f"placement.scoring=split shares the learner's CPU threads between its scoring passes; this "
                f"learner runs on {self.device}: use placement.scoring=serial"
            )
        # placement.critic: own: the critic scores and trains beside the actor, on threads of its own.
        self.critic_threads = critic_threads(cfg)
        if self.critic_threads and self.device.type != "cpu":
            raise ValueError(
                f"placement.critic=own trains the critic beside the actor on CPU threads of its own; this "
                f"learner runs on {self.device}: use placement.critic=learner"
            )
        self.models: Models | None = None
        self.router_tap: moe.RouterTap | None = None  # a mixture-of-experts actor's routers
        # Its routing replay: forces recorded routing with algorithm.routing_replay=rollout, and counts
        # moe/routing_flips against any recorded routing either way.
        self.routing_replay: RoutingReplay | None = None

    def recipe_state(self) -> dict[str, Any]:
        """Also the adaptive KL coefficient (``algorithm.kl_target``): a resume goes on from the β it reached,
        not from ``kl_coef``. A fixed coefficient is the config's, so a resume may change it."""
        state = super().recipe_state()
        if isinstance(self.kl_ctl, AdaptiveKLController):
            state["kl_coef"] = self.kl_ctl.value
        return state

    def restore_recipe_state(self, extra: dict[str, Any]) -> None:
        super().restore_recipe_state(extra)
        if isinstance(self.kl_ctl, AdaptiveKLController) and "kl_coef" in extra:
            self.kl_ctl.value = float(extra["kl_coef"])

    def load_models(self) -> Models:
        models = load_models(self.cfg, self.device)
        actor = models.actor.module
        self.router_tap = moe.RouterTap.of(actor)
        replay = self.cfg.algorithm.routing_replay == "rollout"
        if replay and not moe.is_moe(actor):
            raise ValueError(
                f"algorithm.routing_replay=rollout needs a mixture-of-experts actor; {self.cfg.model.actor} "
                "has no router: set algorithm.routing_replay=off"
            )
        self.routing_replay = RoutingReplay.of(actor, force=replay)
        if self.routing_replay is not None:
            r = moe.routers(actor)
            self.routing_shape = (len(r), self.routing_replay.k, int(r[0].num_experts))
        if self.sp.size > 1:
            if moe.is_moe(actor):
                raise ValueError(
                    f"learner.sequence_parallel: {self.cfg.model.actor} is a mixture-of-experts model, whose "
                    "recorded routing and router metrics are laid out for whole rows (docs/design.md §4.12)"
                )
            roles = {"actor": actor, "critic": models.critic and models.critic.module}
            roles |= {"reference": models.reference, "teacher": models.teacher}
            check_models({k: v for k, v in roles.items() if v is not None}, actor)
        return models

    def replaying(self, mb: MicroBatch, *, count: bool = True) -> contextlib.AbstractContextManager[None]:
        """The actor's forward (and backward) inside: routed as the engine routed ``mb``'s tokens."""
        replay = self.routing_replay
        return contextlib.nullcontext() if replay is None else replay.replaying(mb.routed, count=count)

    def smoke_test(self) -> None:
        """One tiny forward of every model (on every rank: a collective under ZeRO-3)."""
        tok = self.models.tokenizer
        token = tok.eos_token_id if tok.eos_token_id is not None else 0
        dummy = Trajectory(
            traj_id="smoke",
            group_id="smoke",
            prompt_id="smoke",
            prompt_tokens=[token],
            response_tokens=[token],
            behav_logp=[0.0],
            token_versions=[0],
            reward=0.0,
            ref_logp=[0.0] if self.served_reference else None,
        )
        smoke = make_batch([dummy] * self.world, 0).to(self.device)
        prox_logp, ref_logp, old_values = self.score(smoke)
        teacher_logp = self.score_teacher(smoke)
        for name, t in (
            ("actor", prox_logp),
            ("reference", ref_logp),
            ("critic", old_values),
            ("teacher", teacher_logp),
        ):
            if t is not None and not torch.isfinite(t).all():
                raise RuntimeError(f"start-up forward of the {name} gave non-finite outputs")

    # --------------------------------------------------------------------------------------------- step

    def step(self) -> bool:
        """One learner step; False when asked to stop before a batch arrived."""
        with timed() as wait:
            taken = self.take_batch()  # rank 0 reads the buffer; every rank receives the batch
            if taken is None:
                return False
            per_turn = self.cfg.algorithm.credit == "turn"
            budget = self.cfg.learner.max_tokens_per_micro_batch
            batch = make_batch([t.traj for t in taken], self.version, per_turn=per_turn, max_tokens=budget)
            batch = batch.to(self.device)
            self.warn_over_budget(batch)
        with timed() as train:
            self.timers.clear()  # per-role phases of this step (the placement planner's profile)
            stats = self.train(batch)  # no-grad passes, advantages, PPO epochs, optimizer steps
            if "policy/kl" in stats:  # every rank: the same reduced value, the same coefficient
                stats["policy/kl_coef"] = self.kl_ctl.value
                self.kl_ctl.update(stats["policy/kl"], len(batch))
            stats.update(self.steer_staleness(stats))  # max_staleness auto: the next version's bound
            self.version += 1
        with timed() as sync:
            self.sync_weights()  # publish version v, then open admission for it
        with timed() as checkpoint:
            # checkpoint when due, then ack what it contains
            self.commit([t.id for t in taken], [t.traj.prompt_id for t in taken])
        stats.update(
            {
                "reward/mean": float(batch.rewards.mean()),
                **reward_part_means(batch.trajs),
                **episode_metric_means(batch.trajs),
                "staleness/mean": float(batch.staleness.float().mean()),
                "staleness/max": float(batch.staleness.max()),
                "time/wait_for_data": wait.seconds,
                "time/train": train.seconds,
                "time/weight_sync": sync.seconds,
                "weightsync/bytes": float(self.sync_bytes),
                "time/checkpoint": checkpoint.seconds,
                "checkpoint/stall_s": self.ckpt_stats.get("checkpoint/stall_s", 0.0),
                "checkpoint/wait_s": self.ckpt_stats.get("checkpoint/wait_s", 0.0),
                **self.switch,  # colocated: the learner's offload and reload around the wait (GPU)
                **self.score_waits,  # placement.reference / reward_model: own
                **self.timers,
                "throughput/train_tokens_per_s": batch.num_tokens / train.seconds,
                "batch/tokens": float(batch.seq_lens.sum()),
                "memory/peak_gb": peak_memory_gb(self.device),
                "learner/version": self.version,
            }
        )
        if budget is not None:
            stats["batch/over_budget"] = float(batch.dropped.sum())
        if self.version % self.cfg.logging.log_interval == 0:
            self.telemetry.log({**stats, **self.buffer_metrics()}, step=self.version)
        if self.samples is not None:  # logging.samples_interval: a few of this batch as text
            self.samples.log(self.version, batch.trajs)
        return True

    def train(self, batch: Batch) -> dict[str, float]:
        """Everything between a batch and its optimizer steps; every rank, the same code."""
        a = self.cfg.algorithm
        # (B, R) each; ref/values None without a reference/critic, prox None when it would equal logp
        prox_logp, ref_logp, old_values = self.score(batch, actor=not self.prox_is_current)
        kl_reward = None
        if a.kl_in_reward and ref_logp is not None:
            kl_reward = self.kl_estimator(prox_logp, ref_logp)  # (B, R)
        rewards = token_rewards(
            batch.rewards, batch.mask, kl_reward, self.kl_ctl.value, placed=batch.turn_rewards
        )  # (B, R)
        teacher_logp = self.score_teacher(batch)  # (B, R); None without algorithm.distill
        if teacher_logp is not None and a.distill.as_ == "reward":
            # The sampler's own log-probabilities: the reverse KL of the policy that drew the tokens.
            rewards = rewards + distill_rewards(batch.behav_logp, teacher_logp, batch.mask, a.distill.coef)
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
                weight=batch.episode_weight,
            )
        )
        staleness = token_staleness(batch.trajs, self.version, batch.mask.shape[1]).to(self.device)
        return self.ppo_update(
            batch, prox_logp, ref_logp, adv, returns, old_values, staleness, teacher_logp=teacher_logp
        )

    def warn_over_budget(self, batch: Batch) -> None:
        """A trajectory longer than the token budget is dropped, not trained on alone (docs/design.md §4.8):
        a pass above the budget may not fit in memory, and a learner killed by it would take the same
        batch again after its restart."""
        if not self.lead or batch.dropped is None or not batch.dropped.any():
            return
        budget = self.cfg.learner.max_tokens_per_micro_batch
        for i in batch.dropped.nonzero().flatten().tolist():
            t = batch.trajs[i]
            log.warning(
                "trajectory %s: %d tokens, more than learner.max_tokens_per_micro_batch=%d; masked out of "
                "this step (batch/over_budget)",
                t.traj_id,
                len(t.prompt_tokens) + len(t.response_tokens),
                budget,
            )

    # --------------------------------------------------------------------------------------------- math

    @torch.no_grad()
    def score(
        self, batch: Batch, *, actor: bool = True
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """``prox_logp`` (None unless ``actor``), reference logprobs and critic values of every response
        token. Shape: (B, R) each.

        With ``placement.reference`` server or own the reference logprobs are the batch's own, scored by the
        rollout servers or the reference worker with the same model, dtype and temperature
        (``rollout/reference.py``)."""
        m = self.models
        served = served_ref_logp(batch) if self.served_reference else None  # fails before any pass
        if not actor and m.reference is None and m.critic is None:  # GRPO, one optimizer step: no pass
            return None, served, None
        prox_logp = torch.zeros_like(batch.behav_logp) if actor else None
        ref_logp = None if m.reference is None else torch.zeros_like(batch.behav_logp)
        old_values = None if m.critic is None else torch.zeros_like(batch.behav_logp)
        m.actor.eval()
        if m.critic is not None:
            m.critic.eval()
        passes: list[Pass] = []
        if prox_logp is not None:

            def actor_pass(mb: MicroBatch) -> None:
                with self.replaying(mb):
                    prox_logp[mb.rows] = self.logprobs(m.actor, mb, batch.mask[mb.rows])[0]

            passes.append(("time/actor_logp", actor_pass))
        if ref_logp is not None:

            def reference_pass(mb: MicroBatch) -> None:
                with visiting(m.reference, self.device, m.reference_on_cpu) as ref:
                    ref_logp[mb.rows] = self.logprobs(ref, mb, batch.mask[mb.rows])[0]

            passes.append(("time/reference", reference_pass))
        if old_values is not None:

            def critic_pass(mb: MicroBatch) -> None:
                old_values[mb.rows] = response_view(values(m.critic, mb), mb)

            passes.append(("time/critic_values", critic_pass))
        mbs = list(self.micro(batch, torch.arange(len(batch))))
        split = self.cfg.placement.scoring == "split"
        if self.critic_threads and old_values is not None:  # the critic's pass beside the others
            mine, critic = passes[:-1], passes[-1:]

            def scored(p: list[Pass], split: bool) -> Callable[[], None]:
                def run() -> None:
                    with torch.no_grad():  # a new thread starts with gradients on
                        run_passes(p, mbs, split=split, timers=self.timers)

                return run

            beside(
                [(scored(mine, split), self.actor_threads()), (scored(critic, False), self.critic_threads)]
            )
        else:
            run_passes(passes, mbs, split=split, timers=self.timers)
        # Each row was filled by exactly one rank (zeros elsewhere): a sum assembles the whole batch.
        prox_logp, ref_logp, old_values = (
            None if t is None else self.all_sum(t * batch.mask) for t in (prox_logp, ref_logp, old_values)
        )
        return prox_logp, (ref_logp if served is None else served), old_values

    @torch.no_grad()
    def score_teacher(self, batch: Batch) -> Tensor | None:
        """log π_teacher of every response token (``algorithm.distill``), scored as the learner scores the
        reference: the same tempered log-probabilities, its placement's device visits, one all-reduce.
        None without a teacher. Shape: (B, R), 0 off the mask."""
        teacher = self.models.teacher
        if teacher is None:
            return None
        teacher_logp = torch.zeros_like(batch.behav_logp)

        def teacher_pass(mb: MicroBatch) -> None:
            with visiting(teacher, self.device, self.models.teacher_on_cpu) as model:
                teacher_logp[mb.rows] = self.logprobs(model, mb, batch.mask[mb.rows])[0]

        mbs = list(self.micro(batch, torch.arange(len(batch))))
        run_passes([("time/teacher", teacher_pass)], mbs, split=False, timers=self.timers)
        return self.all_sum(teacher_logp * batch.mask)

    def logprobs(
        self,
        model: nn.Module,
        mb: MicroBatch,
        mask: Tensor,
        *,
        entropy: bool = False,
        entropy_grad: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Log-probabilities of ``mb.targets`` under the tempered ``model`` and, with ``entropy``, its
        entropies (with gradient only with ``entropy_grad``). Shape: (b, R) each, valid where ``mask``.

        Above ``learner.chunked_head_threshold`` logits (vocabulary x response tokens) the chunked head
        computes them from the hidden states without a (b, R, V) tensor (docs/design.md §4.8); below it the
        logits are small and the plain path (no recompute in backward) is kept.
        """
        lc, temperature = self.cfg.learner, self.models.temperature
        head = None if lc.chunked_head == "off" else output_head(model)
        # A micro-batch's nominal response tokens, not its actual ones: the same on every rank and every
        # micro-batch of the step, so all ranks take the same path (under ZeRO-3 they gather differently).
        budget = lc.max_tokens_per_micro_batch
        tokens = lc.micro_batch_size * mb.targets.shape[1] if budget is None else budget
        if head is not None and use_chunked_head(
            lc.chunked_head, head.out_features, tokens, lc.chunked_head_threshold
        ):
            logp, ent = policy_logprobs(
                model, mb, temperature, mask, head, chunk_logits=lc.chunked_head_chunk, with_entropy=entropy
            )
            return logp, (ent if entropy_grad else ent.detach()) if entropy else None
        # (b, R, V): of a sharded micro-batch this rank's tokens, assembled once reduced to (b, R)
        logits, mine = local_response_view(policy_logits(model, mb, temperature), mb)
        logp = assemble_response(logprobs_from_logits(logits, mb.targets), mine, mb)
        if not entropy:
            return logp, None
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            return logp, assemble_response(entropy_from_logits(logits), mine, mb)

    def ppo_update(
        self,
        batch: Batch,
        prox_logp: Tensor | None,
        ref_logp: Tensor | None,
        adv: Tensor,
        returns: Tensor | None,
        old_values: Tensor | None,
        staleness: Tensor | None = None,
        *,
        teacher_logp: Tensor | None = None,
    ) -> dict[str, float]:
        """``ppo_epochs`` passes over shuffled minibatches; one optimizer step per minibatch per model.

        The actor's updates and the critic's read the same minibatches and neither reads the other's, so
        they run one after the other (``placement.critic: learner``) or at once, the critic on threads of
        its own (``own``): the same numbers either way."""
        a, m = self.cfg.algorithm, self.models
        # Same permutation on every rank; a function of (seed, version), so a resumed run repeats it.
        order = torch.Generator().manual_seed(self.cfg.run.seed * 1_000_003 + self.version)
        minibatches = [
            rows
            for _ in range(a.ppo_epochs)
            for rows in torch.randperm(len(batch), generator=order).split(a.minibatch_size)
        ]
        actor_stats, critic_stats = Stats(), Stats()

        def actor() -> None:
            m.actor.train()
            trained = len(minibatches)
            for i, rows in enumerate(minibatches):
                # Before the first optimizer step the current policy is the proximal one: nothing to measure.
                if i and a.stop_kl is not None and self.update_kl(batch, rows, prox_logp) > a.stop_kl:
                    trained = i
                    break
                num_tokens = batch.mask[rows].sum()  # the whole minibatch's, on all ranks
                # what the policy loss averages over: the same tokens (token-mean) or the sequences
                units = aggregation_units(batch.mask[rows], a.loss_agg)
                with self.timers("time/actor_train"):
                    for mb in self.micro(batch, rows):
                        self.actor_backward(
                            mb,
                            batch,
                            prox_logp,
                            ref_logp,
                            adv,
                            num_tokens,
                            actor_stats,
                            staleness,
                            units,
                            teacher_logp=teacher_logp,
                        )
                    m.actor.step()
                grad_norm(m.actor, "actor", actor_stats)
            if a.stop_kl is not None:
                skipped = torch.tensor(1.0 - trained / len(minibatches))
                actor_stats.add("policy/kl_skipped_frac", skipped, torch.ones(()))

        def critic() -> None:
            m.critic.train()
            for rows in minibatches:
                num_tokens = batch.mask[rows].sum()
                with self.timers("time/critic_train"):
                    for mb in self.micro(batch, rows):
                        self.critic_backward(mb, batch, old_values, returns, num_tokens, critic_stats)
                    m.critic.step()
                grad_norm(m.critic, "critic", critic_stats)

        if m.critic is None:
            actor()
        elif self.critic_threads:
            beside([(actor, self.actor_threads()), (critic, self.critic_threads)])
        else:
            actor()
            critic()
        actor_stats.extend(critic_stats)
        return actor_stats.reduce()

    @torch.no_grad()
    def update_kl(self, batch: Batch, rows: Tensor, prox_logp: Tensor) -> float:
        """KL(proximal ‖ current) over minibatch ``rows``: the k3 token mean of ``policy/approx_kl``, by a
        no-grad forward of the actor as it now is, over every rank's rows (the same on all ranks)."""
        stats = Stats()
        for mb in self.micro(batch, rows):
            mask = batch.mask[mb.rows]
            with self.replaying(mb):
                logp = self.logprobs(self.models.actor, mb, mask)[0]
            stats.add("kl", (kl_k3(prox_logp[mb.rows], logp) * mask).sum(), mask.sum())
        return stats.reduce().get("kl", 0.0)

    def actor_threads(self) -> int:
        """The actor's share of the learner's threads when the critic has its own."""
        return max(1, torch.get_num_threads() - self.critic_threads)

    def actor_backward(
        self,
        mb: MicroBatch,
        batch: Batch,
        prox_logp: Tensor | None,
        ref_logp: Tensor | None,
        adv: Tensor,
        num_tokens: Tensor,
        stats: Stats,
        staleness: Tensor | None = None,
        units: Tensor | None = None,
        *,
        teacher_logp: Tensor | None = None,
    ) -> None:
        a, rows = self.cfg.algorithm, mb.rows
        units = num_tokens if units is None else units  # the minibatch's aggregation_units
        mask = batch.mask[rows]  # (b, R)
        tap = self.router_tap  # a MoE actor's router logits of this forward pass, for moe_terms
        with tap.recording() if tap else contextlib.nullcontext(), self.replaying(mb):
            # (b, R) each; the entropy carries gradient only when it is in the loss
            logp, entropy = self.logprobs(
                self.models.actor, mb, mask, entropy=True, entropy_grad=a.entropy_coef > 0
            )
        # The batch's only optimizer step starts from the proximal policy: logp *is* prox_logp here.
        prox = logp.detach() if prox_logp is None else prox_logp[rows]
        behav, imp = batch.behav_logp[rows], a.importance
        weights = importance_weights(  # learner/importance.py: (w, cut), (b, R) each
            prox,
            behav,
            mask,
            level=imp.level,
            treatment=imp.treatment,
            cap=a.is_cap,
            mask_low=imp.mask_low,
            mask_high=imp.mask_high,
        )
        loss, metrics = policy_loss(
            logp,
            prox,
            behav,
            adv[rows],
            mask,
            eps_clip_low=a.eps_clip_low,
            eps_clip_high=a.eps_clip_high,
            is_cap=a.is_cap,
            dual_clip=a.dual_clip,
            num_tokens=units,
            loss=a.loss,
            gspo_clip_low=a.gspo_clip_low,
            gspo_clip_high=a.gspo_clip_high,
            importance=weights,
            agg=a.loss_agg,
            agg_norm=self.agg_norm,
        )
        n = mask.sum()
        stats.add("loss/policy", loss * units, aggregation_units(mask, a.loss_agg))
        stats.add_means(metrics, n)
        means, counts = mismatch_metrics(
            prox,
            behav,
            mask,
            cut=weights[1],
            treatment=imp.treatment,
            staleness=None if staleness is None else staleness[rows],
        )
        for key, mean in means.items():  # each over its own tokens (a staleness bucket's, for kl_k3/s*)
            stats.add(key, mean * counts[key], counts[key])
        entropy = masked_mean(entropy, mask, num_tokens)
        stats.add("policy/entropy", entropy * num_tokens, n)
        loss = loss - a.entropy_coef * entropy if a.entropy_coef > 0 else loss
        ref, teacher = (None if t is None else t[rows] for t in (ref_logp, teacher_logp))
        loss = loss + self.kl_terms(logp, prox, ref, teacher, mask, num_tokens, stats)
        if tap:
            loss = loss + self.moe_terms(tap, mb, batch, n / num_tokens, stats)
        # DeepSpeed averages gradients over data-parallel ranks; the loss is already a mean over the minibatch.
        with self.replaying(mb, count=False):  # a gradient-checkpointing recompute routes alike
            self.models.actor.backward(loss * self.dp_world)

    def moe_terms(
        self, tap: moe.RouterTap, mb: MicroBatch, batch: Batch, share: Tensor, stats: Stats
    ) -> Tensor | float:
        """Router metrics of the micro-batch's forward pass (``moe/...``, over its tokens, and
        ``moe/routing_flips`` over its recorded token-layer slots) into ``stats``; the
        load-balancing loss with ``learner.moe_aux_loss_coef`` > 0 (else 0), weighted by the micro-batch's
        ``share`` of the minibatch's response tokens so the accumulated term is the minibatch's mean."""
        padded = mb.position_ids is None
        valid = moe.token_mask(mb.input_ids, batch.seq_lens[mb.rows] if padded else None)
        tokens = mb.input_ids.new_tensor(mb.input_ids.numel()) if valid is None else valid.sum()
        stats.add_means(moe.router_metrics(tap.layers, tap.k, valid), tokens)
        if self.routing_replay is not None:  # 0 slots without recorded routing: left out of the metrics
            flips, slots = self.routing_replay.take_flips()
            stats.add("moe/routing_flips", flips.to(tokens.device), slots.to(tokens.device))
        coef = self.cfg.learner.moe_aux_loss_coef
        if coef == 0:
            return 0.0
        aux = moe.aux_loss(self.models.actor.module, tap.layers, valid)
        stats.add("loss/moe_aux", aux * tokens, tokens)
        return coef * aux * share

    def kl_terms(
        self,
        logp: Tensor,
        prox: Tensor,
        ref_logp: Tensor | None,
        teacher_logp: Tensor | None,
        mask: Tensor,
        num_tokens: Tensor,
        stats: Stats,
    ) -> Tensor | float:
        """The micro-batch's KL metrics into ``stats`` and its KL loss terms: to the reference
        (``policy/kl``; ``loss/kl`` unless the KL is in the reward) and to the distillation teacher
        (``distill/kl``, the proximal student's mean reverse KL; ``loss/distill`` with ``as: loss``).
        Shape: (b, R) each -> () or 0.0."""
        a, n, term = self.cfg.algorithm, mask.sum(), 0.0
        if ref_logp is not None:
            kl = masked_mean(self.kl_estimator(prox, ref_logp), mask, num_tokens)
            stats.add("policy/kl", kl * num_tokens, n)
        if ref_logp is not None and not a.kl_in_reward:
            kl_loss = masked_mean(self.kl_estimator(logp, ref_logp), mask, num_tokens)
            stats.add("loss/kl", kl_loss * num_tokens, n)
            term = term + self.kl_ctl.value * kl_loss
        if teacher_logp is not None:
            kl = masked_mean(distill_reverse_kl(prox, teacher_logp, mask), mask, num_tokens)
            stats.add("distill/kl", kl * num_tokens, n)
        if teacher_logp is not None and a.distill.as_ == "loss":
            distill = distill_loss(logp, teacher_logp, mask, a.distill.coef, num_tokens)
            stats.add("loss/distill", distill * num_tokens, n)
            term = term + distill
        return term

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
        self.models.critic.backward(a.vf_coef * loss * self.dp_world)
