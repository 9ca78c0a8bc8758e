"""The elastic fleet: servers join a running run at the current weights and leave it, gracefully or killed.

The ``dist`` tests use gloo on CPU (NCCL needs GPUs); subscribers run in real spawned processes. The
end-to-end test runs ``launch.py`` and ``launch.py --attach`` as a user does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest

from buffer.schema import PromptRecord
from buffer.streams import ReplayBuffer
from tandem import fleet
from tandem.telemetry import history_path
from tests.test_launch import ROOT, attach, inspect_redis, launch_cmd, leftover_processes
from tests.test_launch import prompts as prompts
from tests.test_weightsync import (
    SPAWN,
    _await,
    _stop_subscribers,
    _subscriber_main,
    assert_bit_identical,
    make_cfg,
    weights,
)
from weightsync import make_publisher
from weightsync.base import Registry, weights_key


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_dist_joiner_gets_the_current_version_at_once(
    redis_server, redis_client, run_id, tiny_ckpt, tmp_path
):
    """A learner that has published v2 and will publish nothing newer: a joiner still gets v2, in a round
    of its own; the subscriber that already holds v2 is not part of it."""
    from safetensors.torch import load_file

    cfg = make_cfg(run_id, tiny_ckpt["actor"], transport="dist")
    out = tmp_path / "received"
    out.mkdir()
    registry = Registry(redis_client, run_id, cfg.weightsync.timeout_s)
    pub = make_publisher(cfg, redis_client)
    procs = {}

    def start(sid: str) -> None:
        procs[sid] = SPAWN.Process(
            target=_subscriber_main, args=(redis_server.url, cfg.model_dump(), sid, str(out)), daemon=True
        )
        procs[sid].start()

    try:
        start("A")
        _await(lambda: "A" in registry.live(), "A registered", procs)
        for v in range(3):
            pub.publish(weights(v).items(), v)
            _await(lambda v=v: (out / f"A-v{v}.safetensors").exists(), f"A at v{v}", procs)
        assert not pub.joiners_waiting()
        pub.publish(weights(2).items(), 2)  # a repeat nobody asked for: returns at once, no round
        assert msgpack.unpackb(redis_client.get(weights_key(run_id, "go")))["round"] == [2, 3]

        start("C")  # what the learner does between steps and while it waits for data:
        deadline = time.monotonic() + 60
        while not (out / "C-v2.safetensors").exists():
            assert time.monotonic() < deadline, "the joiner never received the current version"
            if pub.joiners_waiting():
                pub.publish(weights(2).items(), 2)
            time.sleep(0.05)
        go = msgpack.unpackb(redis_client.get(weights_key(run_id, "go")))
        assert go["version"] == 2 and go["ranks"] == ["C"]  # A holds v2: not in the repeat
        assert not pub.joiners_waiting()  # served: C left the want set
        pub.publish(weights(3).items(), 3)  # and the next version reaches both
        _await(lambda: all((out / f"{s}-v3.safetensors").exists() for s in "AC"), "v3 at A and C", procs)
    finally:
        _stop_subscribers(redis_client, run_id, procs)
        pub.close()
    assert sorted(f.name for f in out.glob("C-*")) == ["C-v2.safetensors", "C-v3.safetensors"]
    for f in out.glob("*.safetensors"):
        assert_bit_identical(load_file(f), weights(int(f.stem.split("-v")[1])), ordered=False)


@pytest.mark.slow
@pytest.mark.faults  # a server killed and restarted (make test-faults)
@pytest.mark.timeout(180)
def test_a_restarted_dist_subscriber_asks_for_a_new_round(
    redis_server, redis_client, run_id, tiny_ckpt, tmp_path
):
    """A server killed and restarted under the same name finds the last round's offer and go, whose ranks
    name it (its earlier incarnation). It must not join that finished rendezvous (a timeout, a crash, a
    restart, the same again: how test_servers_join_and_leave_a_running_run once hung) but ask for the
    current weights, and get them."""
    from safetensors.torch import load_file

    cfg = make_cfg(run_id, tiny_ckpt["actor"], transport="dist")
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    registry = Registry(redis_client, run_id, cfg.weightsync.timeout_s)
    pub = make_publisher(cfg, redis_client)
    procs = {}

    def start(key: str, out: Path) -> None:
        procs[key] = SPAWN.Process(
            target=_subscriber_main, args=(redis_server.url, cfg.model_dump(), "A", str(out)), daemon=True
        )
        procs[key].start()

    try:
        start("A", first)
        _await(lambda: "A" in registry.live(), "A registered", procs)
        pub.publish(weights(0).items(), 0)
        _await(lambda: (first / "A-v0.safetensors").exists(), "A at v0", procs)
        procs.pop("A").kill()  # SIGKILL: its registration and the round's go stay behind
        start("A again", second)
        deadline = time.monotonic() + 60
        while not (second / "A-v0.safetensors").exists():
            assert procs["A again"].exitcode is None, "the restarted subscriber died"
            assert time.monotonic() < deadline, "the restarted subscriber never received v0"
            if pub.joiners_waiting():
                pub.publish(weights(0).items(), 0)
            time.sleep(0.05)
        go = msgpack.unpackb(redis_client.get(weights_key(run_id, "go")))
        assert go["version"] == 0 and go["ranks"] == ["A"] and go["round"] == [0, 2]  # a round of its own
    finally:
        _stop_subscribers(redis_client, run_id, procs)
        pub.close()
    assert_bit_identical(load_file(second / "A-v0.safetensors"), weights(0), ordered=False)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_learner_waiting_for_data_serves_a_dist_joiner(
    redis_server, redis_client, run_id, tiny_ckpt, tmp_path
):
    """The learner has published v0 to nobody and waits for data; a dist server joining now must get v0
    without a new version being published (none can be: there is no data until the joiner makes some)."""
    import threading

    from learner.ppo import PPOLearner
    from tandem.config import load_config
    from tandem.telemetry import ready_key
    from tests.test_learner import group, raw_config

    raw = raw_config(
        tiny_ckpt, redis_server.url, run_id, tmp_path,
        learner={"total_steps": 1, "save_hf_final": False},
        weightsync={"transport": "dist", "timeout_s": 20},
    )  # fmt: skip
    cfg = load_config(None, raw=raw)
    out = tmp_path / "received"
    out.mkdir()
    errors: list[BaseException] = []

    def join_then_feed() -> None:
        proc = None
        try:
            deadline = time.monotonic() + 200
            while not redis_client.exists(ready_key(run_id, "learner")):
                assert time.monotonic() < deadline, "learner not ready"
                time.sleep(0.1)
            proc = SPAWN.Process(
                target=_subscriber_main,
                args=(redis_server.url, cfg.model_dump(), "server-7", str(out)),
                daemon=True,
            )
            proc.start()
            _await(
                lambda: (out / "server-7-v0.safetensors").exists(),
                "the joiner to receive v0",
                {"s": proc},
                90,
            )
        except BaseException as e:
            errors.append(e)
        finally:
            ReplayBuffer.from_config(redis_client, cfg, "test-producer").put(group(0, 4) + group(1, 4))
            if proc is not None:
                redis_client.set(f"{run_id}:test:server-7", "stop")
                proc.join(timeout=30)

    feeder = threading.Thread(target=join_then_feed, daemon=True)
    feeder.start()
    PPOLearner(cfg, tmp_path / "run").run()
    feeder.join(timeout=60)
    assert not errors, errors  # the joiner received v0 while the learner waited for data


def test_fleet_counts_beats_and_hands_out_fresh_ids(redis_client, run_id) -> None:
    fleet.beat(redis_client, run_id, "server-0")
    fleet.beat(redis_client, run_id, "server-3")
    assert fleet.members(redis_client, run_id) == ["server-0", "server-3"]
    old = fleet._now_ms(redis_client) - int(fleet.LIVE_S * 1000) - 1
    redis_client.zadd(fleet.fleet_key(run_id), {"server-3": old})  # its last beat is too old: gone
    assert fleet.members(redis_client, run_id) == ["server-0"]
    fleet.leave(redis_client, run_id, "server-0")
    assert fleet.members(redis_client, run_id) == []
    assert fleet.seen(redis_client, run_id) == ["server-0", "server-3"]
    assert fleet.allocate_ids(redis_client, run_id, 2, first=2) == [2, 3]
    assert fleet.allocate_ids(redis_client, run_id, 1, first=2) == [4]  # never reused


def test_a_leaving_server_hands_back_its_prompts_at_once(redis_client, run_id) -> None:
    """Handed back, a held prompt goes to the next server's claim now, not after claim_idle_ms (60 s)."""
    leaving = ReplayBuffer(redis_client, run_id, consumer="server-5", claim_idle_ms=60_000)
    staying = ReplayBuffer(redis_client, run_id, consumer="server-0", claim_idle_ms=60_000)
    ids = leaving.put_prompts(
        [PromptRecord(prompt_id=f"p{i}", text="ab", tokens=np.array([5, 6])) for i in range(3)]
    )
    held = leaving.take_prompts(2, timeout_s=1.0)
    assert [p.id for p in held] == ids[:2]
    assert [p.id for p in staying.take_prompts(3, timeout_s=0.5)] == ids[2:]  # the held two are not free
    assert staying.take_prompts(3, timeout_s=0.5) == []
    assert leaving.return_prompts() == 2
    back = staying.take_prompts(3, timeout_s=2.0)
    assert [p.id for p in back] == ids[:2] and all(p.redelivered for p in back)  # with their admission


