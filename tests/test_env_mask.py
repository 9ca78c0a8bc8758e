"""Environment tokens of a multi-turn episode are context: never in the loss, the KL, the entropy or the
value targets (docs/environments.md §10.1). Checked against a naive per-token reference and, end to end, by the
gradient the real learner sends into every position."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from buffer.schema import Trajectory
from learner.batch import make_batch
from learner.models import load_models
from learner.ppo import PPOLearner
from tandem.config import load_config
from tests.test_learner import VOCAB, raw_config


def episode(seed: int, group: str, *, turns: int = 3, aborted: bool = False) -> Trajectory:
    """prompt | model | env | model | env | model ... with random lengths (env turns may be long)."""
    rng = np.random.default_rng(seed)
    tokens, mask, versions = [], [], []
    for turn in range(turns):
        if turn:
            env = rng.integers(*VOCAB, size=rng.integers(1, 6))
            tokens += env.tolist()
            mask += [0] * len(env)
            versions += [-1] * len(env)
        gen = rng.integers(*VOCAB, size=rng.integers(1, 5))
        tokens += gen.tolist()
        mask += [1] * len(gen)
        versions += [turn] * len(gen)
    m = np.array(mask)
    return Trajectory(
        traj_id=f"e{seed}",
        group_id=group,
        prompt_id=group,
        prompt_tokens=rng.integers(*VOCAB, size=3),
        response_tokens=tokens,
        behav_logp=np.where(m == 1, -3.5, 0.0),
        token_versions=versions,
        loss_mask=m,
        reward=float(seed % 2),
        finish_reason="abort" if aborted else "stop",
    )


def test_batch_mask_is_the_loss_mask_against_a_naive_loop() -> None:
    trajs = [episode(s, f"g{s // 2}", turns=1 + s % 3, aborted=s == 5) for s in range(8)]
    batch = make_batch(trajs, version=3)
    for i, t in enumerate(trajs):
        for j in range(batch.mask.shape[1]):
            trained = j < len(t.response_tokens) and t.finish_reason != "abort" and t.loss_mask[j] == 1
            assert batch.mask[i, j].item() == (1.0 if trained else 0.0), (i, j)
    assert any((t.loss_mask == 0).any() for t in trajs)  # not vacuous: env tokens exist
    # staleness counts generated tokens only: turn 0 was produced by version 0
    assert batch.staleness.tolist() == [3] * 8


@pytest.fixture(scope="module")
def gae_learner(tiny_ckpt, tmp_path_factory):
    """gae (a critic), a KL loss to a reference and an entropy bonus: every per-token term the learner has."""
    tmp = tmp_path_factory.mktemp("mask")
    raw = raw_config(
        tiny_ckpt, "redis://unused", "mask", tmp,
        model={"actor": str(tiny_ckpt["actor"]), "critic": str(tiny_ckpt["critic"])},
        algorithm={"advantage": "gae", "kl_coef": 0.1, "entropy_coef": 0.01, "batch_size": 4,
                   "minibatch_size": 4},
        learner={"micro_batch_size": 4},
    )  # fmt: skip
    cfg = load_config(None, raw=raw)
    learner = PPOLearner(cfg, tmp)
    learner.models = load_models(cfg, learner.device)
    return learner


@pytest.mark.slow
def test_learner_sends_no_gradient_into_env_positions(gae_learner: PPOLearner) -> None:
    """The gradient of the whole loss (policy + KL + entropy; value for the critic) with respect to every
    position's output is exactly 0 where that position predicts an env token, and not 0 where it predicts
    a generated one."""
    trajs = [episode(s, f"g{s // 2}") for s in range(4)]
    batch = make_batch(trajs, version=2)
    m = gae_learner.models
    assert m.reference is not None and m.critic is not None
    captured: dict[str, list[torch.Tensor]] = {"actor": [], "critic": []}

    def keep(name: str):
        def hook(module, args, kwargs, out):
            t = out.logits if hasattr(out, "logits") else out
            if t.requires_grad:
                t.retain_grad()
                captured[name].append((kwargs["input_ids"], t))

        return hook

    handles = [
        m.actor.module.register_forward_hook(keep("actor"), with_kwargs=True),
        m.critic.module.register_forward_hook(keep("critic"), with_kwargs=True),
    ]
    try:
        gae_learner.train(batch)
    finally:
        for h in handles:
            h.remove()
    for name in ("actor", "critic"):
        assert captured[name], name
        for input_ids, out in captured[name]:
            grad = out.grad.abs()
            grad = grad.sum(-1) if grad.dim() == 3 else grad  # (b, L)
            for k, row in enumerate(input_ids.tolist()):
                t = next(t for t in trajs if row[: t_len(t)] == seq(t))
                p = len(t.prompt_tokens)
                for j, generated in enumerate(t.loss_mask.tolist()):
                    g = grad[k, p - 1 + j].item()  # logits at p-1+j predict response token j
                    if generated:
                        assert g > 0, (name, t.traj_id, j)
                    else:
                        assert g == 0.0, (name, t.traj_id, j, g)


def seq(t: Trajectory) -> list[int]:
    return np.concatenate([t.prompt_tokens, t.response_tokens]).tolist()


def t_len(t: Trajectory) -> int:
    return len(t.prompt_tokens) + len(t.response_tokens)
