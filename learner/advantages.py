"""Advantage estimators and the masked reductions the learner's math shares (docs/design.md §4.5).

Every function is tensor in, tensor out. Per-token tensors are ``(B, T)`` over *response* tokens only,
right-padded, with ``mask`` ``(B, T)`` (1 = real token; bool or float). Padding and aborted tails are
masked out; outputs are 0 there. Advantages and returns are targets, so the estimators run under
``torch.no_grad()``.

Estimators, one function each, picked once at setup from ``ADVANTAGE_ESTIMATORS`` by the
``algorithm.advantage`` name; all share one signature ``(AdvantageInputs) -> (advantages, returns | None)``:

- ``gae``: generalised advantage estimation with a critic (Schulman et al. 2016, "High-Dimensional
  Continuous Control Using Generalized Advantage Estimation"), as in PPO-RLHF (Ouyang et al. 2022).
- ``grpo``: the sequence score centred on its group mean and, optionally, divided by the group std
  (Shao et al. 2024, DeepSeekMath). ``normalize_std=False`` is Dr. GRPO (Liu et al. 2025).
- ``rloo``: REINFORCE with a leave-one-out baseline: the mean score of the other samples of the same
  prompt (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics").
- ``reinforce_pp``: REINFORCE++ (Hu 2025): per-token discounted return of the token rewards, whitened
  over all valid tokens of the batch (a global baseline instead of a per-prompt one).

The sequence score the outcome estimators (grpo, rloo) use is the sum of the token rewards,
``Σ_t token_rewards[b, t]``: the sequence reward when the KL is not folded into the reward, and the
KL-regularised sequence reward ``r − β·Σ_t kl_t`` when it is (the sequence-level view of Ahmadian et al.).
Build token rewards with ``token_rewards``. A row with no valid token has score 0; drop such rows upstream.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageEstimator",
    "AdvantageInputs",
    "discounted_returns",
    "gae",
    "grpo_advantages",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "token_rewards",
]


# ---------------------------------------------------------------------------------------------------
# Masked reductions
# ---------------------------------------------------------------------------------------------------


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` over valid positions (over everything when ``dim`` is None).

    ``torch.where`` rather than ``x * mask``, so non-finite garbage in padding cannot leak in as NaN.

    Shape: x (B, T), mask (B, T) -> () or reduced over ``dim``.
    """
    kept = torch.where(mask.bool(), x, 0.0)
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, num_tokens: float | Tensor | None = None) -> Tensor:
    """Token-level mean over the whole batch: ``Σ x·mask / Σ mask`` (not a mean of per-sequence means).

    A long sequence weighs in proportion to its length (DAPO's token-level loss, Yu et al. 2025).
    ``num_tokens`` replaces the denominator: pass the valid-token count of the whole minibatch when
    the minibatch is split into micro-batches whose gradients accumulate, so the accumulated loss is
    still the token-level mean over the minibatch. The denominator is at least 1: an empty mask gives 0.

    Shape: x (B, T), mask (B, T) -> ().
    """
    if num_tokens is None:
        num_tokens = mask.to(x.dtype).sum()
    return masked_sum(x, mask) / torch.as_tensor(num_tokens, dtype=x.dtype, device=x.device).clamp_min(1.0)


def masked_var(x: Tensor, mask: Tensor) -> Tensor:
    """Population variance (divisor N) of ``x`` over valid positions; 0 for an empty mask.

    Shape: x (B, T), mask (B, T) -> ().
    """
    mean = masked_mean(x, mask)
    return masked_mean((x - mean) ** 2, mask)


def masked_whiten(x: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """``(x − mean) / sqrt(var + eps)`` with mean and (population) variance over valid positions only.

    ``shift_mean=False`` only rescales. Padding is 0 in the output.

    Shape: x (B, T), mask (B, T) -> (B, T).
    """
    scale = torch.rsqrt(masked_var(x, mask) + eps)
    whitened = (x - masked_mean(x, mask)) * scale if shift_mean else x * scale
    return torch.where(mask.bool(), whitened, 0.0)


# ---------------------------------------------------------------------------------------------------
# Rewards and returns
# ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def token_rewards(
    seq_reward: Tensor,
    mask: Tensor,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    *,
    placed: Tensor | None = None,
) -> Tensor:
    """Per-token rewards: the sequence reward on the last valid token, minus ``kl_coef·kl`` on every
    valid token (the KL folded into the reward, Ziegler et al. 2019 / Ouyang et al. 2022).

    ``kl`` is a per-token estimate from ``KL_ESTIMATORS`` (usually k1). Padding is 0. ``placed`` holds
    rewards already on their tokens: per-turn credit, each turn's reward on that turn's last generated
    token (docs/environments.md §10.1). A row of it that is all zero takes the sequence reward as usual.

    Shape: seq_reward (B,), mask (B, T), kl (B, T), placed (B, T) -> (B, T).
    """
    m = mask.bool()
    dtype = seq_reward.dtype if kl is None else torch.promote_types(seq_reward.dtype, kl.dtype)
    rewards = torch.zeros(m.shape, dtype=dtype, device=m.device)
    if kl is not None:
        rewards = torch.where(m, -kl_coef * kl.to(dtype), rewards)
    # argmax returns the first maximum of the running count, i.e. the last valid token.
    last = m.long().cumsum(-1).argmax(-1)  # (B,)
    bonus = torch.where(m.any(-1), seq_reward.to(dtype), 0.0)  # (B,)
    if placed is not None:
        per_turn = placed.ne(0).any(-1)  # (B,)
        bonus = torch.where(per_turn, 0.0, bonus)
        rewards = rewards + torch.where(m & per_turn[:, None], placed.to(dtype), 0.0)
    return rewards.scatter_add(-1, last[:, None], bonus[:, None])


