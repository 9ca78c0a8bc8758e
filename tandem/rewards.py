"""Reward plug-ins: rule-based functions chosen by dotted path (``module:function``), after slime.

A function takes ``(prompt, completion, record)`` and returns a float or a dict of named parts (summed).
:class:`RewardFunctions` loads them once at start-up (so a typo fails before any generation) and scores a
completion into ``(total, parts)``. A plug-in that raises scores 0 for that sample and is logged and
counted, so one bad record never takes a rollout server down.
"""

from __future__ import annotations

import importlib
import logging
import math
from collections.abc import Callable
from typing import Any

from tandem.config import RewardConfig

log = logging.getLogger(__name__)


def load_callable(path: str, what: str = "reward function") -> Callable[..., Any]:
    """Import ``module:attr``; a clear error names ``what`` and the path when either part is missing."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what} {path!r}: cannot import module {module_name!r}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{what} {path!r}: module {module_name!r} has no callable {attr!r}")
    return fn


def part_name(path: str) -> str:
    """The default name of a plug-in's reward part: its module's last component (``toy.tasks.echo:reward``
    is ``echo``); a dict-returning plug-in's parts are ``<name>/<key>``."""
    return path.partition(":")[0].rsplit(".", 1)[-1]


class RewardFunctions:
    """The configured rule-based rewards, weighted and summed."""

    def __init__(self, cfg: RewardConfig) -> None:
        self.fns = [(f.name or part_name(f.path), load_callable(f.path), f.weight) for f in cfg.functions]
        self.clip = cfg.clip
        self.errors = 0

    def score(self, prompt: str, completion: str, record: dict[str, Any]) -> tuple[float, dict[str, float]]:
        parts: dict[str, float] = {}
        total = 0.0
        for name, fn, weight in self.fns:
            try:
                out = fn(prompt, completion, record)
                named = (
                    {f"{name}/{k}": float(v) for k, v in out.items()}
                    if isinstance(out, dict)
                    else {name: float(out)}
                )
            except Exception:  # a plug-in bug costs one sample's reward, not the server
                log.exception("reward function %s raised on prompt %r; scoring 0", name, prompt[:80])
                self.errors += 1
                named = {name: 0.0}
            for k, v in named.items():
                v = v if math.isfinite(v) else 0.0
                parts[k] = v
                total += weight * v
        if self.clip is not None:
            total = max(-self.clip, min(self.clip, total))
        return total, parts


def clip_reward(reward: float, clip: float | None) -> float:
    """``reward`` within ``[-clip, clip]`` (``reward.clip``; None leaves it)."""
    return reward if clip is None else max(-clip, min(clip, reward))


def total_reward(
    rules: float, cfg: RewardConfig, *, model: float | None = None, overlong: float | None = None
) -> float:
    """A sample's reward from its parts, in one order wherever they were scored (docs/design.md §1.3, step 5): the
    rule functions' clipped total, plus ``reward.model_weight`` times the reward model's score, clipped, plus
    the over-long penalty, clipped. The rollout server sums it when the reward model scores there; under
    ``placement.reward_model: own`` the learner sums the same parts once the worker's score arrives."""
    reward = rules
    if model is not None:
        reward = clip_reward(reward + cfg.model_weight * model, cfg.clip)
    if overlong is not None:
        reward = clip_reward(reward + overlong, cfg.clip)
    return reward
