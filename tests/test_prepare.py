"""Prepare steps (launcher/prepare.py): run when missing, reused when made, never half-made, named in errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import launch
from launcher import driver
from launcher.prepare import (
    StepFailed,
    config_reads,
    describe,
    how_to_make,
    load_steps,
    needed,
    run_steps,
)
from tandem.config import Config, ConfigError, PrepareStep, load_config

ROOT = Path(__file__).resolve().parent.parent
# A step's command: writes "size N" into each path it is given (after its `--size` option) and counts its
# runs in runs.log; `--fail` exits 3 after writing the first file half-way.
WRITER = """
import sys
args, size, fail = sys.argv[1:], "full", False
if "--size" in args:
    i = args.index("--size"); size = args[i + 1]; del args[i:i + 2]
if "--fail" in args:
    args.remove("--fail"); fail = True
open("runs.log", "a").write("run\\n")
for path in args:
    open(path, "w").write("half" if fail else f"size {size}")
    if fail:
        sys.exit(3)
"""


def step(*produces: str, name: str = "data", extra: tuple[str, ...] = (), reduced=()) -> PrepareStep:
    return PrepareStep(
        name=name,
        command=["python", "-c", WRITER, *extra, *produces],
        produces=list(produces),
        reduced=list(reduced),
    )


def runs(root: Path) -> int:
    log = root / "runs.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_missing_steps_run_in_order_and_made_ones_are_reused(tmp_path: Path) -> None:
    steps = [step("a.txt", name="first"), step("sub/b.txt", "c.txt", name="second")]
    lines: list[str] = []
    assert run_steps(steps, tmp_path, reduced=False, say=lines.append) == 2
    assert (tmp_path / "sub" / "b.txt").read_text() == "size full" and runs(tmp_path) == 2
    assert lines[0].startswith("[prepare 1/2 first] running: python -c ") and lines[0].endswith(" a.txt")
    assert lines[1].startswith("[prepare 1/2 first] done in ") and lines[1].endswith(": a.txt")
    lines.clear()
    assert run_steps(steps, tmp_path, reduced=False, say=lines.append) == 0
    assert lines == [
        "[prepare 1/2 first] exists, reused (a.txt)",
        "[prepare 2/2 second] exists, reused (sub/b.txt, c.txt)",
    ]
    (tmp_path / "c.txt").unlink()  # one of two outputs gone: the step runs again and makes both
    assert run_steps(steps, tmp_path, reduced=False, say=lines.append) == 1 and runs(tmp_path) == 3


def test_a_failed_step_names_its_command_and_leaves_nothing_half_made(tmp_path: Path) -> None:
    steps = [step("a.txt", name="first"), step("b.txt", name="broken", extra=("--fail",)), step("c.txt")]
    with pytest.raises(
        StepFailed, match=r"(?s)prepare 2/3 broken failed with exit code 3: python -c .* --fail b\.txt$"
    ):
        run_steps(steps, tmp_path, reduced=False, say=lambda _: None)
    assert (tmp_path / "a.txt").exists() and not (tmp_path / "c.txt").exists()  # stopped at the failure
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "runs.log"]  # no b.txt, no partial
    fixed = [steps[0], step("b.txt"), steps[2]]
    assert run_steps(fixed, tmp_path, reduced=False, say=lambda _: None) == 2


def test_a_killed_steps_leftover_is_neither_reused_nor_kept(tmp_path: Path) -> None:
    # What a prepare killed mid-step leaves: its temporary output, under a process id that is gone.
    dead = 2**22 + 12345
    with pytest.raises(ProcessLookupError):
        os.kill(dead, 0)
    (tmp_path / f".partial-{dead}-a.txt").write_text("half")
    assert run_steps([step("a.txt")], tmp_path, reduced=False, say=lambda _: None) == 1
    assert (tmp_path / "a.txt").read_text() == "size full"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "runs.log"]


def test_a_step_that_exits_zero_without_its_output_fails(tmp_path: Path) -> None:
    lazy = PrepareStep(name="lazy", command=["python", "-c", "pass", "out.txt"], produces=["out.txt"])
    with pytest.raises(StepFailed, match=r"exited 0 but did not make out\.txt"):
        run_steps([lazy], tmp_path, reduced=False, say=lambda _: None)


def test_reduced_size_appends_its_arguments_and_is_not_reused_at_full_size(tmp_path: Path) -> None:
    steps = [step("w.txt", name="warm start", reduced=("--size", "small")), step("d.txt", name="data")]
    lines: list[str] = []
    run_steps(steps, tmp_path, reduced=True, say=lines.append)
    assert (tmp_path / "w.txt").read_text() == "size small"
    assert lines[0].startswith("[prepare 1/2 warm start] running (reduced size): ")
    assert lines[0].endswith("w.txt --size small")
    assert run_steps(steps, tmp_path, reduced=True, say=lambda _: None) == 0  # reused at reduced size
    # at full size the reduced warm start is rebuilt; the data step has no reduced size: reused
    assert describe(steps, tmp_path, reduced=False)[0].startswith("prepare 1/2 warm start: would run")
    assert run_steps(steps, tmp_path, reduced=False, say=lambda _: None) == 1
    assert (tmp_path / "w.txt").read_text() == "size full"
    assert run_steps(steps, tmp_path, reduced=False, say=lambda _: None) == 0


def test_reduced_size_comes_from_the_environment(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_PREPARE", "reduced")
    run_steps([step("w.txt", reduced=("--size", "small"))], tmp_path, say=lambda _: None)
    assert (tmp_path / "w.txt").read_text() == "size small"


def test_a_key_value_argument_is_an_output_too(tmp_path: Path) -> None:
    code = "import sys, pathlib; pathlib.Path(sys.argv[1].split('=')[1]).mkdir()"
    s = PrepareStep(name="stage", command=["python", "-c", code, "run.dir=out"], produces=["out"])
    run_steps([s], tmp_path, reduced=False, say=lambda _: None)
    assert (tmp_path / "out").is_dir()


def test_a_produced_path_must_be_an_argument_of_the_command() -> None:
    with pytest.raises(
        ConfigError, match=r"prepare\.0: .*produces 'other' is not an argument of the command"
    ):
        load_config(
            ROOT / "configs/tiny.yaml",
            ['prepare=[{name: x, command: [python, -c, "", a], produces: [other]}]'],
        )


def test_a_missing_input_names_the_command_that_makes_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # a checkout without assets
    cfg = load_config(ROOT / "configs/tiny-calc.yaml")
    with pytest.raises(ConfigError) as e:
        driver.check_inputs(cfg)
    assert "model.actor: " in str(e.value) and "not a checkpoint directory" in str(e.value)
    advice = "`python -m toy warmstart calc assets/tiny/actor assets/calc-warm --steps 1000` makes it"
    assert advice in str(e.value)
    assert "make-tiny" not in str(e.value)  # the old advice, wrong for this config
    cfg = load_config(ROOT / "configs/tiny-calc.yaml", [f"model.actor={tmp_path / 'elsewhere'}"])
    with pytest.raises(ConfigError, match="no prepare step of this config makes it"):
        driver.check_inputs(cfg)
    cfg = load_config(ROOT / "configs/tiny-arith.yaml")  # a path inside a stage's output
    assert "python -m learner.train --config configs/sft-arith.yaml" in how_to_make(cfg, cfg.model.actor)


def test_launch_runs_the_steps_first_and_dry_run_lists_them(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    raw = yaml.safe_load((ROOT / "configs/tiny.yaml").read_text())
    raw["data"]["prompts"] = "mine.jsonl"  # made by a broken step; the echo prompts are then not needed
    broken = ["python", "-c", "raise SystemExit(5)", "mine.jsonl"]
    raw["prepare"].append({"name": "broken", "command": broken, "produces": ["mine.jsonl"]})
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(raw))
    args = ["tiny.yaml", f"run.output_dir={tmp_path / 'runs'}", "--no-console"]
    assert launch.main([*args, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "# prepare 1/3 tiny model: would run python -m toy make-tiny assets/tiny" in out
    assert "# prepare 2/3 echo prompts: not needed, the run reads none of assets/echo.jsonl" in out
    assert "# prepare 3/3 broken: would run python -c" in out and not (tmp_path / "assets").exists()
    assert launch.main(args) == 1  # the model was made, then the broken step stopped the run
    out, err = capsys.readouterr()
    assert "[prepare 1/3 tiny model] done in" in out and "[prepare 2/3 echo prompts] not needed" in out
    assert "error: prepare 3/3 broken failed with exit code 5" in err
    assert (tmp_path / "assets/tiny/actor/config.json").is_file() and not (
        tmp_path / "assets/echo.jsonl"
    ).exists()
    assert not (tmp_path / "runs").exists()


def test_a_step_is_needed_when_the_run_reads_its_output_or_a_needed_step_does(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load_config(ROOT / "configs/tiny-calc.yaml")  # tiny model -> calc prompts, warm start from it
    assert needed(cfg.prepare, config_reads(cfg), tmp_path) == [True, True, True]
    cfg = load_config(ROOT / "configs/tiny-calc.yaml", [f"model.actor={tmp_path / 'my-model'}"])
    assert needed(cfg.prepare, config_reads(cfg), tmp_path) == [False, True, False]
    assert needed(cfg.prepare, None, tmp_path) == [True, True, True]  # python -m launcher.prepare: all
    # the SFT stage reads the model and demonstrations through its own config, named in its command
    (tmp_path / "configs").symlink_to(ROOT / "configs")  # a checkout's
    cfg = load_config(ROOT / "configs/tiny-arith.yaml")
    assert needed(cfg.prepare, config_reads(cfg), tmp_path) == [True] * 6
    cfg = load_config(ROOT / "configs/tiny-arith.yaml", [f"model.actor={tmp_path / 'my-model'}"])
    assert needed(cfg.prepare, config_reads(cfg), tmp_path) == [False, True, False, False, True, False]


def test_every_input_of_every_shipped_config_has_a_prepare_step_or_is_external() -> None:
    """A relative path a config reads is made by one of its steps; only a hub model (absolute) is not."""
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        raw = yaml.safe_load(path.read_text())
        if "model" not in raw:
            continue  # a pipeline's stages: its own schema
        cfg = Config.model_validate(raw)
        steps = load_steps(path)
        needed = [cfg.model.actor, cfg.model.critic, cfg.model.reference, cfg.model.reward_model]
        needed += [cfg.data.prompts, cfg.eval.prompts]
        needed += [getattr(cfg.algorithm, k, None) for k in ("train_file", "eval_file", "init")]
        for p in filter(None, needed):
            made = any(p == s or p.startswith(s.rstrip("/") + "/") for st in steps for s in st.produces)
            assert made or Path(p).is_absolute(), f"{path.name}: nothing makes {p}"


def test_a_prepare_killed_mid_step_is_redone_by_the_next_run(tmp_path: Path) -> None:
    """SIGKILL of the runner while its step writes: no cleanup runs, yet the half output is not reused."""
    code = (
        "import os, pathlib, signal, sys, time\n"
        "out, seen = pathlib.Path(sys.argv[1]), pathlib.Path('killed-once')\n"
        "if not seen.exists():\n"
        "    seen.touch(); out.write_text('half'); os.kill(os.getppid(), signal.SIGKILL); time.sleep(1)\n"
        "    sys.exit(0)\n"
        "out.write_text('full')\n"
    )
    steps = [
        {"name": "slow data", "command": ["python", "-c", code, "data/out.txt"], "produces": ["data/out.txt"]}
    ]
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump({"prepare": steps}))
    cmd = [sys.executable, "-m", "launcher.prepare", "cfg.yaml"]
    first = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert first.returncode == -9 and (tmp_path / "killed-once").exists()
    assert not (tmp_path / "data/out.txt").exists()  # only a .partial-PID- file, its process gone
    second = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "[prepare 1/1 slow data] running: " in second.stdout and "reused" not in second.stdout
    assert (tmp_path / "data/out.txt").read_text() == "full"
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["out.txt"]  # the leftover cleared
