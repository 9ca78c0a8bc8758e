"""Policy and value losses, KL estimators and metrics against closed forms, hand values and naive loops."""

from __future__ import annotations

import math
import typing

import pytest
import torch

from learner.losses import (
    KL_ESTIMATORS,
    entropy_from_logits,
    explained_variance,
    kl_k1,
    kl_k2,
    kl_k3,
    logprobs_from_logits,
    policy_loss,
    value_loss,
)
from tandem.config import AlgorithmConfig

F64 = torch.float64
CLIP = {"eps_clip_low": 0.2, "eps_clip_high": 0.28, "is_cap": 5.0}


def t64(x) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def leaf(x) -> torch.Tensor:
    return t64(x).requires_grad_(True)


# ---------------------------------------------------------------------------------------------------
# Logits → log-probabilities, entropy
# ---------------------------------------------------------------------------------------------------


def test_logprobs_from_logits_matches_naive_loop():
    gen = torch.Generator().manual_seed(0)
    B, T, V = 2, 3, 11
    logits = 5 * torch.randn(B, T, V, generator=gen, dtype=F64)
    labels = torch.randint(V, (B, T), generator=gen)
    out = logprobs_from_logits(logits, labels)
    for b in range(B):
        for t in range(T):
            z = logits[b, t].tolist()
            expected = z[labels[b, t]] - math.log(sum(math.exp(v) for v in z))
            assert out[b, t].item() == pytest.approx(expected, abs=1e-12)
    # bf16 logits are upcast: the result is float32 and exact for the bf16-rounded logits
    low = logits.to(torch.bfloat16)
    out_low = logprobs_from_logits(low, labels)
    assert out_low.dtype == torch.float32
    torch.testing.assert_close(
        out_low.double(), logprobs_from_logits(low.double(), labels), atol=1e-5, rtol=0
    )


def test_entropy_from_logits_matches_naive_loop():
    logits = t64([[[0.0, 0.0, 0.0, 0.0], [10.0, -10.0, 0.0, 1.0]]])
    out = entropy_from_logits(logits)
    assert out[0, 0].item() == pytest.approx(math.log(4))  # uniform over 4
    z = logits[0, 1].tolist()
    p = [math.exp(v) / sum(math.exp(u) for u in z) for v in z]
    assert out[0, 1].item() == pytest.approx(-sum(q * math.log(q) for q in p), abs=1e-12)
    low = logits.to(torch.bfloat16)
    torch.testing.assert_close(
        entropy_from_logits(low).double(), entropy_from_logits(low.double()), atol=1e-5, rtol=0
    )


# ---------------------------------------------------------------------------------------------------
# KL estimators
# ---------------------------------------------------------------------------------------------------


def test_kl_estimators_closed_form_on_hand_inputs():
    logp, ref = t64([math.log(0.5), -1.0]), t64([math.log(0.25), -1.0])
    torch.testing.assert_close(kl_k1(logp, ref), t64([math.log(2), 0.0]))
    torch.testing.assert_close(kl_k2(logp, ref), t64([0.5 * math.log(2) ** 2, 0.0]))
    # k3: exp(log .25 − log .5) − (log .25 − log .5) − 1 = 0.5 + log 2 − 1 ≈ 0.1931
    torch.testing.assert_close(kl_k3(logp, ref), t64([0.5 + math.log(2) - 1, 0.0]))
    assert set(KL_ESTIMATORS) == set(typing.get_args(AlgorithmConfig.model_fields["kl_estimator"].annotation))


def test_k2_and_k3_are_nonnegative():
    gen = torch.Generator().manual_seed(1)
    logp, ref = (
        3 * torch.randn(1000, generator=gen, dtype=F64),
        3 * torch.randn(1000, generator=gen, dtype=F64),
    )
    assert (kl_k3(logp, ref) >= 0).all() and (kl_k2(logp, ref) >= 0).all()
    assert (kl_k1(logp, ref) < 0).any()  # k1 is not


@pytest.mark.parametrize("name", ["k1", "k3"])
def test_k1_and_k3_are_unbiased_for_the_exact_kl(name: str):
    p = t64([0.5, 0.2, 0.15, 0.1, 0.05])  # the policy, which samples
    q = t64([0.1, 0.2, 0.3, 0.2, 0.2])  # the reference
    exact = (p * (p / q).log()).sum().item()  # KL(p ‖ q) ≈ 0.4564
    gen = torch.Generator().manual_seed(2)
    x = torch.multinomial(p, 200_000, replacement=True, generator=gen)
    est = KL_ESTIMATORS[name](p.log()[x], q.log()[x])
    stderr = est.std().item() / math.sqrt(x.numel())
    assert abs(est.mean().item() - exact) < 4 * stderr
    # and the test has teeth: k2 is biased here by far more than its standard error
    k2 = kl_k2(p.log()[x], q.log()[x])
    assert abs(k2.mean().item() - exact) > 10 * k2.std().item() / math.sqrt(x.numel())


