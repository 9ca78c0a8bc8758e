"""Off-policy correction between the behaviour and the proximal policy (docs/design.md §4.9); pure tensor functions.

The behaviour policy ``behav_logp`` is what the rollout engine sampled from (an older version, another
numerical stack); the proximal policy ``prox_logp`` is the actor at the start of the learner step. The
policy loss weighs each token by a detached importance weight built from ``log ρ = prox_logp − behav_logp``
(``algorithm.importance``):

- **level** ``token``: ``ρ_t = exp(prox_t − behav_t)``; ``sequence``: the length-normalised geometric mean
  of the sequence's token ratios, ``ρ_i = exp(mean_t(prox_t − behav_t))`` over its valid tokens, given to
  every one of its tokens (the sequence ratio of GSPO, Zheng et al. 2025, "Group Sequence Policy
  Optimization").
- **treatment** ``truncate`` (TIS): ``w = min(ρ, c)``, Yao et al. 2025, "Your Efficient RL Framework
  Secretly Brings You Off-Policy RL Training" (and IMPALA's V-trace truncation before it). ``mask`` (MIS):
  ``w = ρ`` inside ``[lo, hi]`` and 0 outside, so a token (or, at level sequence, a whole sequence) far off
  the proximal policy leaves the loss: masked importance sampling as in verl's rollout-correction
  documentation (``rollout_rs``/MIS). IcePop (Ling team 2025, Ring-1T, "Every Step Evolves") is the
  token-level two-sided mask, ``level: token, treatment: mask`` with its ``[0.5, 5]``.

A weight of 0 keeps its token in the denominator of the loss's mean (as IcePop's objective does), so the
micro-batch split of a minibatch never changes the loss.

Per-token tensors are ``(B, T)`` over response tokens with ``mask`` ``(B, T)`` (1 = real token). Metrics
are **detached 0-d tensors** (no host sync per micro-batch).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from learner.advantages import masked_sum

__all__ = [
    "STALENESS_BUCKETS",
    "importance_weights",
    "mismatch_metrics",
    "sequence_mean",
]

# exp() of a log-ratio beyond this overflows float32 long before it matters (as in learner/losses.py).
_MAX_LOG_RATIO = 20.0

STALENESS_BUCKETS = 4
"""``mismatch/kl_k3/s0`` … ``s3``: tokens 0, 1 and 2 versions stale, and 3 or more (``s3`` is ``3+``)."""


def sequence_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Each row's mean over its valid tokens, broadcast back to the row: ``(Σ_t x·mask / Σ_t mask)`` per row.

    A row without valid tokens gets 0. Shape: x (B, T), mask (B, T) -> (B, T).
    """
    count = mask.to(x.dtype).sum(-1, keepdim=True).clamp_min(1.0)
    return (masked_sum(x, mask, dim=-1).unsqueeze(-1) / count).expand_as(x)


def importance_weights(
    prox_logp: Tensor,
    behav_logp: Tensor,
    mask: Tensor,
    *,
    level: str = "token",
    treatment: str = "truncate",
    cap: float = 5.0,
    mask_low: float = 0.5,
    mask_high: float = 5.0,
) -> tuple[Tensor, Tensor]:
    """The detached importance weight of every token and where it was cut (truncated or masked).

    With ``ρ`` the token ratio ``exp(prox_logp − behav_logp)`` (``level="token"``) or its sequence's
    geometric mean ``exp(mean_t(prox_logp − behav_logp))`` (``level="sequence"``, GSPO's length-normalised
    ratio, Zheng et al. 2025)::

        truncate (TIS, Yao et al. 2025):   w = min(ρ, cap)                 cut where ρ > cap
        mask (MIS, verl rollout correction; IcePop, Ling team 2025, at level token):
                                           w = ρ · [mask_low ≤ ρ ≤ mask_high]   cut where outside

    ``min(exp(x), c)`` is computed as ``exp(min(x, log c))``: no overflow for very stale tokens. The log-ratio
    is clamped to ±20 before the exponential in both treatments (a masked token's weight is 0 anyway).

    Shape: prox_logp, behav_logp, mask (B, T) -> weight (B, T) detached, cut (B, T) bool.
    """
    log_ratio = (prox_logp - behav_logp).detach()  # (B, T)
    if level == "sequence":
        log_ratio = sequence_mean(log_ratio, mask)
    elif level != "token":
        raise ValueError(f"importance level {level!r}: expected token or sequence")
    if treatment == "truncate":
        log_cap = math.log(cap)
        return torch.exp(log_ratio.clamp(max=log_cap)), log_ratio >= log_cap
    if treatment == "mask":
        cut = (log_ratio < math.log(mask_low)) | (log_ratio > math.log(mask_high))
        ratio = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
        return torch.where(cut, 0.0, ratio), cut
    raise ValueError(f"importance treatment {treatment!r}: expected truncate or mask")


