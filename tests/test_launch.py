"""End-to-end: launch.py runs Redis, a rollout server and the learner for a few steps, in each mode.

These are the only tests that start the whole system as a user does (``python launch.py CONFIG ...``).
After each run, the run's Redis is restarted on its append-only file to inspect what flowed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import yaml

from buffer.redis_server import EmbeddedRedis
from launcher.run_plan import thread_split
from tandem.config import load_config
from tandem.data import write_prompts
from tandem.telemetry import read_history
from toy.tasks import make_records

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_prompts(tmp_path_factory.mktemp("data") / "echo.jsonl", make_records("echo", 200))


def launch_cmd(tiny_ckpt: dict[str, Path], prompts: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "launch.py"),
        str(ROOT / "configs/tiny.yaml"),
        f"model.actor={tiny_ckpt['actor']}",
        f"model.critic={tiny_ckpt['critic']}",
        f"data.prompts={prompts}",
        f"run.output_dir={out}",
        "rollout.n_samples=4",
        "rollout.prompts_per_batch=2",
        "rollout.max_new_tokens=6",
        "algorithm.batch_size=8",
        "algorithm.minibatch_size=8",
        "learner.micro_batch_size=8",
        "logging.wandb_mode=disabled",
        "redis.claim_idle_ms=2000",
        *extra,
        "--no-console",
    ]


def run_dir_of(out: Path) -> Path:
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    return run_dir


def leftover_processes(run_dir: Path) -> list[str]:
    """Processes whose command line mentions the run directory (children launch.py should have stopped)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(run_dir) in cmdline:
            found.append(f"{pid}: {cmdline}")
    return found


def attach(proc: subprocess.Popen, out: Path, deadline: float) -> tuple[Path, redis.Redis]:
    """Wait for a running launch.py to write its run dir, and connect to its Redis (URL from config.yaml,
    which launch.py writes atomically)."""
    while not list(out.glob("*/config.yaml")):
        assert time.monotonic() < deadline and proc.poll() is None, "launch.py did not create its run dir"
        time.sleep(0.2)
    run_dir = run_dir_of(out)
    url = yaml.safe_load((run_dir / "config.yaml").read_text())["redis"]["url"]
    return run_dir, redis.Redis.from_url(url)


def inspect_redis(run_dir: Path):
    """Restart the run's Redis on its AOF (same password) and return (server, client, run id)."""
    server = EmbeddedRedis(run_dir / "redis").start()
    return server, server.client(), run_dir.name


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_launch_runs_end_to_end(mode: str, tiny_ckpt, prompts: Path, tmp_path: Path) -> None:
    steps, max_staleness = 4, 1
    cmd = launch_cmd(
        tiny_ckpt,
        prompts,
        tmp_path,
        f"learner.total_steps={steps}",
        f"algorithm.max_staleness={max_staleness}",
        # A name no other test runs under: the /dev/shm check below globs by it, and another test's
        # tiny.yaml run started in the same second would otherwise share the prefix.
        f"run.name=end-to-end-{mode}",
        "--mode",
        mode,
    )
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = run_dir_of(tmp_path)
    assert f"learner finished at step {steps}" in proc.stdout

    learner = read_history(run_dir, "learner")
    learner = [r for r in learner if "reward/mean" in r]
    assert [int(r["learner/version"]) for r in learner] == list(range(1, steps + 1))  # versions advanced
    bound = 0 if mode == "sync" else max_staleness
    assert max(r["staleness/max"] for r in learner) <= bound  # staleness never exceeded the bound
    if mode == "sync":
        # The take-time filter alone would also keep staleness in bound, by refusing data: in lock-step
        # admission must make every trajectory fresh, so none may have been refused.
        assert learner[-1]["buffer/stale_rejected"] == 0

    server = read_history(run_dir, "server-0")
    assert sum(r.get("rollout/groups", 0) for r in server) >= steps * 2  # trajectories flowed (2 groups/step)
    # weights reached the server: it reports holding a version above 0 before the end
    assert max(r.get("rollout/version", 0) for r in server) >= 1

    assert leftover_processes(run_dir) == []  # every child exited
    assert not list(Path("/dev/shm").glob(f"tandem-{run_dir.name}-*"))  # shared weight files freed
    url = yaml.safe_load((run_dir / "config.yaml").read_text())["redis"]["url"]
    password = url.split("@")[0].rsplit(":", 1)[1]
    assert len(password) >= 16
    for log in [*(run_dir / "logs").iterdir(), *(run_dir / "summary.json",)]:
        assert password not in log.read_text(errors="replace"), f"{log} holds the Redis password"
    assert password not in proc.stdout + proc.stderr
    assert (run_dir / "summary.json").exists() and (run_dir / "reward.png").exists()

    # torch in each process runs the threads the plan gave it.
    per_server, learner_threads = thread_split(load_config(run_dir / "config.yaml"))
    assert f"on cpu, {learner_threads} torch threads" in (run_dir / "logs" / "learner.log").read_text()
    assert f", {per_server} torch threads)" in (run_dir / "logs" / "server-0.log").read_text()


