"""``placement.critic: own``: the critic scores and trains at once with the actor, on CPU threads of its own
in the learner's process (learner/ppo.py, learner/passes.py: ``beside``; docs/placement.md §11.1).

Real tiny checkpoints and real DeepSpeed learner engines (one gloo rank).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from learner.batch import make_batch
from placement.configured import configured_plan, critic_threads, thread_split
from tandem.config import load_config
from tandem.telemetry import read_history
from tandem.timing import Timers
from tests.test_learner import raw_config
from tests.test_reference_placement import learner_of, mixed_trajectories


def ppo(tiny_ckpt, tmp_path, critic: str):
    raw = raw_config(
        tiny_ckpt, "redis://unused", "critic", tmp_path,
        model={"actor": str(tiny_ckpt["actor"]), "critic": str(tiny_ckpt["critic"])},
        algorithm={"advantage": "gae", "kl_coef": 0.1, "prox_forward": "always", "ppo_epochs": 2,
                   "minibatch_size": 4, "batch_size": 8},
        placement={"critic": critic},
        learner={"micro_batch_size": 2},
    )  # fmt: skip
    return load_config(None, raw=raw)


class SpanTimers(Timers):
    """Timers that also keep each phase's (name, start, end), to see which phases overlapped."""

    def __init__(self) -> None:
        super().__init__()
        self.spans: list[tuple[str, float, float]] = []

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            self.add(name, end - start)
            self.spans.append((name, start, end))


def test_an_own_critic_trains_to_the_same_numbers_beside_the_actor(tiny_ckpt, tmp_path) -> None:
    """One batch, two learners from the same checkpoints: the critic in turn with the actor, and on its own
    thread beside it. Scores, losses and every updated weight of both models agree within 1e-5 (the same
    operations; only their threads' float reductions may differ), and the two trainings' spans overlap."""
    torch.set_num_threads(2)
    serial = learner_of(ppo(tiny_ckpt, tmp_path, "learner"), tmp_path / "a")
    own = learner_of(ppo(tiny_ckpt, tmp_path, "own"), tmp_path / "b")
    assert (serial.critic_threads, own.critic_threads) == (
        0,
        critic_threads(own.cfg),
    ) and own.critic_threads >= 1
    batch = make_batch(mixed_trajectories() + mixed_trajectories()[:2], 0)

    want_scores, got_scores = serial.score(batch), own.score(batch)
    for w, g, name in zip(want_scores, got_scores, ("actor", "reference", "critic"), strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0, msg=name)
    before = {name: [p.detach().clone() for p in getattr(own.models, name).module.parameters()]
              for name in ("actor", "critic")}  # fmt: skip
    want = serial.train(batch)
    own.timers = SpanTimers()
    got = own.train(batch)
    assert set(got) == set(want) and "loss/value" in got and "loss/policy" in got
    for k in want:
        assert got[k] == pytest.approx(want[k], abs=1e-5), k
    for name in ("actor", "critic"):
        a, b = getattr(serial.models, name).module, getattr(own.models, name).module
        for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
            torch.testing.assert_close(q, p, atol=1e-5, rtol=0, msg=f"{name}.{n}")
        assert any((q != q0).any() for q, q0 in zip(b.parameters(), before[name], strict=True))  # it trained
    # They ran at once: an actor minibatch and a critic minibatch were in progress at the same moment. (Not a
    # ratio of times: under a loaded machine two threads at once can take as long as one after the other.)
    spans = own.timers.spans
    assert any(
        a0 < c1 and c0 < a1
        for name_a, a0, a1 in spans
        if name_a == "time/actor_train"
        for name_c, c0, c1 in spans
        if name_c == "time/critic_train"
    ), spans
    assert torch.get_num_threads() == 2  # the caller keeps its own thread count


def test_an_own_critic_takes_the_own_share_inside_the_learners_threads(tiny_ckpt, tmp_path) -> None:
    cfg = ppo(tiny_ckpt, tmp_path, "own")
    # 8 cores, one server: an equal share each for the server, the learner and the critic's group; the
    # critic's threads stay in the learner's process.
    assert thread_split(cfg, 8) == (2, 6) and critic_threads(cfg, 8) == 3
    plan = configured_plan(cfg, 8)
    assert (plan.generation, plan.learning, plan.aux, plan.critic) == (3, 2, 3, "own")
    assert critic_threads(ppo(tiny_ckpt, tmp_path, "learner"), 8) == 0


def test_the_profile_reads_an_own_critics_phases_on_its_own_threads(tiny_ckpt, tmp_path) -> None:
    from placement.profile import read_recent

    learner = [{"step": i, "time": float(i), "batch/tokens": 100.0, "time/critic_values": 0.3,
                "time/critic_train": 0.5, "time/actor_train": 0.4, "time/weight_sync": 0.01}
               for i in range(1, 5)]  # fmt: skip
    servers = [
        {"step": i, "time": i - 0.5, "time/generate": 0.5, "rollout/tokens": 50.0} for i in range(1, 5)
    ]
    prof = read_recent(ppo(tiny_ckpt, tmp_path, "own"), learner, servers, 8, 3)
    on = {s.name: s.devices for s in prof.samples}
    assert on["critic_values"] == on["critic_train"] == 3 and on["actor_train"] == 2


@pytest.mark.slow
@pytest.mark.presets  # a launch.py run of a config variant: with the shipped configs (make test-presets)
def test_four_model_ppo_runs_end_to_end_with_an_own_critic(tiny_ckpt, tmp_path) -> None:
    """``launch.py configs/tiny-ppo.yaml placement.critic=own``: the critic's value pass and training are
    logged every step, and the run learns as the 4-model demo does."""
    from tests.test_launch import ROOT, run_dir_of

    steps = 20
    cmd = [
        sys.executable, str(ROOT / "launch.py"), str(ROOT / "configs/tiny-ppo.yaml"), "placement.critic=own",
        f"learner.total_steps={steps}", f"run.output_dir={tmp_path / 'runs'}", "logging.wandb_mode=disabled",
        "--no-console",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = read_history(run_dir_of(tmp_path / "runs"), "learner")
    trained = [r for r in rows if "reward/mean" in r]
    assert len(trained) == steps
    assert all(
        r["time/critic_values"] > 0 and r["time/critic_train"] > 0 and np.isfinite(r["loss/value"])
        for r in trained
    )
