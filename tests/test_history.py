"""A run's history files: written by launch.py at the end of a run, read back by one function."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.telemetry import history_path, history_procs, read_history


def test_rows_come_back_in_order_and_a_half_written_last_line_is_left_out(tmp_path: Path) -> None:
    rows = [{"step": i, "reward/mean": i / 10} for i in range(3)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    history_path(tmp_path, "server-1").write_text(text + '{"step": 3, "rew')
    assert history_path(tmp_path, "server-1") == tmp_path / "server-1_history.jsonl"
    assert read_history(tmp_path, "server-1") == rows
    history_path(tmp_path, "server-1").write_text(text)
    assert read_history(tmp_path, "server-1") == rows


def test_no_file_is_no_rows_but_a_broken_middle_line_is_an_error(tmp_path: Path) -> None:
    assert read_history(tmp_path, "learner") == []  # a run still going, or one whose driver was killed
    history_path(tmp_path, "learner").write_text('{"step": 1}\n{"ste\n{"step": 3}\n')
    with pytest.raises(json.JSONDecodeError):
        read_history(tmp_path, "learner")


def test_the_processes_a_run_holds_histories_of_are_found_by_name(tmp_path: Path) -> None:
    for proc in ("server-1", "learner", "server-0", "reference", "server-10"):
        history_path(tmp_path, proc).write_text('{"step": 1}\n')
    (tmp_path / "server-2.log").write_text("not a history\n")
    assert history_procs(tmp_path, "server-*") == ["server-0", "server-1", "server-10"]
    assert history_procs(tmp_path, "*") == ["learner", "reference", "server-0", "server-1", "server-10"]
