"""Every shipped config runs: each ``configs/*.yaml`` goes through ``launch.py`` for a few learner steps.

A preset keeps everything that can run on this machine (its algorithm, ZeRO stage, weight transport, chat
template, server count up to two, learner ranks up to two) and overrides only what cannot: the hub model
becomes the tiny local checkpoint (it has a chat template), the device is the CPU and the dist backend
gloo, an engine whose package is not installed becomes ``hf``, an external Redis becomes the embedded one,
and sizes shrink to a few tokens. A preset that cannot run even so is skipped with the reason.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rollout.envs import reasoning_gym
from tandem.data import write_prompts
from tandem.tasks import TASKS, make_records

ROOT = Path(__file__).resolve().parent.parent
PRESETS = sorted((ROOT / "configs").glob("*.yaml"))
STEPS = 3
pytestmark = [pytest.mark.slow, pytest.mark.presets]  # make test-presets


OFFLINE = {"sft": "write_demonstrations", "rm": "write_preferences", "dpo": "write_preferences"}


def is_run_config(raw: dict) -> bool:
    return "model" in raw and "data" in raw  # a pipeline of stages (its own schema) is run by its own test


def recipe_of(raw: dict) -> str:
    return raw.get("algorithm", {}).get("recipe", "ppo")


def task_of(raw: dict) -> str:
    """The toy task whose data the preset trains on: named by its data file or its reward plug-in."""
    names = [Path(raw["data"]["prompts"]).stem] + [
        f["path"].split(":")[0].rsplit(".", 1)[-1] for f in raw.get("reward", {}).get("functions", [])
    ]
    return next((n for n in names if n in TASKS), "echo")


RG_REWARDS = "rollout.envs.reasoning_gym:"
# Small reasoning-gym arithmetic, for a preset whose reward scores against reasoning-gym entries (tiny-arith).
RG_ARITH = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=["+", "-"])


def prompts_for(raw: dict, path: Path, n: int = 64, seed: int = 0) -> Path:
    """The preset's kind of prompt records: reasoning-gym entries when its reward or its environment reads
    them (tiny-arith, tiny-rg-retry), else its task's."""
    if (raw.get("env") or {}).get("path", "").endswith(":ReasoningGymEnv"):
        recs = reasoning_gym.make_records(
            "chain_sum", n, seed, lowercase=True, min_terms=2, max_terms=2, max_digits=1
        )
        return write_prompts(path, recs)
    if any(f["path"].startswith(RG_REWARDS) for f in raw.get("reward", {}).get("functions", [])):
        recs = reasoning_gym.make_records("basic_arithmetic", n, seed, lowercase=True, **RG_ARITH)
        return write_prompts(path, recs)
    return write_prompts(path, make_records(task_of(raw), n, seed))


def tiny_overrides(raw: dict, tiny: dict[str, Path], prompts: Path, out: Path) -> list[str]:
    model, rollout, learner = raw["model"], raw.get("rollout", {}), raw.get("learner", {})
    stand_in = {"actor": tiny["actor"], "reference": tiny["actor"], "critic": tiny["critic"]}
    stand_in["reward_model"] = tiny["critic"]  # a scalar-head checkpoint, as a reward model is
    out_args = [f"model.{k}={stand_in[k]}" for k in stand_in if model.get(k) is not None]
    engine = rollout.get("engine", "hf")
    if engine != "hf" and importlib.util.find_spec(engine) is None:
        out_args.append("rollout.engine=hf")
    batch = 8
    return [
        *out_args,
        "model.dtype=float32",
        "run.device=cpu",
        "run.ready_timeout_s=300",
        f"run.output_dir={out}",
        "redis.url=null",
        f"data.prompts={prompts}",
        f"data.max_prompt_tokens={max(64, raw['data'].get('max_prompt_tokens', 0))}",
        f"rollout.num_servers={min(rollout.get('num_servers', 1), 2)}",
        "rollout.n_samples=4",
        "rollout.prompts_per_batch=2",
        "rollout.max_new_tokens=8",
        f"algorithm.batch_size={batch}",
        f"algorithm.minibatch_size={batch}",
        f"learner.micro_batch_size={batch // 2}",
        f"learner.num_ranks={min(learner.get('num_ranks', 1), 2)}",
        f"learner.total_steps={STEPS}",
        "learner.checkpoint_interval=0",
        "weightsync.backend=gloo",
        "logging.wandb_mode=disabled",
    ]


