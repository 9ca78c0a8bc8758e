"""toy/tasks/slow_tool.py: the heavy-tailed environment the episode benchmarks load by path."""

from __future__ import annotations

import time

import pytest

from rollout.envs.base import Action
from toy.tasks import slow_tool
from toy.tasks.slow_tool import SlowTool


def test_a_share_of_steps_is_slow_and_the_sequence_repeats(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(slow_tool.time, "sleep", slept.append)
    env = SlowTool(" ok", slow_ms=1000, slow_share=0.1, fast_ms=2)
    slow_tool.reseed(7)
    first = [env.step(Action("", (1,), "length")) for _ in range(2000)]
    assert all(r.observation == " ok" and not r.done and r.reward == 0.0 for r in first)
    assert set(slept) == {1.0, 0.002}
    assert 0.08 < slept.count(1.0) / len(slept) < 0.12  # 200 expected, sd 13
    again = list(slept)
    slept.clear()
    slow_tool.reseed(7)
    for _ in range(2000):
        SlowTool(" ok", slow_ms=1000, slow_share=0.1, fast_ms=2).step(
            Action("", (1,), "length")
        )  # any instance
    assert slept == again


def test_the_default_is_instant() -> None:
    t0 = time.perf_counter()
    for _ in range(50):
        SlowTool().step(Action("", (1,), "length"))
    assert time.perf_counter() - t0 < 0.5


@pytest.mark.parametrize("kw", [{"slow_share": 1.5}, {"slow_ms": -1.0}])
def test_bad_settings_name_the_field(kw: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(kw))):
        SlowTool(**kw)
