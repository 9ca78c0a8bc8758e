"""launch.py killed by SIGKILL: its children follow it within seconds (tandem/procs.py), and the same command
run again resumes the run in its fixed ``run.dir`` with nothing trained twice or lost (docs/design.md §1.5).
"""

from __future__ import annotations

import json
import random
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis
import yaml

from tandem.data import write_prompts
from tests.chaos import Tally, audit
from tests.test_launch import attach, launch_cmd, leftover_processes
from toy.tasks import make_records

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.faults]  # make test-faults


def redis_port(run_dir: Path) -> int:
    return int(
        yaml.safe_load((run_dir / "config.yaml").read_text())["redis"]["url"].rsplit(":", 1)[1].split("/")[0]
    )


def redis_pids(port: int) -> list[int]:
    found = []
    for pid in (p for p in Path("/proc").iterdir() if p.name.isdigit()):
        try:
            args = (pid / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "redis-server" in args[0] and any(f":{port}" in a for a in args):
            found.append(int(pid.name))
    return found


def port_free(port: int) -> bool:
    """Nothing listens on ``port`` (closed connections may linger in TIME_WAIT: a server rebinds anyway)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_a_kill_9_of_the_driver_takes_every_process_of_the_run_with_it(tiny_ckpt, tmp_path: Path) -> None:
    prompts = write_prompts(tmp_path / "p.jsonl", make_records("echo", 50))
    out = tmp_path / "runs"
    cmd = launch_cmd(tiny_ckpt, prompts, out, "learner.total_steps=100000", "rollout.num_servers=2")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        run_dir, client = attach(proc, out, deadline)
        while int(client.get(f"{run_dir.name}:version") or 0) < 2:  # every process up, training
            assert time.monotonic() < deadline and proc.poll() is None, "the run did not start training"
            time.sleep(0.1)
        port = redis_port(run_dir)
        assert len(leftover_processes(run_dir)) >= 3 and redis_pids(port)  # learner, 2 servers, redis
        proc.kill()  # SIGKILL: no handler, no clean stop
        killed = time.monotonic()
        while leftover_processes(run_dir) or redis_pids(port):
            assert time.monotonic() - killed < 10, f"still there: {leftover_processes(run_dir)}"
            time.sleep(0.1)
        gone_s = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    print(f"\nevery process of the run gone {gone_s:.1f}s after kill -9 of launch.py")
    assert port_free(port)


def version_of(run_dir: Path) -> int:
    """The run's published version now (0 before its Redis answers)."""
    try:
        url = yaml.safe_load((run_dir / "config.yaml").read_text())["redis"]["url"]
        with redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1) as client:
            return int(client.get(f"{run_dir.name}:version") or 0)
    except (OSError, TypeError, KeyError, ValueError, redis.RedisError):
        return 0


def kill_at_a_random_point(proc: subprocess.Popen, run_dir: Path, rng: random.Random) -> str:
    """SIGKILL the driver at a random moment of its life: during start-up (a random delay) or mid-run (a
    random number of versions past its last checkpoint, so the run cannot finish first however fast the
    machine trains). Returns when it was."""
    latest = run_dir / "checkpoints" / "latest.json"
    base = json.loads(latest.read_text())["version"] if latest.exists() else 0
    target = base + rng.randint(1, 30)
    at = rng.uniform(0.3, 8.0) if rng.random() < 0.4 else 180.0
    start, version = time.monotonic(), 0
    while proc.poll() is None and time.monotonic() - start < at and (version := version_of(run_dir)) < target:
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    return f"{time.monotonic() - start:.1f}s in, version {version}"


def kill_and_resume(tiny_ckpt, tmp_path: Path, kills: int, seed: int) -> None:
    """Start the same command ``kills`` times, kill -9 each driver at a random point, then let the last
    one finish; audit the run exactly-once (tests/chaos.py)."""
    steps = 40 + 40 * kills
    prompts = write_prompts(tmp_path / "p.jsonl", make_records("echo", 200))
    out = tmp_path / "runs"
    run_dir = out / "exp"
    cmd = launch_cmd(
        tiny_ckpt, prompts, out, f"run.dir={run_dir}", f"learner.total_steps={steps}",
        "learner.checkpoint_interval=3",
    )  # fmt: skip
    rng = random.Random(seed)
    points, resumed_from = [], []
    for i in range(kills):
        log = tmp_path / f"launch-{i}.out"
        with open(log, "w") as sink:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
            points.append(kill_at_a_random_point(proc, run_dir, rng))
        text = log.read_text()
        assert "learner finished" not in text, f"the run finished before kill {i + 1}"
        if "[launch] resuming the run in" in text:
            resumed_from.append(text.split(" from ", 1)[1].split("\n", 1)[0])
    final = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stdout[-4000:] + final.stderr[-3000:]
    assert f"[launch] resuming the run in {run_dir} from version" in final.stdout
    assert f"learner finished at step {steps}" in final.stdout
    assert sorted(p.name for p in out.iterdir()) == ["exp"]  # one run, resumed in place
    tally = Tally()
    audit(run_dir, steps, tally)
    print(f"\nkills at {points}; resumed from {resumed_from}; audit: {tally.line()}")
    assert tally.missing_versions == 0 and tally.final_version == steps
    assert tally.trained_twice == 0 and tally.prompts_lost == 0 and tally.prompts_emitted > 0
    assert leftover_processes(run_dir) == []


def test_the_same_command_resumes_after_six_kills_of_the_driver(tiny_ckpt, tmp_path: Path) -> None:
    kill_and_resume(tiny_ckpt, tmp_path, kills=6, seed=6)
