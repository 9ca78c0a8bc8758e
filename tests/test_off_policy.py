"""The off-policy toolbox of the policy loss (learner/importance.py, learner/losses.py; docs/design.md §4.9):
importance weights (token/sequence level, truncate/mask), the gspo and cispo losses, the four aggregations
and the behaviour/proximal mismatch metrics, against hand values and against peers' published formulas."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from learner.importance import importance_weights, mismatch_metrics
from learner.losses import aggregate, aggregation_units, policy_loss
from tandem.config import ConfigError, load_config

F64 = torch.float64
ROOT = Path(__file__).resolve().parents[1]
LN = math.log


def t64(x) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def leaf(x) -> torch.Tensor:
    return t64(x).requires_grad_(True)


def close(got: torch.Tensor, expected: torch.Tensor, atol: float = 1e-12, msg: str = "") -> None:
    """Elementwise equality to ``atol`` (torch.testing.assert_close's first call imports torch.distributed)."""
    assert torch.allclose(got, expected, atol=atol, rtol=1e-9), f"{msg}\n{got}\n!=\n{expected}"


# The 2×3 example: row 0 has three valid tokens, row 1 two (its last position is padding, filled with junk).
MASK = t64([[1, 1, 1], [1, 1, 0]])
# log importance ratios prox − behav: row 0 ratios 2, 1/4, 16; row 1 ratios 1, 9
BEHAV = t64([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
PROX = t64([[LN(2), LN(0.25), LN(16)], [0.0, LN(9), 30.0]])


def weights(**kw):
    w, cut = importance_weights(PROX, BEHAV, MASK, **kw)
    return w * MASK, cut & MASK.bool()  # padding is never read


# ---------------------------------------------------------------------------------------------------
# Importance weights, by hand
# ---------------------------------------------------------------------------------------------------


def test_token_truncate_is_tis():
    # min(ρ, 5): row 0 [2, 0.25, min(16, 5) = 5], row 1 [1, min(9, 5) = 5]; cut where ρ ≥ 5
    w, cut = weights(level="token", treatment="truncate", cap=5.0)
    close(w, t64([[2.0, 0.25, 5.0], [1.0, 5.0, 0.0]]))
    assert cut.tolist() == [[False, False, True], [False, True, False]]


def test_sequence_truncate_uses_the_geometric_mean_of_token_ratios():
    # row 0: exp(mean(ln 2, ln 1/4, ln 16)) = (2 · 1/4 · 16)^(1/3) = 8^(1/3) = 2   (arithmetic mean: 6.083)
    # row 1: exp(mean(ln 1, ln 9)) = 9^(1/2) = 3                                   (arithmetic mean: 5)
    # the padding's 30 is not part of row 1's mean; cap 2.5: row 0 keeps 2, row 1 is truncated to 2.5
    w, cut = weights(level="sequence", treatment="truncate", cap=2.5)
    close(w, t64([[2.0, 2.0, 2.0], [2.5, 2.5, 0.0]]))
    assert cut.tolist() == [[False, False, False], [True, True, False]]
    w, _ = weights(level="sequence", treatment="truncate", cap=100.0)
    close(w, t64([[2.0, 2.0, 2.0], [3.0, 3.0, 0.0]]))


def test_token_mask_is_icepop():
    # IcePop's two-sided mask [0.5, 5]: 1/4 < 0.5 and 16 > 5 and 9 > 5 get weight 0; the rest keep ρ
    w, cut = weights(level="token", treatment="mask", mask_low=0.5, mask_high=5.0)
    close(w, t64([[2.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))
    assert cut.tolist() == [[False, True, True], [False, True, False]]


def test_sequence_mask_drops_whole_sequences():
    # sequence ratios 2 and 3 against [0.5, 2.5]: row 0 is kept (every token weighs 2), row 1 dropped whole
    w, cut = weights(level="sequence", treatment="mask", mask_low=0.5, mask_high=2.5)
    close(w, t64([[2.0, 2.0, 2.0], [0.0, 0.0, 0.0]]))
    assert cut.tolist() == [[False, False, False], [True, True, False]]


# ---------------------------------------------------------------------------------------------------
# Aggregations, by hand
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 4 + 5) / 5),  # 3: every valid token weighs 1/5
        ("seq-mean-token-sum", ((1 + 2 + 3) + (4 + 5)) / 2),  # (6 + 9) / 2 = 7.5
        ("seq-mean-token-mean", ((1 + 2 + 3) / 3 + (4 + 5) / 2) / 2),  # (2 + 4.5) / 2 = 3.25
        ("seq-mean-token-sum-norm", ((1 + 2 + 3) / 4 + (4 + 5) / 4) / 2),  # norm 4: (1.5 + 2.25) / 2 = 1.875
    ],
)
def test_aggregations_by_hand(mode: str, expected: float):
    per_token = leaf([[1.0, 2.0, 3.0], [4.0, 5.0, 99.0]])  # 99 is padding
    loss = aggregate(per_token, MASK, mode, norm=4.0)
    assert loss.item() == pytest.approx(expected)
    loss.backward()
    assert per_token.grad[1, 2] == 0.0
    # a fully masked row (an aborted sample) changes nothing: it is not a sequence of the mean
    padded = torch.cat([per_token.detach(), t64([[7.0, 7.0, 7.0]])])
    assert aggregate(
        padded, torch.cat([MASK, torch.zeros(1, 3, dtype=F64)]), mode, 4.0
    ).item() == pytest.approx(expected)


def test_seq_mean_token_sum_norm_needs_a_positive_norm():
    with pytest.raises(ValueError, match="positive norm"):
        aggregate(torch.ones(2, 3), MASK, "seq-mean-token-sum-norm")


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_micro_batches_with_the_minibatch_units_sum_to_the_minibatch_loss(mode: str):
    gen = torch.Generator().manual_seed(1)
    mask = (torch.arange(5)[None] < torch.tensor([5, 1, 3, 2])[:, None]).to(F64)
    per_token = torch.randn(4, 5, generator=gen, dtype=F64)
    full = aggregate(per_token, mask, mode, 6.0)
    units = aggregation_units(mask, mode)
    parts = [aggregate(per_token[s], mask[s], mode, 6.0, units=units) for s in (slice(0, 1), slice(1, 4))]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item())