@pytest.mark.faults
def test_killed_rollout_server_is_restarted_and_no_prompt_is_lost(
    tiny_ckpt, prompts: Path, tmp_path: Path
) -> None:
    # Enough steps that the run still needs the server after the kill: a step takes ~0.1 s here, and with
    # 10 steps the learner once finished before the kill landed, leaving the successor nothing to answer.
    steps = 40
    cmd = launch_cmd(
        tiny_ckpt, prompts, tmp_path, f"learner.total_steps={steps}", "supervision.server_restarts=2"
    )
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        run_dir, client = attach(proc, tmp_path, deadline)
        key = f"{run_dir.name}:ready:server-0"
        # wait until the server is ready and the learner has taken a step, then kill the server mid-run
        while not (client.exists(key) and int(client.get(f"{run_dir.name}:version") or 0) >= 2):
            assert time.monotonic() < deadline and proc.poll() is None, "run did not reach step 2"
            time.sleep(0.02)
        pid = json.loads(client.get(key))["pid"]
        os.kill(pid, signal.SIGKILL)
        killed_at = int(client.get(f"{run_dir.name}:version"))
        assert killed_at < steps - 10, f"the kill landed too late (version {killed_at}) to test a restart"
        # the prompts the dead server held: they must be answered by its successor, not lost
        held = {
            e["message_id"].decode()
            for e in client.xpending_range(f"{run_dir.name}:prompts", "rollout", "-", "+", 1000, "server-0")
        }
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    assert f"learner finished at step {steps}" in out
    log = (run_dir / "logs" / "server-0.log").read_text()
    assert log.count("=== ") >= 2  # started twice: the crash was noticed and the server restarted
    assert leftover_processes(run_dir) == []

    server, client, run = inspect_redis(run_dir)
    try:
        left = {i.decode() for i, _ in client.xrange(f"{run}:prompts")}
        assert not (held & left), "prompts held by the killed server were never answered"
        # Exact accounting: every prompt fed is either still queued or was answered by one group of n
        # trajectories, each of which was trained on, refused (counted), or is still in the stream.
        feeder = client.hgetall(f"{run}:feeder")
        fed = int(feeder[b"epoch"]) * 200 + int(feeder[b"index"])
        counts = {k.decode(): int(v) for k, v in client.hgetall(f"{run}:counts").items()}
        refused = counts.get(f"{run}:traj:stale", 0) + counts.get(f"{run}:traj:dead", 0)
        trained = steps * 8
        in_stream = client.xlen(f"{run}:traj")
        assert (fed - len(left)) * 4 == trained + refused + in_stream
    finally:
        client.close()
        server.stop()


