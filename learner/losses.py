"""Losses, KL estimators and loss metrics of the learner (docs/design.md §4); pure tensor functions.

Per-token tensors are ``(B, T)`` over response tokens, right-padded, with ``mask`` ``(B, T)``
(1 = real token). Losses are token-level means over the batch (``masked_mean``). Metrics are returned as
**detached 0-d tensors** on the inputs' device (no host sync per micro-batch); call ``float()`` to log.

Where the ideas come from:

- Clipped surrogate: PPO (Schulman et al. 2017). Asymmetric clip range ``[1−ε_low, 1+ε_high]``: DAPO's
  clip-higher (Yu et al. 2025). Dual-clip for negative advantages: Ye et al. 2020, "Mastering Complex
  Control in MOBA Games with Deep Reinforcement Learning".
- Three policies, decoupled PPO: the ratio is taken against the *proximal* policy ``prox_logp`` (the actor
  at the start of this learner step) while the off-policy gap to the *behaviour* policy ``behav_logp``
  (what the rollout engine sampled from) is corrected by a detached importance weight
  ``w = exp(prox_logp − behav_logp)`` (Hilton et al. 2022, "Batch size-invariance for policy
  optimization"; AReaL, Fu et al. 2025), truncated at ``c`` as in IMPALA's V-trace (Espeholt et al. 2018)
  to bound its variance. With ``prox_logp == behav_logp`` the loss is textbook PPO.
- KL estimators k1/k2/k3: Schulman, "Approximating KL Divergence" (2020).
- Clipped value loss: the PPO2 baselines implementation (as in CleanRL).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from learner.advantages import masked_mean, masked_sum, masked_var, masked_whiten
from tandem.logprobs import FULL_PRECISION, logprobs_from_logits  # shared with the rollout servers

__all__ = [
    "KL_ESTIMATORS",
    "KLEstimator",
    "entropy_from_logits",
    "explained_variance",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "policy_loss",
    "value_loss",
]

# exp() of a log-ratio beyond this overflows float32 long before it matters; clamping only touches
# tokens whose ratio is already far outside any clip range.
_MAX_LOG_RATIO = 20.0


# ---------------------------------------------------------------------------------------------------
# Entropy from logits (log-probabilities: ``tandem/logprobs.py``, shared with the rollout servers)
# ---------------------------------------------------------------------------------------------------


def _entropy(logits: Tensor) -> Tensor:
    return torch.logsumexp(logits, dim=-1) - (F.softmax(logits, dim=-1) * logits).sum(-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical at each position, ``logsumexp(z) − Σ softmax(z)·z``.

    Half-precision logits are upcast one sequence at a time, as in ``logprobs_from_logits``.

    Shape: logits (B, T, V) -> (B, T); float32 for half-precision logits.
    """
    if logits.dtype in FULL_PRECISION:
        return _entropy(logits)
    return torch.stack([_entropy(row.float()) for row in logits])


# ---------------------------------------------------------------------------------------------------
# KL estimators (per token, samples from the policy of ``logp``)
# ---------------------------------------------------------------------------------------------------

KLEstimator = Callable[[Tensor, Tensor], Tensor]
"""``(logp, ref_logp) -> kl``, all (B, T): a per-token estimate of KL(π ‖ π_ref) for tokens sampled from π."""


