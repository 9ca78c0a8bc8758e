"""Supervision pieces on their own: the restart policy, bounded reconnects across a real Redis restart,
and what the buffer does about acks and deliveries a Redis restart lost (docs/design.md §6.3, §6.6)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from buffer.redis_server import EmbeddedRedis
from buffer.retry import (
    BACKOFF_BASE_S,
    BACKOFF_CAP_S,
    Incarnation,
    RedisUnavailable,
    connect,
    connect_run,
    retries_for,
)
from buffer.schema import PromptRecord
from buffer.streams import ReplayBuffer
from launcher.supervision import RestartPolicy, Restarts
from tandem.config import redact
from tandem.data import write_prompts
from tandem.net import free_port
from tests.test_buffer import traj
from toy.tasks import make_records

ROOT = Path(__file__).resolve().parent.parent


def test_restart_policy_backs_off_and_stops_past_the_limit_within_the_window() -> None:
    r = Restarts("server-0", RestartPolicy(limit=3, window_s=100.0, backoff_s=1.0, backoff_max_s=3.0))
    delays = []
    for t in (0.0, 10.0, 20.0):
        delays.append(r.after_crash(t))
        r.restarted(t)
    assert delays == [1.0, 2.0, 3.0]  # doubling, capped
    assert r.after_crash(30.0) is None  # a 4th crash within 100 s: over the limit
    assert "server-0" in r.refusal() and "3 restarts within 100s" in r.refusal()
    assert r.after_crash(105.0) == 3.0  # the crash at t=0 left the window: one restart allowed again
    assert Restarts("redis", RestartPolicy(0, 10.0, 1.0, 1.0)).after_crash(0.0) is None  # limit 0: never


def test_tend_waits_out_the_backoff_then_restarts_and_refuses_past_the_budget() -> None:
    r = Restarts("server-0", RestartPolicy(limit=2, window_s=100.0, backoff_s=1.0, backoff_max_s=8.0))
    assert [r.tend(t) for t in (0.0, 0.5, 1.0)] == ["wait", "wait", "restart"]
    assert [r.tend(t) for t in (5.0, 6.0, 7.0)] == ["wait", "wait", "restart"]  # 2 s: doubled
    assert r.tend(8.0) == "refused" and r.total == 2


def test_a_restart_after_which_the_role_progressed_resets_its_budget() -> None:
    """A crash loop (no progress between restarts) uses the budget up; progress wipes it, backoff too."""
    version = [0]
    r = Restarts("learner", RestartPolicy(2, 600.0, 1.0, 8.0), progress=lambda: version[0])
    for t in range(5):  # five crashes, each after the learner published a new version: never refused
        now = 10.0 * t
        assert r.tend(now) == "wait" and r.restart_at == now + 1.0  # first backoff every time
        assert r.tend(now + 1.0) == "restart"
        version[0] += 3
    assert r.total == 5 and r.resets == 4
    # Now it crashes at start-up, again and again, with no version between: the budget runs out.
    assert r.tend(100.0) == "wait" and r.tend(101.0) == "restart"
    assert r.tend(102.0) == "wait" and r.tend(104.0) == "restart"
    assert r.tend(105.0) == "refused"
    assert "learner crashed more than supervision allows (2 restarts within 600s" in r.refusal()


def test_progress_that_cannot_be_read_counts_as_none() -> None:
    def down() -> int:
        raise redis.ConnectionError("down")

    r = Restarts("learner", RestartPolicy(1, 600.0, 0.0, 0.0), progress=down)
    assert r.tend(0.0) == "restart"  # no backoff: restarted at once
    assert r.tend(1.0) == "refused"


def test_learner_progress_reads_the_version_key_and_the_newest_checkpoint(redis_client, run_id, tmp_path):
    from launcher.supervision import learner_progress

    progress = learner_progress(redis_client, run_id, tmp_path)
    assert progress() is None
    (tmp_path / "latest.json").write_text('{"version": 6}')
    assert progress() == 6
    redis_client.set(f"{run_id}:version", 9)
    assert progress() == 9


def test_retries_for_covers_the_budget() -> None:
    for budget in (0.5, 2.0, 60.0):
        k = retries_for(budget)
        slept = sum(min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**i) for i in range(1, k + 1))
        assert slept >= budget and slept - min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**k) < budget


def test_a_client_rides_out_a_redis_kill_and_restart_and_a_dead_one_fails_in_bounded_time(tmp_path: Path):
    server = EmbeddedRedis(tmp_path / "r").start()
    try:
        client = connect(server.url, reconnect_s=30)
        client.set("k", "v")
        incarnation = Incarnation(client)
        os.kill(server.pid, signal.SIGKILL)
        server.proc.wait()
        got = {}
        reader = threading.Thread(target=lambda: got.update(v=client.get("k")))
        reader.start()  # blocked in retries while Redis is down
        time.sleep(1.0)
        server.restart()  # same port and password; the AOF gives the key back
        reader.join(timeout=30)
        assert got == {"v": b"v"}
        assert incarnation.changed() and not incarnation.changed()
        os.kill(server.pid, signal.SIGKILL)
        server.proc.wait()
        start = time.monotonic()
        with pytest.raises(redis.ConnectionError):
            connect(server.url, reconnect_s=1.0).get("k")
        assert time.monotonic() - start < 10  # bounded: about reconnect_s, not forever
    finally:
        if not server.alive:
            server.restart()
        server.stop()


def test_connect_run_answers_or_names_the_redis_without_its_password(redis_server) -> None:
    assert connect_run(redis_server.url, reconnect_s=1.0).ping()
    dead = f"redis://:s3cret@127.0.0.1:{free_port()}/0"
    start = time.monotonic()
    with pytest.raises(RedisUnavailable) as e:
        connect_run(dead, reconnect_s=0.5)
    assert str(e.value).startswith("Redis at redis://:***@127.0.0.1:") and "s3cret" not in str(e.value)
    assert e.value.url == redact(dead) and time.monotonic() - start < 10


def test_an_ack_lost_by_a_redis_restart_is_never_handed_out_again(redis_client, run_id, monkeypatch) -> None:
    learner = ReplayBuffer(redis_client, run_id, consumer="learner-0", claim_idle_ms=100)
    ReplayBuffer(redis_client, run_id, consumer="server-0").put([traj(i) for i in range(4)])
    taken = learner.take(4, timeout_s=2)
    acked = [t.id for t in taken[:2]]
    with monkeypatch.context() as m:  # the ack "ran", and a Redis restart lost it: still pending in Redis
        m.setattr(learner._traj, "_ack", lambda ids: None)
        learner.ack(acked)
    time.sleep(0.3)  # idle past claim_idle_ms: XAUTOCLAIM would hand them out again
    assert learner.take(4, timeout_s=0.5) == []  # neither the acked nor the 2 still held come back
    assert learner.trajectories_pending() == 2  # and the acked ones were acked again on sight
    assert learner.reack() == 2  # re-acking is idempotent


def test_a_delivery_lost_by_a_redis_restart_does_not_hand_out_an_entry_twice(redis_client, run_id) -> None:
    learner = ReplayBuffer(redis_client, run_id, consumer="learner-0")
    ReplayBuffer(redis_client, run_id, consumer="server-0").put([traj(i) for i in range(3)])
    held = learner.take(3, timeout_s=2)
    # A restart that lost the deliveries: the group's cursor is back before them, so they read as new.
    redis_client.xgroup_setid(f"{run_id}:traj", "learner", id="0")
    assert learner.take(3, timeout_s=0.3) == []
    learner.ack([t.id for t in held])
    assert learner.trajectories_pending() == 0


def test_the_feeder_position_and_its_prompts_move_together_once(redis_client, run_id) -> None:
    buf = ReplayBuffer(redis_client, run_id, consumer="launch")
    key = f"{run_id}:feeder"
    prompts = [PromptRecord(f"p{i}", "q", [1]) for i in range(3)]
    assert buf.feed_prompts(prompts, position_key=key, at=(0, 0), to=(0, 3)) == 3
    # A retry of the same call (its reply lost to a Redis crash) appends nothing twice.
    assert buf.feed_prompts(prompts, position_key=key, at=(0, 0), to=(0, 3)) == -1
    assert buf.prompts_pending() == 3
    assert redis_client.hmget(key, "epoch", "index") == [b"0", b"3"]


def test_the_feeder_emits_each_pass_in_its_seeded_order(redis_client, run_id, tmp_path) -> None:
    """Pass after pass, across top-ups that end mid-pass: the ids a naive replay of the seeded shuffles gives."""
    import random

    from buffer.schema import decode_prompt
    from launcher.feeder import PromptFeeder, PromptSet
    from tandem.config import load_config

    records = [{"id": f"r{i}", "prompt": f"q{i}"} for i in range(7)]
    data = tmp_path / "p.jsonl"
    data.write_text("".join(f'{{"id": "{r["id"]}", "prompt": "{r["prompt"]}"}}\n' for r in records))
    raw = {
        "run": {"name": run_id, "seed": 3},
        "model": {"actor": "unused"},
        "data": {"prompts": str(data), "epochs": 3, "shuffle": True},
        "reward": {"functions": [{"path": "toy.tasks.echo:reward"}]},
    }
    cfg = load_config(None, raw=raw)
    buf = ReplayBuffer(redis_client, cfg.run.name, consumer="launch")
    feeder = PromptFeeder(cfg, PromptSet(records, [[1]] * 7), buf, redis_client)
    feeder.depth = 5  # top-ups of 5 cross the pass boundaries at different offsets
    emitted = []
    while feeder.top_up():
        entries = redis_client.xrange(f"{run_id}:prompts")
        emitted += [decode_prompt(f[b"d"]).prompt_id for _, f in entries]
        redis_client.xdel(f"{run_id}:prompts", *[i for i, _ in entries])
    want = []
    for e in range(3):
        order = list(range(7))
        random.Random(3 * 100_003 + e).shuffle(order)
        want += [f"r{i}@{e}" for i in order]
    assert emitted == want


# ------------------------------------------------------------------------- through launch.py, for real


@pytest.mark.slow
@pytest.mark.faults
def test_a_learner_that_crashes_at_start_up_stops_the_run_after_its_budget(tiny_ckpt, tmp_path) -> None:
    """A crash loop: the learner cannot load its critic (a config.json with no model in it), so it never
    publishes a version; after its one allowed restart the run stops, naming it."""
    from tests.test_launch import launch_cmd, leftover_processes, run_dir_of

    prompts = write_prompts(tmp_path / "p.jsonl", make_records("echo", 50))
    broken = tmp_path / "critic"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    cmd = launch_cmd(
        tiny_ckpt, prompts, tmp_path / "runs", "learner.total_steps=5", "algorithm.advantage=gae",
        f"model.critic={broken}", "supervision.learner_restarts=1", "supervision.backoff_s=0.1",
    )  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "learner crashed more than supervision allows (1 restarts within 600s without progress" in (
        proc.stdout
    )
    assert proc.stdout.count("[launch] restarted learner") == 1
    assert leftover_processes(run_dir_of(tmp_path / "runs")) == []


@pytest.mark.slow
@pytest.mark.faults
def test_a_learner_killed_again_and_again_while_it_progresses_finishes_the_run(tiny_ckpt, tmp_path) -> None:
    """Six kill -9 of the learner at random moments, each after it trained past where it was last
    restarted, against a budget of 2 restarts: progress resets the budget, so the run finishes, and the
    exactly-once audit of tests/chaos.py holds (every version, nothing trained twice, no prompt lost)."""
    from tests.chaos import Tally, audit
    from tests.test_launch import attach, launch_cmd, leftover_processes

    kills, steps = 6, 300
    prompts = write_prompts(tmp_path / "p.jsonl", make_records("echo", 200))
    out = tmp_path / "runs"
    cmd = launch_cmd(
        tiny_ckpt, prompts, out, f"learner.total_steps={steps}", "learner.checkpoint_interval=3",
        "supervision.learner_restarts=2", "supervision.backoff_s=0.2",
    )  # fmt: skip
    rng = random.Random(7)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed = 0
    try:
        deadline = time.monotonic() + 240
        run_dir, client = attach(proc, out, deadline)
        run, high, last_pid = run_dir.name, 0, None
        while killed < kills:
            raw = client.get(f"{run}:ready:learner")
            version = int(client.get(f"{run}:version") or 0)
            pid = json.loads(raw)["pid"] if raw else None
            if pid is not None and pid != last_pid and version > high:  # restarted, and trained on
                time.sleep(rng.uniform(0.0, 1.0))
                high = max(high, int(client.get(f"{run}:version") or 0))
                os.killpg(pid, signal.SIGKILL)
                killed, last_pid = killed + 1, pid
            assert time.monotonic() < deadline and proc.poll() is None, f"the run ended after {killed} kills"
            time.sleep(0.05)
        out_text, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out_text[-4000:]
    assert f"learner finished at step {steps}" in out_text
    assert out_text.count("[launch] restarted learner") == kills
    assert "its restart budget is whole again" in out_text
    tally = Tally()
    audit(run_dir, steps, tally)
    assert tally.missing_versions == 0 and tally.final_version == steps
    assert tally.trained_twice == 0 and tally.prompts_lost == 0 and tally.prompts_emitted > 0
    assert leftover_processes(run_dir) == []


# ------------------------------------------------------------------------ children that die with us


def test_a_child_started_from_a_short_lived_thread_outlives_the_thread(tmp_path) -> None:
    """The death signal follows the thread that forked: procs.popen forks from one that lives on."""
    from tandem.procs import alive, popen

    got = {}
    t = threading.Thread(target=lambda: got.update(p=popen(["sleep", "30"])))
    t.start()
    t.join()
    try:
        time.sleep(0.5)
        assert alive(got["p"].pid)
    finally:
        got["p"].kill()
        got["p"].wait()


def test_a_child_whose_driver_died_exits_by_itself_even_when_its_clean_stop_hangs() -> None:
    from tandem.procs import DRIVER_PID_ENV, ORPHAN_GRACE_S, alive

    driver = subprocess.Popen(["sleep", "60"])
    child_code = (
        "import signal, time\n"
        "from tandem.procs import exit_with_driver\n"
        "signal.signal(signal.SIGTERM, lambda *_: None)  # a clean stop that never ends\n"
        "exit_with_driver()\n"
        "time.sleep(60)\n"
    )
    env = {**os.environ, DRIVER_PID_ENV: str(driver.pid)}
    child = subprocess.Popen([sys.executable, "-c", child_code], cwd=ROOT, env=env, stderr=subprocess.PIPE)
    try:
        time.sleep(3.0)  # imported, watching
        assert child.poll() is None
        driver.kill()  # left a zombie until reaped below: the watch must see through that
        start = time.monotonic()
        child.wait(timeout=ORPHAN_GRACE_S + 5)
        assert time.monotonic() - start < ORPHAN_GRACE_S + 2
        assert b"is gone" in child.stderr.read()
        assert not alive(child.pid)
    finally:
        driver.kill()
        driver.wait()
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_child_that_will_not_stop_leaves_its_stacks_in_its_log_before_sigkill(tmp_path: Path) -> None:
    """The stop ladder's last rung: a child still running after its grace (here one that ignores SIGTERM)
    is asked for its threads' stacks, which reach its log, and is then SIGKILLed."""
    from launcher.backends.local import Child, LocalBackend
    from launcher.run_plan import Role
    from tandem.procs import driver_env

    role = Role("server-0", "tests.stuck_child", (), processes=1, threads=1, gpus=0)
    log = tmp_path / "server-0.log"
    child = Child(
        role, {**os.environ, **driver_env()}, log, Restarts("server-0", RestartPolicy(3, 60.0, 1.0, 1.0))
    )
    backend = LocalBackend()
    backend.children = [child]
    child.start()
    deadline = time.monotonic() + 60
    while "stuck child: ready" not in log.read_text():
        assert child.running and time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.1)
    backend.stop(1.0, ask=signal.SIGTERM)
    assert not child.running and child.proc.returncode == -signal.SIGKILL
    text = log.read_text()
    assert "Current thread" in text or "Thread 0x" in text, text[-2000:]
    assert "in stuck_here" in text  # where it hung


