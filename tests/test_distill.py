"""On-policy distillation (``algorithm.distill``): the reverse-KL math (learner/losses.py), the teacher's
tokenizer check (tandem/tokenizer_match.py, at launch and in the learner), and the learner's wiring of the
KL into the reward or the loss (learner/ppo.py), on real tiny checkpoints and real DeepSpeed engines.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from learner.batch import make_batch
from learner.losses import distill_loss, distill_reverse_kl, distill_rewards
from tandem.config import ConfigError, load_config
from tandem.tokenizer_match import check_same_tokenizer, tokenizer_mismatch
from tests.test_learner import raw_config
from tests.test_reference_placement import learner_of, mixed_trajectories, other_ckpt  # noqa: F401

# ------------------------------------------------------------------------------------------------- math


def test_reverse_kl_of_a_hand_worked_pair() -> None:
    """π = (1/2, 1/4, 1/4), π_T = (1/4, 1/2, 1/4): per sampled token log π − log π_T is (ln 2, −ln 2, 0),
    and its expectation under π, Σ_y π(y)·(...), is KL(π ‖ π_T) = ½ln2 − ¼ln2 = ¼ln2 (worked by hand)."""
    pi, teacher = torch.tensor([0.5, 0.25, 0.25]), torch.tensor([0.25, 0.5, 0.25])
    kl = distill_reverse_kl(pi.log()[None], teacher.log()[None], torch.ones(1, 3))[0]
    torch.testing.assert_close(kl, torch.tensor([math.log(2), -math.log(2), 0.0]))
    assert float((pi * kl).sum()) == pytest.approx(0.25 * math.log(2), abs=1e-7)
    # padding is 0, whatever it holds
    padded = distill_reverse_kl(
        torch.tensor([[-1.0, float("nan")]]), torch.tensor([[-3.0, 0.0]]), torch.tensor([[1, 0]])
    )
    assert padded.tolist() == [[2.0, 0.0]]


def test_reward_and_loss_match_a_naive_loop() -> None:
    """Rewards, loss value and the loss's gradient against a per-token Python loop."""
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(3, 5, generator=g) * 4).requires_grad_(True)
    teacher = -torch.rand(3, 5, generator=g) * 4
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    coef = 0.7
    rewards = distill_rewards(logp, teacher, mask, coef)
    loss = distill_loss(logp, teacher, mask, coef)
    loss.backward()
    n = int(mask.sum())
    want_loss, want_grad = 0.0, torch.zeros(3, 5)
    for b in range(3):
        for t in range(5):
            d = float(logp[b, t].detach()) - float(teacher[b, t])
            want_r = -coef * d if mask[b, t] else 0.0
            assert float(rewards[b, t]) == pytest.approx(want_r, abs=1e-6)
            if mask[b, t]:
                want_loss += coef * 0.5 * d * d / n
                want_grad[b, t] = coef * d / n  # d/dlogp of ½(logp − t)²: the reverse KL's gradient weight
    assert float(loss.detach()) == pytest.approx(want_loss, abs=1e-6)
    torch.testing.assert_close(logp.grad, want_grad)
    assert not rewards.requires_grad


def test_an_equal_teacher_gives_no_loss_and_no_gradient() -> None:
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    loss = distill_loss(logp, logp.detach().clone(), torch.ones(1, 3), 2.0)
    loss.backward()
    assert float(loss) == 0.0 and torch.all(logp.grad == 0)


# -------------------------------------------------------------------------------------------- tokenizer


def _checkpoint_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_the_same_tokenizer_passes(tiny_ckpt, other_ckpt) -> None:  # noqa: F811
    check_same_tokenizer(str(tiny_ckpt["actor"]), str(other_ckpt))  # other weights, the same tokenizer


def test_an_added_token_is_named_with_both_paths(tiny_ckpt, tmp_path) -> None:
    teacher = _checkpoint_copy(tiny_ckpt["actor"], tmp_path / "teacher")
    tok = AutoTokenizer.from_pretrained(teacher)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(teacher)
    with pytest.raises(ConfigError) as e:
        check_same_tokenizer(str(tiny_ckpt["actor"]), str(teacher))
    msg = str(e.value)
    assert str(teacher) in msg and str(tiny_ckpt["actor"]) in msg and "<extra>" in msg


def test_a_moved_special_token_is_a_mismatch(tiny_ckpt) -> None:
    student = AutoTokenizer.from_pretrained(tiny_ckpt["actor"])
    teacher = AutoTokenizer.from_pretrained(tiny_ckpt["actor"])
    assert tokenizer_mismatch(student, teacher) is None
    other = next(t for t in teacher.get_vocab() if t not in teacher.all_special_tokens)
    teacher.eos_token = other  # same vocabulary, another end-of-sequence token
    problem = tokenizer_mismatch(student, teacher)
    assert problem is not None and "eos_token" in problem


def test_launch_refuses_a_teacher_with_another_tokenizer(tiny_ckpt, tmp_path) -> None:
    from launcher.driver import check_inputs

    teacher = _checkpoint_copy(tiny_ckpt["actor"], tmp_path / "teacher")
    tok = AutoTokenizer.from_pretrained(teacher)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(teacher)
    cfg = load_config(None, raw=distill_raw(tiny_ckpt, tmp_path, teacher, "reward"))
    with pytest.raises(ConfigError, match=r"model\.teacher"):
        check_inputs(cfg)


# ----------------------------------------------------------------------------------------------- config


