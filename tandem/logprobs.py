"""Log-probabilities of sampled tokens from a causal LM's logits: the pure math the learner and the rollout
servers share, so both score a token with the same numbers.

The learner scores the actor and the reference with it (``learner/models.py``, ``learner/ppo.py``); the
rollout servers score the reference next to generation with it when ``placement.reference: server``
(``rollout/reference.py``, docs/placement.md §11.1).
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import Tensor, nn

FULL_PRECISION = (torch.float32, torch.float64)


def temper(logits: Tensor, temperature: float) -> Tensor:
    """float32 logits of the distribution sampled at ``temperature``: divided by it, so log-probabilities
    are comparable to the engine's ``behav_logp``. ``temperature`` 0 (greedy) leaves them as they are.

    Shape: (..., V) -> (..., V), float32.
    """
    logits = logits.float()
    return logits / temperature if temperature > 0 else logits


def _logprobs(logits: Tensor, labels: Tensor) -> Tensor:
    return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """``log softmax(logits)[labels]`` as ``gather − logsumexp``, without a second (B, T, V) log_softmax.

    ``logits[:, t]`` must already be the distribution of ``labels[:, t]`` (shift by one before calling)
    and divided by the sampling temperature (:func:`temper`), so the result is comparable to
    ``behav_logp``. Half-precision logits are upcast to float32 one sequence at a time: a bf16 logprob
    carries ~3 significant digits, which is ratio noise of about 1%, while a float32 copy of the whole
    (B, T, V) batch may not fit.

    Shape: logits (B, T, V), labels (B, T) -> (B, T); float32 for half-precision logits.
    """
    labels = labels.long()
    if logits.dtype in FULL_PRECISION:
        return _logprobs(logits, labels)
    return torch.stack([_logprobs(row.float(), lab) for row, lab in zip(logits, labels, strict=True)])


def plain_output_head(model: nn.Module) -> nn.Linear | None:
    """A causal LM's output layer when its logits are exactly ``head(last hidden state)``, so they can be
    made a chunk of tokens at a time from the hidden states; else None.

    None for a head that is not a plain ``nn.Linear`` (a LoRA-adapted or ``modules_to_save`` head: its
    weight is not the one the forward uses), for models that post-process their logits (soft-capping, a
    logit scale), which only the model's own forward computes faithfully, and for models whose forward
    takes no ``logits_to_keep`` (older remote-code models, which cannot be asked for one position only).
    """
    head = model.get_output_embeddings()
    config = getattr(model, "config", None)
    if type(head) is not nn.Linear or any(
        getattr(config, k, None) is not None for k in ("final_logit_softcapping", "logit_scale")
    ):
        return None
    return head if _keeps_logits(type(model)) else None


@functools.cache
def _keeps_logits(cls: type) -> bool:
    # Once per model class: reading a signature costs ~70 µs, asked on every micro-batch.
    return "logits_to_keep" in inspect.signature(cls.forward).parameters