class ExitsOnSecondLook:
    """A stand-in for the learner's ``Popen``: still running at the first ``poll``, exited 0 from the
    second on, so the exit falls between two looks of one supervision tick (a race a real child hits
    rarely, seen once in 48 launches of bench/algorithms.py on 2026-11-30)."""

    def __init__(self) -> None:
        self.returncode: int | None = None
        self.looks = 0

    def poll(self) -> int | None:
        self.looks += 1
        if self.looks >= 2:
            self.returncode = 0
        return self.returncode


def test_a_learner_that_exits_during_a_tick_finishes_the_run_and_is_never_restarted(tmp_path: Path) -> None:
    from launcher.backends.local import Child, LocalBackend
    from launcher.run_plan import Role

    role = Role("learner", "learner.online", (), processes=1, threads=1, gpus=0)
    # A zero backoff: a learner taken for crashed would be restarted within this very tick.
    learner = Child(role, {}, tmp_path / "learner.log", Restarts("learner", RestartPolicy(3, 60.0, 0.0, 0.0)))
    learner.proc = ExitsOnSecondLook()  # type: ignore[assignment]
    backend = LocalBackend()
    backend.children = [learner]
    restarted: list[str] = []
    backend._restart = lambda c: restarted.append(c.name)  # type: ignore[method-assign]
    outcomes = [backend.poll(stopping=False) for _ in range(3)]
    assert restarted == [] and learner.restarts.total == 0
    finished = [o for o in outcomes if o is not None]
    assert finished and finished[0].ok and finished[0].message == "learner finished"