@torch.no_grad()
def mismatch_metrics(
    prox_logp: Tensor,
    behav_logp: Tensor,
    mask: Tensor,
    *,
    cut: Tensor | None = None,
    treatment: str = "truncate",
    staleness: Tensor | None = None,
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """How far the behaviour policy is from the proximal one, overall and per staleness bucket.

    With ``x = behav_logp − prox_logp`` over valid tokens (samples from the behaviour policy):

    - ``mismatch/kl_k3``: the k3 estimate of KL(behaviour ‖ proximal), ``mean(exp(−x) + x − 1)``
      (Schulman 2020; ``x`` clamped to ±20);
    - ``mismatch/log_ratio_mean``: ``mean(prox_logp − behav_logp)``, the mean log importance ratio;
    - ``mismatch/log_ratio_max``: ``max |prox_logp − behav_logp|``;
    - ``mismatch/truncated_frac`` (treatment truncate) or ``mismatch/masked_frac`` (mask): the fraction of
      tokens whose weight was cut (``cut`` from :func:`importance_weights`; left out without it);
    - ``mismatch/kl_k3/s0`` … ``s3``: the k3 mean over the tokens of each staleness bucket (``staleness``
      ``(B, T)`` integer: learner version minus the version that generated the token; ``s3`` is 3 or more).

    Returns ``(means, counts)``: detached 0-d tensors, and for each key the number of tokens its mean is
    over, so that means over micro-batches combine as ``Σ mean·count / Σ count`` (a bucket with no token has
    count 0 and mean 0, and is left out of a weighted reduction such as ``learner.runtime.Stats``).

    Shape: prox_logp, behav_logp, mask (B, T), staleness (B, T) -> ({key: ()}, {key: ()}).
    """
    valid = mask.bool()
    x = (behav_logp - prox_logp).float().clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    k3 = torch.exp(-x) + x - 1.0  # (B, T)
    rows = [k3, -x]
    if cut is not None:
        rows.append(cut.to(k3.dtype))
    if staleness is not None:
        bucket = staleness.clamp(0, STALENESS_BUCKETS - 1)
        in_bucket = [bucket == s for s in range(STALENESS_BUCKETS)]
        rows += [torch.where(b, k3, 0.0) for b in in_bucket] + [b.to(k3.dtype) for b in in_bucket]
    sums = torch.where(valid, torch.stack(rows), 0.0).sum((1, 2))  # one masked sum for every metric
    n = valid.sum().to(k3.dtype)
    means = {
        "mismatch/kl_k3": sums[0] / n.clamp_min(1.0),
        "mismatch/log_ratio_mean": sums[1] / n.clamp_min(1.0),
        "mismatch/log_ratio_max": torch.where(valid, x.abs(), 0.0).max(),
    }
    counts = dict.fromkeys(means, n)
    if cut is not None:
        key = "mismatch/truncated_frac" if treatment == "truncate" else "mismatch/masked_frac"
        means[key], counts[key] = sums[2] / n.clamp_min(1.0), n
    if staleness is not None:
        first = len(sums) - 2 * STALENESS_BUCKETS
        for s in range(STALENESS_BUCKETS):
            count = sums[first + STALENESS_BUCKETS + s]
            means[f"mismatch/kl_k3/s{s}"] = sums[first + s] / count.clamp_min(1.0)
            counts[f"mismatch/kl_k3/s{s}"] = count
    return means, counts
