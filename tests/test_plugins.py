"""Every plug-in a config names is imported and its call checked before any process starts
(tandem/plugins.py): check-config, launch.py and its --dry-run refuse a bad one with exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tandem.config import load_config
from tandem.plugins import check_plugins

ROOT = Path(__file__).resolve().parent.parent
BAD_PATH = "reward.functions=[{path: nosuch.mod:fn}]"


def check_config(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tandem", "check-config", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_shipped_configs_plugins_pass(config: str) -> None:
    if config.startswith("pipeline"):
        from stages.pipeline import Pipeline
        from stages.pipeline_config import load_pipeline
        from tandem.plugins import check_pipeline_plugins

        pipeline = Pipeline(load_pipeline(ROOT / "configs" / config))
        assert check_pipeline_plugins(pipeline.pc) == []
        for cfg in pipeline.stage_configs().values():
            assert check_plugins(cfg) == []
    else:
        assert check_plugins(load_config(ROOT / "configs" / config)) == []


def test_unknown_module_refused_by_check_config() -> None:
    r = check_config("configs/tiny.yaml", BAD_PATH)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip() == (
        "error: reward.functions[0].path: cannot import 'nosuch.mod': No module named 'nosuch'"
    )


def test_missing_function_and_wrong_arity_refused() -> None:
    cfg = load_config(
        ROOT / "configs/tiny.yaml",
        [
            "reward.functions=[{path: toy.tasks.echo:nosuch}, {path: os:getpid}, {path: toy.tasks.echo:reward}]"
        ],
    )
    errors = check_plugins(cfg)
    assert len(errors) == 2, errors
    assert errors[0] == "reward.functions[0].path: module 'toy.tasks.echo' has no attribute 'nosuch'"
    assert errors[1].startswith("reward.functions[1].path: os:getpid() cannot be called as getpid(")
    assert "too many positional arguments" in errors[1]


def test_env_and_agent_calls_checked() -> None:
    cfg = load_config(ROOT / "configs/tiny-calc.yaml", ["env.kwargs.bogus=1"])
    (error,) = check_plugins(cfg)
    assert error.startswith("env.path: toy.calculator:CalculatorEnv")
    assert "unexpected keyword argument 'bogus'" in error
    cfg = load_config(ROOT / "configs/tiny-agent.yaml", ["agent.path=toy.tasks.echo:reward"])
    (error,) = check_plugins(cfg)
    assert error.startswith("agent.path: toy.tasks.echo:reward(")
    assert "cannot be called as reward(client, record, model=..." in error


@pytest.mark.parametrize("dry_run", [True, False])
def test_launch_refuses_before_anything_starts(tmp_path: Path, dry_run: bool) -> None:
    out = tmp_path / "runs"
    cmd = [sys.executable, str(ROOT / "launch.py"), "configs/tiny.yaml", BAD_PATH, f"run.output_dir={out}"]
    r = subprocess.run(
        [*cmd, *(["--dry-run"] if dry_run else []), "--no-console"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert "error: reward.functions[0].path: cannot import 'nosuch.mod': No module named 'nosuch'" in r.stderr
    assert not out.exists()  # no run directory, no process
