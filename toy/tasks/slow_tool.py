"""``slow_tool``: an environment whose steps take heavy-tailed time, as real tools do (a network call, a
sandboxed run). Most steps take ``fast_ms``, a ``slow_share`` of them ``slow_ms``; every step answers with
the same observation and none ends the episode, so ``env.max_turns`` does. The benchmarks of episode
progression (``bench/episodes.py``, ``bench/episode_window.py``) load it by path.

Every instance draws from one seeded generator, so a run's sequence of slow steps is the same from run to
run while the episodes of one batch still differ from each other.
"""

from __future__ import annotations

import random
import threading
import time

from rollout.envs.base import Action, Env, StepResult

_RNG = random.Random(0)
_LOCK = threading.Lock()


def reseed(seed: int) -> None:
    """Restart the shared sequence of slow and fast steps."""
    with _LOCK:
        _RNG.seed(seed)


class SlowTool(Env):
    def __init__(self, obs: str = " ok", slow_ms: float = 0.0, slow_share: float = 0.0, fast_ms: float = 0.0):
        if not 0.0 <= slow_share <= 1.0:
            raise ValueError(f"slow_share: {slow_share} is not a share in [0, 1]")
        if slow_ms < 0 or fast_ms < 0:
            raise ValueError(f"slow_ms, fast_ms: delays must be >= 0 (got {slow_ms}, {fast_ms})")
        self.obs, self.slow_s, self.slow_share, self.fast_s = obs, slow_ms / 1000, slow_share, fast_ms / 1000

    def step(self, action: Action) -> StepResult:
        with _LOCK:
            slow = _RNG.random() < self.slow_share
        time.sleep(self.slow_s if slow else self.fast_s)
        return StepResult(self.obs, 0.0, False)