# ---------------------------------------------------------------------------------------------------
# Policy loss
# ---------------------------------------------------------------------------------------------------


def naive_ppo(logp, old_logp, adv, mask, eps: float) -> float:
    """Textbook PPO clip loss, token-level mean over valid tokens, one token at a time."""
    total, n = 0.0, 0
    for row_lp, row_old, row_a, row_m in zip(
        logp.tolist(), old_logp.tolist(), adv.tolist(), mask.tolist(), strict=True
    ):
        for lp, old, a, m in zip(row_lp, row_old, row_a, row_m, strict=True):
            if m:
                r = math.exp(lp - old)
                total += -min(r * a, min(max(r, 1 - eps), 1 + eps) * a)
                n += 1
    return total / n


def test_policy_loss_is_textbook_ppo_when_prox_equals_behav():
    gen = torch.Generator().manual_seed(3)
    B, T = 4, 6
    old = -torch.rand(B, T, generator=gen, dtype=F64) * 3
    logp = old + 0.5 * torch.randn(B, T, generator=gen, dtype=F64)  # ratios well outside [0.8, 1.2]
    adv = torch.randn(B, T, generator=gen, dtype=F64)
    mask = (torch.arange(T)[None] < torch.tensor([6, 2, 4, 1])[:, None]).to(F64)
    loss, m = policy_loss(logp, old, old, adv, mask, eps_clip_low=0.2, eps_clip_high=0.2, is_cap=5.0)
    assert loss.item() == pytest.approx(naive_ppo(logp, old, adv, mask, 0.2), abs=1e-12)
    assert m["policy/is_weight_mean"].item() == 1.0 and m["policy/ess"].item() == pytest.approx(1.0)
    assert 0.0 < m["policy/clipfrac"].item() < 1.0
    assert all(v.ndim == 0 and not v.requires_grad for v in m.values())


def test_clipping_zeroes_gradient_only_on_the_clipped_side():
    # ε_low = 0.2, ε_high = 0.28: ratios are clipped to [0.8, 1.28]
    ratio = t64([1.5, 0.5, 1.1, 1.5, 0.5, 1.25])
    adv = t64([1.0, -1.0, 1.0, -1.0, 1.0, 1.0])
    prox = torch.zeros(1, 6, dtype=F64)
    logp = leaf(ratio.log()[None].tolist())
    loss, m = policy_loss(logp, prox, prox, adv[None], torch.ones(1, 6, dtype=F64), **CLIP)
    loss.backward()
    # per-token max(−rA, −clip(r)A):
    #  0: r=1.5, A=+1 → max(−1.5, −1.28) = −1.28  clipped above: no gradient
    #  1: r=0.5, A=−1 → max(0.5, 0.8)   =  0.8   clipped below: no gradient
    #  2: r=1.1, A=+1 → −1.1 inside                 dℓ/dlogp = −A·r = −1.1
    #  3: r=1.5, A=−1 → max(1.5, 1.28)  =  1.5   unclipped (pessimistic side): dℓ/dlogp = 1.5
    #  4: r=0.5, A=+1 → max(−0.5, −0.8) = −0.5   unclipped: dℓ/dlogp = −0.5
    #  5: r=1.25, A=+1 → −1.25, inside thanks to the asymmetric ε_high (a symmetric 0.2 would clip)
    assert loss.item() == pytest.approx((-1.28 + 0.8 - 1.1 + 1.5 - 0.5 - 1.25) / 6)
    torch.testing.assert_close(logp.grad, t64([[0.0, 0.0, -1.1, 1.5, -0.5, -1.25]]) / 6)
    assert m["policy/clipfrac"].item() == pytest.approx(2 / 6)


