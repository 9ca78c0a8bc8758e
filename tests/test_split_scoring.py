"""``placement.scoring: split``: the learner's scoring passes (proximal actor, reference, critic) run at once,
each on its own share of the learner's CPU threads (learner/passes.py, docs/placement.md §11.1).

Real tiny checkpoints and real DeepSpeed learner engines (one gloo rank).
"""

from __future__ import annotations

import subprocess
import time

import numpy as np
import pytest
import torch

from learner.batch import make_batch
from learner.passes import shares
from tandem.config import ConfigError, load_config
from tandem.telemetry import read_history
from tests.test_learner import raw_config
from tests.test_reference_placement import learner_of, mixed_trajectories


def test_thread_shares_by_hand() -> None:
    assert shares(2, 2) == [1, 1]
    assert shares(2, 3) == [1, 1, 1]  # fewer threads than passes: one each, oversubscribed
    assert shares(8, 3) == [3, 3, 2]
    assert shares(5, 2) == [3, 2]


def four_models(tiny_ckpt, tmp_path, scoring: str):
    raw = raw_config(
        tiny_ckpt, "redis://unused", "split", tmp_path,
        model={"actor": str(tiny_ckpt["actor"]), "critic": str(tiny_ckpt["critic"])},
        algorithm={"advantage": "gae", "kl_coef": 0.1, "prox_forward": "always"},
        placement={"scoring": scoring},
        learner={"micro_batch_size": 2},
    )  # fmt: skip
    return load_config(None, raw=raw)


def test_split_scoring_computes_the_serial_numbers_with_the_passes_side_by_side(tiny_ckpt, tmp_path) -> None:
    serial = learner_of(four_models(tiny_ckpt, tmp_path, "serial"), tmp_path)
    split = learner_of(four_models(tiny_ckpt, tmp_path, "split"), tmp_path)
    split.models = serial.models  # the same weights: only the schedule differs
    torch.set_num_threads(2)
    batch = make_batch(mixed_trajectories(), 0)
    want = serial.score(batch)
    assert all(t is not None for t in want)  # three passes: actor, reference, critic
    split.timers.take()
    start = time.perf_counter()
    got = split.score(batch)
    wall = time.perf_counter() - start
    for w, g, name in zip(want, got, ("actor", "reference", "critic"), strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=0, msg=name)  # one thread per pass, not two
    spent = split.timers.take()
    passes = [spent[f"time/{p}"] for p in ("actor_logp", "reference", "critic_values")]
    assert sum(passes) > 1.2 * wall  # the passes' spans overlap: they ran at once
    assert torch.get_num_threads() == 2  # the caller keeps its own thread count


@pytest.mark.parametrize(("section", "value"), [("run", {"device": "cuda"}), ("learner", {"num_ranks": 2})])
def test_split_scoring_is_refused_off_one_cpu_rank(tiny_ckpt, tmp_path, section, value) -> None:
    raw = raw_config(tiny_ckpt, "redis://unused", "split", tmp_path, placement={"scoring": "split"})
    raw[section].update(value)
    with pytest.raises(
        ConfigError, match=r"placement\.scoring=split .* run\.device=cpu and learner\.num_ranks=1"
    ):
        load_config(None, raw=raw)


@pytest.mark.slow
@pytest.mark.presets  # a launch.py run of a config variant: with the shipped configs (make test-presets)
def test_four_model_ppo_runs_end_to_end_with_split_scoring(tiny_ckpt, tmp_path) -> None:
    """``launch.py`` with ``placement.scoring=split``: actor, critic, reference and a KL term; the learner
    logs its reference and critic passes, each timed in its own thread."""
    from tandem.data import write_prompts
    from tests.test_launch import ROOT, launch_cmd, run_dir_of
    from toy.tasks import make_records

    prompts = write_prompts(tmp_path / "echo.jsonl", make_records("echo", 50))
    steps = 3
    cmd = launch_cmd(
        tiny_ckpt, prompts, tmp_path / "runs", f"learner.total_steps={steps}", "algorithm.kl_coef=0.05",
        "algorithm.advantage=gae", f"model.critic={tiny_ckpt['critic']}", "placement.scoring=split",
    )  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = read_history(run_dir_of(tmp_path / "runs"), "learner")
    trained = [r for r in rows if "reward/mean" in r]
    assert len(trained) == steps
    assert all(
        np.isfinite(r["policy/kl"]) and r["time/reference"] > 0 and r["time/critic_values"] > 0
        for r in trained
    )


def test_the_profile_reads_each_split_pass_on_its_share_of_the_cores(tiny_ckpt, tmp_path) -> None:
    """What the planner fits: under split scoring on 4 cores, colocated, the reference and the critic pass
    each ran on 2 of them; under serial, on all 4."""
    from placement.profile import read_recent

    learner = [{"step": i, "time": float(i), "batch/tokens": 100.0, "time/reference": 0.2, "time/critic_values": 0.3,
                "time/actor_train": 0.4, "time/weight_sync": 0.01} for i in range(1, 5)]  # fmt: skip
    servers = [
        {"step": i, "time": i - 0.5, "time/generate": 0.5, "rollout/tokens": 50.0} for i in range(1, 5)
    ]
    raw = raw_config(tiny_ckpt, "redis://unused", "split", tmp_path, run={"mode": "sync"},
                     model={"critic": str(tiny_ckpt["critic"])}, algorithm={"advantage": "gae", "kl_coef": 0.1})  # fmt: skip
    for scoring, want in (("split", 2), ("serial", 4)):
        raw["placement"] = {"scoring": scoring}
        prof = read_recent(load_config(None, raw=raw), learner, servers, 4, 3)
        on = {s.name: s.devices for s in prof.samples}
        assert on["reference"] == on["critic_values"] == want and on["actor_train"] == 4
