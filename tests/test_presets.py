"""Every shipped config runs as a new user runs it: ``python launch.py configs/X.yaml``, nothing before.

Each config goes through ``launch.py`` from a fresh checkout (a directory holding ``configs/`` and nothing
else: no assets, data or runs), so its prepare steps make its data, models, warm starts and earlier stages
first, at reduced size (``TANDEM_PREPARE=reduced``). The checkout is shared by the module, as a user's is:
a step an earlier config ran (the tiny model, the echo prompts) is reused by the next.

A preset keeps everything that can run on this machine (its algorithm, ZeRO stage, weight transport, chat
template, server count up to two, learner ranks up to two) and overrides only what cannot: a hub model
(which tandem never downloads) becomes the tiny local checkpoint, the device is the CPU and the dist backend
gloo, an engine whose package is not installed becomes ``hf``, an external Redis becomes the embedded one,
and sizes shrink to a few steps.

A preset that another CI test runs through launch.py as shipped (:data:`RUN_ELSEWHERE`) is checked to be
named by that test, and not run twice.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launcher.prepare import load_steps
from tandem.telemetry import read_history

ROOT = Path(__file__).resolve().parent.parent
PRESETS = sorted((ROOT / "configs").glob("*.yaml"))
STEPS = 3
pytestmark = [pytest.mark.slow, pytest.mark.presets]  # make test-presets

OFFLINE = ("sft", "rm", "dpo")
# Presets that another CI test already runs through launch.py as shipped, at more steps or on the setting the
# preset is for (a Ray cluster): that test stands for the preset here, and the run is not repeated.
RUN_ELSEWHERE = {
    "tiny-ppo": "tests/test_learning.py::test_four_model_ppo_learns_echo",  # make test-stages, 220 steps
    "ray-2node-vllm": "tests/test_ray.py::test_the_two_node_preset_runs_on_its_node_labels",  # make test-ray
}


def is_run_config(raw: dict) -> bool:
    return "model" in raw and "data" in raw  # a pipeline of stages (its own schema) is run by its own test


def recipe_of(raw: dict) -> str:
    return raw.get("algorithm", {}).get("recipe", "ppo")


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh checkout's working directory: the configs and none of what they need."""
    root = tmp_path_factory.mktemp("checkout")
    (root / "configs").symlink_to(ROOT / "configs")
    return root


