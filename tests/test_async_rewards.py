"""Async and group-level reward functions (tandem/rewards.py): every call of a batch at once, each bounded by
``reward.timeout_s``; a call that hangs or raises costs only its own samples (scored 0, kept, counted).

The plug-ins below are real functions named by dotted path (``tests.test_async_rewards:...``), loaded the
way a config names them.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

import tandem.rewards
from tandem.config import RewardConfig
from tandem.config.rollout import RewardFunction
from tandem.rewards import RewardFunctions

HERE = "tests.test_async_rewards"
GROUP_CALLS: list[tuple[str, list[str], dict]] = []
_calls_lock = threading.Lock()


async def sleepy(prompt: str, completion: str, record: dict) -> float:
    """0.2 s of waiting (a remote verifier), then the completion's length."""
    await asyncio.sleep(0.2)
    return float(len(completion))


async def hangs_on_marker(prompt: str, completion: str, record: dict) -> float:
    if completion == "hang":
        await asyncio.sleep(60)
    if completion == "raise":
        raise RuntimeError("verifier down")
    return 1.0


def sync_hangs_on_marker(prompt: str, completion: str, record: dict) -> float:
    if completion == "hang":
        time.sleep(3)  # holds one worker thread this long; the batch does not wait for it
    return 2.0


async def blocks_the_loop(prompt: str, completion: str, record: dict) -> float:
    time.sleep(1.0)  # no await: nothing else on the loop can run meanwhile
    return 1.0


def lengths(prompt: str, completions: list[str], record: dict, *, scale: float = 1.0) -> list[float]:
    """A group function: each completion's length relative to the group's longest, times ``scale``."""
    with _calls_lock:
        GROUP_CALLS.append((prompt, list(completions), record))
    longest = max(len(c) for c in completions)
    return [scale * len(c) / longest for c in completions]


async def group_fails_on_prompt(prompt: str, completions: list[str], record: dict) -> list[float]:
    if prompt == "hang":
        await asyncio.sleep(60)
    if prompt == "raise":
        raise ValueError("judge said no")
    if prompt == "short":
        return [1.0]  # the wrong length: an error, the group scores 0
    return [1.0] * len(completions)


def exact(prompt: str, completion: str, record: dict) -> float:
    return float(completion == record["answer"])


def rewards(functions=(), group_functions=(), timeout_s: float = 0.5, clip=None) -> RewardFunctions:
    """Each plug-in's parts named after the function (the default would be this module's name)."""
    cfg = RewardConfig(
        functions=[RewardFunction(path=f"{HERE}:{p}", **{"name": p, **kw}) for p, kw in functions],
        group_functions=[
            RewardFunction(path=f"{HERE}:{p}", **{"name": p, **kw}) for p, kw in group_functions
        ],
        timeout_s=timeout_s,
        clip=clip,
    )
    return RewardFunctions(cfg)


def test_a_hanging_async_reward_costs_only_its_sample() -> None:
    rf = rewards([("hangs_on_marker", {}), ("exact", {"weight": 2.0})], timeout_s=0.3)
    start = time.perf_counter()
    scored = rf.score_groups([("p", ["a", "hang", "b"], {"answer": "a"}), ("q", ["c"], {"answer": "x"})])
    elapsed = time.perf_counter() - start
    assert elapsed < 0.3 + 1.0, elapsed  # about the timeout, never the 60 s
    (a, hang, b), (c,) = scored
    assert a == (1.0 + 2.0 * 1.0, {"hangs_on_marker": 1.0, "exact": 1.0})
    assert hang == (0.0, {"hangs_on_marker": 0.0, "exact": 0.0})  # kept, scored 0 by the hung part
    assert b == (1.0, {"hangs_on_marker": 1.0, "exact": 0.0})
    assert c[0] == 1.0
    assert rf.metrics() == {"reward/timeouts": 1.0, "reward/errors": 0.0}  # what the server logs
    rf.close()


def test_a_raising_async_reward_costs_only_its_sample_and_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rf = rewards([("hangs_on_marker", {"name": "verifier"})])
    with caplog.at_level(logging.WARNING, logger="tandem.rewards"):
        scored = rf.score_group("p", ["raise", "ok", "raise"], {})
        scored += rf.score_group("p", ["raise"], {})
    assert [total for total, _ in scored] == [0.0, 1.0, 0.0, 0.0]
    assert (rf.errors, rf.timeouts) == (3, 0)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "verifier" in warnings[0].getMessage()
    rf.close()