def test_importance_weight_is_truncated_detached_and_decoupled_from_the_ratio():
    # logp = prox, so r = 1 and nothing is clipped, although logp is far from behav_logp
    prox = leaf([[-1.0, -1.0]])
    behav = leaf([[-1.0 - math.log(10.0), -1.0 + math.log(2.0)]])  # w = exp(prox − behav) = 10, 0.5
    adv = leaf([[1.0, -2.0]])
    logp = leaf([[-1.0, -1.0]])
    mask = torch.ones(1, 2, dtype=F64)
    loss, m = policy_loss(logp, prox, behav, adv, mask, eps_clip_low=0.2, eps_clip_high=0.2, is_cap=2.0)
    loss.backward()
    # w = [min(10, 2), 0.5] = [2, 0.5]; ℓ = w·(−A·r) = [2·(−1), 0.5·2] = [−2, 1]; mean −0.5
    assert loss.item() == pytest.approx(-0.5)
    torch.testing.assert_close(logp.grad, t64([[-2.0, 1.0]]) / 2)  # dℓ/dlogp = −w·A·r
    assert prox.grad is None and behav.grad is None and adv.grad is None
    assert m["policy/is_weight_max"].item() == pytest.approx(2.0)
    assert m["policy/is_weight_mean"].item() == pytest.approx(1.25)
    assert m["policy/is_truncfrac"].item() == pytest.approx(0.5)
    assert m["policy/ess"].item() == pytest.approx(2.5**2 / (2 * (4 + 0.25)))  # (Σw)²/(N·Σw²)
    assert m["policy/approx_kl"].item() == pytest.approx(0.0)


def test_dual_clip_bounds_the_loss_of_negative_advantages():
    ratio, adv = t64([5.0, 2.0, 5.0]), t64([-1.0, -1.0, 1.0])
    prox, mask = torch.zeros(1, 3, dtype=F64), torch.ones(1, 3, dtype=F64)

    def run(dual_clip):
        logp = leaf(ratio.log()[None].tolist())
        loss, m = policy_loss(logp, prox, prox, adv[None], mask, **CLIP, dual_clip=dual_clip)
        loss.backward()
        return loss.item(), logp.grad, m

    # without: ℓ = [max(5, 1.28), max(2, 1.28), max(−5, −1.28)] = [5, 2, −1.28]
    loss, grad, m = run(None)
    assert loss == pytest.approx((5 + 2 - 1.28) / 3)
    torch.testing.assert_close(grad, t64([[5.0, 2.0, 0.0]]) / 3)
    assert m["policy/dual_clipfrac"].item() == 0.0
    # c = 3: token 0 is bounded at −c·A = 3 (no gradient); token 1 (2 < 3) and A > 0 are untouched
    loss, grad, m = run(3.0)
    assert loss == pytest.approx((3 + 2 - 1.28) / 3)
    torch.testing.assert_close(grad, t64([[0.0, 2.0, 0.0]]) / 3)
    assert m["policy/dual_clipfrac"].item() == pytest.approx(1 / 3)


def test_masked_tokens_get_no_gradient_and_do_not_change_the_loss():
    gen = torch.Generator().manual_seed(4)
    B, T = 3, 5
    mask = t64([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]])
    prox = -torch.rand(B, T, generator=gen, dtype=F64)
    behav = prox - 0.1 * torch.randn(B, T, generator=gen, dtype=F64)
    adv = torch.randn(B, T, generator=gen, dtype=F64)
    logp = leaf((prox + 0.01 * torch.randn(B, T, generator=gen, dtype=F64)).tolist())  # inside the clip range
    loss, _ = policy_loss(logp, prox, behav, adv, mask, **CLIP)
    loss.backward()
    assert (logp.grad[mask == 0] == 0).all() and (logp.grad[mask == 1] != 0).all()

    # garbage in the padding (huge ratios, advantages and IS weights) changes nothing
    pad = mask == 0
    junk = [
        t.masked_fill(pad, v) for t, v in ((logp.detach(), 30.0), (prox, -30.0), (behav, -60.0), (adv, 1e6))
    ]
    loss_junk, _ = policy_loss(*junk, mask, **CLIP, dual_clip=3.0)
    assert loss_junk.item() == pytest.approx(
        policy_loss(logp, prox, behav, adv, mask, **CLIP, dual_clip=3.0)[0].item()
    )


def test_token_level_aggregation_weighs_long_sequences_more():
    # ratio 1, w = 1: ℓ_t = −A_t. Row 0: three tokens with A = 1; row 1: one token with A = −3.
    mask = t64([[1, 1, 1], [1, 0, 0]])
    adv = t64([[1.0, 1.0, 1.0], [-3.0, 0.0, 0.0]])
    logp = leaf(torch.zeros(2, 3).tolist())
    loss, _ = policy_loss(logp, torch.zeros(2, 3, dtype=F64), torch.zeros(2, 3, dtype=F64), adv, mask, **CLIP)
    loss.backward()
    # token-level: (−1 −1 −1 + 3) / 4 = 0; a mean of sequence means would be (−1 + 3) / 2 = 1
    assert loss.item() == pytest.approx(0.0)
    # every valid token weighs 1/4 (a sequence mean would give row 0's tokens 1/6 each and row 1's 1/2)
    torch.testing.assert_close(logp.grad, t64([[-1.0, -1.0, -1.0], [3.0, 0.0, 0.0]]) / 4)


