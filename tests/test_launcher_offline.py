"""launcher/offline.py's ``follow``: the learner's output reaches the console and its log, and a learner that
will not exit is killed rather than waited on forever."""

from __future__ import annotations

import io
import subprocess
import sys
import time

import pytest

from launcher import offline


def child(code: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def test_the_output_is_copied_and_the_exit_code_returned(capsys: pytest.CaptureFixture[str]) -> None:
    log = io.StringIO()
    rc = offline.follow(child("print('step 1'); print('step 2'); raise SystemExit(3)"), log)
    assert rc == 3
    assert log.getvalue() == "step 1\nstep 2\n"
    assert "step 2" in capsys.readouterr().out


def test_a_learner_that_closes_its_output_but_hangs_is_killed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(offline, "EXIT_GRACE_S", 0.5)
    proc = child("import os, time; print('done', flush=True); os.close(1); os.close(2); time.sleep(60)")
    t0 = time.monotonic()
    rc = offline.follow(proc, io.StringIO())
    assert rc == -9 and time.monotonic() - t0 < 10