def test_async_rewards_of_a_batch_run_concurrently() -> None:
    n = 24
    rf = rewards([("sleepy", {})], timeout_s=5.0)
    start = time.perf_counter()
    scored = rf.score_groups([(f"p{i}", ["ab", "abcd", "abc"], {}) for i in range(n // 3)])
    elapsed = time.perf_counter() - start
    assert [t for g in scored for t, _ in g] == [2.0, 4.0, 3.0] * (n // 3)
    assert elapsed < 0.25 * n / 4, elapsed  # in turn they would take n * 0.2 = 4.8 s
    rf.close()


def test_a_hanging_sync_reward_is_bounded_by_the_timeout() -> None:
    rf = rewards([("sync_hangs_on_marker", {})], timeout_s=0.3)
    start = time.perf_counter()
    scored = rf.score_group("p", ["hang", "ok"], {})
    assert time.perf_counter() - start < 0.3 + 1.0
    assert [t for t, _ in scored] == [0.0, 2.0]
    assert rf.timeouts == 1
    rf.close()


def test_an_async_reward_that_blocks_the_loop_costs_its_batch_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tandem.rewards, "LOOP_GRACE_S", 0.2)
    rf = rewards([("blocks_the_loop", {}), ("exact", {})], timeout_s=0.2)
    start = time.perf_counter()
    scored = rf.score_group("p", ["a", "b"], {"answer": "a"})
    assert time.perf_counter() - start < 0.9  # given up before the 1 s block ends
    assert scored == [(0.0, {"blocks_the_loop": 0.0, "exact": 0.0})] * 2
    assert rf.timeouts == 4  # every call of the batch
    rf.fns = rf.fns[1:]  # a fresh loop serves the next batch
    assert rf.score_group("p", ["a", "b"], {"answer": "a"}) == [(1.0, {"exact": 1.0}), (0.0, {"exact": 0.0})]
    rf.close()


def test_a_group_function_sees_the_whole_group_and_its_scores_line_up() -> None:
    GROUP_CALLS.clear()
    rf = rewards(
        [("exact", {"weight": 2.0})],
        [("lengths", {"weight": 0.5, "name": "relative", "kwargs": {"scale": 4.0}})],
        clip=3.0,
    )
    rec1, rec2 = {"answer": "aaaa"}, {"answer": "zz"}
    scored = rf.score_groups([("p1", ["a", "aaaa", "aa"], rec1), ("p2", ["zz", "z"], rec2)])
    assert sorted(GROUP_CALLS, key=lambda c: c[0]) == [
        ("p1", ["a", "aaaa", "aa"], rec1),
        ("p2", ["zz", "z"], rec2),
    ]
    # by hand: relative = 4 * len / longest; total = 2 * exact + 0.5 * relative, clipped to 3
    assert scored[0][0] == (0.5, {"exact": 0.0, "relative": 1.0})
    assert scored[0][1] == (3.0, {"exact": 1.0, "relative": 4.0})  # 2 + 2 = 4, clipped
    assert scored[0][2] == (1.0, {"exact": 0.0, "relative": 2.0})
    assert scored[1] == [(3.0, {"exact": 1.0, "relative": 4.0}), (1.0, {"exact": 0.0, "relative": 2.0})]
    rf.close()


def test_a_failing_group_function_costs_only_its_group() -> None:
    rf = rewards([("exact", {})], [("group_fails_on_prompt", {"name": "judge"})], timeout_s=0.3)
    start = time.perf_counter()
    scored = rf.score_groups(
        [
            ("hang", ["a", "b"], {"answer": "a"}),
            ("raise", ["a"], {"answer": "a"}),
            ("short", ["a", "b"], {"answer": "a"}),
            ("fine", ["a", "b"], {"answer": "a"}),
        ]
    )
    assert time.perf_counter() - start < 0.3 + 1.0
    judge = [[parts["judge"] for _, parts in g] for g in scored]
    assert judge == [[0.0, 0.0], [0.0], [0.0, 0.0], [1.0, 1.0]]
    assert [[t for t, _ in g] for g in scored] == [[1.0, 0.0], [1.0], [1.0, 0.0], [2.0, 1.0]]
    assert (rf.timeouts, rf.errors) == (1, 2)
    rf.close()


def test_check_plugins_names_a_group_function_whose_kwargs_do_not_bind() -> None:
    from tandem.config import load_config
    from tandem.plugins import check_plugins

    raw = {
        "run": {"name": "g"},
        "model": {"actor": "a"},
        "data": {"prompts": "p"},
        "reward": {
            "group_functions": [
                {"path": f"{HERE}:lengths", "kwargs": {"scale": 2.0}},
                {"path": f"{HERE}:lengths", "kwargs": {"scael": 2.0}},
            ]
        },
    }
    errors = check_plugins(load_config(None, raw=raw))
    assert len(errors) == 1 and errors[0].startswith("reward.group_functions[1].path")
    assert "scael" in errors[0]