# ---------------------------------------------------------------------------------------------------
# Losses, by hand
# ---------------------------------------------------------------------------------------------------


def test_ppo_with_sequence_mask_weights_by_hand():
    # r = 1 (logp = prox), so ℓ = w · (−A); w from the sequence mask above: row 0 weighs 2, row 1 is dropped
    adv = t64([[1.0, -1.0, 2.0], [5.0, 5.0, 0.0]])
    logp = leaf(PROX.tolist())
    imp = importance_weights(
        PROX, BEHAV, MASK, level="sequence", treatment="mask", mask_low=0.5, mask_high=2.5
    )
    loss, m = policy_loss(logp, PROX, BEHAV, adv, MASK, eps_clip_low=0.2, eps_clip_high=0.2, importance=imp)
    loss.backward()
    # ℓ = [−2, 2, −4 | 0, 0]; token-mean over the 5 valid tokens (dropped ones still count): −4/5
    assert loss.item() == pytest.approx(-4 / 5)
    close(logp.grad, t64([[-2.0, 2.0, -4.0], [0.0, 0.0, 0.0]]) / 5)  # −w·A·r / 5
    assert m["policy/is_truncfrac"].item() == pytest.approx(2 / 5)
    assert m["policy/is_weight_mean"].item() == pytest.approx(6 / 5)


def test_gspo_by_hand():
    # logp − prox: row 0 [0.3, −0.1, 0.1] → mean 0.1 → s0 = e^0.1; row 1 [0, −0.2] → mean −0.1 → s1 = e^−0.1
    prox = t64([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]])
    logp = leaf((prox + t64([[0.3, -0.1, 0.1], [0.0, -0.2, 50.0]])).tolist())
    adv = t64([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])
    s0, s1 = math.exp(0.1), math.exp(-0.1)

    def run(**clip):
        logp.grad = None
        loss, m = policy_loss(
            logp, prox, prox, adv, MASK, eps_clip_low=0.2, eps_clip_high=0.2, loss="gspo",
            agg="seq-mean-token-mean", **clip,
        )  # fmt: skip
        loss.backward()
        return loss.item(), logp.grad.clone(), m["policy/clipfrac"].item()

    # clip range [0.8, 1.2]: both inside. Row 0: ℓ = −s0·1 per token; row 1: ℓ = −s1·(−1) = s1.
    # seq-mean-token-mean: (−s0 + s1) / 2 = −0.100167. Gradient of ℓ_t in logp_t is −A·s_i (GSPO-token),
    # divided by the row's n_i and by 2 sequences: row 0 −s0/6 each, row 1 +s1/4 each.
    loss, grad, clipfrac = run(gspo_clip_low=0.2, gspo_clip_high=0.2)
    assert loss == pytest.approx((-s0 + s1) / 2)
    close(grad, t64([[-s0 / 6] * 3, [s1 / 4, s1 / 4, 0.0]]))
    assert clipfrac == 0.0
    # GSPO's own range [1 − 3e-4, 1 + 4e-4]: both sequences clipped, the pessimistic side is the clipped one:
    # row 0 max(−s0, −1.0004) = −1.0004; row 1 max(s1, 0.9997) = 0.9997; no gradient
    loss, grad, clipfrac = run()
    assert loss == pytest.approx((-1.0004 + 0.9997) / 2)
    assert (grad == 0).all() and clipfrac == 1.0


