"""Admission and the policy version: the staleness rules by hand, then the Redis side against a real server."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import redis

from buffer.admission import (
    Admission,
    admission_bound,
    freshness_floor,
    largest_group,
    recounted,
    stale_reason,
)
from buffer.schema import PromptRecord, Trajectory
from buffer.streams import ReplayBuffer
from tandem.config import load_config

ROOT = Path(__file__).resolve().parent.parent


def traj(i: int, *, version: int = 0) -> Trajectory:
    return Trajectory(
        traj_id=f"t{i}",
        group_id="g",
        prompt_id=f"p{i}",
        prompt_tokens=np.arange(4),
        response_tokens=np.arange(3),
        behav_logp=-np.linspace(0.1, 1.0, 3),
        token_versions=np.full(3, version),
        reward=0.0,
        reward_parts={},
        server_id="s0",
    )


def admission(
    client: redis.Redis,
    run: str,
    consumer: str = "c0",
    *,
    n: int = 3,
    batch_size: int = 16,
    max_staleness: int = 1,
) -> Admission:
    return Admission(
        client, run, consumer=consumer, batch_size=batch_size, max_staleness=max_staleness, n_samples=n
    )


# ------------------------------------------------------------------------------------ the rules by hand


def test_admission_bound_by_hand():
    # (v + s + 1) * B: at version 0 with staleness 1, two batches of 16; each version adds one batch.
    assert admission_bound(0, batch_size=16, max_staleness=1) == 32
    assert admission_bound(1, batch_size=16, max_staleness=1) == 48
    assert admission_bound(5, batch_size=4, max_staleness=0) == 24  # sync: one batch per version
    assert admission_bound(3, batch_size=8, max_staleness=2) == 48


def test_freshness_floor_by_hand():
    assert freshness_floor(5, max_staleness=2) == 3
    assert freshness_floor(5, max_staleness=0) == 5  # sync: the learner's own version
    assert freshness_floor(0, max_staleness=3) == -3  # any weights will do at the start


def test_take_time_screen_by_hand():
    assert stale_reason(2, 5, max_staleness=2) is None  # at the bound: still trained on
    assert stale_reason(3, 5, max_staleness=2) == "staleness 3 > max_staleness 2 at version 5"
    assert stale_reason(0, 0, max_staleness=0) is None
    assert stale_reason(1, 7, max_staleness=0) == "staleness 1 > max_staleness 0 at version 7"


def test_the_bound_and_the_screen_meet_at_max_staleness():
    """The last trajectory admitted at version v (generated with v's weights) is trained at v + s at the
    latest, batches of B in admission order: exactly as stale as the screen still accepts."""
    b, s = 4, 2
    for v in range(6):
        trained_at = (admission_bound(v, batch_size=b, max_staleness=s) - 1) // b
        assert trained_at == v + s
        assert stale_reason(trained_at - v, trained_at, max_staleness=s) is None
        assert stale_reason(trained_at - v + 1, trained_at, max_staleness=s) is not None


def test_largest_group_and_recount_by_hand():
    assert largest_group(batch_size=16, max_staleness=1) == 32
    assert largest_group(batch_size=4, max_staleness=0) == 4
    # 2 versions of 8 trained, 5 in the stream, 3 prompts claimed and 1 credit held, groups of 4.
    assert recounted(2, batch_size=8, n_samples=4, trajectories=5, claimed=3, credits=1) == 16 + 5 + 16
    # A live learner's 8 trained-but-unacked trajectories are in both the version and the stream.
    assert (
        recounted(2, batch_size=8, n_samples=4, trajectories=13, claimed=0, credits=0, trained_unacked=8)
        == 21
    )


def test_from_config_takes_the_sizes_once():
    cfg = load_config(ROOT / "configs/tiny.yaml", ["algorithm.max_staleness=2", "run.mode=sync"])
    a = Admission.from_config(redis.Redis(), cfg, "server-0")  # no command is sent
    assert (a.batch_size, a.max_staleness, a.n_samples) == (
        cfg.algorithm.batch_size,
        0,  # sync mode forces 0
        cfg.rollout.n_samples,
    )
    assert (a.run, a.consumer) == (cfg.run.name, "server-0")


# ------------------------------------------------------------------------------------------- the version


def test_version_defaults_to_zero_and_round_trips(redis_client: redis.Redis, run_id: str):
    a = admission(redis_client, run_id)
    assert a.version() == 0
    a.set_version(7)
    assert admission(redis_client, run_id, "other").version() == 7
    assert a.freshness_floor() == 6


# ------------------------------------------------------------------------------------------------ admit


def test_admission_never_exceeds_the_bound_under_concurrency(redis_client: redis.Redis, run_id: str):
    batch_size, max_staleness, n = 16, 1, 3
    bound = admission_bound(0, batch_size=batch_size, max_staleness=max_staleness)
    wins: list[int] = []

    def hammer() -> None:
        a = admission(redis_client, run_id)
        wins.append(sum(a.try_admit(1) for _ in range(20)))

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    admitted = int(redis_client.get(f"{run_id}:admitted"))
    assert admitted == sum(wins) * n == (bound // n) * n  # as many whole groups as fit, never more
    a = admission(redis_client, run_id)
    a.set_version(1)  # one learner step: one more batch of room
    more = sum(a.try_admit(1) for _ in range(20))
    assert more == (3 * batch_size - admitted) // n == 6  # bound 48, 30 already admitted
    with pytest.raises(ValueError, match="group of 33"):
        admission(redis_client, run_id, n=33).try_admit(1)


def test_try_admit_takes_as_many_whole_groups_as_fit_atomically(redis_client: redis.Redis, run_id: str):
    n, bound = 3, admission_bound(0, batch_size=16, max_staleness=1)  # 32: ten groups of 3 fit
    got: list[int] = []

    def hammer() -> None:
        a = admission(redis_client, run_id)
        got.extend(a.try_admit(4) for _ in range(5))

    threads = [threading.Thread(target=hammer) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert all(0 <= k <= 4 for k in got) and sum(got) == bound // n
    assert int(redis_client.get(f"{run_id}:admitted")) == (bound // n) * n
    a = admission(redis_client, run_id)
    a.set_version(1)  # bound 48, 30 admitted: six groups fit, though seven are asked for
    assert a.try_admit(7) == 6 and a.credits == 6
    assert a.wait(2, timeout_s=0.2) == 0
    a.set_version(2)
    assert a.wait(2, timeout_s=5) == 2 and a.credits == 8


def test_wait_wakes_on_a_new_version(redis_client: redis.Redis, run_id: str):
    a = admission(redis_client, run_id, n=4, batch_size=4, max_staleness=0)
    assert a.try_admit(1)
    timer = threading.Timer(0.3, lambda: admission(redis_client, run_id, "learner").set_version(1))
    timer.start()
    start = time.monotonic()
    assert a.wait(1, timeout_s=10)
    timer.join()
    assert 0.25 < time.monotonic() - start < 5


def test_wait_gives_up_on_timeout_or_stop(redis_client: redis.Redis, run_id: str):
    a = admission(redis_client, run_id, n=4, batch_size=4, max_staleness=0)
    assert a.try_admit(1)
    start = time.monotonic()
    assert not a.wait(1, timeout_s=0.3)
    assert 0.29 < time.monotonic() - start < 3
    start = time.monotonic()
    assert not a.wait(1, timeout_s=30, should_stop=lambda: True)
    assert time.monotonic() - start < 3
    a.refund(4)
    assert a.try_admit(1)


def test_top_up_waits_only_when_it_holds_nothing(redis_client: redis.Redis, run_id: str):
    a = admission(redis_client, run_id, n=2, batch_size=4, max_staleness=0)  # room for two groups
    assert a.top_up(3, timeout_s=5) == 2  # waited for the first, took what was free
    start = time.monotonic()
    assert a.top_up(3, timeout_s=30) == 2  # holds some: never waits
    assert time.monotonic() - start < 3
    a.spend(2)
    assert a.top_up(1, timeout_s=0.2) == 0  # holds none and the window is full: waited, in vain


def test_refused_trajectories_give_their_admission_back(redis_client: redis.Redis, run_id: str):
    """A stale trajectory used an admission slot but will never be trained on: the slot is returned."""
    a = admission(redis_client, run_id, n=4, batch_size=4, max_staleness=0)
    buf = ReplayBuffer(redis_client, run_id, consumer="learner-0")
    assert a.try_admit(1)
    assert not admission(redis_client, run_id, n=1, batch_size=4, max_staleness=0).try_admit(1)  # full
    a.set_version(2)
    buf.put([traj(v, version=v) for v in (2, 0, 0, 2)])  # two with staleness 2 > 0
    assert len(buf.take(2, timeout_s=2, admission=a)) == 2
    assert a.admitted() == 4 - 2


# ---------------------------------------------------------------------------------- credits and recount


def test_unspent_credits_are_kept_per_server_and_counted_by_recount(redis_client: redis.Redis, run_id: str):
    """Admission granted but not yet spent on prompts is recorded per server, atomically with the counter,
    so a killed server's next life can adopt it and a recount can include it."""
    kw = dict(n=2, batch_size=4, max_staleness=1)  # room for 8 trajectories: four groups of 2
    a, b = (
        admission(redis_client, run_id, "server-0", **kw),
        admission(redis_client, run_id, "server-1", **kw),
    )
    assert a.try_admit(3) == 3 and b.try_admit(3) == 1
    a.spend(1)
    next_life = admission(redis_client, run_id, "server-0", **kw)
    assert next_life.held_credits() == 2 and next_life.adopt() == 2 and next_life.credits == 2
    assert b.held_credits() == 1
    b.give_back()  # server-1 stops cleanly
    assert b.held_credits() == 0 == b.credits and a.admitted() == 6
    # 0 trained, nothing in the streams or pending: only server-0's 2 unspent groups of 2 remain admitted.
    assert a.recount(0, ReplayBuffer(redis_client, run_id, consumer="learner-0")) == 4


def test_recount_after_a_learner_restart(redis_client: redis.Redis, run_id: str):
    """Trained + still in the stream + claimed-but-unanswered groups; the crashed run's count is discarded."""
    buf = ReplayBuffer(redis_client, run_id, consumer="learner-0")
    redis_client.set(f"{run_id}:admitted", 400)  # what the crashed run had admitted, far ahead
    buf.put([traj(i) for i in range(5)])  # 5 trajectories waiting in the stream
    buf.put_prompts([PromptRecord(prompt_id=f"p{i}", text="x", tokens=[1, 2]) for i in range(4)])
    server = ReplayBuffer(redis_client, run_id, consumer="server-0")
    assert len(server.take_prompts(3, timeout_s=2)) == 3  # 3 groups in flight, 1 prompt still queued
    a = admission(redis_client, run_id, n=4, batch_size=8)
    assert a.recount(2, buf) == 2 * 8 + 5 + 3 * 4
    assert a.admitted() == 33
