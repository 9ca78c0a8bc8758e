"""The SFT → RM → PPO pipeline: configs validate up front, and configs/pipeline-tiny.yaml runs end to end.

The end-to-end tests run ``python launch.py pipeline`` as a user would (real children: ``learner.train``
for sft and rm, ``launch.py`` with a rollout server, Redis and the learner for ppo) and check each stage's
headline: held-out SFT loss falls, the reward model ranks held-out pairs, and PPO against the reward model
raises the rule-based echo score it never trains on. A re-run skips every finished stage.
``python -m stages.pipeline``, the same entry point without launch.py, is run by tests/test_stage_schedule.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stages.pipeline import Pipeline
from stages.pipeline_config import load_pipeline
from tandem.config import ConfigError

REPO = Path(__file__).resolve().parents[1]
PIPELINES = sorted((REPO / "configs").glob("pipeline-*.yaml"))


@pytest.mark.parametrize("path", PIPELINES, ids=[p.name for p in PIPELINES])
def test_shipped_pipelines_validate_every_stage(path: Path) -> None:
    pc = load_pipeline(path)
    cfgs = Pipeline(pc).stage_configs()
    assert [c.recipe for c in cfgs.values()] == ["sft", "rm", "ppo"]
    ppo = cfgs["ppo"].model
    sft_out = ppo.actor
    assert sft_out.endswith("sft/final") and ppo.reference == sft_out  # actor and reference: SFT
    rm_from = sft_out if pc.rm_from == "sft" else cfgs["sft"].model.actor  # InstructGPT, or the base model
    assert cfgs["rm"].model.actor == rm_from
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


# ------------------------------------------------------------------------- preference data, monitor, control


def _samples(record: dict, texts: list[str]) -> list:
    from stages.evaluate import Sample

    return [Sample(record, [1], [2], t) for t in texts]


def test_candidate_pairs_drop_ties_and_duplicates_and_put_the_higher_first() -> None:
    from stages.preferences import candidate_pairs

    rec = {"id": "p0", "prompt": "say a:"}
    groups = [_samples(rec, ["aaaa", "ab", "aaaa", "bb", " "])]
    scores = [[1.0, 0.5, 1.0, 0.5, 0.0]]  # "aaaa" twice, "ab" ties "bb", " " is blank
    got = [(c, r, gap) for _, c, r, gap in candidate_pairs(groups, scores)]
    assert got == [("aaaa", "ab", 0.5), ("aaaa", "bb", 0.5)]


def test_select_pairs_spreads_over_prompts_and_margin_takes_the_least_sure() -> None:
    from stages.preferences import select_pairs

    a, b = {"id": "a", "prompt": "say a:"}, {"id": "b", "prompt": "say b:"}
    cands = [(a, "x1", "y", 1.0), (a, "x2", "y", 1.0), (a, "x3", "y", 1.0), (b, "z1", "w", 1.0)]
    # random: b's only candidate is in any 2 picked (one per prompt before any second)
    for seed in range(5):
        picked = select_pairs(cands, 2, "random", seed=seed)
        assert sorted(r["id"] for r, *_ in picked) == ["a", "b"]
    margins = {"x1": 3.0, "x2": -0.1, "x3": 0.5, "z1": 2.0}
    fn = lambda cs: [margins[c] for _, c, _r, _g in cs]  # noqa: E731
    assert [c for _, c, *_ in select_pairs(cands, 2, "margin", margin_fn=fn)] == ["x2", "z1"]
    assert [c for _, c, *_ in select_pairs(cands, 3, "margin", margin_fn=fn)] == ["x2", "z1", "x3"]
    with pytest.raises(ValueError, match="needs a reward model"):
        select_pairs(cands, 2, "margin")


def test_adaptive_kl_controller_hand_values() -> None:
    from learner.kl_control import AdaptiveKLController, FixedKLController, make_kl_controller

    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    # KL 9: error 9/6 - 1 = 0.5, clipped to 0.2; 256 trajectories: β *= 1 + 0.2·256/10000 = 1.00512
    assert ctl.update(9.0, 256) == pytest.approx(0.100512, abs=1e-9)
    # KL 6.6: error 0.1 (unclipped); β *= 1 + 0.1·1000/10000 = 1.01
    assert ctl.update(6.6, 1000) == pytest.approx(0.100512 * 1.01, abs=1e-9)
    # KL 0: error -1 clipped to -0.2; β *= 1 - 0.2·5000/10000 = 0.9
    assert ctl.update(0.0, 5000) == pytest.approx(0.100512 * 1.01 * 0.9, abs=1e-9)
    assert ctl.update(6.0, 10**6) == pytest.approx(0.100512 * 1.01 * 0.9)  # on target: unchanged
    fixed = make_kl_controller(0.05, None, 10000)
    assert isinstance(fixed, FixedKLController) and fixed.update(100.0, 10**6) == 0.05
    with pytest.raises(ValueError, match="> 0"):
        make_kl_controller(0.0, 6.0, 10000)


def test_stop_reason_patience_and_drop() -> None:
    from stages.overoptimization import best_index, diverging, stop_reason

    assert stop_reason([0.5, 0.6, 0.7], patience=2, max_drop=0.3) is None  # still improving
    assert stop_reason([0.5, 0.7, 0.69, 0.68], patience=2, max_drop=0.3) == (
        "gold has not improved for 2 evaluations (best 0.700)"
    )
    assert stop_reason([0.5, 0.7, 0.69], patience=2, max_drop=0.3) is None
    # a collapse stops at once, whatever the patience: 0.45 < 0.7 x 0.7
    assert "below 0.70 x its best 0.700" in stop_reason([0.5, 0.7, 0.45], patience=0, max_drop=0.3)
    assert stop_reason([0.5, 0.7, 0.45], patience=0, max_drop=1.0) is None
    assert best_index([{"gold": 0.5}, {"gold": 0.7}, {"gold": 0.7}]) == 1
    pts = [{"gold": 0.6, "proxy": 1.0}, {"gold": 0.4, "proxy": 2.0}]
    assert diverging(pts) and not diverging(pts[::-1]) and not diverging(pts[:1])


def test_the_watch_stops_a_collapse_and_keeps_the_best_gold_snapshot(tmp_path: Path) -> None:
    """Snapshots v5..v30 of a run whose gold rises, then collapses while the proxy keeps rising."""
    from stages.overoptimization import PPOWatch
    from stages.pipeline_config import Monitor

    golds = {0: 0.50, 5: 0.60, 10: 0.66, 15: 0.55, 20: 0.40, 25: 0.10, 30: 0.0}

    class FakeGold:
        def evaluate(self, policy: Path, version: int) -> dict:
            return {
                "version": version,
                "gold": golds[version],
                "proxy": version / 5,
                "kl": version / 10,
                "sqrt_kl": 0.0,
            }

    cfg = Pipeline(
        load_pipeline(REPO / "configs/pipeline-tiny.yaml", [f"output_dir={tmp_path}"])
    ).stage_configs()["ppo"]
    run_dir = tmp_path / "ppo" / f"{cfg.run.name}-1"
    for v in golds:
        if v:
            (run_dir / "snapshots" / f"v{v:08d}").mkdir(parents=True)
    watch = PPOWatch(FakeGold(), Monitor(patience=3, max_drop=0.3), tmp_path / "ppo", cfg)
    assert watch.run_dir() == run_dir and watch.poll(run_dir)
    # 0.40 < 0.7 x 0.66: stopped at v20, before the gold fell by half; v25 and v30 never looked at
    assert [p["version"] for p in watch.points] == [0, 5, 10, 15, 20]
    assert watch.stop == "gold fell to 0.400, below 0.70 x its best 0.660"
    assert [w.split(":")[0] for w in watch.warnings] == ["v15", "v20"]  # proxy up, gold down
    assert (
        watch.warnings[0]
        == "v15: proxy rose 2.000 -> 3.000 while gold fell 0.660 -> 0.550 (over-optimisation)"
    )
    out = watch.result(run_dir)
    assert (
        out["best_version"] == 10 and out["final"].endswith("v00000010") and out["stop_reason"] == watch.stop
    )
    assert (tmp_path / "ppo" / "curve.png").exists() and len(
        (tmp_path / "ppo" / "curve.jsonl").read_text().splitlines()
    ) == 5
    again = PPOWatch(FakeGold(), Monitor(), tmp_path / "ppo", cfg)  # a re-run reads the curve back
    assert len(again.points) == 5


def test_a_finished_stage_of_another_seed_is_not_reused(tmp_path: Path) -> None:
    """``base.run.seed=1`` over a directory where seed 0 ran must not print seed 0's results as its own."""
    from tandem.config import dump_config

    path = REPO / "configs/pipeline-tiny.yaml"
    first = Pipeline(load_pipeline(path, [f"output_dir={tmp_path}"]))
    sft = first.dir / "sft"
    sft.mkdir(parents=True)
    (sft / "config.yaml").write_text(dump_config(first.stage_configs()["sft"]))
    (sft / "done.json").write_text("{}")
    other = Pipeline(load_pipeline(path, [f"output_dir={tmp_path}", "base.run.seed=1"]))
    with pytest.raises(ConfigError, match=r"sft: finished in .* with run.seed 0, not 1"):
        other.run()