def test_cispo_by_hand():
    # r = exp(logp − prox): row 0 [1.5, 0.5, 1], row 1 [1.1, 1]; clip to [0.8, 1.28] → [1.28, 0.8, 1], [1.1, 1]
    logp = leaf([[-1.0, -2.0, -0.5], [-1.0, -3.0, 0.0]])
    prox = logp.detach() - t64([[LN(1.5), LN(0.5), 0.0], [LN(1.1), 0.0, 0.0]])
    adv = t64([[1.0, 1.0, -1.0], [2.0, 2.0, 0.0]])
    loss, m = policy_loss(logp, prox, prox, adv, MASK, eps_clip_low=0.2, eps_clip_high=0.28, loss="cispo")
    loss.backward()
    # ℓ = −ĉ·A·logp: [−1.28·1·(−1), −0.8·1·(−2), −1·(−1)·(−0.5) | −1.1·2·(−1), −1·2·(−3)]
    #   = [1.28, 1.6, −0.5 | 2.2, 6]; token-mean 10.58 / 5 = 2.116
    assert loss.item() == pytest.approx(10.58 / 5)
    # every token keeps a gradient, −ĉ·A / 5, the clipped ones too (unlike PPO's clip)
    close(logp.grad, t64([[-1.28, -0.8, 1.0], [-2.2, -2.0, 0.0]]) / 5)
    assert m["policy/clipfrac"].item() == pytest.approx(2 / 5)


def test_mismatch_metrics_by_hand():
    # x = behav − prox: row 0 [−ln 2, ln 4, −ln 16], row 1 [0, −ln 9]; k3 = e^−x + x − 1
    k3 = [2 - LN(2) - 1, 0.25 + LN(4) - 1, 16 - LN(16) - 1, 0.0, 9 - LN(9) - 1]
    staleness = torch.tensor([[0, 0, 5], [1, 1, 1]])  # the third token of row 0 is 5 stale: bucket 3+
    _, cut = importance_weights(PROX, BEHAV, MASK, cap=5.0)
    means, counts = mismatch_metrics(PROX, BEHAV, MASK, cut=cut, staleness=staleness)
    assert means["mismatch/kl_k3"].item() == pytest.approx(sum(k3) / 5)
    assert means["mismatch/log_ratio_mean"].item() == pytest.approx((LN(2) + LN(0.25) + LN(16) + LN(9)) / 5)
    assert means["mismatch/log_ratio_max"].item() == pytest.approx(LN(16))
    assert means["mismatch/truncated_frac"].item() == pytest.approx(2 / 5)  # 16 and 9 hit the cap
    assert means["mismatch/kl_k3/s0"].item() == pytest.approx((k3[0] + k3[1]) / 2)
    assert means["mismatch/kl_k3/s1"].item() == pytest.approx((k3[3] + k3[4]) / 2)
    assert means["mismatch/kl_k3/s3"].item() == pytest.approx(k3[2])
    assert [counts[f"mismatch/kl_k3/s{s}"].item() for s in range(4)] == [2, 2, 0, 1]  # s2: none, left out
    assert all(v.ndim == 0 and not v.requires_grad for v in means.values())
    means, _ = mismatch_metrics(PROX, BEHAV, MASK, cut=cut, treatment="mask")
    assert "mismatch/masked_frac" in means and "mismatch/kl_k3/s0" not in means


# ---------------------------------------------------------------------------------------------------
# Against peers' published formulas, on random masked inputs
# ---------------------------------------------------------------------------------------------------


def random_inputs(seed: int, B: int = 6, T: int = 7):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    mask = (torch.arange(T)[None] < lengths[:, None]).to(F64)
    prox = -torch.rand(B, T, generator=gen, dtype=F64) * 3
    behav = prox + 0.5 * torch.randn(B, T, generator=gen, dtype=F64)
    logp = prox + 0.3 * torch.randn(B, T, generator=gen, dtype=F64)
    adv = torch.randn(B, 1, generator=gen, dtype=F64).expand(B, T).contiguous()
    return logp, prox, behav, adv, mask


