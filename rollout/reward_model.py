"""A scalar-head reward model scored on the rollout server (``model.reward_model``).

Any ``AutoModelForSequenceClassification`` checkpoint with one label, loaded by path. It scores the
prompt text followed by the completion text with its own tokenizer, so it need not share the actor's
vocabulary. Scoring next to generation (as OpenRLHF's remote reward models do) keeps the learner's step
free of a third forward pass.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rollout.engines.devices import resolve_device, resolve_dtype
from tandem.config import Config


class RewardModel:
    def __init__(
        self,
        path: str,
        *,
        device: str | torch.device | None = None,
        dtype: str = "auto",
        trust_remote_code: bool = False,
        batch_size: int = 32,
    ) -> None:
        self.device = resolve_device(str(device) if device is not None else None)
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        # Right padding: the score is read at the last real token.
        self.tokenizer.padding_side = "right"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=resolve_dtype(dtype, self.device), trust_remote_code=trust_remote_code
        )
        if self.model.config.num_labels != 1:
            raise ValueError(
                f"reward model {path}: expected a scalar head (num_labels=1), got {self.model.config.num_labels}"
            )
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(self.device).eval().requires_grad_(False)
        self.batch_size = batch_size

    @torch.inference_mode()
    def score(self, texts: list[str]) -> list[float]:
        """One scalar per text (prompt + completion)."""
        scores: list[float] = []
        for i in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(texts[i : i + self.batch_size], padding=True, return_tensors="pt")
            logits = self.model(**batch.to(self.device)).logits  # (B, 1)
            scores.extend(logits[:, 0].float().tolist())
        return scores


def reward_model_of(cfg: Config) -> RewardModel | None:
    """The run's reward model (``model.reward_model``) on the run's device and dtype; None without one. The
    rollout servers and the reward model worker load it alike."""
    if cfg.model.reward_model is None:
        return None
    return RewardModel(
        cfg.model.reward_model,
        device=cfg.run.device,
        dtype=cfg.model.dtype,
        trust_remote_code=cfg.model.trust_remote_code,
    )