def test_adaptive_kl_and_snapshots_validate(tmp_path: Path) -> None:
    pc = load_pipeline(
        REPO / "configs/pipeline-tiny.yaml", ["ppo.algorithm.kl_target=0.05", "monitor.interval=4"]
    )
    cfgs = Pipeline(pc).stage_configs()
    assert cfgs["ppo"].algorithm.kl_target == 0.05 and cfgs["ppo"].learner.save_hf_interval == 4
    assert cfgs["sft"].learner.save_hf_interval == 0
    none = Pipeline(load_pipeline(REPO / "configs/pipeline-tiny.yaml", ["monitor=null"])).stage_configs()
    assert none["ppo"].learner.save_hf_interval == 0


def run_pipeline(tmp_path: Path, *overrides: str, timeout: int = 900) -> tuple[dict, str]:
    """``launch.py pipeline configs/pipeline-tiny.yaml``: its summary.json and its stdout."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    }
    cmd = [
        sys.executable,
        "launch.py",
        "pipeline",
        "configs/pipeline-tiny.yaml",
        f"run.output_dir={tmp_path}",
        *overrides,
    ]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((tmp_path / "pipeline-tiny" / "summary.json").read_text()), done.stdout


@pytest.mark.stages
@pytest.mark.timeout(2000)
def test_the_shipped_pipeline_raises_the_held_out_rule_score(tmp_path: Path) -> None:
    """configs/pipeline-tiny.yaml as a user runs it, at seed 2: the seed on which near-miss pairs once took
    PPO's gold score from 0.47 to 0.00 (docs/stages.md §4.4 has all five seeds). Each stage did its part,
    and the same command run again skips every finished stage."""
    summary, _ = run_pipeline(tmp_path, "base.run.seed=2")
    sft, rm, ppo = summary["sft"], summary["rm"], summary["ppo"]
    assert sft["after"]["eval/loss"] < sft["before"]["eval/loss"] - 1.0, sft
    assert sft["task_score"] > sft["task_score_base"] + 0.2, sft
    assert rm["after"]["eval/accuracy"] >= 0.7, rm  # 0.81 measured at this seed; chance is 0.5
    assert ppo["task_score"] >= sft["task_score"] + 0.1, (sft["task_score"], ppo["task_score"])
    assert Path(ppo["curve_png"]).exists() and len(ppo["curve"]) >= 2 and ppo["curve"][0]["version"] == 0
    assert all(summary[s]["wall_s"] > 0 for s in ("sft", "rm", "ppo"))

    _, again = run_pipeline(tmp_path, "base.run.seed=2", timeout=300)
    for stage in ("sft", "rm", "ppo"):
        assert f"[pipeline] {stage}: done before, skipped" in again


@pytest.mark.stages
@pytest.mark.timeout(2000)
def test_a_reward_model_that_rewards_one_letter_is_stopped_before_gold_halves(tmp_path: Path) -> None:
    """The judge labels pairs by their count of ``a`` (toy.tasks.echo:letter_a), whatever the prompt:
    the reward model learns to reward one letter, and PPO against it lowers the echo score. The monitor
    must stop PPO (or warn) while the gold is still above half of the SFT model's, and keep a policy whose
    held-out rule score is not below half the SFT model's either. The collapse is fast (seed 0: gold 0.52
    at v0, 0.27 at v5), so the monitor looks every 2 versions."""
    summary, _ = run_pipeline(
        tmp_path, "pairs.judge=toy.tasks.echo:letter_a", "ppo.learner.total_steps=80", "monitor.interval=2"
    )
    sft, ppo = summary["sft"], summary["ppo"]
    curve = ppo["curve"]
    assert "stop_reason" in ppo or ppo.get("warnings"), ppo
    assert all(p["gold"] >= 0.5 * curve[0]["gold"] for p in curve), curve
    assert ppo["task_score"] >= 0.5 * sft["task_score"], (sft["task_score"], ppo["task_score"])


def test_the_pipeline_config_doc_has_a_described_row_for_every_field() -> None:
    """``python -m stages.pipeline_config`` covers the pipeline's schema as config-doc covers a run's."""
    from stages.pipeline_config import PipelineConfig
    from tests.test_config import _every_field

    fields = _every_field(PipelineConfig)
    assert {"pairs.judge", "monitor.patience", "data.task", "prepare[].name", "rm_from"} <= set(fields)
    assert [path for path, desc in fields.items() if not desc] == []
    proc = subprocess.run(
        [sys.executable, "-m", "stages.pipeline_config"],
        cwd=Path(__file__).parent.parent,
        capture_output=True,
        text=True,
        check=True,
    )
    rows = {line.split("`")[1] for line in proc.stdout.splitlines() if line.startswith("| `")}
    assert sorted(set(fields) - rows) == []
