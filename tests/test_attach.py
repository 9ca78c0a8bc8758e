"""``launch.py --attach`` supervises its servers with the local backend (docs/design.md §6.3): a crashed
server is restarted, one past its restart budget ends the attach, and leaving escalates from SIGTERM to
SIGKILL for a server that ignores SIGTERM. Real processes: a small Python script stands in for
``rollout.server`` (what is under test is the supervision around it), against the session's real Redis."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from launcher import attach
from launcher.run_plan import Role
from tandem.config import Config, dump_config
from tandem.telemetry import ready_key

# argv: the marks file, then "once" (the first life crashes, the next ignores SIGTERM) or "always".
SERVER = """
import os, signal, sys, time
from pathlib import Path

marks, mode = Path(sys.argv[1]), sys.argv[2]
lives = len(marks.read_text().splitlines()) if marks.exists() else 0


def mark(what):
    with marks.open("a") as f:
        f.write(f"{what} {os.getpid()}\\n")


if mode == "always" or lives == 0:
    mark("start")
    sys.exit(3)
signal.signal(signal.SIGTERM, lambda *_: mark("sigterm"))  # noted, then ignored: only SIGKILL ends it
mark("start")
while True:
    time.sleep(0.05)
"""


@pytest.fixture
def run_dir(redis_server, redis_client, run_id, tmp_path, monkeypatch) -> Path:
    """A live run to attach to (a ready learner, no stop) whose servers are ``SERVER`` scripts."""
    (tmp_path / "attach_server.py").write_text(SERVER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # python -m attach_server

    def roles(cfg: Config, run_dir: Path, ids: list[int]) -> list[Role]:
        mode = os.environ["ATTACH_TEST_MODE"]
        return [Role(f"server-{i}", "attach_server", (str(tmp_path / "marks"), mode), 1, 1, 0) for i in ids]

    monkeypatch.setattr(attach, "server_roles", roles)
    monkeypatch.setattr(attach, "LEAVE_GRACE_S", 1.0)
    cfg = Config.model_validate(
        {
            "run": {"name": run_id, "device": "cpu"},
            "model": {"actor": "unused"},
            "data": {"prompts": "unused.jsonl"},
            "reward": {"functions": [{"path": "toy.tasks.echo:reward"}]},
            "redis": {"url": redis_server.url},
            "supervision": {"server_restarts": 1, "backoff_s": 0.1, "reconnect_s": 1.0},
        }
    )
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    redis_client.set(ready_key(run_id, "learner"), "{}")
    return tmp_path


def marks(run_dir: Path) -> list[tuple[str, int]]:
    path = run_dir / "marks"
    lines = path.read_text().splitlines() if path.exists() else []
    return [(what, int(pid)) for what, pid in (line.split() for line in lines)]


def leave_after_two_starts(run_dir: Path, leave: threading.Event, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and [w for w, _ in marks(run_dir)].count("start") < 2:
        time.sleep(0.05)
    leave.set()


def test_attach_restarts_a_crashed_server_and_kills_one_that_ignores_sigterm(run_dir, monkeypatch, capsys):
    monkeypatch.setenv("ATTACH_TEST_MODE", "once")
    leave = threading.Event()
    watcher = threading.Thread(target=leave_after_two_starts, args=(run_dir, leave), daemon=True)
    watcher.start()
    start = time.monotonic()
    try:
        code = attach.attach(run_dir, 1, leave=leave)
        took = time.monotonic() - start
    finally:
        for _, pid in marks(run_dir):  # whatever happened: no server outlives the test
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    out = capsys.readouterr().out
    assert code == 0 and "[attach] left the run" in out, out
    assert "[attach] restarted server-" in out and "(restart 1)" in out  # after the first life's crash
    (_, first), (_, second), *rest = marks(run_dir)
    assert first != second and rest == [("sigterm", second)]  # asked to leave with SIGTERM, ignored
    assert not Path(f"/proc/{second}").exists()  # then SIGKILL after the grace (1 s here), and reaped
    assert took < 10.0, took
    log = next((run_dir / "logs").glob("server-*.log")).read_text()
    assert log.count(" start: ") == 2


def test_attach_ends_with_code_1_when_a_server_is_past_its_restart_budget(run_dir, monkeypatch, capsys):
    monkeypatch.setenv("ATTACH_TEST_MODE", "always")
    assert attach.attach(run_dir, 1) == 1
    out = capsys.readouterr().out
    assert "crashed more than supervision allows (1 restarts within 600s" in out
    assert "last lines of" in out and [w for w, _ in marks(run_dir)] == ["start", "start"]
