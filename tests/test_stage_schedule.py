"""SFT and the reward model at once (stages/schedule.py, docs/stages.md §4.5): the planner's choice against
hand-computed laws, the config refusals, a failing child stopping its sibling, and (tier ``stages``) the
shipped ``configs/pipeline-parallel-tiny.yaml`` end to end with ``schedule: auto``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from placement.cost import Law
from stages.pipeline import Pipeline
from stages.pipeline_config import load_pipeline
from stages.schedule import (
    Job,
    ProfileRun,
    StageCost,
    candidates,
    fit_stage,
    history,
    run_together,
    step_seconds,
    total_steps,
)
from tandem.config import ConfigError

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs/pipeline-parallel-tiny.yaml"


def test_fit_stage_recovers_the_laws_of_two_profile_runs() -> None:
    # sft: 1.0 s/step with 2 threads, 1.5 with 1: t = 0.5 + 1.0/g. Start-up and finish (the run's seconds
    # outside its steps): 10 s with 2, 12 with 1: 8 + 4/g.
    sft = fit_stage(
        "sft", [ProfileRun(2, (1.0, 1.0, 1.0), 13.0, 3), ProfileRun(1, (1.5, 1.5), 15.0, 2)], steps_left=20
    )
    assert (sft.step.alpha, sft.step.beta) == pytest.approx((0.5, 1.0))
    assert (sft.overhead.alpha, sft.overhead.beta) == pytest.approx((8.0, 4.0))
    assert sft.wall(2) == pytest.approx(10 + 20 * 1.0) and sft.wall(1) == pytest.approx(12 + 20 * 1.5)
    # rm: 0.6 s/step with 2, 1.0 with 1 (0.2 + 0.8/g); 5 s of start-up whatever the threads
    # rm: a first step four times the others (warm-up) is a cost of the run, not of every step: the
    # median gap is the step (0.6 s with 2 threads, 1.0 with 1: 0.2 + 0.8/g), and what a run spent beyond
    # its steps at that pace is overhead: 8.0 - 3 x 0.6 = 6.2 s; the resumed run (its first step has no
    # row before it) 9.2 - 3 x 1.0 = 6.2 s, whatever the threads.
    rm = fit_stage(
        "rm", [ProfileRun(2, (2.4, 0.6, 0.6), 8.0, 3), ProfileRun(1, (1.0, 1.0), 9.2, 3)], steps_left=40
    )
    assert (rm.step.alpha, rm.step.beta) == pytest.approx((0.2, 0.8))
    assert (rm.overhead.alpha, rm.overhead.beta) == pytest.approx((6.2, 0.0), abs=1e-9)
    # On 2 cores: serial 30 + (6.2 + 40 x 0.6) = 60.2 s; split 1:1 max(42, 6.2 + 40 x 1.0) = 46.2 s
    ranking = candidates(sft, rm, 2)
    assert [(c.name, round(c.wall_s, 6)) for c in ranking] == [("split 1:1", 46.2), ("serial", 60.2)]


def test_candidates_pick_the_split_by_hand_values() -> None:
    # sft wall(g) = 8 + 4/g + 20 (0.5 + 1/g) = 18 + 24/g; rm wall(g) = 5 + 40 (0.2 + 0.8/g) = 13 + 32/g
    sft = StageCost("sft", Law(0.5, 1.0), Law(8.0, 4.0), 20)
    rm = StageCost("rm", Law(0.2, 0.8), Law(5.0, 0.0), 40)
    got = {c.name: c.wall_s for c in candidates(sft, rm, 4)}
    assert got == pytest.approx(
        {
            "serial": (18 + 6) + (13 + 8),  # 45
            "split 1:3": max(18 + 24, 13 + 32 / 3),  # 42
            "split 2:2": max(18 + 12, 13 + 16),  # 30
            "split 3:1": max(18 + 8, 13 + 32),  # 45
        }
    )
    ranking = candidates(sft, rm, 4)
    assert ranking[0].name == "split 2:2" and (ranking[0].sft_threads, ranking[0].rm_threads) == (2, 2)
    assert [c.name for c in ranking[2:]] == ["serial", "split 3:1"]  # a tie goes to serial


def test_stages_that_scale_perfectly_run_serially() -> None:
    # No fixed costs: each stage alone on every core is as fast as it gets, and a split only idles cores.
    # sft 24/g, rm 32/g on 4: serial 6 + 8 = 14; splits max(24, 10.7), max(12, 16), max(8, 32)
    sft = StageCost("sft", Law(0.0, 1.2), Law(0.0, 0.0), 20)
    rm = StageCost("rm", Law(0.0, 0.8), Law(0.0, 0.0), 40)
    ranking = candidates(sft, rm, 4)
    assert ranking[0].serial and ranking[0].wall_s == pytest.approx(14.0)
    assert [round(c.wall_s, 3) for c in ranking[1:]] == [16.0, 24.0, 32.0]


def test_step_seconds_are_the_gaps_between_a_runs_rows() -> None:
    rows = [{"step": 0, "time": 100.0}, {"step": 1, "time": 100.5}, {"step": 2, "time": 101.25}]
    assert step_seconds(rows) == pytest.approx((0.5, 0.75))
    assert step_seconds(rows[:1]) == ()


def test_total_steps_is_the_offline_runtimes(tmp_path: Path) -> None:
    pc = load_pipeline(CONFIG, [f"output_dir={tmp_path}", "data.demonstrations=100"])
    p = Pipeline(pc)
    p.make_data()
    cfg = p.stage_configs()["sft"]
    assert total_steps(cfg) == min(20, 1 * (100 // 32))  # one epoch of 100 demonstrations, batches of 32
    cfg = cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(update={"epochs": 10})})
    assert total_steps(cfg) == 20  # learner.total_steps


def test_parallel_and_auto_need_an_rm_stage_that_needs_no_sft_model() -> None:
    tiny = REPO / "configs/pipeline-tiny.yaml"  # rm_from: sft, pairs.source: policy
    for mode in ("parallel", "auto"):
        with pytest.raises(ConfigError, match=rf"schedule: {mode} needs rm_from: base \(rm_from: sft starts"):
            load_pipeline(tiny, [f"schedule={mode}"])
        with pytest.raises(ConfigError, match=rf"schedule: {mode} needs pairs.source: task \(pairs.source:"):
            load_pipeline(tiny, [f"schedule={mode}", "rm_from=base"])
        load_pipeline(tiny, [f"schedule={mode}", "rm_from=base", "pairs.source=task"])
    with pytest.raises(ConfigError, match=r"schedule: Input should be 'serial', 'parallel' or 'auto'"):
        load_pipeline(CONFIG, ["schedule=together"])
    # serial accepts either starting point, and policy pairs
    pc = load_pipeline(tiny, ["rm_from=base"])
    cfgs = Pipeline(pc).stage_configs()
    assert cfgs["rm"].model.actor == cfgs["sft"].model.actor != cfgs["ppo"].model.actor


def test_a_failing_stage_stops_the_other_and_is_named(tmp_path: Path) -> None:
    """Real children: one sleeps, one fails; the sleeper is stopped at once, not orphaned."""
    # The sleeper takes SIGINT as a stage's child does (learner.train and launch.py install their own
    # handlers): a pytest worker can hand its children SIGINT blocked or ignored, and a sleeper that slept
    # through it was killed only after the 60 s grace. The failing child waits until the sleeper is asleep.
    asleep = tmp_path / "asleep"
    take_sigint = "signal.signal(signal.SIGINT, signal.default_int_handler); signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})"
    sleeper = Job(
        "sft", [sys.executable, "-c", f"import pathlib, signal, time; {take_sigint}; pathlib.Path({str(asleep)!r}).touch(); time.sleep(120)"],
        tmp_path / "sft.log", 1,
    )  # fmt: skip
    failing = Job(
        "rm", [sys.executable, "-c", f"import os, sys, time\nwhile not os.path.exists({str(asleep)!r}): time.sleep(0.02)\nsys.exit(3)"],
        tmp_path / "rm.log", 1,
    )  # fmt: skip
    t0 = time.time()
    with pytest.raises(RuntimeError, match=r"(?s)^rm: .* exited with 3; stopped sft; log .*rm\.log"):
        run_together([sleeper, failing])
    assert time.time() - t0 < 60
    assert sleeper.proc.poll() is not None and failing.proc.returncode == 3
    with pytest.raises(ProcessLookupError):
        os.kill(sleeper.proc.pid, 0)  # reaped: no process of that id is left


@pytest.mark.stages  # a pipeline with PPO: its own tier (make test-stages), not make test
@pytest.mark.timeout(900)
def test_auto_schedule_trains_sft_and_rm_at_once_then_ppo_from_both(tmp_path: Path) -> None:
    """configs/pipeline-parallel-tiny.yaml, shortened, on 2 threads: the planner profiles both stages,
    picks the split (the tiny model's steps hardly speed up with a second thread, and start-ups dominate),
    and the two children train at the same time; PPO then starts from the SFT model and the reward model."""
    profile = 3
    overrides = [
        f"output_dir={tmp_path}", "split.cores=2", f"split.profile_steps={profile}", "base.logging.log_interval=1",
        "data.demonstrations=640", "data.pairs=640", "data.held_out=64", "data.prompts=256", "score.prompts=16",
        "monitor.prompts=16",
        # long enough after the profile that the two stages' training, not only their start-ups, overlaps
        "sft.algorithm.epochs=8", "sft.learner.total_steps=160", "sft.algorithm.eval_interval=40",
        "sft.algorithm.early_stop_patience=0", "rm.algorithm.epochs=8", "rm.learner.total_steps=160",
        "rm.algorithm.eval_interval=40", "rm.algorithm.early_stop_patience=0", "ppo.learner.total_steps=6",
    ]  # fmt: skip
    env = {
        k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    }
    cmd = [sys.executable, "-m", "stages.pipeline", str(CONFIG), *overrides]
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=850)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    root = tmp_path / "pipeline-parallel-tiny"
    summary = json.loads((root / "summary.json").read_text())
    sched = summary["schedule"]
    assert sched["mode"] == "auto" and sched["plan"] == sched["ranking"][0]["plan"] == "split 1:1", sched
    assert sched["predicted_s"] > 0 and sched["measured_s"] > 0 and sched["profile_s"] > 0
    assert f"predicted {sched['predicted_s']:.1f}s, measured {sched['measured_s']:.1f}s" in run.stdout

    # The profile's steps were kept: every stage resumed twice (half the threads, then the plan) and
    # trained its steps once each.
    spans = {}
    for stage in ("sft", "rm"):
        d = root / stage
        assert (d / "final" / "config.json").exists() and summary[stage]["steps"] == 160
        log = (d / "train.log").read_text()
        assert log.count("resumed at step") == 2 and "1 torch threads" in log and "2 torch threads" in log
        steps = [r["step"] for r in history(d)]
        assert steps == list(range(161)), steps  # every step logged once: none lost, none trained twice
        resumed = int(re.findall(r"resumed at step (\d+)", log)[-1])  # where the plan's run began
        assert 2 * profile <= resumed < 160
        rows = [r for r in history(d) if r["step"] > resumed]
        spans[stage] = (rows[0]["time"], rows[-1]["time"])
    # The two stages trained at the same time: each one's steps began before the other's ended.
    (s0, s1), (r0, r1) = spans["sft"], spans["rm"]
    assert max(s0, r0) < min(s1, r1), spans
    assert yaml.safe_load((root / "rm" / "config.yaml").read_text())["model"]["actor"].endswith(
        "assets/tiny/actor"
    )

    # PPO ran from both.
    ppo_cfg = yaml.safe_load((root / "ppo" / "config.yaml").read_text())["model"]
    assert ppo_cfg["actor"] == str(root / "sft" / "final") and ppo_cfg["reward_model"] == str(
        root / "rm" / "final"
    )
    assert summary["ppo"]["steps"] > 0
