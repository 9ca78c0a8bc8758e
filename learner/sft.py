"""The ``sft`` recipe: supervised fine-tuning on demonstrations, loss on response tokens only.

:meth:`SFTTrainer.train_step` is the algorithm: the mean negative log-likelihood of every response token of
the batch (prompt tokens are context, never targets), one optimizer step. Demonstrations are
prompt/response pairs or chat messages through the tokenizer's chat template (``learner/examples.py``).
``algorithm.packing`` concatenates each micro-batch into one row with restarting position ids
(``learner/batch.py``): no padding, which pays only with a varlen attention kernel (GPU), not on CPU.
A vision-language checkpoint trains on demonstrations with images (padded rows only), its vision tower
frozen under ``model.freeze_vision`` as in the online recipes.

The demo kit's supervised warm-start (``toy/warmstart.py``, ``python -m toy warmstart``) is a one-rank run of
this recipe (docs/stages.md §3.1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from learner.batch import Batch, Layout, MicroBatch, make_batch, with_row_vision
from learner.examples import Demonstration, as_trajectory, load_demonstrations
from learner.models import load_policy, make_engine, resolve_dtype
from learner.offline_runtime import OfflineRuntime
from learner.runtime import Stats, grad_norm
from tandem.config import Config
from tandem.vision import VisionProcessor, is_vision_checkpoint


class SFTTrainer(OfflineRuntime):
    headline = "eval/loss"

    def __init__(
        self, cfg: Config, run_dir: str | Path, *, resume: bool = False, layout: Layout = "pad"
    ) -> None:
        super().__init__(cfg, run_dir, resume=resume, layout="pack" if cfg.algorithm.packing else layout)

    def load_models(self) -> None:
        dtype = resolve_dtype(self.cfg, self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(
            self.cfg.model.actor, trust_remote_code=self.cfg.model.trust_remote_code
        )
        self.vision = None
        if is_vision_checkpoint(self.cfg.model.actor):
            if self.layout == "pack":
                raise ValueError(
                    f"algorithm.packing: {self.cfg.model.actor} is a vision-language model, whose 3-D "
                    "positions are computed per padded row; set algorithm.packing false"
                )
            self.vision = VisionProcessor.from_pretrained(
                self.cfg.model.actor, trust_remote_code=self.cfg.model.trust_remote_code
            )
        self.actor = make_engine(
            load_policy(self.cfg, self.cfg.model.actor, dtype), self.cfg, dtype, self.cfg.learner.actor_lr
        )

    def load_examples(self, path: str) -> list[Demonstration]:
        a = self.cfg.algorithm
        return load_demonstrations(
            path, self.tokenizer, max_tokens=a.max_tokens, chat_template=a.chat_template, vision=self.vision
        )

    def micro(self, batch: Batch, rows: torch.Tensor) -> list[MicroBatch]:
        """For a vision-language actor, each micro-batch with its rows' images and the placeholder ids the
        policy never writes (``learner.batch.with_vision``)."""
        mbs = super().micro(batch, rows)
        if self.vision is None:
            return mbs
        return with_row_vision(mbs, batch, self.actor.module.config)

    def rows(self, examples: list[Demonstration]) -> Batch:
        return make_batch(
            [as_trajectory(d.prompt, d.response, str(i), d.vision) for i, d in enumerate(examples)], 0
        )

    def engines(self) -> dict[str, Any]:
        return {"actor": self.actor}

    def pass_tokens(self, example: Demonstration) -> int:
        return len(example.prompt) + len(example.response)

    def train_step(self, examples: list[Demonstration]) -> dict[str, float]:
        batch = self.rows(examples).to(self.device)
        num_tokens, stats = batch.mask.sum(), Stats()  # the whole batch's response tokens, on all ranks
        self.actor.train()
        rows = self.cfg.learner.micro_batch_size
        for mb in self.micro(batch, torch.arange(len(batch))):
            mask = batch.mask[mb.rows]
            logp, _ = self.response_logprobs(self.actor, mb, mask, rows=rows)
            nll = -(logp * mask).sum()
            stats.add("loss/sft", nll, mask.sum())
            # A token mean over the whole batch; DeepSpeed averages gradients over ranks.
            self.actor.backward(nll / num_tokens * self.dp_world)
        self.actor.step()
        grad_norm(self.actor, "actor", stats)
        return stats.reduce()

    @torch.no_grad()
    def evaluate(self, examples: list[Demonstration]) -> dict[str, float]:
        self.actor.eval()
        stats = Stats()
        batch = self.rows(examples).to(self.device)
        rows = self.cfg.learner.micro_batch_size
        for mb in self.micro(batch, torch.arange(len(batch))):
            mask = batch.mask[mb.rows]
            logp, top1 = self.response_logprobs(self.actor, mb, mask, rows=rows, top1=True)
            stats.add("eval/loss", -(logp * mask).sum(), mask.sum())
            # Teacher-forced: how often the most likely next token is the demonstrated one.
            stats.add("eval/token_accuracy", (top1 * mask).sum(), mask.sum())
        return stats.reduce()

    def save_final(self, out: Path) -> None:
        self.save_hf(self.actor, out, self.tokenizer)
        if self.vision is not None and self.lead:  # the checkpoint stays loadable with its images
            self.vision.image_processor.save_pretrained(out)