def trl_grpo_loss(logp, old, adv, mask, *, level, loss_type, eps_low, eps_high, max_len=None):
    """TRL's GRPOTrainer._compute_loss (TRL v0.20.0, which added ``importance_sampling_level``), written
    from its formula: log w = logp − old per token, or (Σ_t (logp − old)·mask) / max(Σ_t mask, 1) per
    sequence (kept as a (B, 1) column); ℓ = −min(w·A, clip(w, 1−ε, 1+ε_high)·A); loss_type grpo: mean over
    rows of each row's token mean; bnpo: Σ ℓ·mask / Σ mask; dr_grpo: Σ ℓ·mask / (B · max_completion_length)."""
    log_ratio = logp - old
    if level == "sequence":
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        log_w = log_ratio
    coef_1 = torch.exp(log_w)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    return (per_token * mask).sum() / (per_token.size(0) * max_len)  # dr_grpo


@pytest.mark.parametrize(
    ("loss_type", "agg"),
    [("grpo", "seq-mean-token-mean"), ("bnpo", "token-mean"), ("dr_grpo", "seq-mean-token-sum-norm")],
)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_ppo_and_gspo_match_trl_grpo(level: str, loss_type: str, agg: str):
    """On-policy (behav = prox) TRL's token level is our ppo and its sequence level our gspo (GSPO-token has
    GSPO's values); values and gradients match for each TRL loss_type and our aggregation of the same."""
    logp, prox, _, adv, mask = random_inputs(11)
    eps = (0.2, 0.28) if level == "token" else (3e-2, 4e-2)  # a range that some sequences leave
    ours = leaf(logp.tolist())
    kwargs = {
        "eps_clip_low": eps[0],
        "eps_clip_high": eps[1],
        "gspo_clip_low": eps[0],
        "gspo_clip_high": eps[1],
    }
    loss = "ppo" if level == "token" else "gspo"
    mine, _ = policy_loss(ours, prox, prox, adv, mask, loss=loss, agg=agg, agg_norm=7.0, **kwargs)
    mine.backward()
    theirs = leaf(logp.tolist())
    ref = trl_grpo_loss(
        theirs, prox, adv, mask, level=level, loss_type=loss_type, eps_low=eps[0], eps_high=eps[1], max_len=7
    )
    ref.backward()
    assert mine.item() == pytest.approx(ref.item(), abs=1e-12)
    close(ours.grad, theirs.grad * mask)


def test_cispo_matches_the_minimax_m1_formula_as_trl_writes_it():
    """TRL's GRPOTrainer._compute_loss, loss_type="cispo" (TRL main, late 2025): ℓ = −sg(min(w, ε_high))·A·logp
    with w the token ratio and ε_high the cap itself (no lower bound, as MiniMax-M1 sets ε_low^IS large),
    aggregated as loss_type dapo (token mean). Ours with ε_low near 1 and 1 + ε_high = TRL's cap."""
    logp, prox, _, adv, mask = random_inputs(12)
    cap = 1.1
    ours = leaf(logp.tolist())
    mine, _ = policy_loss(
        ours, prox, prox, adv, mask, eps_clip_low=1 - 1e-9, eps_clip_high=cap - 1, loss="cispo"
    )
    mine.backward()
    theirs = leaf(logp.tolist())
    weight = torch.clamp(torch.exp(theirs - prox), max=cap).detach()
    ref = ((-weight * adv * theirs) * mask).sum() / mask.sum()
    ref.backward()
    assert mine.item() == pytest.approx(ref.item(), abs=1e-12)
    close(ours.grad, theirs.grad * mask)


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_aggregate_matches_verl_agg_loss(mode: str):
    """verl's agg_loss (verl/trainer/ppo/core_algos.py at commit 012be9d, 2025), from its formulas, on rows that
    all hold a token: token-mean Σ ℓ·m / Σ m; seq-mean-token-sum mean_i Σ_t ℓ·m; seq-mean-token-mean
    mean_i (Σ_t ℓ·m / Σ_t m); seq-mean-token-sum-norm Σ_i Σ_t ℓ·m / L with L the padded response length
    (verl sums over sequences there: ours, Dr. GRPO's 1/G · Σ_i, is that divided by the row count B)."""
    _, _, _, _, mask = random_inputs(13)
    per_token = torch.randn(mask.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    B, L = mask.shape
    seq_sums = (per_token * mask).sum(-1)
    ref = {
        "token-mean": (per_token * mask).sum() / mask.sum(),
        "seq-mean-token-sum": seq_sums.mean(),
        "seq-mean-token-mean": (seq_sums / mask.sum(-1)).mean(),
        "seq-mean-token-sum-norm": seq_sums.sum() / L / B,
    }[mode]
    assert aggregate(per_token, mask, mode, norm=float(L)).item() == pytest.approx(ref.item(), abs=1e-12)


def test_importance_weights_match_the_tis_and_icepop_formulas():
    """Truncate: verl's ``tis_imp_ratio_cap`` branch of compute_policy_loss_vanilla (core_algos.py, 2025),
    clamp(exp(old − rollout), max=cap), Yao et al.'s TIS. Mask: IcePop's M(k) = k if α ≤ k ≤ β else 0 (Ring-1T
    report, 2025). At sequence level both read the sequence's ratio exp(Σ_t (old − rollout)·m / Σ_t m), as
    TRL's ``importance_sampling_level="sequence"`` (v0.20.0) forms it."""
    _, prox, behav, _, mask = random_inputs(14)
    lo, hi = 0.7, 1.6
    log_ratio = (prox - behav) * mask
    seq = (log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)).expand_as(prox)
    for level, lr in (("token", log_ratio), ("sequence", seq)):
        ratio = torch.exp(lr)
        refs = {
            "truncate": torch.clamp(ratio, max=hi),
            "mask": torch.where((ratio >= lo) & (ratio <= hi), ratio, 0.0),
        }
        for treatment, ref in refs.items():
            w, _ = importance_weights(
                prox, behav, mask, level=level, treatment=treatment, cap=hi, mask_low=lo, mask_high=hi
            )
            close(w * mask, ref * mask, msg=f"{level} {treatment}")