@pytest.mark.parametrize("preset", PRESETS, ids=[p.stem for p in PRESETS])
def test_every_shipped_preset_runs_its_code_paths(preset: Path, tiny_ckpt, tmp_path: Path) -> None:
    raw = yaml.safe_load(preset.read_text())
    if not is_run_config(raw):
        pytest.skip(
            f"{preset.name} is a pipeline of stages: tests/test_pipeline.py runs it (make test-stages)"
        )
    if recipe_of(raw) in OFFLINE:
        run_offline_preset(preset, raw, tiny_ckpt, tmp_path)
        return
    prompts = prompts_for(raw, tmp_path / "prompts.jsonl")
    cmd = [sys.executable, str(ROOT / "launch.py"), str(preset), "--no-console"]
    cmd += tiny_overrides(raw, tiny_ckpt, prompts, tmp_path / "runs")
    if raw.get("eval", {}).get("prompts"):  # held-out prompts of the same kind, from another seed
        held_out = prompts_for(raw, tmp_path / "eval.jsonl", n=8, seed=1)
        cmd += [f"eval.prompts={held_out}", "eval.n_samples=2"]
    if raw.get("algorithm", {}).get("dynamic_sampling"):
        # The random tiny checkpoint solves nothing: every group's rewards are equal, dynamic sampling would
        # drop them all and the learner would starve. tests/test_arith.py runs it from a warm start.
        cmd.append("algorithm.dynamic_sampling=false")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"learner finished at step {STEPS}" in proc.stdout
    # placement.mode auto profiles in probe runs of its own first
    probes = tmp_path / "runs" / f"{raw.get('run', {}).get('name', 'tiny')}-auto-probes"
    (run_dir,) = (p for p in (tmp_path / "runs").iterdir() if p != probes)
    if (raw.get("placement") or {}).get("mode") == "auto":
        assert "placement auto: chose" in proc.stdout and "ms/step predicted" in proc.stdout
        assert json.loads((probes / "choice.json").read_text())["predicted_step_s"] > 0
        assert "placement auto: predicted" in proc.stdout  # against measured, after the run
    rows = [json.loads(line) for line in (run_dir / "learner_history.jsonl").read_text().splitlines()]
    assert [int(r["learner/version"]) for r in rows if "reward/mean" in r] == list(range(1, STEPS + 1))
    if (raw.get("env") or {}).get("path"):  # episodes were played: the environment's own metrics arrived
        assert all({"env/turns"} < {k for k in r if k.startswith("env/")} for r in rows if "reward/mean" in r)
    if raw.get("algorithm", {}).get("advantage") == "gae":
        assert all("loss/value" in r for r in rows if "reward/mean" in r)  # the critic trained


def run_offline_preset(preset: Path, raw: dict, tiny: dict[str, Path], tmp_path: Path) -> None:
    """An sft / rm / dpo preset through ``python -m learner.train``, on data built here, for a few steps."""
    import tandem.tasks

    write = getattr(tandem.tasks, OFFLINE[recipe_of(raw)])
    train, held_out = (
        write("echo", tmp_path / "train.jsonl", 64),
        write("echo", tmp_path / "eval.jsonl", 16, seed=1),
    )
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "learner.train", "--config", str(preset), "--run-dir", str(run_dir),
        f"model.actor={tiny['actor']}", "run.device=cpu", f"data.prompts={train}",
        f"algorithm.train_file={train}", f"algorithm.eval_file={held_out}", "algorithm.batch_size=8",
        "algorithm.eval_interval=2", f"learner.total_steps={STEPS}", "learner.micro_batch_size=8",
        "logging.wandb_mode=disabled",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary, "the recipe wrote an empty summary"
    assert (run_dir / "final" / "config.json").is_file()