def launch(cmd_args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TANDEM_PREPARE": "reduced"}
    cmd = [sys.executable, str(ROOT / "launch.py"), *cmd_args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=420)


def hub_overrides(raw: dict, tiny: dict[str, Path]) -> list[str]:
    """A model path that no prepare step makes and this machine lacks (a hub download) -> the tiny one."""
    stand_in = {"actor": tiny["actor"], "reference": tiny["actor"], "critic": tiny["critic"]}
    stand_in["reward_model"] = tiny["critic"]  # a scalar-head checkpoint, as a reward model is
    return [
        f"model.{k}={stand_in[k]}"
        for k, p in raw["model"].items()
        if k in stand_in and isinstance(p, str) and Path(p).is_absolute() and not Path(p).exists()
    ]


def online_overrides(raw: dict, out: Path) -> list[str]:
    rollout, learner = raw.get("rollout", {}), raw.get("learner", {})
    engine = rollout.get("engine", "hf")
    args = ["rollout.engine=hf"] if engine != "hf" and importlib.util.find_spec(engine) is None else []
    batch = 8
    args += [
        "model.dtype=float32",
        "run.device=cpu",
        "run.ready_timeout_s=300",
        f"run.output_dir={out}",
        "redis.url=null",
        # within the tiny stand-in's 512 positions, as launch.py checks (prompt + rollout.max_new_tokens)
        f"data.max_prompt_tokens={min(max(64, raw['data'].get('max_prompt_tokens', 0)), 256)}",
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
    if raw.get("eval", {}).get("prompts"):
        args.append("eval.n_samples=2")
    if raw.get("algorithm", {}).get("dynamic_sampling"):
        # A reduced warm start solves next to nothing: every group's rewards are equal, dynamic sampling
        # would drop them all and the learner would starve. tests/test_arith.py runs it from a real one.
        args.append("algorithm.dynamic_sampling=false")
    return args


def offline_overrides(out: Path) -> list[str]:
    return [
        "run.device=cpu", f"run.output_dir={out}", "algorithm.batch_size=8", "algorithm.eval_interval=2",
        f"learner.total_steps={STEPS}", "learner.micro_batch_size=8", "logging.wandb_mode=disabled",
    ]  # fmt: skip


@pytest.mark.parametrize("preset", PRESETS, ids=[p.stem for p in PRESETS])
def test_every_shipped_preset_runs_with_one_command(
    preset: Path, checkout: Path, tiny_ckpt, tmp_path: Path
) -> None:
    raw = yaml.safe_load(preset.read_text())
    if preset.stem in RUN_ELSEWHERE:
        path, name = RUN_ELSEWHERE[preset.stem].split("::")
        source = (ROOT / path).read_text()
        body = source.split(f"def {name}(", 1)[-1].split("\ndef ", 1)[0]
        assert f"def {name}(" in source and f"configs/{preset.name}" in body, RUN_ELSEWHERE[preset.stem]
        pytest.skip(f"{preset.name} runs through launch.py in {RUN_ELSEWHERE[preset.stem]}")
    if not is_run_config(raw):
        pytest.skip(
            f"{preset.name} is a pipeline of stages: tests/test_pipeline.py runs it (make test-stages)"
        )
    out = tmp_path / "runs"
    config = f"configs/{preset.name}"  # as a user types it, from the checkout
    if recipe_of(raw) in OFFLINE:
        args = [config, "--no-console", *offline_overrides(out)]
    else:
        args = [config, "--no-console", *hub_overrides(raw, tiny_ckpt), *online_overrides(raw, out)]
    proc = launch(args, checkout)
    log = proc.stdout[-4000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, log
    steps = load_steps(preset)
    for i, step in enumerate(steps, 1):  # each step ran here or was reused from an earlier config
        assert f"[prepare {i}/{len(steps)} {step.name}]" in proc.stdout, log
        assert f"[prepare {i}/{len(steps)} {step.name}] not needed" not in proc.stdout, log
        assert all((checkout / p).exists() for p in step.produces), step.name
    assert not list(checkout.rglob(".partial-*")), "a prepare step left a temporary output"
    (run_dir,) = (p for p in out.iterdir() if not p.name.endswith("-auto-probes"))
    if recipe_of(raw) in OFFLINE:
        assert json.loads((run_dir / "summary.json").read_text())["steps"] >= 1
        assert (run_dir / "final" / "config.json").is_file()
        return
    assert f"learner finished at step {STEPS}" in proc.stdout, log
    if (raw.get("placement") or {}).get("mode") == "auto":  # it profiled in probe runs of its own first
        probes = out / f"{raw.get('run', {}).get('name', 'tiny')}-auto-probes"
        assert "placement auto: chose" in proc.stdout and "ms/step predicted" in proc.stdout
        assert json.loads((probes / "choice.json").read_text())["predicted_step_s"] > 0
        # after the run, its plan's prediction (against a measurement when it ran past 2 warm-up steps)
        assert re.search(r"placement auto: .* after step 0: predicted [\d.]+ ms/step", proc.stdout)
    rows = read_history(run_dir, "learner")
    assert [int(r["learner/version"]) for r in rows if "reward/mean" in r] == list(range(1, STEPS + 1))
    if (raw.get("env") or {}).get("path"):  # episodes were played: the environment's own metrics arrived
        assert all({"env/turns"} < {k for k in r if k.startswith("env/")} for r in rows if "reward/mean" in r)
    if raw.get("algorithm", {}).get("advantage") == "gae":
        assert all("loss/value" in r for r in rows if "reward/mean" in r)  # the critic trained
    if adapters := ((raw.get("learner") or {}).get("lora") or {}).get("adapters"):
        assert_each_adapter_trained_on_its_own(adapters, raw, run_dir)


def assert_each_adapter_trained_on_its_own(adapters: list[dict], raw: dict, run_dir: Path) -> None:
    """Several adapters at once (learner.lora.adapters): each trained every step, on its own dataset's
    prompts only, and checkpointed in its own folder."""
    summary = json.loads((run_dir / "summary.json").read_text())["adapters"]
    for adapter in adapters:
        name, folder = adapter["name"], run_dir / "adapters" / adapter["name"]
        dataset = Path(adapter.get("prompts") or raw["data"]["prompts"]).name
        rows = read_history(folder, "learner")
        assert [int(r["learner/version"]) for r in rows if "reward/mean" in r] == list(range(1, STEPS + 1))
        assert summary[name]["steps"] == STEPS
        trained = [json.loads(line) for line in (folder / "trained.jsonl").open()]
        tasks = {p.split("-")[0] for line in trained for p in line["prompts"]}
        assert tasks == {dataset.removesuffix(".jsonl")}, (name, tasks)
        assert json.loads((folder / "checkpoints" / "latest.json").read_text())["version"] == STEPS
