"""The offline learner runtime: a fixed dataset, seeded epochs, validation, early stop, checkpoint and resume.

The ``sft``, ``rm`` and ``dpo`` recipes subclass :class:`OfflineRuntime` and write four things: how to load
their models and examples, one ``train_step`` on a list of examples, and ``evaluate`` on the held-out set.
The loop here reads top to bottom (docs/stages.md §3):

    start (load, resume)  ->  while steps remain: step (train, validate when due, log, checkpoint when due)
                          ->  finish (checkpoint, final HF directory, summary.json)

- **Order.** Step ``s`` trains on examples ``perm_e[(s mod S)·B : (s mod S + 1)·B]`` of epoch ``e = s // S``
  (``S`` full batches per epoch, ``perm_e`` seeded by ``(run.seed, e)``), so a resumed run sees exactly the
  batches the killed one would have: a checkpoint needs only the step.
- **Validation and early stop.** ``evaluate`` runs every ``algorithm.eval_interval`` steps and at the end;
  ``eval/loss`` is the validation metric. After ``algorithm.early_stop_patience`` evaluations in a row
  without a new best, training stops (the best value and the count are checkpointed too).
- **Micro-batches and the output head.** ``learner.micro_batch_size`` rows (pairs for rm and dpo) per
  forward pass, or as many as fit ``learner.max_tokens_per_micro_batch`` tokens; an example that alone
  exceeds the budget fails the load, naming both. Log-probabilities come from the chunked head
  (``learner/lm_head.py``) under ``learner.chunked_head``, as in PPO (docs/design.md §4.8).
- **Outputs.** ``<run dir>/history.jsonl`` (one row of metrics per logged step), ``final/`` (a Hugging Face
  directory) and, last, ``summary.json`` (headline metrics and wall time): its presence marks the run done.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import Tensor, nn

from learner import checkpoint
from learner.batch import Batch, Layout, MicroBatch, pair_micro_batches, response_view
from learner.lm_head import chunk_tokens, chunked_logprobs_top1, use_chunked_head
from learner.losses import logprobs_from_logits
from learner.models import output_head, policy_logits, policy_logprobs, response_head
from learner.runtime import Runtime, log
from tandem.config import Config
from tandem.telemetry import Telemetry
from tandem.timing import timed

SUMMARY = "summary.json"


class OfflineRuntime(Runtime):
    """One rank of an offline trainer; the recipe fills in models, examples, a step and an evaluation."""

    headline = "eval/loss"  # the metric the pipeline's summary shows for this recipe

    def __init__(
        self, cfg: Config, run_dir: str | Path, *, resume: bool = False, layout: Layout = "pad"
    ) -> None:
        super().__init__(cfg, run_dir, resume=resume, layout=layout)
        a = cfg.algorithm
        self.require_multiple_of_ranks(**{"algorithm.batch_size": a.batch_size})
        self.best = math.inf  # best eval/loss so far
        self.bad_evals = 0  # evaluations in a row without a new best
        self.stopped_early = False
        self.history: TextIO | None = None
        self.last_eval: dict[str, float] = {}
        self.first_eval: dict[str, float] = {}
        self.train_examples: list[Any] = []
        self.eval_examples: list[Any] = []
        self.t_start = time.time()

    # -------------------------------------------------------------------------------------- recipe hooks

    def load_models(self) -> None:
        raise NotImplementedError

    def load_examples(self, path: str) -> list[Any]:
        raise NotImplementedError

    def train_step(self, examples: list[Any]) -> dict[str, float]:
        """Forward, backward and one optimizer step on ``examples`` (every rank holds them all)."""
        raise NotImplementedError

    def evaluate(self, examples: list[Any]) -> dict[str, float]:
        """``eval/*`` metrics over held-out ``examples``, ``eval/loss`` among them (no gradient)."""
        raise NotImplementedError

    def engines(self) -> dict[str, Any]:
        raise NotImplementedError

    def save_final(self, out: Path) -> None:
        raise NotImplementedError

    def pass_tokens(self, example: Any) -> int:
        """Tokens one forward pass reads for ``example`` alone (both sequences of a pair)."""
        raise NotImplementedError

    def pair_micro(self, batch: Batch) -> list[MicroBatch]:
        """This rank's micro-batches of a pair recipe (rm, dpo), each holding both sequences of whole
        pairs (``micro_batch_size`` pairs, or by ``learner.max_tokens_per_micro_batch``)."""
        lc = self.cfg.learner
        return pair_micro_batches(
            batch,
            self.rank,
            self.world,
            self.layout,
            self.device,
            size=lc.micro_batch_size,
            budget=lc.max_tokens_per_micro_batch,
        )

    # ------------------------------------------------------------------------------------------ the loop

    def run(self) -> None:
        self.start()
        try:
            while self.version < self.total_steps and not self.stopped_early and not self.any_rank_stopping():
                self.step()
            self.finish()
        finally:
            self.close()

    def start(self) -> None:
        a = self.cfg.algorithm
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.load_models()
        self.train_examples = self.load_examples(a.train_file)
        self.eval_examples = self.load_examples(a.eval_file) if a.eval_file else []
        self.check_budget()
        self.steps_per_epoch = len(self.train_examples) // a.batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"algorithm.train_file has {len(self.train_examples)} examples, fewer than algorithm.batch_size ({a.batch_size})"
            )
        self.total_steps = min(self.cfg.learner.total_steps, a.epochs * self.steps_per_epoch)
        state = checkpoint.load(self.ckpt_dir, self.engines()) if self.resume else None
        if state is not None:
            self.version = self.checkpointed_version = state.version
            best = state.extra.get("best")  # None: checkpointed before its first validation
            self.best = math.inf if best is None else best
            self.bad_evals = state.extra.get("bad_evals", 0)
            self.stopped_early = state.extra.get("stopped_early", False)
            self.first_eval = state.extra.get("first_eval", {})
            log.info("resumed at step %d from %s", self.version, self.ckpt_dir)
        elif self.resume:
            log.warning("--resume: no checkpoint in %s, starting fresh", self.ckpt_dir)
        if self.lead:
            self.telemetry = Telemetry(
                self.cfg, "learner", run_dir=str(self.run_dir), job_type=self.cfg.recipe
            )
            self.history = open(self.run_dir / "history.jsonl", "a")  # noqa: SIM115 (closed in close())
        if self.eval_examples and not self.first_eval:  # where training starts from, for the summary
            self.first_eval = self.evaluate(self.eval_examples)
            self.log_row({**self.first_eval, "step": self.version})
        log.info(
            "%s: %d train / %d eval examples, %d steps (%d per epoch) from step %d",
            self.cfg.recipe,
            len(self.train_examples),
            len(self.eval_examples),
            self.total_steps,
            self.steps_per_epoch,
            self.version,
        )
        self.install_signal_handlers()

    def step(self) -> None:
        a = self.cfg.algorithm
        with timed() as train:
            stats = self.train_step(self.batch_at(self.version))
            self.version += 1
        stats["time/train"] = train.seconds
        stats["epoch"] = self.version / self.steps_per_epoch
        last = self.version == self.total_steps
        if self.eval_examples and (self.version % a.eval_interval == 0 or last):
            stats.update(self.validate())
        if self.version % self.cfg.logging.log_interval == 0 or "eval/loss" in stats:
            self.log_row({**stats, "step": self.version})
        interval = self.cfg.learner.checkpoint_interval
        if interval and self.version % interval == 0 and not last:
            self.save_checkpoint()

    def check_budget(self) -> None:
        """Every example fits ``learner.max_tokens_per_micro_batch`` on its own: the dataset is fixed, so
        one that does not would fail (or exceed memory) on every run; refuse it before training."""
        budget = self.cfg.learner.max_tokens_per_micro_batch
        if budget is None:
            return
        a = self.cfg.algorithm
        for field, examples in (
            ("algorithm.train_file", self.train_examples),
            ("algorithm.eval_file", self.eval_examples),
        ):
            worst = max(map(self.pass_tokens, examples), default=0)
            if worst > budget:
                raise ValueError(
                    f"learner.max_tokens_per_micro_batch ({budget}) is below the {worst} tokens that one example "
                    f"of {field} ({getattr(a, field.split('.')[1])}) reads in a forward pass: raise the budget"
                )

    # ------------------------------------------------------------------------------- the output head

    def response_logprobs(
        self, model: nn.Module, mb: MicroBatch, mask: Tensor, *, rows: int, top1: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Log-probabilities of ``mb.targets`` (temperature 1) and, with ``top1``, whether each is the
        model's most likely token (no gradient). Shape: (b, R) each, valid where ``mask``.

        From the chunked head when ``learner.chunked_head`` asks for it (docs/design.md §4.8) for a
        micro-batch of ``rows`` nominal rows (the same on every rank: ranks must take the same path),
        else from the full logits.
        """
        lc = self.cfg.learner
        head = None if lc.chunked_head == "off" else output_head(model)
        tokens = (
            rows * mb.targets.shape[1]
            if lc.max_tokens_per_micro_batch is None
            else lc.max_tokens_per_micro_batch
        )
        if head is not None and use_chunked_head(
            lc.chunked_head, head.out_features, tokens, lc.chunked_head_threshold
        ):
            if not top1:
                logp, _ = policy_logprobs(
                    model, mb, 1.0, mask, head, chunk_logits=lc.chunked_head_chunk, with_entropy=False
                )
                return logp, None
            chunk = chunk_tokens(head.out_features, lc.chunked_head_chunk)
            logp, hits = response_head(
                model,
                mb,
                mask,
                head,
                lambda h, y: chunked_logprobs_top1(h, head.weight, y, bias=head.bias, chunk=chunk),
            )
            return logp, hits
        logits = response_view(policy_logits(model, mb, 1.0), mb)  # (b, R, V)
        logp = logprobs_from_logits(logits, mb.targets)
        return logp, (logits.argmax(-1) == mb.targets).float() if top1 else None

    def batch_at(self, step: int) -> list[Any]:
        """The examples of step ``step``: a pure function of (seed, step), the same on every rank."""
        bs = self.cfg.algorithm.batch_size
        epoch, k = divmod(step, self.steps_per_epoch)
        order = torch.randperm(
            len(self.train_examples),
            generator=torch.Generator().manual_seed(self.cfg.run.seed * 1_000_003 + epoch),
        )
        return [self.train_examples[i] for i in order[k * bs : (k + 1) * bs].tolist()]

    def validate(self) -> dict[str, float]:
        metrics = self.evaluate(self.eval_examples)
        self.last_eval = metrics
        if metrics["eval/loss"] < self.best - 1e-6:
            self.best, self.bad_evals = metrics["eval/loss"], 0
        else:
            self.bad_evals += 1
        patience = self.cfg.algorithm.early_stop_patience
        if patience and self.bad_evals >= patience:
            self.stopped_early = True
            log.info("early stop at step %d: no better eval/loss in %d evaluations", self.version, patience)
        return metrics

    def log_row(self, row: dict[str, float]) -> None:
        step = int(row["step"])
        self.telemetry.log({k: v for k, v in row.items() if k != "step"}, step=step)
        if self.history is not None:
            self.history.write(json.dumps({**row, "time": time.time()}) + "\n")
            self.history.flush()
        shown = "  ".join(f"{k} {v:.4g}" for k, v in sorted(row.items()) if k.startswith(("loss", "eval/")))
        if self.lead and shown:
            log.info("step %d  %s", step, shown)

    # ---------------------------------------------------------------------------------------- checkpoints

    def save_checkpoint(self) -> None:
        extra = {
            "best": self.best if math.isfinite(self.best) else None,
            "bad_evals": self.bad_evals,
            "stopped_early": self.stopped_early,
            "first_eval": self.first_eval,
        }
        checkpoint.save(self.ckpt_dir, self.engines(), checkpoint.LearnerState(self.version, [], extra))
        self.checkpointed_version = self.version

    def finish(self) -> None:
        """Final checkpoint, the final model as a Hugging Face directory, then the summary (the done mark)."""
        if self.checkpointed_version != self.version:
            self.save_checkpoint()
        if self.eval_examples and not self.last_eval:  # resumed at the end, or stopped before an eval
            self.last_eval = self.evaluate(self.eval_examples)
        if self.cfg.learner.save_hf_final:
            self.save_final(self.run_dir / "final")
        if self.version >= self.total_steps or self.stopped_early:  # not after a stop request: unfinished
            summary = {
                "recipe": self.cfg.recipe,
                "steps": self.version,
                "stopped_early": self.stopped_early,
                "headline": self.headline,
                "before": self.first_eval,
                "after": self.last_eval,
                "wall_s": time.time() - self.t_start,
            }
            if self.lead:
                (self.run_dir / SUMMARY).write_text(json.dumps(summary, indent=2))

    def close(self) -> None:
        self.restore_signal_handlers()
        if self.history is not None:
            self.history.close()
        self.telemetry.close()
