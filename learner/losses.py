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
  to bound its variance. With ``prox_logp == behav_logp`` the loss is textbook PPO. The weight's other
  levels and treatments (sequence-level, masked) are ``learner/importance.py``'s.
- Loss variants (``algorithm.loss``): GSPO's sequence-level ratio and clip (Zheng et al. 2025, "Group
  Sequence Policy Optimization"); CISPO's clipped, detached importance weight on a REINFORCE term
  (MiniMax-M1, 2025). Aggregations (``algorithm.loss_agg``): token-level mean (DAPO), the sequence means of
  GRPO, and Dr. GRPO's constant normaliser (Liu et al. 2025).
- KL estimators k1/k2/k3: Schulman, "Approximating KL Divergence" (2020).
- On-policy distillation: the per-token reverse KL to a teacher on the student's own samples, as a reward
  or a loss term (Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
  Self-Generated Mistakes"; Lu and Thinking Machines Lab 2025, "On-Policy Distillation").
- Clipped value loss: the PPO2 baselines implementation (as in CleanRL).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from learner.advantages import masked_mean, masked_sum, masked_var, masked_whiten
from learner.importance import importance_weights, sequence_mean
from tandem.logprobs import FULL_PRECISION, logprobs_from_logits  # shared with the rollout servers

__all__ = [
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "KLEstimator",
    "aggregate",
    "aggregation_units",
    "distill_loss",
    "distill_reverse_kl",
    "distill_rewards",
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
# On-policy distillation (algorithm.distill)
# ---------------------------------------------------------------------------------------------------


def distill_reverse_kl(logp: Tensor, teacher_logp: Tensor, mask: Tensor) -> Tensor:
    """Per-token reverse KL to the teacher on the student's own samples: ``log π(y_t) − log π_T(y_t)``.

    For ``y_t`` sampled from the student π this is the single-sample (k1) estimate of
    ``KL(π ‖ π_T)`` at that position, mode-seeking: the student is pushed off tokens the teacher finds
    unlikely (Agarwal et al. 2024, GKD with λ = 1, β = 1; Lu and Thinking Machines Lab 2025, "On-Policy
    Distillation", who reward each token with its negative). Its token mean is ``distill/kl``. 0 off the
    mask.

    Shape: logp, teacher_logp, mask (B, T) -> (B, T).
    """
    return torch.where(mask.bool(), kl_k1(logp, teacher_logp), 0.0)


@torch.no_grad()
def distill_rewards(logp: Tensor, teacher_logp: Tensor, mask: Tensor, coef: float) -> Tensor:
    """``as: reward``: each response token's reward ``−coef · (log π(y_t) − log π_T(y_t))``, detached, to add
    to :func:`learner.advantages.token_rewards`' output before the advantage estimator. A per-token
    estimator (gae, reinforce_pp) credits each token with its own; an outcome one (grpo, rloo) scores the
    sequence by their sum, ``−coef · Σ_t kl_t`` (Lu and Thinking Machines Lab 2025 use the per-token form
    with a discount of 0; Agarwal et al. 2024, §3).

    Shape: logp, teacher_logp, mask (B, T) -> (B, T), 0 off the mask.
    """
    return -coef * distill_reverse_kl(logp.detach(), teacher_logp.detach(), mask)


def distill_loss(
    logp: Tensor, teacher_logp: Tensor, mask: Tensor, coef: float, num_tokens: float | Tensor | None = None
) -> Tensor:
    """``as: loss``: ``coef`` times the token mean of ``½(log π(y_t) − log π_T(y_t))²`` (Schulman's k2).

    On the student's samples its gradient, ``(log π − log π_T)·∇log π``, is the gradient of the reverse KL
    ``KL(π ‖ π_T)`` (the score-function term ``E[∇log π]`` is 0), as in Agarwal et al. 2024's on-policy
    GKD; the k1 value itself would give only the score function, whose mean is 0. A teacher equal to the
    student gives loss and gradient 0. ``teacher_logp`` is detached; ``num_tokens`` as in
    :func:`learner.advantages.masked_mean` (a minibatch split into micro-batches).

    Shape: logp, teacher_logp, mask (B, T) -> ().
    """
    return coef * masked_mean(kl_k2(logp, teacher_logp.detach()), mask, num_tokens)


# ---------------------------------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------------------------------

AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
"""Keys match ``algorithm.loss_agg``; see :func:`aggregate`."""


def aggregation_units(mask: Tensor, mode: str) -> Tensor:
    """What ``mode`` averages over in ``mask``: its valid tokens (token-mean) or its sequences with at least
    one valid token (the seq-mean modes). Pass a minibatch's to :func:`aggregate` for each of its
    micro-batches. Shape: mask (B, T) -> () float."""
    tokens = mask.float().sum(-1)  # (B,)
    return tokens.sum() if mode == "token-mean" else (tokens > 0).float().sum()


def aggregate(
    loss_per_token: Tensor,
    mask: Tensor,
    mode: str = "token-mean",
    norm: float | None = None,
    *,
    units: float | Tensor | None = None,
) -> Tensor:
    """One loss from per-token losses ``ℓ``, over valid tokens (``n_i`` of sequence ``i``)::

        token-mean                Σ_i Σ_t ℓ_it / Σ_i n_i          every token weighs the same (DAPO)
        seq-mean-token-sum        mean_i Σ_t ℓ_it                  a long sequence weighs more
        seq-mean-token-mean       mean_i (Σ_t ℓ_it / n_i)          every sequence weighs the same (GRPO, GSPO)
        seq-mean-token-sum-norm   mean_i (Σ_t ℓ_it / norm)         norm a constant, e.g. the longest response
                                                                   allowed: no length bias (Dr. GRPO, Liu et
                                                                   al. 2025, "Understanding R1-Zero-Like
                                                                   Training: A Critical Perspective")

    ``mean_i`` is over sequences with at least one valid token (a fully masked row, e.g. an aborted sample,
    counts for nothing). ``units`` replaces the denominator (the count of tokens, or of sequences): pass
    :func:`aggregation_units` of the whole minibatch when it is split into micro-batches whose gradients
    accumulate, so that their losses sum to the minibatch's. The denominator is at least 1.

    Shape: loss_per_token (B, T), mask (B, T) -> ().
    """
    if mode == "token-mean":
        return masked_mean(loss_per_token, mask, units)
    sums = masked_sum(loss_per_token, mask, dim=-1)  # (B,)
    if mode == "seq-mean-token-sum":
        per_seq = sums
    elif mode == "seq-mean-token-mean":
        per_seq = sums / mask.to(sums.dtype).sum(-1).clamp_min(1.0)
    elif mode == "seq-mean-token-sum-norm":
        if norm is None or not norm > 0:
            raise ValueError(f"loss aggregation {mode} needs a positive norm (got {norm})")
        per_seq = sums / norm
    else:
        raise ValueError(f"loss aggregation {mode!r}: expected one of {', '.join(AGGREGATIONS)}")
    if units is None:
        units = aggregation_units(mask, mode)
    return per_seq.sum() / torch.as_tensor(units, dtype=sums.dtype, device=sums.device).clamp_min(1.0)


# ---------------------------------------------------------------------------------------------------
# Policy loss
# ---------------------------------------------------------------------------------------------------

POLICY_LOSSES = ("ppo", "gspo", "cispo")
"""Keys match ``algorithm.loss``; see :func:`policy_loss`."""


def _ppo_terms(
    logp: Tensor, prox_logp: Tensor, advantages: Tensor, low: float, high: float, dual_clip: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token clipped surrogate (PPO; dual-clip, Ye et al. 2020), the clip and the dual-clip branches."""
    ratio = torch.exp((logp - prox_logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))  # (B, T)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - low, 1.0 + high)
    per_token = torch.maximum(unclipped, clipped)  # (B, T)
    dual_active = torch.zeros_like(per_token, dtype=torch.bool)
    if dual_clip is not None:
        # Bounds the loss of a negative-advantage token whose ratio has exploded (a stale or rare token).
        bound = -dual_clip * advantages
        dual_active = (advantages < 0) & (per_token > bound)
        per_token = torch.where(dual_active, bound, per_token)
    return per_token, clipped > unclipped, dual_active


def _gspo_terms(
    logp: Tensor, prox_logp: Tensor, advantages: Tensor, mask: Tensor, low: float, high: float
) -> tuple[Tensor, Tensor]:
    """Per-token GSPO-token surrogate (Zheng et al. 2025) and its clip branch.

    ``s_i = exp(mean_t(logp − prox_logp))`` over the sequence's valid tokens, and per token
    ``s_it = sg[s_i] · π_t / sg[π_t]``: the value of ``s_i``, the gradient ``s_i·∇log π_t`` of its token.
    """
    seq_log_ratio = sequence_mean((logp - prox_logp).detach(), mask).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(logp - logp.detach() + seq_log_ratio)  # (B, T), equal along a row
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - low, 1.0 + high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _cispo_terms(
    logp: Tensor, prox_logp: Tensor, advantages: Tensor, low: float, high: float
) -> tuple[Tensor, Tensor]:
    """Per-token CISPO term (MiniMax-M1, 2025): ``−sg(clip(r, 1−ε_low, 1+ε_high)) · A · log π``, and where
    ``r`` was clipped. Every token keeps a gradient, scaled by its clipped ratio."""
    ratio = torch.exp((logp - prox_logp).detach().clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    weight = ratio.clamp(1.0 - low, 1.0 + high)
    return -weight * advantages * logp, weight != ratio


def policy_loss(
    logp: Tensor,
    prox_logp: Tensor,
    behav_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_clip_low: float,
    eps_clip_high: float,
    is_cap: float = 5.0,
    dual_clip: float | None = None,
    num_tokens: float | Tensor | None = None,
    loss: str = "ppo",
    gspo_clip_low: float = 3e-4,
    gspo_clip_high: float = 4e-4,
    importance: tuple[Tensor, Tensor] | None = None,
    agg: str = "token-mean",
    agg_norm: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled policy loss: a surrogate against the proximal policy times a detached importance weight ``w``
    for the behaviour → proximal gap, aggregated by ``agg`` (default: token-level mean).

    Per valid token, with ``r = exp(logp − prox_logp)``::

        ppo    ℓ = w · max(−r·A, −clip(r, 1−ε_low, 1+ε_high)·A)
               ℓ = w · min(max(−r·A, −clip(r)·A), −c·A)     for A < 0 when dual_clip = c (> 1)
        gspo   ℓ = w · max(−s·A, −clip(s, 1−g_low, 1+g_high)·A)   s = exp(mean_t(logp − prox_logp)) of the
               token's sequence, gradient s·∇logp per token (GSPO-token, Zheng et al. 2025); g = gspo_clip_*
        cispo  ℓ = −w · sg(clip(r, 1−ε_low, 1+ε_high)) · A · logp   (CISPO, MiniMax-M1, 2025)

    ``importance``: ``(w, cut)`` from :func:`learner.importance.importance_weights` (any level and
    treatment); None is the default token-level truncation ``w = min(exp(prox_logp − behav_logp), is_cap)``.
    ``prox_logp``, ``behav_logp`` and ``advantages`` are detached here: gradient flows only into ``logp``, and
    only at valid tokens. ``num_tokens``: the minibatch's :func:`aggregation_units` (its token count for
    token-mean, its sequence count otherwise) when it is split into micro-batches; see :func:`aggregate`.

    Metrics (detached 0-d tensors, means over valid tokens):
    ``policy/clipfrac`` (the clip branch is active; for cispo, r was clipped), ``policy/dual_clipfrac`` (the
    dual-clip bound is active; 0 without dual-clip), ``policy/approx_kl`` (k3 estimate of KL(prox ‖ current)),
    ``policy/is_weight_mean``, ``policy/is_weight_max``, ``policy/is_truncfrac`` (w was cut: truncated at
    the cap or masked), ``policy/ess`` (effective sample size of w normalised to (0, 1]: (Σw)² / (N·Σw²)).

    Shape: logp, prox_logp, behav_logp, advantages, mask (B, T) -> loss ().
    """
    prox_logp, behav_logp, advantages = prox_logp.detach(), behav_logp.detach(), advantages.detach()
    if importance is None:
        importance = importance_weights(prox_logp, behav_logp, mask, cap=is_cap)
    is_weight, cut = importance  # (B, T) each, detached
    dual_active = None
    if loss == "ppo":
        per_token, clip_active, dual_active = _ppo_terms(
            logp, prox_logp, advantages, eps_clip_low, eps_clip_high, dual_clip
        )
    elif loss == "gspo":
        per_token, clip_active = _gspo_terms(logp, prox_logp, advantages, mask, gspo_clip_low, gspo_clip_high)
    elif loss == "cispo":
        per_token, clip_active = _cispo_terms(logp, prox_logp, advantages, eps_clip_low, eps_clip_high)
    else:
        raise ValueError(f"policy loss {loss!r}: expected one of {', '.join(POLICY_LOSSES)}")
    loss_value = aggregate(per_token * is_weight.detach(), mask, agg, agg_norm, units=num_tokens)
    metrics = _policy_metrics(logp, prox_logp, mask, is_weight, cut, clip_active, dual_active)
    return loss_value, metrics


@torch.no_grad()
def _policy_metrics(
    logp: Tensor,
    prox_logp: Tensor,
    mask: Tensor,
    is_weight: Tensor,
    cut: Tensor,
    clip_active: Tensor,
    dual_active: Tensor | None,
) -> dict[str, Tensor]:
    """:func:`policy_loss`'s metrics, as its docstring lists them."""
    # Every per-token quantity in one (6, B, T) stack and one masked sum: on a small model each torch
    # op costs more in dispatch than in arithmetic, and separate masked means were ~40 ops.
    valid = mask.bool()
    dtype = is_weight.dtype
    per_token_metrics = torch.stack(
        [
            clip_active.to(dtype),
            (torch.zeros_like(is_weight) if dual_active is None else dual_active.to(dtype)),
            kl_k3(prox_logp, logp.detach()).to(dtype),
            cut.to(dtype),
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
    return metrics


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
