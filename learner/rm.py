"""The ``rm`` recipe: a Bradley–Terry reward model on chosen/rejected pairs, a scalar head on the actor's architecture.

:meth:`RewardModelTrainer.train_step` is the algorithm: score both completions of every pair, loss
``−log σ(r_chosen − r_rejected)`` averaged over pairs, one optimizer step. The model is
``AutoModelForSequenceClassification`` (one label) loaded from ``algorithm.init`` or ``model.actor``; from
a causal LM its head is new and starts at zero. A completion's score is the head at its last token of
``tokenize(prompt text + completion text)``, exactly what the rollout server's ``rollout/reward_model.py``
computes, so the trained directory plugs into ``model.reward_model`` (and ``model.critic_init:
reward_model``) as it is. Held-out pairwise accuracy is ``eval/accuracy``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AutoTokenizer

from learner.batch import Batch, MicroBatch, make_batch
from learner.examples import Pair, as_trajectory, load_pairs
from learner.models import load_scalar_head, make_engine, resolve_dtype, values
from learner.offline_runtime import OfflineRuntime
from learner.runtime import Stats, grad_norm


def bradley_terry_loss(chosen: Tensor, rejected: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Summed ``−log σ(r_c − r_r)`` over pairs, with the pair count's worth of metrics. Shapes: (b,)."""
    margin = chosen - rejected
    loss = -F.logsigmoid(margin).sum()
    return loss, {"accuracy": (margin > 0).float().sum(), "margin": margin.sum(), "chosen": chosen.sum()}


def pair_batch(rows: list[tuple[list[int], list[int]]]) -> Batch:
    """Batch rows of 2b sequences (b chosen, then b rejected); each row's last token is its 'response'.

    The score of a sequence is read at its last token, which is the position predicting nothing; keeping it
    as the one-token response makes ``logit_start + 1`` that position in both layouts.
    """
    trajs = [
        as_trajectory(ids[:-1], ids[-1:], str(i)) for i, ids in enumerate(s for pair in rows for s in pair)
    ]
    return make_batch(trajs[0::2] + trajs[1::2], 0)


class RewardModelTrainer(OfflineRuntime):
    headline = "eval/accuracy"

    def load_models(self) -> None:
        cfg = self.cfg
        init = cfg.algorithm.init or cfg.model.actor
        dtype = resolve_dtype(cfg, self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(
            cfg.model.actor, trust_remote_code=cfg.model.trust_remote_code
        )
        model = load_scalar_head(cfg, init, dtype, zero_head=True)
        model.seq_cls.config.pad_token_id = (
            self.tokenizer.pad_token_id
        )  # the server reads the last non-pad token
        self.model = make_engine(model, cfg, dtype, cfg.learner.actor_lr)

    def load_examples(self, path: str) -> list[tuple[list[int], list[int]]]:
        a = self.cfg.algorithm
        pairs = load_pairs(path, self.tokenizer, max_tokens=a.max_tokens, chat_template=a.chat_template)
        return [(self.text_ids(p, p.chosen_text), self.text_ids(p, p.rejected_text)) for p in pairs]

    def text_ids(self, pair: Pair, completion: str) -> list[int]:
        return [int(t) for t in self.tokenizer(pair.prompt_text + completion)["input_ids"]]

    def engines(self) -> dict[str, Any]:
        return {"reward_model": self.model}

    def pass_tokens(self, example: tuple[list[int], list[int]]) -> int:
        c, r = map(len, example)
        return 2 * max(c, r) if self.layout == "pad" else c + r

    def scores(self, mb: MicroBatch, b: int) -> tuple[Tensor, Tensor]:
        """Scores of the micro-batch's chosen and rejected sequences, pair-aligned. Shapes: (k,), (k,)."""
        per_position = values(self.model, mb)  # (rows, N)
        last = per_position[mb.logit_row, mb.logit_start + 1]  # (2k,) in mb.rows order
        by_row = dict(zip(mb.rows.tolist(), range(len(mb.rows)), strict=True))
        chosen_rows = sorted(r for r in by_row if r < b)
        idx_c = torch.tensor([by_row[r] for r in chosen_rows], device=last.device)
        idx_r = torch.tensor([by_row[r + b] for r in chosen_rows], device=last.device)
        return last[idx_c], last[idx_r]

    def train_step(self, examples: list[tuple[list[int], list[int]]]) -> dict[str, float]:
        batch, stats = pair_batch(examples), Stats()
        self.model.train()
        for mb in self.pair_micro(batch):
            chosen, rejected = self.scores(mb, len(examples))
            loss, metrics = bradley_terry_loss(chosen, rejected)
            n = torch.tensor(float(len(chosen)))
            stats.add("loss/rm", loss, n)
            stats.add_sums("rm", metrics, n)
            self.model.backward(loss / len(examples) * self.dp_world)  # a mean over the batch's pairs
        self.model.step()
        grad_norm(self.model, "reward_model", stats)
        return stats.reduce()

    @torch.no_grad()
    def evaluate(self, examples: list[tuple[list[int], list[int]]]) -> dict[str, float]:
        self.model.eval()
        stats = Stats()
        size = self.cfg.algorithm.batch_size
        for i in range(0, len(examples), size):
            chunk = examples[i : i + size]
            batch = pair_batch(chunk)
            for mb in self.pair_micro(batch):
                chosen, rejected = self.scores(mb, len(chunk))
                loss, metrics = bradley_terry_loss(chosen, rejected)
                metrics = {"accuracy": metrics["accuracy"], "margin": metrics["margin"]}
                stats.add_sums("eval", {"loss": loss, **metrics}, torch.tensor(float(len(chosen))))
        return stats.reduce()

    def save_final(self, out: Path) -> None:
        """A plain ``*ForSequenceClassification`` directory: what ``model.reward_model`` loads."""
        import weightsync

        state = {k.removeprefix("seq_cls."): v for k, v in weightsync.named_full_parameters(self.model)}
        if self.lead:
            self.model.module.seq_cls.save_pretrained(out, state_dict=state)
            self.tokenizer.save_pretrained(out)
        torch.distributed.barrier()
