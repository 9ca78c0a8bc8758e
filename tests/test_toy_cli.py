"""``python -m toy``: the demo kit's commands, which the shipped configs run as prepare steps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tandem import cli as tandem_cli
from toy import cli
from toy.tasks import echo


def test_make_data_writes_each_kind(tmp_path: Path) -> None:
    for kind, keys in [
        ("prompts", {"id", "prompt", "answer", "letter"}),
        ("sft", {"prompt", "response"}),
        ("prefs", {"prompt", "chosen", "rejected"}),
    ]:
        out = tmp_path / f"{kind}.jsonl"
        assert cli.main(["make-data", "echo", str(out), "--kind", kind, "--n", "5", "--seed", "3"]) == 0
        records = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(records) == 5 and all(set(r) == keys for r in records), (kind, records[0])
    for r in records:  # the prefs file: chosen is the ideal completion and scores above the near miss
        task = {"letter": r["prompt"][len("say ")]}
        assert (
            echo.reward(r["prompt"], r["chosen"], task) == 1.0 > echo.reward(r["prompt"], r["rejected"], task)
        )


def test_the_demo_commands_left_python_m_tandem(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        tandem_cli.main(["make-tiny", "x"])
    assert e.value.code == 2 and "invalid choice: 'make-tiny'" in capsys.readouterr().err


def test_python_m_toy_runs_from_any_directory(tmp_path: Path) -> None:
    """The installed package (not the checkout on the path) provides ``toy``."""
    out = subprocess.run(
        [sys.executable, "-m", "toy", "make-tiny", "--help"], cwd=tmp_path, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "--tokenizer" in out.stdout and "--head-dim" in out.stdout
