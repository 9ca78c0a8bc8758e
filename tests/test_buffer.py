"""The replay buffer against a real redis-server: delivery, crashes, dead letters, the staleness screen.

Admission itself is tests/test_admission.py's."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import redis

from buffer.admission import Admission
from buffer.redis_server import EmbeddedRedis
from buffer.schema import PromptRecord, Trajectory, encode_trajectory
from buffer.streams import ReplayBuffer


def traj(i: int, *, version: int = 0, group: str = "g", n: int = 3) -> Trajectory:
    return Trajectory(
        traj_id=f"t{i}",
        group_id=group,
        prompt_id=f"p{i}",
        prompt_tokens=np.arange(4),
        response_tokens=np.arange(n) + i,
        behav_logp=-np.linspace(0.1, 1.0, n),
        token_versions=np.full(n, version),
        reward=float(i),
        reward_parts={"answer": float(i)},
        server_id="s0",
        meta={"i": i},
    )


def buffer(client: redis.Redis, run: str, consumer: str = "c0", **kwargs: object) -> ReplayBuffer:
    kwargs = {"claim_idle_ms": 60_000, "put_timeout_s": 5.0, **kwargs}
    return ReplayBuffer(client, run, consumer=consumer, **kwargs)


# ---------------------------------------------------------------------------------------- basic delivery


def test_put_take_ack_round_trip(redis_client: redis.Redis, run_id: str):
    buf = buffer(redis_client, run_id)
    sent = [traj(i, version=2) for i in range(5)]
    ids = buf.put(sent)
    assert len(ids) == 5 and all(isinstance(i, str) for i in ids)
    taken = buf.take(5, timeout_s=2)
    assert [t.id for t in taken] == ids
    for got, want in zip((t.traj for t in taken), sent, strict=True):
        assert (got.traj_id, got.reward, got.reward_parts, got.meta) == (
            want.traj_id,
            want.reward,
            want.reward_parts,
            want.meta,
        )
        np.testing.assert_array_equal(got.behav_logp, want.behav_logp)
        np.testing.assert_array_equal(got.token_versions, want.token_versions)
    assert not any(t.redelivered for t in taken)
    assert buf.trajectories_pending() == 5  # taken, not yet acked
    buf.ack(ids[:3])
    buf.ack(ids[:3])  # idempotent
    assert buf.trajectories_pending() == 2
    buf.ack(ids[3:])
    assert buf.trajectories_pending() == 0
    assert buf.take(1, timeout_s=0) == []


def test_take_returns_fewer_only_after_the_timeout(redis_client: redis.Redis, run_id: str):
    buf = buffer(redis_client, run_id)
    buf.put([traj(0), traj(1)])
    start = time.monotonic()
    assert len(buf.take(5, timeout_s=0.4)) == 2
    assert time.monotonic() - start >= 0.39


def test_take_waits_for_entries_that_arrive_while_blocked(redis_client: redis.Redis, run_id: str):
    buf = buffer(redis_client, run_id)
    later = threading.Timer(0.3, lambda: buffer(redis_client, run_id, "producer").put([traj(1), traj(2)]))
    later.start()
    start = time.monotonic()
    got = buf.take(2, timeout_s=10)
    later.join()
    assert [t.traj.traj_id for t in got] == ["t1", "t2"]
    assert time.monotonic() - start < 5


def test_concurrent_groups_stay_contiguous(redis_client: redis.Redis, run_id: str):
    def produce(name: str) -> None:
        buf = buffer(redis_client, run_id, name)
        for g in range(10):
            buf.put([traj(i, group=f"{name}-{g}") for i in range(8)])

    threads = [threading.Thread(target=produce, args=(f"s{k}",)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    groups = [t.traj.group_id for t in buffer(redis_client, run_id).take(240, timeout_s=5)]
    assert len(groups) == 240
    runs = [g for k, g in enumerate(groups) if k == 0 or groups[k - 1] != g]
    assert len(runs) == len(set(runs)) == 30  # each group is one unbroken run of 8


def test_refuses_a_decoding_client(redis_server: EmbeddedRedis, run_id: str):
    with pytest.raises(ValueError, match="decode_responses=False"):
        buffer(redis_server.client(decode_responses=True), run_id)


def test_from_config_uses_the_redis_section(redis_client: redis.Redis):
    from tandem.config import Config  # here, so spawned test workers need not import pydantic

    cfg = Config.model_validate(
        {
            "run": {"name": "cfgrun"},
            "model": {"actor": "a"},
            "data": {"prompts": "p.jsonl"},
            "reward": {"functions": [{"path": "m:f"}]},
            "redis": {
                "stream_maxlen": 64,
                "claim_idle_ms": 500,
                "put_timeout_s": 2.5,
                "max_traj_bytes": 4096,
            },
        }
    )
    buf = ReplayBuffer.from_config(redis_client, cfg, "learner-0")
    assert (buf.run, buf.consumer, buf.maxlen, buf.put_timeout_s, buf.max_traj_bytes) == (
        "cfgrun",
        "learner-0",
        64,
        2.5,
        4096,
    )


# ------------------------------------------------------------------------------- many producers/consumers


def _produce(url: str, run: str, name: str, start: int, count: int) -> None:
    buf = ReplayBuffer(redis.Redis.from_url(url), run, consumer=name, maxlen=2_000, put_timeout_s=60)
    for lo in range(start, start + count, 50):
        buf.put([traj(i, n=2) for i in range(lo, min(lo + 50, start + count))])


def _consume(url: str, run: str, name: str, total: int) -> None:
    """Take and ack until the run's counter of consumed trajectories reaches total; record traj ids."""
    client = redis.Redis.from_url(url)
    buf = ReplayBuffer(client, run, consumer=name)
    deadline = time.monotonic() + 120
    while int(client.get(f"{run}:test:consumed") or 0) < total and time.monotonic() < deadline:
        taken = buf.take(64, timeout_s=0.2)
        if taken:
            client.rpush(f"{run}:test:seen", *[t.traj.traj_id for t in taken])
            buf.ack([t.id for t in taken])
            client.incrby(f"{run}:test:consumed", len(taken))