def test_attach_refuses_what_it_cannot_join(redis_server, redis_client, run_id, tiny_ckpt, tmp_path, capsys):
    import launch
    from launcher.attach import attach as attach_run
    from tandem.config import dump_config
    from tandem.telemetry import ready_key, stop_key

    cfg = make_cfg(run_id, tiny_ckpt["actor"])
    assert launch.main(["--servers", "+2"]) == 2
    assert "--attach RUN_DIR and --servers +K go together" in capsys.readouterr().err
    assert launch.main(["--attach", str(tmp_path), "--servers", "+2"]) == 2  # no config.yaml there
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    assert launch.main(["--attach", str(tmp_path), "--servers", "+0"]) == 2
    assert "--servers: want +K with K >= 1" in capsys.readouterr().err

    dead = cfg.model_copy(update={"redis": cfg.redis.model_copy(update={"url": "redis://:pw@127.0.0.1:1/0"})})
    # attach rides out a Redis restart for supervision.reconnect_s before calling the run gone: 1 s here
    dead = dead.model_copy(update={"supervision": dead.supervision.model_copy(update={"reconnect_s": 1.0})})
    (tmp_path / "config.yaml").write_text(dump_config(dead))
    assert attach_run(tmp_path, 1) == 1
    out = capsys.readouterr().out
    assert "does not answer" in out and "pw" not in out  # the password is never printed

    live = cfg.model_copy(update={"redis": cfg.redis.model_copy(update={"url": redis_server.url})})
    (tmp_path / "config.yaml").write_text(dump_config(live))
    assert attach_run(tmp_path, 1) == 1
    assert "has no ready learner" in capsys.readouterr().out
    redis_client.set(ready_key(run_id, "learner"), "{}")
    redis_client.set(stop_key(run_id), 1)
    assert attach_run(tmp_path, 1) == 1
    assert "is stopping" in capsys.readouterr().out
    assert not (tmp_path / "logs").exists()  # no server was started