def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = log π − log π_ref: unbiased, high variance, can be negative.

    As a loss term its gradient is the score function, which averages to zero: use it in the reward.

    Shape: (B, T), (B, T) -> (B, T).
    """
    return logp - ref_logp


def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 = ½(log π − log π_ref)²: biased, low variance, ≥ 0; its gradient is that of KL on-policy.

    Shape: (B, T), (B, T) -> (B, T).
    """
    return 0.5 * (logp - ref_logp) ** 2


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 = exp(log π_ref − log π) − (log π_ref − log π) − 1: unbiased, low variance, ≥ 0 (GRPO's KL).

    Shape: (B, T), (B, T) -> (B, T).
    """
    log_ratio = (ref_logp - logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(log_ratio) - log_ratio - 1.0


KL_ESTIMATORS: dict[str, KLEstimator] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}
"""Keys match ``algorithm.kl_estimator``. In the reward: ``token_rewards(..., kl=est(logp, ref_logp))``;
as a loss term: ``kl_coef * masked_mean(est(logp, ref_logp), mask)`` with ``logp`` carrying gradient."""


# ---------------------------------------------------------------------------------------------------
# Policy loss
# ---------------------------------------------------------------------------------------------------


def policy_loss(
    logp: Tensor,
    prox_logp: Tensor,
    behav_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_clip_low: float,
    eps_clip_high: float,
    is_cap: float,
    dual_clip: float | None = None,
    num_tokens: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled PPO clipped surrogate with a truncated importance weight, token-level mean.

    Per valid token, with ``r = exp(logp − prox_logp)`` and ``w = min(exp(prox_logp − behav_logp), is_cap)``::

        ℓ = w · max(−r·A, −clip(r, 1−ε_low, 1+ε_high)·A)
        ℓ = w · min(max(−r·A, −clip(r)·A), −c·A)          for A < 0 when dual_clip = c (> 1)

    ``prox_logp``, ``behav_logp`` and ``advantages`` are detached here: gradient flows only into ``logp``,
    and only at valid tokens. ``num_tokens``: see ``masked_mean`` (micro-batch accumulation).

    Metrics (detached 0-d tensors, means over valid tokens):
    ``policy/clipfrac`` (the clip branch is active), ``policy/dual_clipfrac`` (the dual-clip bound is
    active; 0 without dual-clip), ``policy/approx_kl`` (k3 estimate of KL(prox ‖ current)),
    ``policy/is_weight_mean``, ``policy/is_weight_max``, ``policy/is_truncfrac`` (w hit the cap),
    ``policy/ess`` (effective sample size of w normalised to (0, 1]: (Σw)² / (N·Σw²)).

    Shape: logp, prox_logp, behav_logp, advantages, mask (B, T) -> loss ().
    """
    prox_logp, behav_logp, advantages = prox_logp.detach(), behav_logp.detach(), advantages.detach()
    log_ratio = (logp - prox_logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)  # (B, T)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_clip_low, 1.0 + eps_clip_high)
    per_token = torch.maximum(unclipped, clipped)  # (B, T)
    dual_active = torch.zeros_like(per_token, dtype=torch.bool)
    if dual_clip is not None:
        # Bounds the loss of a negative-advantage token whose ratio has exploded (a stale or rare token).
        bound = -dual_clip * advantages
        dual_active = (advantages < 0) & (per_token > bound)
        per_token = torch.where(dual_active, bound, per_token)

    # min(exp(x), c) as exp(min(x, log c)): no overflow for very stale tokens.
    is_weight = torch.exp((prox_logp - behav_logp).clamp(max=math.log(is_cap)))  # (B, T), detached
    loss = masked_mean(per_token * is_weight, mask, num_tokens)

    with torch.no_grad():
        # Every per-token quantity in one (6, B, T) stack and one masked sum: on a small model each torch
        # op costs more in dispatch than in arithmetic, and separate masked means were ~40 ops.
        valid = mask.bool()
        dtype = is_weight.dtype
        per_token_metrics = torch.stack(
            [
                (clipped > unclipped).to(dtype),
                dual_active.to(dtype),
                kl_k3(prox_logp, logp.detach()).to(dtype),
                (prox_logp - behav_logp >= math.log(is_cap)).to(dtype),
                is_weight,
                is_weight**2,
            ]
        )
        sums = torch.where(valid, per_token_metrics, 0.0).sum((1, 2))  # (6,)
        n = valid.sum().to(dtype).clamp_min(1.0)
        clipfrac, dual_clipfrac, approx_kl, truncfrac = sums[:4] / n
        w_sum, w_sq_sum = sums[4], sums[5]
        metrics = {
            "policy/clipfrac": clipfrac,
            "policy/dual_clipfrac": dual_clipfrac,
            "policy/approx_kl": approx_kl,
            "policy/is_weight_mean": w_sum / n,
            "policy/is_weight_max": torch.where(valid, is_weight, 0.0).max(),
            "policy/is_truncfrac": truncfrac,
            "policy/ess": w_sum**2 / (n * w_sq_sum).clamp_min(torch.finfo(dtype).tiny),
        }
    return loss, metrics


# ---------------------------------------------------------------------------------------------------
# Value loss
# ---------------------------------------------------------------------------------------------------


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """``1 − Var[returns − values] / Var[returns]`` over valid tokens (population variances), detached.

    1 is a perfect critic, 0 is no better than a constant, < 0 is worse; NaN when the returns are constant.

    Shape: values (B, T), returns (B, T), mask (B, T) -> ().
    """
    values, returns = values.detach(), returns.detach()
    var_returns = masked_var(returns, mask)
    return 1.0 - masked_var(returns - values, mask) / var_returns.where(var_returns > 0, torch.nan)


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    value_clip: float | None = None,
    num_tokens: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """½·(V − R)², or with ``value_clip`` = ε_v the pessimistic ½·max((V − R)², (V_clip − R)²) where
    ``V_clip = V_old + clip(V − V_old, −ε_v, ε_v)``; token-level mean.

    ``old_values`` (the critic at rollout time, the values GAE used) and ``returns`` are detached here.
    Metrics (detached 0-d tensors): ``value/clipfrac`` (the clipped term is the larger; 0 without
    clipping), ``value/explained_variance`` (of ``values`` for ``returns``).

    Shape: values, old_values, returns, mask (B, T) -> loss ().
    """
    old_values, returns = old_values.detach(), returns.detach()
    unclipped = (values - returns) ** 2  # (B, T)
    per_token = unclipped
    clip_active = torch.zeros_like(unclipped, dtype=torch.bool)
    if value_clip is not None:
        clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
        clipped = (clipped_values - returns) ** 2
        clip_active = clipped > unclipped
        per_token = torch.maximum(unclipped, clipped)
    loss = 0.5 * masked_mean(per_token, mask, num_tokens)
    metrics = {
        "value/clipfrac": masked_mean(clip_active.to(unclipped.dtype), mask),
        "value/explained_variance": explained_variance(values, returns, mask),
    }
    return loss, metrics
