"""The SFT → RM → PPO pipeline: configs validate up front, and a shorter configs/pipeline-tiny.yaml runs end to end.

The end-to-end test runs ``python -m learner.pipeline`` as a user would (real children: ``learner.train``
for sft and rm, ``launch.py`` with a rollout server, Redis and the learner for ppo) and checks each stage's
headline: held-out SFT loss falls, the reward model ranks held-out pairs, and PPO against the reward model
raises the rule-based echo score it never trains on. A re-run skips every finished stage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from learner.pipeline import Pipeline, load_pipeline
from tandem.config import ConfigError

REPO = Path(__file__).resolve().parents[1]
PIPELINES = sorted((REPO / "configs").glob("pipeline-*.yaml"))


@pytest.mark.parametrize("path", PIPELINES, ids=[p.name for p in PIPELINES])
def test_shipped_pipelines_validate_every_stage(path: Path) -> None:
    cfgs = Pipeline(load_pipeline(path)).stage_configs()
    assert [c.recipe for c in cfgs.values()] == ["sft", "rm", "ppo"]
    sft_out = str(Path(cfgs["rm"].model.actor))
    ppo = cfgs["ppo"].model
    assert sft_out.endswith("sft/final") and ppo.actor == ppo.reference == sft_out  # actor and reference: SFT
    assert ppo.reward_model.endswith("rm/final") and ppo.critic_init == "reward_model"
    assert cfgs["ppo"].algorithm.advantage == "gae" and cfgs["ppo"].algorithm.kl_coef > 0  # four models


def test_a_bad_stage_override_names_the_field(tmp_path: Path) -> None:
    pc = load_pipeline(REPO / "configs/pipeline-tiny.yaml", ["rm.algorithm.batch_size=0"])
    with pytest.raises(
        ConfigError, match=r"algorithm\.batch_size: Input should be greater than or equal to 1"
    ):
        Pipeline(pc).stage_configs()
    with pytest.raises(ConfigError, match=r"sft: Input should be a valid dictionary"):
        load_pipeline(REPO / "configs/pipeline-tiny.yaml", ["sft=3"])


@pytest.mark.stages  # minutes: its own tier (make test-stages), not make test
@pytest.mark.timeout(1200)
def test_shorter_pipeline_runs_end_to_end_and_skips_finished_stages(tmp_path: Path) -> None:
    overrides = [
        f"output_dir={tmp_path}", "data.demonstrations=640", "data.pairs=640", "data.held_out=64",
        "data.prompts=256", "score.prompts=24", "rm.learner.total_steps=30", "ppo.learner.total_steps=20",
    ]  # fmt: skip
    env = {
        k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    }
    cmd = [sys.executable, "-m", "learner.pipeline", "configs/pipeline-tiny.yaml", *overrides]
    first = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1100)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    summary = json.loads((tmp_path / "pipeline-tiny" / "summary.json").read_text())
    sft, rm, ppo = summary["sft"], summary["rm"], summary["ppo"]
    assert sft["after"]["eval/loss"] < sft["before"]["eval/loss"] - 1.0, sft
    assert sft["task_score"] > sft["task_score_base"] + 0.2, sft
    assert rm["after"]["eval/accuracy"] >= 0.9, rm
    assert ppo["steps"] == 20
    assert ppo["reward/reward_model"]["last"] > ppo["reward/reward_model"]["first"], ppo
    assert ppo["task_score"] > sft["task_score"] + 0.1, (
        sft["task_score"],
        ppo["task_score"],
    )  # the rule it never saw
    assert all(summary[s]["wall_s"] > 0 for s in ("sft", "rm", "ppo"))

    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    for stage in ("sft", "rm", "ppo"):
        assert f"[pipeline] {stage}: done before, skipped" in again.stdout
