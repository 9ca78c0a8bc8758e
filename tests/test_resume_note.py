"""A new run beside an interrupted one of the same name says how to resume it (launcher/driver.py)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from launcher import driver
from tandem.config import load_config

ROOT = Path(__file__).resolve().parent.parent


def make_run(parent: Path, name: str, *, total: int = 2, version: int | None = None) -> Path:
    run_dir = parent / name
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.public.yaml").write_text(yaml.safe_dump({"learner": {"total_steps": total}}))
    if version is not None:
        (run_dir / "checkpoints" / "latest.json").write_text(json.dumps({"version": version}))
    return run_dir


def test_unfinished_runs_of_the_same_name(tmp_path: Path, monkeypatch) -> None:
    cfg = load_config(ROOT / "configs/tiny.yaml", [f"run.output_dir={tmp_path}", "run.name=mine"])
    assert driver.unfinished_runs(cfg) == []
    assert driver.resume_note(cfg) is None
    older = make_run(tmp_path, "mine-20261122-101500", version=None)  # stopped before its first checkpoint
    make_run(tmp_path, "mine-20261122-111500", version=2)  # finished
    newest = make_run(tmp_path, "mine-20261122-121500.1", version=1)  # stopped at step 1 of 2
    make_run(tmp_path, "other-20261122-131500", version=0)  # another run's name
    make_run(tmp_path, "mine-extra-20261122-131500", version=0)  # another run's name too
    (tmp_path / "mine-20261122-141500").mkdir()  # never started (no config)
    running = make_run(tmp_path, "mine-20261122-151500", version=0)
    lock = driver.RunLock(running)  # a launch.py is running it now
    try:
        assert driver.unfinished_runs(cfg) == [older, newest]
        monkeypatch.chdir(tmp_path)
        assert driver.resume_note(cfg) == (
            "note: mine-20261122-121500.1 did not finish; resume it with: "
            "python launch.py --resume mine-20261122-121500.1"
        )
    finally:
        lock.release()
    assert driver.unfinished_runs(cfg) == [older, newest, running]
