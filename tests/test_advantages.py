"""Advantage estimators and masked reductions against hand-worked values and naive Python loops."""

from __future__ import annotations

import math
import typing

import pytest
import torch

from learner.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    discounted_returns,
    gae,
    grpo_advantages,
    masked_mean,
    masked_whiten,
    reinforce_pp_advantages,
    rloo_advantages,
    token_rewards,
)
from tandem.config import AlgorithmConfig

F64 = torch.float64


def t64(x) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def prefix_mask(lengths: list[int], T: int) -> torch.Tensor:
    return (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).to(F64)


# ---------------------------------------------------------------------------------------------------
# Masked reductions
# ---------------------------------------------------------------------------------------------------


def test_masked_mean_is_token_level_and_ignores_padding_garbage():
    x = t64([[1.0, 2.0, 3.0], [10.0, math.nan, math.inf]])
    mask = t64([[1, 1, 1], [1, 0, 0]])
    # (1 + 2 + 3 + 10) / 4 tokens = 4.0; a mean of per-row means would be (2 + 10) / 2 = 6.0
    assert masked_mean(x, mask).item() == pytest.approx(4.0)
    # micro-batch accumulation: the caller supplies the minibatch's token count
    assert masked_mean(x, mask, num_tokens=8).item() == pytest.approx(2.0)
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0


def test_masked_whiten_hand_values():
    x = t64([[1.0, 2.0, 3.0], [6.0, 1e9, -1e9]])
    mask = t64([[1, 1, 1], [1, 0, 0]])
    # valid x = 1, 2, 3, 6: mean 3, population var (4 + 1 + 0 + 9) / 4 = 3.5
    out = masked_whiten(x, mask, eps=0.0)
    s = math.sqrt(3.5)
    torch.testing.assert_close(out, t64([[-2 / s, -1 / s, 0.0], [3 / s, 0.0, 0.0]]))
    torch.testing.assert_close(masked_whiten(x, mask, shift_mean=False, eps=0.0)[0], t64([1, 2, 3]) / s)


# ---------------------------------------------------------------------------------------------------
# Token rewards and returns
# ---------------------------------------------------------------------------------------------------


