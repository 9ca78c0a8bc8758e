"""Acked ranges (learner/acked_ranges.py) against a naive set-based reference, and the lineage re-ack end to end.

The naive reference works on a finite universe of stream ids: the ranges must cover every member, no
barrier, and be exactly the maximal runs of members between barriers. The end-to-end test drops every ack
the learner ever made by restoring an older Redis (its AOF copied before training) and audits that a
resumed learner trains none of those trajectories again.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest

from buffer.redis_server import EmbeddedRedis
from buffer.streams import ReplayBuffer
from learner import acked_ranges as ar
from learner.ppo import PPOLearner
from tandem.config import load_config
from tests.test_learner import group, lineage, raw_config


def naive(members: set, barriers: set) -> list:
    """Maximal runs of members in the sorted sequence of members and barriers, as (first, last)."""
    out, run = [], []
    for p in sorted(members | barriers):
        if p in barriers:
            if run:
                out.append((run[0], run[-1]))
            run = []
        else:
            run.append(p)
    if run:
        out.append((run[0], run[-1]))
    return out


def universe(rng: random.Random) -> list:
    """Ids as Redis makes them: a few per millisecond, milliseconds with gaps."""
    ms, ids = 1_700_000_000_000, []
    for _ in range(rng.randint(1, 40)):
        ms += rng.randint(1, 3)
        ids += [(ms, s) for s in range(rng.randint(1, 4))]
    return ids


@pytest.mark.parametrize("seed", range(200))
def test_merge_matches_the_naive_reference(seed: int) -> None:
    rng = random.Random(seed)
    points = universe(rng)
    old_members = {p for p in points if rng.random() < 0.4}
    old_barriers = {p for p in points if p not in old_members and rng.random() < 0.2}
    old = ar.merge([], old_members, old_barriers)
    assert old == naive(old_members, old_barriers)

    # A later checkpoint: new members, new barriers (entries still waiting then), never inside old ranges.
    covered_before = {p for p in points if ar.contains(old, p)}
    new_members = {p for p in points if p not in covered_before and rng.random() < 0.4}
    new_barriers = {p for p in points if p not in covered_before | new_members and rng.random() < 0.2}
    got = ar.merge(old, new_members, new_barriers)
    assert got == naive(covered_before | new_members, new_barriers)
    for p in covered_before | new_members:
        assert ar.contains(got, p)
    for p in new_barriers:
        assert not ar.contains(got, p)
    assert ar.from_json(json.loads(json.dumps(ar.to_json(got)))) == got


def test_merge_by_hand() -> None:
    a, b, c, d, e = (5, 0), (5, 1), (7, 0), (9, 3), (12, 0)
    assert ar.merge([], [a, b, c, e]) == [(a, e)]  # no barrier: one range across the gaps
    assert ar.merge([], [a, b, c, e], [d]) == [(a, c), (e, e)]
    assert ar.merge([(a, c)], [e], [b]) == [(a, e)]  # b is covered by a range: a member, no barrier
    assert ar.merge([(a, b), (c, c)], [], [(6, 0)]) == [(a, b), (c, c)]
    assert ar.to_json([(a, e)]) == [["5-0", "12-0"]]
    assert not ar.contains([(a, b), (e, e)], c) and ar.contains([(a, b), (e, e)], b)
    with pytest.raises(ValueError, match="not a stream id"):
        ar.parse("12")


def test_a_long_lineage_stays_compact() -> None:
    """1,000 checkpoints of 32 in-order ids, each taken with the next batch still waiting: one range."""
    ranges: list = []
    next_ms = 1
    for _ in range(1000):
        batch = [(next_ms + i // 8, i % 8) for i in range(32)]
        next_ms += 4
        waiting = [(next_ms, 0), (next_ms, 1)]  # undelivered, above every member
        ranges = ar.merge(ranges, batch, waiting)
    assert ranges == [((1, 0), (next_ms - 1, 7))]


# ----------------------------------------------------------------------------------- end to end


@pytest.mark.slow
@pytest.mark.faults
def test_acks_lost_from_older_checkpoints_are_replayed(tiny_ckpt, run_id, tmp_path) -> None:
    """Redis loses every ack of four checkpoints (an older AOF is restored); the resumed learner re-acks the
    lineage's ranges and trains only what is new. Re-acking just the latest checkpoint's ids (the old
    behaviour) would train the first three checkpoints' trajectories a second time."""
    data = tmp_path / "redis"
    redis = EmbeddedRedis(data).start()
    port, password = redis.port, redis.password
    try:
        raw = raw_config(
            tiny_ckpt, redis.url, run_id, tmp_path,
            learner={"total_steps": 4, "checkpoint_interval": 1, "save_hf_final": False},
        )  # fmt: skip
        cfg = load_config(None, raw=raw)
        client = redis.client()
        buffer = ReplayBuffer.from_config(client, cfg, "test-producer")
        first = [i for g in range(8) for i in buffer.put(group(g, 4))]
        client.close()
        redis.stop()  # a clean stop flushes the AOF: this copy holds the entries and no ack
        shutil.copytree(data, tmp_path / "snapshot")
        redis = EmbeddedRedis(data, port=port, password=password).start()

        PPOLearner(cfg, tmp_path / "run").run()
        assert sorted(i for ids in lineage(tmp_path / "run").values() for i in ids) == sorted(first)
        state = json.loads(
            (tmp_path / "run" / "checkpoints" / "state" / "v00000004" / "learner.json").read_text()
        )
        assert len(state["trained_ids"]) == 8  # the latest checkpoint alone names only its own step
        assert len(state["acked"]) == 1  # ...while its ranges cover all four

        redis.stop()
        shutil.rmtree(data)
        shutil.copytree(tmp_path / "snapshot", data)  # every ack is gone: the 32 entries are back
        redis = EmbeddedRedis(data, port=port, password=password).start()
        client = redis.client()
        buffer = ReplayBuffer.from_config(client, cfg, "test-producer")
        assert buffer.trajectories_pending() == len(first)
        fresh = [i for g in range(8, 10) for i in buffer.put(group(g, 4))]

        resumed = load_config(None, raw={**raw, "learner": {**raw["learner"], "total_steps": 5}})
        PPOLearner(resumed, tmp_path / "run", resume=True).run()
        trained = lineage(tmp_path / "run")
        assert sorted(trained) == [1, 2, 3, 4, 5]
        assert sorted(trained[5]) == sorted(fresh)
        flat = [i for v in sorted(trained) for i in trained[v]]
        assert len(flat) == len(set(flat))  # none twice
        assert buffer.trajectories_pending() == 0
        client.close()
    finally:
        redis.stop()