def test_three_producers_two_consumers_none_lost_none_duplicated(redis_server: EmbeddedRedis, run_id: str):
    total, ctx = 10_000, mp.get_context("spawn")
    shares = [(0, 3334), (3334, 3333), (6667, 3333)]
    procs = [ctx.Process(target=_consume, args=(redis_server.url, run_id, f"c{k}", total)) for k in range(2)]
    procs += [
        ctx.Process(target=_produce, args=(redis_server.url, run_id, f"p{k}", lo, n))
        for k, (lo, n) in enumerate(shares)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    client = redis_server.client()
    seen = [s.decode() for s in client.lrange(f"{run_id}:test:seen", 0, -1)]
    assert len(seen) == total
    assert set(seen) == {f"t{i}" for i in range(total)}
    assert buffer(client, run_id).trajectories_pending() == 0


# ---------------------------------------------------------------------------------------------- crashes


def _take_and_hang(url: str, run: str, n: int) -> None:
    client = redis.Redis.from_url(url)
    taken = ReplayBuffer(client, run, consumer="doomed").take(n, timeout_s=30)
    client.rpush(f"{run}:test:taken", *[t.id for t in taken])
    time.sleep(60)  # killed here, never acking


def test_entries_of_a_killed_consumer_are_claimed_by_another(redis_server: EmbeddedRedis, run_id: str):
    client = redis_server.client()
    buffer(client, run_id, "producer").put([traj(i) for i in range(5)])
    doomed = mp.get_context("spawn").Process(target=_take_and_hang, args=(redis_server.url, run_id, 3))
    doomed.start()
    try:
        got = client.blpop([f"{run_id}:test:taken"], timeout=60)
        assert got is not None, "the doomed consumer never took its entries"
        time.sleep(0.1)
    finally:
        os.kill(doomed.pid, signal.SIGKILL)
        doomed.join(timeout=10)
    held = [got[1].decode(), *(i.decode() for i in client.lrange(f"{run_id}:test:taken", 0, -1))]
    survivor = buffer(client, run_id, "survivor", claim_idle_ms=200)
    taken = survivor.take(5, timeout_s=10)
    assert sorted(t.id for t in taken if t.redelivered) == sorted(held)
    assert len(taken) == 5 and len({t.id for t in taken}) == 5
    survivor.ack([t.id for t in taken])
    assert survivor.metrics()["buffer/pending"] == 0


def test_live_consumers_entries_are_not_claimed_early(redis_client: redis.Redis, run_id: str):
    buffer(redis_client, run_id, "p").put([traj(i) for i in range(4)])
    assert len(buffer(redis_client, run_id, "a", claim_idle_ms=30_000).take(2, timeout_s=1)) == 2
    got = buffer(redis_client, run_id, "b", claim_idle_ms=30_000).take(4, timeout_s=0.3)
    assert [t.traj.traj_id for t in got] == ["t2", "t3"]


def test_restarted_consumer_gets_its_own_pending_first(redis_client: redis.Redis, run_id: str):
    first_life = buffer(redis_client, run_id, "learner-0")
    first_life.put([traj(i) for i in range(3)])
    held = first_life.take(3, timeout_s=1)
    first_life.put([traj(i) for i in range(3, 5)])
    second_life = buffer(redis_client, run_id, "learner-0")
    taken = second_life.take(5, timeout_s=2)
    assert [t.traj.traj_id for t in taken] == ["t0", "t1", "t2", "t3", "t4"]
    assert [t.redelivered for t in taken] == [True] * 3 + [False] * 2
    assert [t.id for t in taken[:3]] == [t.id for t in held]
    assert second_life.take(5, timeout_s=0) == []  # handed out once per life, not again


def test_unacked_entries_survive_a_redis_crash(tmp_path: Path):
    server = EmbeddedRedis(tmp_path).start()
    try:
        buf = buffer(server.client(), "crash", "learner-0")
        buf.put([traj(i) for i in range(6)])
        taken = buf.take(4, timeout_s=1)
        buf.ack([t.id for t in taken[:2]])
        server.wait_aof_written()  # a slow disk can postpone the write; that loss is another test's (§6.6)
        server.kill()  # SIGKILL: only what the AOF holds survives
        server.start()
        buf = buffer(server.client(), "crash", "learner-0")
        assert buf.trajectories_pending() == 4
        again = buf.take(4, timeout_s=1)
        assert [t.traj.traj_id for t in again] == ["t2", "t3", "t4", "t5"]
        assert [t.redelivered for t in again] == [True, True, False, False]
    finally:
        server.stop()


# ------------------------------------------------------------------------------------------ dead letters


def _raw_variant(kind: str) -> bytes:
    d = msgpack.unpackb(encode_trajectory(traj(99)))
    if kind == "wrong dtype":
        d["behav_logp"][0] = "<f8"
    elif kind == "mismatched lengths":
        d["token_versions"] = ["<i4", [2], np.zeros(2, np.int32).tobytes()]
    elif kind == "oversize":
        big = np.zeros(4096, np.int32)
        d["prompt_tokens"] = ["<i4", [len(big)], big.tobytes()]
    return msgpack.packb(d, use_bin_type=True)


def test_malformed_entries_are_dead_lettered_while_valid_ones_flow(redis_client: redis.Redis, run_id: str):
    buf = buffer(redis_client, run_id, max_traj_bytes=8192)
    key = f"{run_id}:traj"
    buf.put([traj(0)])
    redis_client.xadd(key, {"d": b"\x00\xffnot msgpack"})
    wrong_dtype = _raw_variant("wrong dtype")
    redis_client.xadd(key, {"d": wrong_dtype})
    buf.put([traj(1)])
    redis_client.xadd(key, {"d": _raw_variant("mismatched lengths")})
    redis_client.xadd(key, {"d": _raw_variant("oversize")})
    redis_client.xadd(key, {"junk": b"1", "more": b"2"})
    buf.put([traj(2)])
    taken = buf.take(3, timeout_s=2)
    assert [t.traj.traj_id for t in taken] == ["t0", "t1", "t2"]
    dead = redis_client.xrange(f"{key}:dead")
    reasons = [f[b"reason"].decode() for _, f in dead]
    assert len(reasons) == 5
    assert reasons[0].startswith("trajectory: not valid msgpack")
    assert reasons[1].startswith("behav_logp: dtype '<f8'")
    assert reasons[2].startswith("token_versions: length 2 != len(response_tokens) 3")
    assert reasons[3].startswith("entry: ") and "exceeds the limit of 8192" in reasons[3]
    assert reasons[4].startswith("entry: no b'd' field")
    assert dead[1][1][b"data"] == wrong_dtype  # kept for inspection
    m = buf.metrics()
    assert m["buffer/dead"] == 5
    assert m["buffer/pending"] == 3  # the dead ones were acknowledged; only the valid taken are pending
    buf.ack([t.id for t in taken])
    assert buf.trajectories_pending() == 0


def test_pending_entry_deleted_behind_our_back_is_cleared(redis_client: redis.Redis, run_id: str):
    """A foreign XDEL of a pending entry must not leave it in the pending list forever."""
    buffer(redis_client, run_id, "p").put([traj(0), traj(1)])
    (held,) = buffer(redis_client, run_id, "dead", claim_idle_ms=100).take(1, timeout_s=1)
    redis_client.xdel(f"{run_id}:traj", held.id)
    time.sleep(0.15)
    survivor = buffer(redis_client, run_id, "survivor", claim_idle_ms=100)
    assert [t.traj.traj_id for t in survivor.take(1, timeout_s=2)] == ["t1"]
    survivor.take(1, timeout_s=0.3)
    m = survivor.metrics()
    assert (m["buffer/pending"], m["buffer/dead"]) == (1, 1)  # t1 still held; the deleted one cleared
    (dead,) = redis_client.xrange(f"{run_id}:traj:dead")
    assert dead[1][b"id"].decode() == held.id and b"deleted" in dead[1][b"reason"]


def test_malformed_prompts_are_dead_lettered(redis_client: redis.Redis, run_id: str):
    buf = buffer(redis_client, run_id)
    redis_client.xadd(f"{run_id}:prompts", {"d": b"garbage"})
    buf.put_prompts([PromptRecord("p1", "hi", [1, 2])])
    assert [t.prompt.prompt_id for t in buf.take_prompts(2, timeout_s=0.3)] == ["p1"]
    assert buf.metrics()["buffer/prompts_dead"] == 1


def test_put_refuses_an_oversize_trajectory(redis_client: redis.Redis, run_id: str):
    buf = buffer(redis_client, run_id, max_traj_bytes=1024)
    with pytest.raises(ValueError, match=r"trajectory t0: \d+ bytes exceeds max_traj_bytes 1024"):
        buf.put([traj(0, n=500)])
    assert buf.trajectories_pending() == 0


# -------------------------------------------------------------------------------------------- staleness


def test_stale_entries_are_moved_and_counted(redis_client: redis.Redis, run_id: str):
    buf = buffer(redis_client, run_id)
    admission = Admission(redis_client, run_id, consumer="c0", batch_size=4, max_staleness=2, n_samples=1)
    admission.set_version(5)
    buf.put([traj(v, version=v) for v in (5, 4, 2, 3)])  # staleness 0, 1, 3, 2
    taken = buf.take(3, timeout_s=2, admission=admission)
    assert [t.traj.traj_id for t in taken] == ["t5", "t4", "t3"]
    stale = redis_client.xrange(f"{run_id}:traj:stale")
    assert [f[b"reason"] for _, f in stale] == [b"staleness 3 > max_staleness 2 at version 5"]
    m = buf.metrics()
    assert (m["buffer/stale_rejected"], m["buffer/dead"], m["buffer/pending"]) == (1, 0, 3)
    assert (m["staleness/mean"], m["staleness/max"], m["staleness/count"]) == (1.0, 2.0, 3.0)
    assert (m["staleness/hist_0"], m["staleness/hist_1"], m["staleness/hist_2"]) == (1, 1, 1)
    assert buf.metrics()["staleness/count"] == 0  # a window per metrics() call


def test_metrics_are_namespaced_numbers(redis_client: redis.Redis, run_id: str):
    buf = buffer(redis_client, run_id)
    buf.put([traj(i) for i in range(4)])
    buf.take(4, timeout_s=1)
    m = buf.metrics()
    assert all(k.split("/")[0] in ("buffer", "staleness") and isinstance(v, float) for k, v in m.items())
    assert m["buffer/put_per_s"] > 0 and m["buffer/take_per_s"] > 0
    assert (m["buffer/length"], m["buffer/undelivered"]) == (4, 0)


# ------------------------------------------------------------------------------------- capacity and trim


def test_full_stream_blocks_put_until_consumed(redis_client: redis.Redis, run_id: str):
    buf = buffer(redis_client, run_id, maxlen=16, put_timeout_s=10)
    buf.put([traj(i) for i in range(12)])
    done = threading.Event()
    blocked = threading.Thread(
        target=lambda: (
            buffer(redis_client, run_id, "p2", maxlen=16).put([traj(i) for i in range(12, 20)]),
            done.set(),
        )
    )
    blocked.start()
    assert not done.wait(0.5)  # 12 + 8 > 16: waits rather than trimming
    assert buf.trajectories_pending() == 12
    buf.ack([t.id for t in buf.take(4, timeout_s=1)])
    assert done.wait(10)
    blocked.join(timeout=10)
    assert [t.traj.traj_id for t in buf.take(16, timeout_s=1)] == [f"t{i}" for i in range(4, 20)]


def test_put_times_out_with_a_clear_error(redis_client: redis.Redis, run_id: str):
    buf = buffer(redis_client, run_id, maxlen=16, put_timeout_s=0.3)
    buf.put([traj(i) for i in range(16)])
    with pytest.raises(TimeoutError, match=f"{run_id}:traj stayed full \\(16 unconsumed of maxlen 16\\)"):
        buf.put([traj(16)])
    with pytest.raises(ValueError, match="can never fit"):
        buf.put([traj(i) for i in range(17)])


def test_trim_drops_only_what_is_no_longer_needed(redis_client: redis.Redis, run_id: str):
    buf = buffer(redis_client, run_id)
    buf.put([traj(i) for i in range(10)])
    taken = buf.take(6, timeout_s=1)
    # Acknowledged elsewhere without deleting (XACK alone), as a plain Redis client would.
    redis_client.xack(f"{run_id}:traj", "learner", *[t.id for t in taken[:3]])
    assert buf.trim() == 3
    assert buf.trim() == 0
    assert buf.metrics()["buffer/pending"] == 3
    assert [t.traj.traj_id for t in buf.take(10, timeout_s=0.2)] == [f"t{i}" for i in range(6, 10)]


# ---------------------------------------------------------------------------------------------- prompts


def test_prompt_acknowledged_atomically_with_its_trajectories(redis_client: redis.Redis, run_id: str):
    launcher = buffer(redis_client, run_id, "launch")
    launcher.put_prompts([PromptRecord(f"p{i}", f"q{i}", [1, i + 1]) for i in range(3)])
    assert launcher.prompts_pending() == 3
    server = buffer(redis_client, run_id, "server-0")
    prompts = server.take_prompts(2, timeout_s=1)
    assert [p.prompt.prompt_id for p in prompts] == ["p0", "p1"]
    assert launcher.prompts_pending() == 3  # taken is not done
    server.put([traj(0), traj(1)], ack_prompts=[prompts[0].id])
    assert launcher.prompts_pending() == 2
    server.ack_prompts([prompts[1].id])
    assert launcher.prompts_pending() == 1
    assert buffer(redis_client, run_id, "learner").take(2, timeout_s=1)[1].traj.traj_id == "t1"


def test_unacked_prompt_goes_to_another_server(redis_client: redis.Redis, run_id: str):
    buffer(redis_client, run_id, "launch").put_prompts([PromptRecord("p0", "q", [1])])
    assert len(buffer(redis_client, run_id, "dead-server", claim_idle_ms=100).take_prompts(1, 1)) == 1
    time.sleep(0.15)
    again = buffer(redis_client, run_id, "server-1", claim_idle_ms=100).take_prompts(1, timeout_s=5)
    assert [(p.prompt.prompt_id, p.redelivered) for p in again] == [("p0", True)]


def test_a_slow_server_keeps_its_claim_and_a_duplicate_answer_is_refused(
    redis_client: redis.Redis, run_id: str
):
    """A generation outlasting claim_idle_ms: the heartbeat keeps the prompt its own; without it, another
    server claims and answers it, and the first answer to arrive wins; the other is refused whole."""
    buffer(redis_client, run_id, "launch").put_prompts(
        [PromptRecord("p0", "q", [1]), PromptRecord("p1", "q", [1])]
    )
    slow = buffer(redis_client, run_id, "slow", claim_idle_ms=200)
    held = slow.take_prompts(2, timeout_s=1)
    other = buffer(redis_client, run_id, "other", claim_idle_ms=200)
    for _ in range(4):  # 0.6 s of generation, three times claim_idle_ms, with a heartbeat on p0 only
        time.sleep(0.15)
        slow.keep_prompts([held[0].id])
    stolen = other.take_prompts(2, timeout_s=0.5)
    assert [p.prompt.prompt_id for p in stolen] == ["p1"]  # p0 kept its claim; p1 looked abandoned

    learner = buffer(redis_client, run_id, "learner")
    assert other.put([traj(10), traj(11)], ack_prompts=[stolen[0].id])  # the claimer answers p1 first
    assert slow.put([traj(20), traj(21)], ack_prompts=[held[1].id]) == []  # the late answer is refused
    assert slow.put([traj(0), traj(1)], ack_prompts=[held[0].id])
    got = sorted(t.traj.traj_id for t in learner.take(10, timeout_s=0.5))
    assert got == ["t0", "t1", "t10", "t11"]  # one group per prompt
    assert slow.prompts_pending() == 0


def test_reclaim_takes_only_redelivered_prompts(redis_client: redis.Redis, run_id: str):
    """What a server without admission may take: its own prompts from an earlier life and prompts idle on a
    dead server, which carry admission already; never a new prompt, which needs admission of its own."""
    buffer(redis_client, run_id, "launch").put_prompts([PromptRecord(f"p{i}", "q", [1]) for i in range(6)])
    assert len(buffer(redis_client, run_id, "server-0").take_prompts(2, timeout_s=1)) == 2  # then killed
    assert len(buffer(redis_client, run_id, "server-1").take_prompts(2, timeout_s=1)) == 2  # then killed
    restarted = buffer(redis_client, run_id, "server-0", claim_idle_ms=100)
    assert [(p.prompt.prompt_id, p.redelivered) for p in restarted.reclaim_prompts(4)] == [
        ("p0", True),
        ("p1", True),
    ]  # server-1's claim is still young: not taken
    time.sleep(0.15)
    got = restarted.reclaim_prompts(4)
    assert [(p.prompt.prompt_id, p.redelivered) for p in got] == [("p2", True), ("p3", True)]
    assert restarted.reclaim_prompts(4) == []  # p4 and p5 are new
    assert [p.prompt.prompt_id for p in restarted.take_prompts(4, timeout_s=0.2)] == ["p4", "p5"]


def test_put_groups_appends_each_group_atomically_in_one_call(redis_client: redis.Redis, run_id: str):
    """A server's groups go in one pipeline: each stays contiguous, a group whose prompt was answered is
    refused alone, and a group with no room yet waits for the learner to make room."""
    buffer(redis_client, run_id, "launch").put_prompts([PromptRecord(f"p{i}", "q", [1]) for i in range(4)])
    server = buffer(redis_client, run_id, "s0", maxlen=4)
    held = server.take_prompts(4, timeout_s=1)
    server.ack_prompts([held[1].id])  # p1 answered elsewhere meanwhile
    learner = buffer(redis_client, run_id, "learner")
    drained: list[str] = []

    def drain() -> None:  # room for the fourth group only once the learner takes the first
        time.sleep(0.3)
        got = learner.take(2, timeout_s=5)
        drained.extend(t.traj.traj_id for t in got)
        learner.ack([t.id for t in got])

    t = threading.Thread(target=drain)
    t.start()
    groups = [[traj(10 * g + i, group=f"g{g}") for i in range(2)] for g in range(4)]
    start = time.monotonic()
    got = server.put_groups([(group, p.id) for group, p in zip(groups, held, strict=True)])
    assert time.monotonic() - start >= 0.3  # the fourth group waited for room
    t.join(timeout=10)
    assert [len(ids) for ids in got] == [2, 0, 2, 2]
    assert drained == ["t0", "t1"]
    rest = [x.traj.traj_id for x in learner.take(10, timeout_s=0.5)]
    assert rest == ["t20", "t21", "t30", "t31"]  # each group contiguous, in order
    assert server.prompts_pending() == 0