def child_pids(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.mark.slow
@pytest.mark.faults  # a joined server is killed with SIGKILL (make test-faults)
@pytest.mark.timeout(1200)
def test_servers_join_and_leave_a_running_run(tiny_ckpt, prompts, tmp_path: Path) -> None:
    """One launched server; two join with ``--attach`` (dist weights: each starts at the current version);
    one of them is killed with SIGKILL (restarted), then both leave gracefully (SIGTERM to the attach).
    The run goes on, stops when asked, and every prompt fed is accounted for."""
    cmd = launch_cmd(
        tiny_ckpt, prompts, tmp_path, "learner.total_steps=100000", "supervision.server_restarts=3",
        "weightsync.transport=dist", "weightsync.timeout_s=20", "learner.checkpoint_interval=20",
    )  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    joiner = None
    try:
        deadline = time.monotonic() + 900  # a loaded 2-core host has taken minutes to start the learner
        run_dir, client = attach(proc, tmp_path, deadline)
        run = run_dir.name

        def version() -> int:
            return int(client.get(f"{run}:version") or 0)

        def wait(cond, what: str) -> None:
            while not cond():
                assert time.monotonic() < deadline and proc.poll() is None, f"run ended or timed out: {what}"
                if joiner is not None and joiner.poll() not in (None, 0):
                    raise AssertionError(f"launch.py --attach failed: {joiner.stdout.read()[-3000:]}")
                time.sleep(0.1)

        wait(lambda: version() >= 3, "learner at v3")
        joined_at = version()
        joiner = subprocess.Popen(
            [sys.executable, str(ROOT / "launch.py"), "--attach", str(run_dir), "--servers", "+2"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        wait(lambda: fleet.members(client, run) == ["server-0", "server-1", "server-2"], "a fleet of 3")
        logs = {s: run_dir / "logs" / f"server-{s}.log" for s in (1, 2)}
        started = {}
        for s, path in logs.items():
            wait(
                lambda path=path: "rollout loop started at weights v" in path.read_text(), f"server-{s} loop"
            )
            started[s] = int(path.read_text().split("rollout loop started at weights v")[1].split()[0])
        assert all(v >= joined_at for v in started.values()), (joined_at, started)  # current, not v0

        before = version()
        wait(lambda: version() >= before + 3, "steps with three servers")
        pid = json.loads(client.get(f"{run}:ready:server-1"))["pid"]
        assert pid in child_pids(joiner.pid)
        os.kill(pid, signal.SIGKILL)  # a crash: the attach restarts it
        wait(lambda: logs[1].read_text().count("=== ") >= 2, "server-1 restarted")
        wait(lambda: "rollout loop started" in logs[1].read_text().split("=== ")[-1], "server-1 back")
        before = version()
        wait(lambda: version() >= before + 3, "steps after the restart")

        joiner.send_signal(signal.SIGTERM)  # both attached servers leave gracefully
        joiner_out, _ = joiner.communicate(timeout=120)
        assert joiner.returncode == 0, joiner_out[-3000:]
        assert "left the run" in joiner_out
        wait(lambda: fleet.members(client, run) == ["server-0"], "the fleet back to 1")
        before = version()
        wait(lambda: version() >= before + 3, "steps after they left")
        client.set(f"{run}:stop", 1)
        out, _ = proc.communicate(timeout=240)
    finally:
        for p in (joiner, proc):
            if p is not None and p.poll() is None:
                p.kill()
    assert proc.returncode == 0, out[-4000:]
    assert "learner finished" in out
    assert "[launch] fleet (servers):" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    sizes = [c["servers"] for c in summary["fleet"]]
    # 1, then 3 (with a dip while server-1 restarts), then 1 again (0 at the very end: shutdown)
    assert sizes[0] == 1 and 3 in sizes and 1 in sizes[sizes.index(3) :], summary["fleet"]
    for s in (1, 2):
        assert history_path(run_dir, f"server-{s}").exists()
    left = logs[2].read_text()  # a server that hung while leaving ends with its threads' stacks
    assert "handed back" in left or "stopped after" in left, left[-6000:]
    assert leftover_processes(run_dir) == []

    trained = {}
    for line in (run_dir / "trained.jsonl").read_text().splitlines():
        row = json.loads(line)
        trained[row["version"]] = row["ids"]
    flat = [i for ids in trained.values() for i in ids]
    assert len(flat) == len(set(flat))  # none trained twice
    server, client, run = inspect_redis(run_dir)
    try:
        left = client.xlen(f"{run}:prompts")
        feeder = client.hgetall(f"{run}:feeder")
        fed = int(feeder[b"epoch"]) * 200 + int(feeder[b"index"])
        counts = {k.decode(): int(v) for k, v in client.hgetall(f"{run}:counts").items()}
        refused = counts.get(f"{run}:traj:stale", 0) + counts.get(f"{run}:traj:dead", 0)
        in_stream = client.xlen(f"{run}:traj")
        # No prompt lost: each one fed is still queued or was answered by one group of 4 trajectories,
        # each trained on, refused (counted), or still in the stream.
        assert (fed - left) * 4 == len(flat) + refused + in_stream
    finally:
        client.close()
        server.stop()