@pytest.mark.faults
def test_crashed_learner_past_its_restart_budget_stops_the_run_and_resume_finishes_it(
    tiny_ckpt, prompts: Path, tmp_path: Path
) -> None:
    # With restarts allowed the learner would come back by itself (tests/test_chaos.py); with none, the
    # run stops naming the role, and `launch.py --resume` continues it by hand.
    steps = 12
    cmd = launch_cmd(
        tiny_ckpt,
        prompts,
        tmp_path,
        f"learner.total_steps={steps}",
        "learner.checkpoint_interval=3",
        "supervision.learner_restarts=0",
    )
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        run_dir, client = attach(proc, tmp_path, deadline)
        while int(client.get(f"{run_dir.name}:version") or 0) < 5:
            assert time.monotonic() < deadline and proc.poll() is None, "run did not reach step 5"
            time.sleep(0.05)
        os.kill(json.loads(client.get(f"{run_dir.name}:ready:learner"))["pid"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    assert "learner crashed more than supervision allows (0 restarts" in out  # named, the run stopped
    assert "last lines of" in out
    assert leftover_processes(run_dir) == []

    resumed = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "--resume", str(run_dir), "--no-console"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"learner finished at step {steps}" in resumed.stdout
    rows = [json.loads(line) for line in (run_dir / "trained.jsonl").read_text().splitlines()]
    final = {}
    for r in rows:  # a version trained twice (lost with the crash, then retrained): the later one counts
        final[r["version"]] = r["ids"]
    assert sorted(final) == list(range(1, steps + 1))
    ids = [i for v in final.values() for i in v]
    assert len(ids) == len(set(ids)) == steps * 8  # every trajectory in the final model trained exactly once
    assert leftover_processes(run_dir) == []


# The first things a new user tries that no shipped config sets, each through launch.py to the end of its
# steps: dist weight sync with servers that wait on admission in lock-step, and two servers in sync mode.
# The others run as shipped configs in tests/test_presets.py: chat templates through transformers 5's
# tokenizer API and dist weight sync in async mode (qwen2.5-0.5b-vllm, qwen2.5-7b-sglang, two servers each),
# the critic and reference of classic PPO (tiny-ppo, in tests/test_learning.py). Run with the shipped
# configs (make test-presets), which they vary, to keep make test within its 8 minutes.
USER_PATHS = {
    "dist_sync": ["weightsync.transport=dist", "--mode", "sync"],
    "two_servers_sync": ["rollout.num_servers=2", "run.mode=sync"],
}


@pytest.mark.presets
@pytest.mark.parametrize("path", list(USER_PATHS))
def test_first_user_paths_run(path: str, tiny_ckpt, prompts: Path, tmp_path: Path) -> None:
    steps = 3
    cmd = launch_cmd(tiny_ckpt, prompts, tmp_path, f"learner.total_steps={steps}", *USER_PATHS[path])
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"learner finished at step {steps}" in proc.stdout
    run_dir = run_dir_of(tmp_path)
    learner = read_history(run_dir, "learner")
    assert [int(r["learner/version"]) for r in learner if "reward/mean" in r] == [1, 2, 3]
    assert leftover_processes(run_dir) == []


def test_sync_interval_beyond_staleness_is_refused_before_anything_starts(
    tiny_ckpt, prompts: Path, tmp_path: Path
) -> None:
    cmd = launch_cmd(tiny_ckpt, prompts, tmp_path, "algorithm.sync_interval=4", "algorithm.max_staleness=2")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error:") and "algorithm.sync_interval (4)" in proc.stderr
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # no run directory, no process


def test_eval_and_sampling_switches_run_end_to_end(tiny_ckpt, prompts: Path, tmp_path: Path) -> None:
    """Held-out evaluation, dynamic sampling and over-long shaping through launch.py: the summary and the
    console carry the evaluation of every version, the servers report what they dropped and shaped."""
    steps = 3
    cmd = launch_cmd(
        tiny_ckpt, prompts, tmp_path / "runs", f"learner.total_steps={steps}",
        f"eval.prompts={prompts}", "eval.interval=1", "eval.n_samples=2",
        "algorithm.dynamic_sampling=true", "algorithm.overlong_buffer=2",
    )  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = run_dir_of(tmp_path / "runs")
    summary = json.loads((run_dir / "summary.json").read_text())
    versions = [e["version"] for e in summary["eval"]]
    assert versions[0] == 0 and versions == sorted(set(versions)) and len(versions) >= 2
    assert all(0.0 <= e["pass@1"] <= e["pass@2"] <= 1.0 for e in summary["eval"])
    assert "[launch] eval (held-out): v0:" in proc.stdout
    server = read_history(run_dir, "server-0")
    assert "rollout/uniform_groups_dropped" in server[-1]
    learner = read_history(run_dir, "learner")
    assert all("reward/overlong" in r for r in learner if "reward/mean" in r)  # the shaped part arrived