# ---------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["algorithm.importance.mask_low=1.2", "algorithm.importance.treatment=mask"], r"algorithm\.importance\.mask_low \(1\.2\)"),
        (["algorithm.importance.mask_high=0.9"], r"algorithm\.importance\.mask_high \(0\.9\)"),
        (["algorithm.loss=gspo", "algorithm.importance.level=sequence", "algorithm.dual_clip=3"], r"algorithm\.dual_clip"),
        (["algorithm.loss=cispo", "algorithm.dual_clip=3"], r"algorithm\.dual_clip .*algorithm\.loss=cispo"),
        (["algorithm.loss=gspo"], r"algorithm\.loss=gspo .*algorithm\.importance\.level=token"),
        (["algorithm.loss_agg_norm=512"], r"algorithm\.loss_agg_norm .*algorithm\.loss_agg=token-mean"),
        (["algorithm.loss_agg=seq-mean-token-sum-norm", "algorithm.loss_agg_norm=0"], r"algorithm\.loss_agg_norm: .*greater than 0"),
        (["algorithm.loss=reinforce"], r"algorithm\.loss: "),
        (["algorithm.stop_kl=0.05"], r"algorithm\.stop_kl .*algorithm\.ppo_epochs=1 and algorithm\.minibatch_size"),
        (["algorithm.stop_kl=0", "algorithm.ppo_epochs=2"], r"algorithm\.stop_kl: .*greater than 0"),
    ],
)  # fmt: skip
def test_each_refusal_names_its_fields(overrides: list[str], named: str):
    with pytest.raises(ConfigError, match=named):
        load_config(ROOT / "configs/tiny.yaml", overrides)


def test_token_sum_norm_of_a_multi_turn_run_needs_its_own_norm():
    calc = ROOT / "configs/tiny-calc.yaml"
    with pytest.raises(
        ConfigError,
        match=r"algorithm\.loss_agg=seq-mean-token-sum-norm .*env\.path .*algorithm\.loss_agg_norm",
    ):
        load_config(calc, ["algorithm.loss_agg=seq-mean-token-sum-norm"])
    cfg = load_config(calc, ["algorithm.loss_agg=seq-mean-token-sum-norm", "algorithm.loss_agg_norm=256"])
    assert cfg.algorithm.loss_agg_norm == 256


def test_defaults_are_todays_loss():
    a = load_config(ROOT / "configs/tiny.yaml").algorithm
    assert (a.loss, a.loss_agg, a.importance.level, a.importance.treatment, a.is_cap) == (
        "ppo", "token-mean", "token", "truncate", 5.0,
    )  # fmt: skip
    cfg = load_config(
        ROOT / "configs/tiny.yaml",
        ["algorithm.loss=gspo", "algorithm.importance.level=sequence", "algorithm.importance.treatment=mask"],
    )
    assert cfg.algorithm.importance.mask_low == 0.5 and cfg.algorithm.importance.mask_high == 5.0