def test_micro_batches_with_num_tokens_sum_to_the_full_batch_loss():
    gen = torch.Generator().manual_seed(5)
    B, T = 4, 5
    mask = (torch.arange(T)[None] < torch.tensor([5, 1, 3, 2])[:, None]).to(F64)
    logp, prox, adv = (torch.randn(B, T, generator=gen, dtype=F64) for _ in range(3))
    full, _ = policy_loss(logp, prox, prox, adv, mask, **CLIP)
    n = mask.sum()
    halves = [
        policy_loss(logp[s], prox[s], prox[s], adv[s], mask[s], **CLIP, num_tokens=n)[0]
        for s in (slice(0, 2), slice(2, 4))
    ]
    assert (halves[0] + halves[1]).item() == pytest.approx(full.item())


# ---------------------------------------------------------------------------------------------------
# Value loss, explained variance
# ---------------------------------------------------------------------------------------------------


def test_value_loss_clipping_hand_values_and_gradients():
    values = leaf([[1.0, 2.0]])
    old = leaf([[0.5, 1.9]])
    returns = leaf([[2.0, 1.0]])
    mask = torch.ones(1, 2, dtype=F64)
    loss, m = value_loss(values, old, returns, mask, value_clip=0.2)
    loss.backward()
    # token 0: (1 − 2)² = 1; V_clip = 0.5 + clip(0.5, ±0.2) = 0.7 → (0.7 − 2)² = 1.69; max 1.69 (clipped)
    # token 1: V − V_old = 0.1 is inside the clip range, so both terms are (2 − 1)² = 1
    # loss = ½ · (1.69 + 1) / 2 = 0.6725
    assert loss.item() == pytest.approx(0.6725)
    assert m["value/clipfrac"].item() == pytest.approx(0.5)
    # token 0's clipped term does not depend on V; token 1: ½ · 2(V − R) / 2 = 0.5
    torch.testing.assert_close(values.grad, t64([[0.0, 0.5]]))
    assert old.grad is None and returns.grad is None

    loss, m = value_loss(values.detach(), old, returns, mask)
    assert loss.item() == pytest.approx(0.5 * (1 + 1) / 2)
    assert m["value/clipfrac"].item() == 0.0


def test_explained_variance_hand_values():
    returns = t64([[1.0, 2.0, 3.0, 4.0, 99.0]])
    mask = t64([[1, 1, 1, 1, 0]])
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 2.5), returns, mask).item() == pytest.approx(0.0)
    # residual [−1, 0, 0, 1]: var 0.5; var(returns) = 1.25 → 1 − 0.5/1.25 = 0.6
    values = t64([[2.0, 2.0, 3.0, 3.0, -50.0]])
    assert explained_variance(values, returns, mask).item() == pytest.approx(0.6)
    _, m = value_loss(values, values, returns, mask)
    assert m["value/explained_variance"].item() == pytest.approx(0.6)
    assert math.isnan(explained_variance(values, torch.ones_like(values), mask).item())


def test_stats_weighted_means_match_a_naive_loop():
    """Stats (learner/runtime.py) sums per key over micro-batches, skips non-finite totals with their
    weight, and leaves out keys of no weight: checked against a plain dict loop."""
    from learner.runtime import Stats

    rng = torch.Generator().manual_seed(0)
    calls = []
    for _ in range(5):  # five micro-batches
        w = torch.randint(0, 4, (), generator=rng).float()
        loss = torch.randn((), generator=rng) * w
        metrics = {"policy/a": torch.rand((), generator=rng), "policy/b": torch.rand((), generator=rng)}
        calls.append((w, loss, metrics))
    calls[2][2]["policy/b"] = torch.tensor(float("nan"))  # e.g. explained variance of constant returns
    stats, sums, weights = Stats(), {}, {}
    for w, loss, metrics in calls:
        stats.add("loss/x", loss, w)
        stats.add_means(metrics, w)
        stats.add("never", torch.tensor(1.0), torch.tensor(0.0))
        for k, total in [("loss/x", loss), *((k, m * w) for k, m in metrics.items())]:
            if math.isfinite(float(total)):
                sums[k] = sums.get(k, 0.0) + float(total)
                weights[k] = weights.get(k, 0.0) + float(w)
    got = stats.reduce()
    assert set(got) == {"loss/x", "policy/a", "policy/b"}  # "never" had no weight
    for k, v in got.items():
        assert v == pytest.approx(sums[k] / weights[k], rel=1e-6), k
