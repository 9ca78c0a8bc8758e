"""The frozen reference policy scored on the rollout server (``placement.reference: server``).

With a KL penalty (``algorithm.kl_coef > 0``) the learner needs log π_ref of every trained token. Scored
here, next to generation as the reward model is (OpenRLHF's and verl's reference on the rollout side),
each trajectory carries its ``ref_logp`` and the learner loads no reference: its devices are spared the
reference's weights and its forward pass, and the server holds a second copy of a model instead
(docs/placement.md §11.1).

The numbers are the learner's own: the same checkpoint (``model.reference``, else the actor's initial
weights), the same dtype (``model.dtype``), logits tempered by the sampling temperature and turned into
log-probabilities by the same function (``tandem/logprobs.py``). Rows are right-padded without an
attention mask, the learner's ``pad`` layout: under a causal mask a real token never attends to the
padding after it, so padding changes no number. Environment tokens of a multi-turn episode get 0, as the
learner's ``loss_mask`` gives them.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from buffer.schema import Trajectory
from rollout.engines.devices import release_freed_memory, resolve_device, resolve_dtype
from tandem.config import Config
from tandem.logprobs import logprobs_from_logits, plain_output_head, temper

# Tokens (rows x longest row) of one forward pass: bounds the (rows, L, H) hidden states a pass holds.
TOKENS_PER_PASS = 4096
CHUNK_LOGITS = 1 << 24  # logits made at once from hidden states (64 MB in float32), whatever the vocabulary


class ReferenceModel:
    """A frozen causal LM (eval mode, no gradients) that scores sampled tokens at the sampling temperature."""

    def __init__(
        self,
        path: str,
        *,
        temperature: float,
        device: str | torch.device | None = None,
        dtype: str = "auto",
        trust_remote_code: bool = False,
        tokens_per_pass: int = TOKENS_PER_PASS,
    ) -> None:
        self.device = resolve_device(str(device) if device is not None else None)
        self.path, self.dtype, self.trust_remote_code = (
            path,
            resolve_dtype(dtype, self.device),
            trust_remote_code,
        )
        self.temperature = temperature
        self.tokens_per_pass = tokens_per_pass
        self._lock = threading.Lock()  # scoring (loop, HTTP API) against a release
        self.model: torch.nn.Module | None = None
        self.released = False
        self._load()

    def _load(self) -> None:
        if self.model is None:  # from the checkpoint: it is frozen, so nothing was lost
            self.model = AutoModelForCausalLM.from_pretrained(
                self.path, dtype=self.dtype, trust_remote_code=self.trust_remote_code
            )
            self.model.eval().requires_grad_(False)
            self.head = plain_output_head(self.model)  # None: the model post-processes its logits
        self.model.to(self.device)
        self.released = False

    def release(self) -> None:
        """Free the reference's device memory while the learner trains (colocated with
        ``placement.release_memory``, docs/placement.md §11.1): on GPU it is parked in host memory; on CPU,
        where host memory is what would be freed, it is dropped and read again from its checkpoint. The
        next scoring call brings it back."""
        with self._lock:
            if self.released or self.model is None:
                return
            if self.device.type == "cuda":
                self.model.to("cpu")
            else:
                self.model = self.head = None
            self.released = True
        release_freed_memory(self.device)

    @torch.inference_mode()
    def logprobs(self, rows: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[np.ndarray]:
        """log π_ref(response token | prompt, earlier response tokens) of each ``(prompt, response)`` row.

        Shape: rows of (P,), (R,) token ids -> one float32 (R,) per row, in order.
        """
        with self._lock:
            if self.released:
                self._load()
            return self._logprobs(rows)

    def _logprobs(self, rows: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[np.ndarray]:
        assert self.model is not None
        seqs = [np.concatenate([np.asarray(p), np.asarray(r)]).astype(np.int64) for p, r in rows]
        out: list[np.ndarray] = [np.zeros(0, dtype=np.float32)] * len(seqs)
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))  # longest first: little padding
        for chunk in _passes(order, [len(s) for s in seqs], self.tokens_per_pass):
            longest = len(seqs[chunk[0]])
            ids = torch.zeros((len(chunk), longest), dtype=torch.long)  # (b, L) right-padded
            for k, i in enumerate(chunk):
                ids[k, : len(seqs[i])] = torch.from_numpy(seqs[i])
            ids = ids.to(self.device)
            if self.head is None:  # the model's own forward: its logits may be post-processed
                states = self.model(input_ids=ids, use_cache=False).logits  # (b, L, V)
            else:  # the last hidden states (b, L, H): logits are made per chunk of response tokens below
                states = self.model.base_model(input_ids=ids, use_cache=False).last_hidden_state
            for k, i in enumerate(chunk):
                p, r = len(rows[i][0]), len(rows[i][1])
                # Position t predicts token t + 1: response token j is read at p - 1 + j.
                out[i] = self.score(states[k, p - 1 : p - 1 + r], ids[k, p : p + r]).cpu().numpy()
        return out

    def score(self, states: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Tempered log-probabilities of ``labels`` from logits, or from hidden states through the head a
        chunk of tokens at a time, so a pass never holds more than ``CHUNK_LOGITS`` logits of a real
        vocabulary. Shape: states (R, V) or (R, H), labels (R,) -> (R,) float32."""
        if self.head is None:
            return logprobs_from_logits(temper(states, self.temperature)[None], labels[None])[0]
        step = max(1, CHUNK_LOGITS // self.head.out_features)
        scored = [
            logprobs_from_logits(temper(self.head(h), self.temperature)[None], y[None])[0]
            for h, y in zip(states.split(step), labels.split(step), strict=True)
        ]
        return torch.cat(scored) if scored else torch.zeros(0)

    def trajectories(self, trajs: Sequence[Trajectory]) -> list[np.ndarray]:
        """Each trajectory's ``ref_logp``: log π_ref of its response tokens, 0 on environment tokens (the
        learner's mask). Shape: one float32 (R,) per trajectory."""
        scored = self.logprobs([(t.prompt_tokens, t.response_tokens) for t in trajs])
        return [np.where(t.generated, s, 0.0).astype(np.float32) for t, s in zip(trajs, scored, strict=True)]

    def fill(self, trajs: Sequence[Trajectory]) -> list[Trajectory]:
        """Set each trajectory's ``ref_logp``; returns them."""
        for t, logp in zip(trajs, self.trajectories(trajs), strict=True):
            t.ref_logp = logp
        return list(trajs)


def _passes(order: list[int], lens: list[int], budget: int) -> list[list[int]]:
    """Rows (sorted longest first) grouped so that rows x longest stays within ``budget`` tokens; a row
    longer than the budget gets a pass of its own."""
    passes: list[list[int]] = []
    for i in order:
        if passes and (len(passes[-1]) + 1) * lens[passes[-1][0]] <= budget:
            passes[-1].append(i)
        else:
            passes.append([i])
    return passes


def load_reference(cfg: Config) -> ReferenceModel | None:
    """The server's reference when this run scores it there (``placement.reference: server`` with a KL
    penalty), else None."""
    if cfg.reference_scorer != "server":
        return None
    return reference_of(cfg)


def reference_of(cfg: Config) -> ReferenceModel:
    """The run's reference: the learner's checkpoint (``model.reference``, else the actor's initial
    weights), dtype and sampling temperature."""
    return ReferenceModel(
        cfg.model.reference or cfg.model.actor,
        temperature=cfg.rollout.temperature,
        device=cfg.run.device,
        dtype=cfg.model.dtype,
        trust_remote_code=cfg.model.trust_remote_code,
    )