def test_token_rewards_places_reward_on_last_valid_token_and_kl_on_every_valid_token():
    mask = t64([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    kl = t64([[1.0, 1.0, 99.0], [2.0, 99.0, 99.0], [99.0, 99.0, 99.0]])
    out = token_rewards(t64([1.0, 2.0, 3.0]), mask, kl=kl, kl_coef=0.1)
    # row 0: -0.1·1 on both tokens, +1 on the last; row 1: 2 - 0.1·2; row 2: no token, nothing
    torch.testing.assert_close(out, t64([[-0.1, 0.9, 0.0], [1.8, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(token_rewards(t64([1.0, 2.0, 3.0]), mask)[:2], t64([[0, 1, 0], [2, 0, 0]]))


def test_per_turn_credit_puts_each_turn_reward_on_its_last_token_and_gae_credits_turns_separately():
    # Two model turns (tokens 0-1 and 4-5) around two environment tokens, then padding. Turn 1 earned
    # 1.0, turn 2 earned 0.5; the episode's sum, 1.5, is the sequence reward.
    mask = t64([[1, 1, 0, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0]])
    placed = t64([[0, 1.0, 0, 0, 0, 0.5, 0], [0, 0, 0, 0, 0, 0, 0]])  # row 1: single-turn, no placement
    seq = t64([1.5, 2.0])
    r = token_rewards(seq, mask, placed=placed)
    torch.testing.assert_close(r, t64([[0, 1.0, 0, 0, 0, 0.5, 0], [0, 0, 2.0, 0, 0, 0, 0]]))
    # KL still lands on every valid token, beside the placed rewards.
    kl = torch.ones_like(mask)
    r_kl = token_rewards(seq, mask, kl, 0.1, placed=placed)
    torch.testing.assert_close(r_kl[0], t64([-0.1, 0.9, 0, 0, -0.1, 0.4, 0]))
    # GAE with V = 0, γ = 0.5, λ = 1 over the valid steps 0, 1, 4, 5 (environment tokens skipped):
    #   per turn:   G5 = 0.5, G4 = 0.25, G1 = 1 + 0.5·0.25 = 1.125, G0 = 0.5625
    #   per episode: the 1.5 at step 5 only: G5 = 1.5, G4 = 0.75, G1 = 0.375, G0 = 0.1875
    values = torch.zeros_like(mask)
    adv_turn, _ = gae(r, values, mask, gamma=0.5, lam=1.0)
    adv_episode, _ = gae(token_rewards(seq, mask), values, mask, gamma=0.5, lam=1.0)
    torch.testing.assert_close(adv_turn[0], t64([0.5625, 1.125, 0, 0, 0.25, 0.5, 0]))
    torch.testing.assert_close(adv_episode[0], t64([0.1875, 0.375, 0, 0, 0.75, 1.5, 0]))
    torch.testing.assert_close(adv_turn[1], adv_episode[1])  # a row without turns is unchanged


def test_discounted_returns_hand_values_and_masked_tail():
    rewards = t64([[1.0, 0.0, 2.0, 7.0]])
    mask = t64([[1, 1, 1, 0]])
    # γ = 0.5: G2 = 2, G1 = 0 + 0.5·2 = 1, G0 = 1 + 0.5·1 = 1.5; the masked 7 is never seen
    torch.testing.assert_close(discounted_returns(rewards, mask, 0.5), t64([[1.5, 1.0, 2.0, 0.0]]))


def test_a_zero_inside_the_mask_is_skipped_not_an_end():
    # Environment tokens of a multi-turn episode: the return flows across them to the earlier turn.
    rewards, values, mask = t64([[1.0, 1.0, 9.0, 1.0]]), torch.zeros(1, 4, dtype=F64), t64([[1, 1, 0, 1]])
    # γ = 1: G3 = 1; G2 = 0 (env; its 9 is never seen); G1 = 1 + G3 = 2; G0 = 1 + G1 = 3
    torch.testing.assert_close(discounted_returns(rewards, mask, 1.0), t64([[3.0, 2.0, 0.0, 1.0]]))
    # γ = 0.5 discounts per generated token: G1 = 1 + 0.5·1 = 1.5, G0 = 1 + 0.5·1.5 = 1.75
    torch.testing.assert_close(discounted_returns(rewards, mask, 0.5), t64([[1.75, 1.5, 0.0, 1.0]]))
    adv, _ = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, t64([[3.0, 2.0, 0.0, 1.0]]))
    # With values: δ1 = r1 + V3 − V1 (the next *generated* token's value, not the env token's 5)
    values = t64([[0.5, 0.25, 5.0, 0.75]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.0)
    torch.testing.assert_close(adv, t64([[1 + 0.25 - 0.5, 1 + 0.75 - 0.25, 0.0, 1 - 0.75]]))
    torch.testing.assert_close(ret, t64([[1.25, 1.75, 0.0, 1.0]]))


# ---------------------------------------------------------------------------------------------------
# GAE
# ---------------------------------------------------------------------------------------------------


def test_gae_gamma_one_lambda_one_is_return_minus_value():
    rewards, values = t64([[0.0, 0.0, 1.0]]), t64([[0.5, 0.2, 0.8]])
    adv, ret = gae(rewards, values, torch.ones_like(rewards), gamma=1.0, lam=1.0)
    # A_t = Σ_{s≥t} r_s − V_t = 1 − V_t; returns = A + V = 1
    torch.testing.assert_close(adv, t64([[0.5, 0.8, 0.2]]))
    torch.testing.assert_close(ret, t64([[1.0, 1.0, 1.0]]))


def test_gae_hand_values_with_masked_tail():
    # one real row of 3 tokens, padded with garbage that must not matter
    rewards = t64([[0.0, 0.0, 1.0, 5.0, 5.0]])
    values = t64([[0.5, 0.2, 0.8, 9.0, 9.0]])
    mask = t64([[1, 1, 1, 0, 0]])
    adv, ret = gae(rewards, values, mask, gamma=0.5, lam=0.5)
    # δ2 = 1 + 0.5·0 − 0.8 = 0.2   (V after the last valid token is 0: terminal)
    # δ1 = 0 + 0.5·0.8 − 0.2 = 0.2
    # δ0 = 0 + 0.5·0.2 − 0.5 = −0.4
    # A2 = 0.2, A1 = 0.2 + 0.25·0.2 = 0.25, A0 = −0.4 + 0.25·0.25 = −0.3375
    torch.testing.assert_close(adv, t64([[-0.3375, 0.25, 0.2, 0.0, 0.0]]))
    torch.testing.assert_close(ret, t64([[0.1625, 0.45, 1.0, 0.0, 0.0]]))


def naive_gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    """A_t = Σ_l (γλ)^l δ_{t+l}, δ_t = r_t + γ V_{t+1} − V_t, V_L = 0: the definition, not the recursion."""
    L = len(rewards)
    v = [*values, 0.0]
    deltas = [rewards[t] + gamma * v[t + 1] - v[t] for t in range(L)]
    return [sum((gamma * lam) ** k * deltas[t + k] for k in range(L - t)) for t in range(L)]


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.95), (0.99, 0.9), (0.5, 0.0), (0.0, 0.7)])
def test_gae_matches_naive_double_loop(gamma: float, lam: float):
    gen = torch.Generator().manual_seed(0)
    B, T = 6, 9
    lengths = [9, 1, 0, 4, 7, 9]
    rewards = torch.randn(B, T, generator=gen, dtype=F64)
    values = torch.randn(B, T, generator=gen, dtype=F64)
    adv, ret = gae(rewards, values, prefix_mask(lengths, T), gamma, lam)
    for b, L in enumerate(lengths):
        expected = naive_gae(rewards[b, :L].tolist(), values[b, :L].tolist(), gamma, lam)
        torch.testing.assert_close(adv[b, :L], t64(expected))
        torch.testing.assert_close(ret[b, :L], t64(expected) + values[b, :L])
        assert not adv[b, L:].any() and not ret[b, L:].any()


# ---------------------------------------------------------------------------------------------------
# Outcome estimators
# ---------------------------------------------------------------------------------------------------


def test_grpo_group_mean_and_std_with_uneven_groups():
    # groups (non-contiguous labels, different sizes): 7 → [1, 0, 0, 1], 2 → [1, 2, 6], 4 → [3], 9 → [3, 3]
    score = t64([1.0, 1.0, 0.0, 2.0, 0.0, 3.0, 6.0, 1.0, 3.0, 3.0])
    group = torch.tensor([7, 2, 7, 2, 7, 4, 2, 7, 9, 9])
    adv = grpo_advantages(score, group, eps=0.0)
    # group 7: mean 0.5, unbiased std sqrt(4·0.25 / 3) = 1/√3 → ±0.5·√3
    # group 2: mean 3, centred [−2, −1, 3], unbiased var (4 + 1 + 9) / 2 = 7 → centred / √7
    # group 4: one sample → 0; group 9: equal scores → 0 (std 0: no division)
    h, r7 = 0.5 * math.sqrt(3), math.sqrt(7)
    expected = [h, -2 / r7, -h, -1 / r7, -h, 0.0, 3 / r7, h, 0.0, 0.0]
    torch.testing.assert_close(adv, t64(expected))
    # Dr. GRPO: centred only
    centred = [0.5, -2.0, -0.5, -1.0, -0.5, 0.0, 3.0, 0.5, 0.0, 0.0]
    torch.testing.assert_close(grpo_advantages(score, group, normalize_std=False), t64(centred))


@pytest.mark.parametrize("value", [0.1, 0.3, 0.7])
def test_group_of_equal_scores_gets_exactly_zero_advantage(value: float):
    # 8 × 0.7 summed in float32 is not 8 · 0.7: a naive mean leaves ±ulp residues, and dividing them by
    # their own ~ulp std made them O(0.01–1) before the group was centred on its max.
    score = torch.full((8,), value, dtype=torch.float32)
    group = torch.zeros(8, dtype=torch.long)
    assert not grpo_advantages(score, group).any()
    assert not grpo_advantages(score, group, eps=0.0).any()
    assert not rloo_advantages(score, group).any()


def test_rloo_leave_one_out_baseline():
    score = t64([1.0, 2.0, 6.0, 5.0])
    group = torch.tensor([0, 0, 0, 1])
    # baselines: (2 + 6)/2 = 4, (1 + 6)/2 = 3.5, (1 + 2)/2 = 1.5; a group of one has no baseline → 0
    torch.testing.assert_close(rloo_advantages(score, group), t64([-3.0, -1.5, 4.5, 0.0]))


def test_reinforce_pp_discounted_return_then_global_whitening():
    mask = t64([[1, 1, 1], [1, 0, 0]])
    kl = t64([[0.1, 0.1, 0.1], [0.2, 0.0, 0.0]])
    rewards = token_rewards(t64([1.0, 0.0]), mask, kl=kl, kl_coef=1.0)  # [[-.1, -.1, .9], [-.2, 0, 0]]
    adv = reinforce_pp_advantages(rewards, mask, gamma=1.0)
    # returns (γ = 1): row 0 [0.7, 0.8, 0.9], row 1 [−0.2]; over the 4 valid tokens mean 2.2/4 = 0.55,
    # deviations [0.15, 0.25, 0.35, −0.75], population var (.0225 + .0625 + .1225 + .5625)/4 = 0.1925
    s = math.sqrt(0.1925 + 1e-8)
    torch.testing.assert_close(adv, t64([[0.15 / s, 0.25 / s, 0.35 / s], [-0.75 / s, 0.0, 0.0]]))


def test_registry_covers_config_names_and_broadcasts_sequence_advantages():
    config_names = set(typing.get_args(AlgorithmConfig.model_fields["advantage"].annotation))
    assert set(ADVANTAGE_ESTIMATORS) == config_names

    mask = t64([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    rewards = token_rewards(t64([1.0, 2.0, 6.0]), mask)
    inputs = AdvantageInputs(
        rewards, mask, group_index=torch.tensor([0, 0, 0]), values=torch.zeros_like(mask)
    )

    adv, ret = ADVANTAGE_ESTIMATORS["rloo"](inputs)
    assert ret is None
    torch.testing.assert_close(adv, t64([[-3.0, -3.0, 0.0], [-1.5, -1.5, -1.5], [4.5, 0.0, 0.0]]))

    adv, ret = ADVANTAGE_ESTIMATORS["grpo"](inputs)
    assert ret is None
    torch.testing.assert_close(adv[:, 0], grpo_advantages(t64([1.0, 2.0, 6.0]), torch.tensor([0, 0, 0])))
    assert adv[0, 2] == 0 and adv[2, 1:].abs().sum() == 0

    adv, ret = ADVANTAGE_ESTIMATORS["gae"](inputs)
    torch.testing.assert_close(ret, rewards.flip(-1).cumsum(-1).flip(-1) * mask)  # V = 0, γ = λ = 1

    adv, ret = ADVANTAGE_ESTIMATORS["reinforce_pp"](inputs)
    assert ret is None
    torch.testing.assert_close(adv, reinforce_pp_advantages(rewards, mask, 1.0))


@pytest.mark.parametrize(
    "name,missing", [("gae", "values"), ("grpo", "group_index"), ("rloo", "group_index")]
)
def test_estimator_names_the_missing_input(name: str, missing: str):
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match=missing):
        ADVANTAGE_ESTIMATORS[name](AdvantageInputs(torch.zeros(2, 3), mask))


def test_gae_whitening_whitens_advantages_over_valid_tokens_and_keeps_returns():
    rewards = t64([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    values = t64([[0.5, 0.2, 0.1], [0.3, 0.4, 9.9]])
    mask = t64([[1, 1, 1], [1, 1, 0]])
    plain = ADVANTAGE_ESTIMATORS["gae"](AdvantageInputs(rewards, mask, values=values, gamma=1.0, lam=1.0))
    white = ADVANTAGE_ESTIMATORS["gae"](
        AdvantageInputs(rewards, mask, values=values, gamma=1.0, lam=1.0, whiten=True, eps=0.0)
    )
    # By hand (γ = λ = 1): A = return - V = [[0.5, 0.8, 0.9], [1.7, 1.6, ·]]; five valid tokens.
    adv = [0.5, 0.8, 0.9, 1.7, 1.6]
    mean = sum(adv) / 5
    std = (sum((a - mean) ** 2 for a in adv) / 5) ** 0.5
    expected = t64([[(a - mean) / std for a in adv[:3]], [(a - mean) / std for a in adv[3:]] + [0.0]])
    torch.testing.assert_close(plain[0], t64([[0.5, 0.8, 0.9], [1.7, 1.6, 0.0]]))
    torch.testing.assert_close(white[0], expected)
    torch.testing.assert_close(white[1], plain[1])  # the critic's targets are not whitened


def test_overlong_penalty_by_hand():
    from rollout.shaping import overlong_penalty

    # L_max 20, buffer 4: no penalty up to 16 tokens, then -0.25 per token, -1 at 20 (DAPO's Eq. 13).
    assert [overlong_penalty(n, 20, 4) for n in (1, 16, 17, 18, 20)] == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(18, 20, 4, penalty=0.5) == -0.25
    with pytest.raises(ValueError, match="overlong buffer 30"):
        overlong_penalty(5, 20, 30)


def test_uniform_groups_are_not_informative():
    from rollout.shaping import is_informative

    assert not is_informative([1.0, 1.0, 1.0]) and not is_informative([0.0, 0.0])
    assert is_informative([0.0, 0.0, 1.0])