@torch.no_grad()
def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """``G_t = r_t + γ·G_{t+1}``, with ``G = 0`` after the last valid token (terminal).

    Time steps are the valid tokens: a zero inside a row (the environment's tokens of a multi-turn episode,
    docs/environments.md §10.1) is skipped, not an end, so the return flows across it to earlier turns.

    Shape: token_rewards (B, T), mask (B, T) -> (B, T).
    """
    m = mask.bool()
    rewards = torch.where(m, token_rewards, 0.0)
    running = rewards.new_zeros(rewards.shape[0])  # (B,)
    out = []
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(m[:, t], rewards[:, t] + gamma * running, running)
        out.append(torch.where(m[:, t], running, 0.0))
    return torch.stack(out[::-1], dim=1)


@torch.no_grad()
def gae(
    token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over response tokens.

    ``δ_t = r_t + γ·V_{t+1} − V_t``, ``A_t = δ_t + γλ·A_{t+1}``, with ``V = 0`` and ``A = 0`` after the
    last valid token (terminal), and ``returns = A + V`` (the critic's target). Time steps are the valid
    tokens: a zero inside a row (environment tokens, docs/environments.md §10.1) is skipped, so ``V_{t+1}`` is the
    value at the next *generated* token and advantages flow across environment turns.

    Shape: token_rewards (B, T), values (B, T), mask (B, T) -> advantages (B, T), returns (B, T).
    """
    m = mask.bool()
    values = torch.where(m, values, 0.0)
    rewards = torch.where(m, token_rewards.to(values.dtype), 0.0)
    next_value = values.new_zeros(values.shape[0])  # (B,)
    running = values.new_zeros(values.shape[0])  # (B,)
    out = []
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(m[:, t], delta + gamma * lam * running, running)
        out.append(torch.where(m[:, t], running, 0.0))
        next_value = torch.where(m[:, t], values[:, t], next_value)
    advantages = torch.stack(out[::-1], dim=1)
    return advantages, torch.where(m, advantages + values, 0.0)


# ---------------------------------------------------------------------------------------------------
# Outcome (group) estimators
# ---------------------------------------------------------------------------------------------------


def _group_sum(x: Tensor, inverse: Tensor) -> Tensor:
    """Sum over each element's group, broadcast back to the element. Shape: (B,), (B,) -> (B,)."""
    return x.new_zeros(int(inverse.max()) + 1).index_add_(0, inverse, x)[inverse]


def _group_centre(
    seq_score: Tensor, group_index: Tensor, weight: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """``(s − mean_g, n_g, inverse)`` per element; ``inverse`` maps labels to 0..G−1.

    The mean is taken of ``s − max_g``, so a group of equal scores centres to exactly 0 rather than to
    the rounding error of its mean, which a division by a std of the same size would blow up to O(1).
    ``weight``: each row's share of a sample (1 by default); an agent episode split into k segments is
    k rows of weight 1/k, so ``n_g`` and the mean count episodes (docs/environments.md §10.6).

    Shape: seq_score (B,), group_index (B,), weight (B,) -> (B,), (B,), (B,).
    """
    _, inverse = torch.unique(group_index, return_inverse=True)
    anchor = seq_score.new_zeros(int(inverse.max()) + 1)
    anchor = anchor.scatter_reduce(0, inverse, seq_score, "amax", include_self=False)[inverse]
    shifted = seq_score - anchor
    w = torch.ones_like(seq_score) if weight is None else weight.to(seq_score)
    count = _group_sum(w, inverse)
    return shifted - _group_sum(w * shifted, inverse) / count, count, inverse


@torch.no_grad()
def grpo_advantages(
    seq_score: Tensor,
    group_index: Tensor,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
    weight: Tensor | None = None,
) -> Tensor:
    """GRPO: ``(s − mean_g) / (std_g + eps)``, or ``s − mean_g`` without ``normalize_std`` (Dr. GRPO).

    ``std_g`` is the unbiased (n−1) sample std, as in the DeepSeekMath reference implementations.
    A group of one or of equal scores (std 0) is centred only, which makes it exactly 0; it is never
    divided. Groups may differ in size; ``group_index`` may hold any integer labels. ``weight``: rows'
    shares of a sample (:func:`_group_centre`); mean, std and n count weighted rows.

    Shape: seq_score (B,), group_index (B,), weight (B,) -> (B,).
    """
    centred, count, inverse = _group_centre(seq_score, group_index, weight)
    if not normalize_std:
        return centred
    w = torch.ones_like(centred) if weight is None else weight.to(centred)
    std = (_group_sum(w * centred**2, inverse) / (count - 1).clamp_min(1.0)).sqrt()
    return torch.where(std > 0, centred / (std + eps), centred)


@torch.no_grad()
def rloo_advantages(seq_score: Tensor, group_index: Tensor, weight: Tensor | None = None) -> Tensor:
    """RLOO: ``s_i − mean_{j≠i} s_j`` within the group; 0 for a group of one (no baseline exists).

    Computed as ``n/(n−1)·(s_i − mean_g)``, the same quantity. ``weight``: rows' shares of a sample
    (:func:`_group_centre`); the rows of one sample (its segments, of one score) are left out together.

    Shape: seq_score (B,), group_index (B,), weight (B,) -> (B,).
    """
    centred, count, _ = _group_centre(seq_score, group_index, weight)
    return torch.where(count > 1, centred * count / (count - 1).clamp_min(1.0), 0.0)


@torch.no_grad()
def reinforce_pp_advantages(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """REINFORCE++: discounted per-token returns, whitened over all valid tokens of the batch.

    Shape: token_rewards (B, T), mask (B, T) -> (B, T).
    """
    return masked_whiten(discounted_returns(token_rewards, mask, gamma), mask)


# ---------------------------------------------------------------------------------------------------
# Uniform interface and registry
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AdvantageInputs:
    """What any estimator may need; each uses a subset.

    token_rewards: (B, T) from ``token_rewards`` (the KL already folded in, if configured).
    mask: (B, T) prefix mask of valid response tokens.
    group_index: (B,) integer group label (samples of one prompt share it); grpo and rloo need it.
    values: (B, T) critic values of the rollout (``old_values``); gae needs it.
    weight: (B,) each row's share of a sample for grpo and rloo's group statistics (None: 1 each).
    """

    token_rewards: Tensor
    mask: Tensor
    group_index: Tensor | None = None
    values: Tensor | None = None
    gamma: float = 1.0
    lam: float = 1.0
    normalize_std: bool = True
    whiten: bool = False
    eps: float = 1e-6
    weight: Tensor | None = None


AdvantageEstimator = Callable[[AdvantageInputs], tuple[Tensor, Tensor | None]]
"""``(inputs) -> (advantages (B, T), returns (B, T) or None)``; returns only from critic-based estimators."""


def _require(value: Tensor | None, estimator: str, field: str) -> Tensor:
    if value is None:
        raise ValueError(f"advantage estimator {estimator!r} needs AdvantageInputs.{field}")
    return value


def _broadcast(seq_adv: Tensor, mask: Tensor) -> Tensor:
    """Every valid token of a sequence gets the sequence's advantage. Shape: (B,), (B, T) -> (B, T)."""
    return torch.where(mask.bool(), seq_adv[:, None], 0.0)


def _seq_score(inp: AdvantageInputs) -> Tensor:
    return masked_sum(inp.token_rewards, inp.mask, dim=-1)  # (B,)


def _gae_estimator(inp: AdvantageInputs) -> tuple[Tensor, Tensor | None]:
    values = _require(inp.values, "gae", "values")
    advantages, returns = gae(inp.token_rewards, values, inp.mask, inp.gamma, inp.lam)
    if inp.whiten:  # the policy sees whitened advantages; the critic's targets stay in reward units
        advantages = masked_whiten(advantages, inp.mask)
    return advantages, returns


def _grpo_estimator(inp: AdvantageInputs) -> tuple[Tensor, Tensor | None]:
    group_index = _require(inp.group_index, "grpo", "group_index")
    adv = grpo_advantages(
        _seq_score(inp), group_index, normalize_std=inp.normalize_std, eps=inp.eps, weight=inp.weight
    )
    return _broadcast(adv, inp.mask), None


def _rloo_estimator(inp: AdvantageInputs) -> tuple[Tensor, Tensor | None]:
    group_index = _require(inp.group_index, "rloo", "group_index")
    return _broadcast(rloo_advantages(_seq_score(inp), group_index, inp.weight), inp.mask), None


def _reinforce_pp_estimator(inp: AdvantageInputs) -> tuple[Tensor, Tensor | None]:
    return reinforce_pp_advantages(inp.token_rewards, inp.mask, inp.gamma), None


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "gae": _gae_estimator,
    "grpo": _grpo_estimator,
    "rloo": _rloo_estimator,
    "reinforce_pp": _reinforce_pp_estimator,
}
"""Keys match ``algorithm.advantage`` in the config."""