def distill_raw(tiny_ckpt, tmp: Path, teacher: Path | None, use: str | None, **algorithm) -> dict:
    raw = raw_config(
        tiny_ckpt, "redis://unused", "distill", tmp,
        algorithm={"advantage": "grpo", "batch_size": 8, "minibatch_size": 8, **algorithm},
        rollout={"n_samples": 2, "temperature": 1.0},
    )  # fmt: skip
    if teacher is not None:
        raw["model"]["teacher"] = str(teacher)
    if use is not None:
        raw["algorithm"]["distill"] = {"as": use, "coef": 0.5}
    return raw


def test_config_checks_name_the_fields(tiny_ckpt, tmp_path) -> None:
    cfg = load_config(None, raw=distill_raw(tiny_ckpt, tmp_path, tiny_ckpt["actor"], "loss"))
    assert cfg.algorithm.distill.as_ == "loss" and cfg.algorithm.distill.coef == 0.5
    with pytest.raises(ConfigError, match=r"algorithm\.distill needs model\.teacher"):
        load_config(None, raw=distill_raw(tiny_ckpt, tmp_path, None, "loss"))
    with pytest.raises(ConfigError, match=r"model\.teacher .* is read only by algorithm\.distill"):
        load_config(None, raw=distill_raw(tiny_ckpt, tmp_path, tiny_ckpt["actor"], None))
    raw = distill_raw(tiny_ckpt, tmp_path, tiny_ckpt["actor"], "reward")
    raw["algorithm"]["distill"]["placement"] = "server"
    with pytest.raises(ConfigError, match=r"algorithm\.distill\.placement=server"):
        load_config(None, raw=raw)


# ------------------------------------------------------------------------------------------------ wiring


def _on_policy(learner, trajs):
    """The trajectories with behav_logp set to the actor's own log-probabilities (sampled now)."""
    prox, _, _ = learner.score(make_batch(trajs, 0))
    for i, t in enumerate(trajs):
        t.behav_logp = prox[i, : len(t.response_tokens)].numpy().astype(np.float32)
    return trajs


@pytest.mark.parametrize("use", ["loss", "reward"])
def test_a_teacher_equal_to_the_student_changes_nothing(tiny_ckpt, tmp_path, use: str) -> None:
    """Teacher = student, on-policy samples: distill/kl is 0, and the step updates the actor exactly as the
    same step without distillation does (no distill gradient, no reward change); it does update it."""
    torch.set_num_threads(1)
    plain = learner_of(load_config(None, raw=distill_raw(tiny_ckpt, tmp_path, None, None)), tmp_path / "a")
    cfg = load_config(None, raw=distill_raw(tiny_ckpt, tmp_path, tiny_ckpt["actor"], use))
    distilled = learner_of(cfg, tmp_path / "b")
    trajs = _on_policy(plain, mixed_trajectories())
    before = [p.detach().clone() for p in plain.models.actor.module.parameters()]
    want = plain.train(make_batch(trajs, 0))
    got = distilled.train(make_batch(trajs, 0))
    assert got["distill/kl"] == pytest.approx(0.0, abs=1e-6)
    if use == "loss":
        assert got["loss/distill"] == pytest.approx(0.0, abs=1e-10)
    assert got["loss/policy"] == pytest.approx(want["loss/policy"], abs=1e-6)
    a, b = plain.models.actor.module, distilled.models.actor.module
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=0, msg=name)
    assert any((p != p0).any() for p, p0 in zip(a.parameters(), before, strict=True))  # it trained


def test_reward_distillation_is_grpo_on_the_kl_penalised_score(tiny_ckpt, other_ckpt, tmp_path) -> None:  # noqa: F811
    """as: reward with another teacher equals plain GRPO on sequence rewards r − coef·Σ_t(behav − teacher)
    worked out here from the teacher's own forward; distill/kl is the token mean of prox − teacher."""
    torch.set_num_threads(1)
    cfg = load_config(None, raw=distill_raw(tiny_ckpt, tmp_path, other_ckpt, "reward"))
    distilled = learner_of(cfg, tmp_path / "a")
    plain = learner_of(load_config(None, raw=distill_raw(tiny_ckpt, tmp_path, None, None)), tmp_path / "b")
    trajs = mixed_trajectories()
    teacher = distilled.score_teacher(make_batch(trajs, 0))
    module = distilled.models.teacher
    shifted = []
    for i, t in enumerate(trajs):
        ids = torch.tensor(np.concatenate([t.prompt_tokens, t.response_tokens]), dtype=torch.long)[None]
        with torch.no_grad():
            logits = module(input_ids=ids).logits[0, len(t.prompt_tokens) - 1 : -1]  # (R, V)
        own = torch.log_softmax(logits.float(), -1).gather(-1, torch.as_tensor(t.response_tokens)[:, None])[
            :, 0
        ]
        m = t.loss_mask.astype(bool)
        np.testing.assert_allclose(teacher[i, : len(m)][m].numpy(), own.numpy()[m], atol=1e-5)
        kl_sum = float(np.sum((t.behav_logp - own.numpy())[m]))
        shifted.append(dataclasses.replace(t, reward=t.reward - 0.5 * kl_sum))
    prox, _, _ = plain.score(make_batch(trajs, 0))
    batch = make_batch(trajs, 0)
    want_kl = float(((prox - teacher) * batch.mask).sum() / batch.mask.sum())
    got = distilled.train(batch)
    plain.train(make_batch(shifted, 0))
    assert got["distill/kl"] == pytest.approx(want_kl, abs=1e-5)
    # Adam's first step is ~lr·sign(g) (1e-2 here): float noise of the two sums moves near-zero gradients'
    # weights by a few 1e-6; a wrong reward would move them by ~1e-2.
    a, b = plain.models.actor.module, distilled.models.actor.module
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(q, p, atol=5e-5, rtol=0, msg=name)
