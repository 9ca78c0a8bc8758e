"""The ``dpo`` recipe: direct preference optimisation (Rafailov et al., 2023) against a frozen reference.

:meth:`DPOTrainer.train_step` is the algorithm: the policy's summed log-probability of each pair's chosen
and rejected response, the implied rewards ``β·(log π − log π_ref)``, the loss
``−(1−ε)·log σ(r_c − r_r) − ε·log σ(r_r − r_c)`` (ε = ``label_smoothing``, conservative DPO) averaged
over pairs, one optimizer step. The reference log-probabilities of every train and held-out pair are
computed once at start-up and the reference is then freed: it never shares memory with the policy's
optimizer. Logged: ``dpo/reward_accuracy`` (implied reward of chosen > rejected) and ``dpo/margin``, and on
held-out pairs the same plus ``eval/logp_accuracy``: how often the policy itself gives the chosen response
the higher likelihood, which, unlike the implied reward (0 for both at step 0), has a baseline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoTokenizer

from learner.batch import Batch, MicroBatch, make_batch
from learner.examples import Pair, as_trajectory, load_pairs
from learner.models import load_frozen, load_policy, make_engine, resolve_dtype
from learner.offline_runtime import OfflineRuntime
from learner.runtime import Stats, grad_norm


def dpo_loss(
    logp_c: Tensor, logp_r: Tensor, ref_c: Tensor, ref_r: Tensor, beta: float, label_smoothing: float = 0.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """Summed DPO loss over pairs, and summed metrics. Inputs: sequence log-probabilities, shape (b,)."""
    reward_c, reward_r = beta * (logp_c - ref_c), beta * (logp_r - ref_r)
    margin = reward_c - reward_r
    loss = -(1 - label_smoothing) * F.logsigmoid(margin) - label_smoothing * F.logsigmoid(-margin)
    metrics = {
        "reward_accuracy": (margin > 0).float().sum(),
        "margin": margin.detach().sum(),
        "reward_chosen": reward_c.detach().sum(),
        "reward_rejected": reward_r.detach().sum(),
        "logp_accuracy": (logp_c > logp_r).float().sum(),
    }
    return loss.sum(), metrics


class DPOTrainer(OfflineRuntime):
    headline = "eval/reward_accuracy"

    def load_models(self) -> None:
        cfg = self.cfg
        dtype = resolve_dtype(cfg, self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(
            cfg.model.actor, trust_remote_code=cfg.model.trust_remote_code
        )
        self.actor = make_engine(load_policy(cfg, cfg.model.actor, dtype), cfg, dtype, cfg.learner.actor_lr)
        self.reference: nn.Module | None = load_frozen(
            cfg, cfg.model.reference or cfg.model.actor, dtype, self.device
        )

    def start(self) -> None:
        super().start()
        self.reference = None  # every reference log-probability is computed: free it

    def load_examples(self, path: str) -> list[tuple[Pair, float, float]]:
        """Pairs with their reference log-probabilities (chosen, rejected), computed here, once."""
        a = self.cfg.algorithm
        pairs = load_pairs(path, self.tokenizer, max_tokens=a.max_tokens, chat_template=a.chat_template)
        ref = torch.zeros(len(pairs), 2)
        with torch.no_grad():
            for i in range(0, len(pairs), a.batch_size):
                chunk = pairs[i : i + a.batch_size]
                c, r = self.sequence_logps(self.reference, chunk)
                ref[i : i + len(chunk)] = torch.stack([c, r], 1).cpu()
        return [(p, float(c), float(r)) for p, (c, r) in zip(pairs, ref.tolist(), strict=True)]

    def engines(self) -> dict[str, Any]:
        return {"actor": self.actor}

    def pass_tokens(self, example: tuple[Pair, float, float]) -> int:
        p = example[0]
        c, r = len(p.prompt) + len(p.chosen), len(p.prompt) + len(p.rejected)
        return 2 * max(c, r) if self.layout == "pad" else c + r

    def batch_of(self, pairs: list[Pair]) -> Batch:
        """2b rows: every pair's chosen response, then every pair's rejected one."""
        trajs = [as_trajectory(p.prompt, p.chosen, f"c{i}") for i, p in enumerate(pairs)]
        trajs += [as_trajectory(p.prompt, p.rejected, f"r{i}") for i, p in enumerate(pairs)]
        return make_batch(trajs, 0).to(self.device)

    def micro_logps(self, model: nn.Module, batch: Batch, mb: MicroBatch) -> tuple[Tensor, Tensor, Tensor]:
        """Summed response log-probabilities of the micro-batch's pairs: (pair ids, chosen, rejected)."""
        b, mask = len(batch) // 2, batch.mask[mb.rows]
        logp, _ = self.response_logprobs(model, mb, mask, rows=2 * self.cfg.learner.micro_batch_size)
        seq = (logp * mask).sum(-1)  # (2k,) in mb.rows order
        pos = {r: k for k, r in enumerate(mb.rows.tolist())}
        ids = sorted(r for r in pos if r < b)
        c = seq[torch.tensor([pos[r] for r in ids], device=seq.device)]
        r = seq[torch.tensor([pos[r + b] for r in ids], device=seq.device)]
        return torch.tensor(ids), c, r

    def sequence_logps(self, model: nn.Module, pairs: list[Pair]) -> tuple[Tensor, Tensor]:
        """No-grad (chosen, rejected) log-probabilities of every pair, assembled over ranks. Shapes: (b,)."""
        batch = self.batch_of(pairs)
        out = torch.zeros(2, len(pairs), device=self.device)
        for mb in self.pair_micro(batch):
            ids, c, r = self.micro_logps(model, batch, mb)
            out[0, ids], out[1, ids] = c, r
        out = self.all_sum(out)
        return out[0], out[1]

    def train_step(self, examples: list[tuple[Pair, float, float]]) -> dict[str, float]:
        a, stats = self.cfg.algorithm, Stats()
        batch = self.batch_of([p for p, _, _ in examples])
        ref = torch.tensor([[c, r] for _, c, r in examples], device=self.device)  # (b, 2)
        self.actor.train()
        for mb in self.pair_micro(batch):
            ids, logp_c, logp_r = self.micro_logps(self.actor, batch, mb)
            loss, metrics = dpo_loss(logp_c, logp_r, ref[ids, 0], ref[ids, 1], a.beta, a.label_smoothing)
            n = torch.tensor(float(len(ids)))
            stats.add("loss/dpo", loss, n)
            stats.add_sums("dpo", metrics, n)
            self.actor.backward(loss / len(examples) * self.dp_world)  # a mean over the batch's pairs
        self.actor.step()
        grad_norm(self.actor, "actor", stats)
        return stats.reduce()

    @torch.no_grad()
    def evaluate(self, examples: list[tuple[Pair, float, float]]) -> dict[str, float]:
        a, stats = self.cfg.algorithm, Stats()
        self.actor.eval()
        for i in range(0, len(examples), a.batch_size):
            chunk = examples[i : i + a.batch_size]
            logp_c, logp_r = self.sequence_logps(self.actor, [p for p, _, _ in chunk])
            ref = torch.tensor([[c, r] for _, c, r in chunk], device=self.device)
            loss, metrics = dpo_loss(logp_c, logp_r, ref[:, 0], ref[:, 1], a.beta, a.label_smoothing)
            stats.add_sums("eval", {"loss": loss, **metrics}, torch.tensor(float(len(chunk))))
        return stats.reduce()

    def save_final(self, out: Path) -> None:
        self.save_hf(self.actor, out, self.tokenizer)
