"""Reward plug-ins: functions chosen by dotted path (``module:function``), after slime.

A per-completion function takes ``(prompt, completion, record, **kwargs)`` and returns a float or a dict
of named parts (summed); a group function takes ``(prompt, completions, record, **kwargs)`` (the ``n``
samples of one prompt, RULER-style judges that rank them together) and returns one float or dict per
completion. Either may be ``async def``.

:class:`RewardFunctions` loads them once at start-up (so a typo fails before any generation) and scores a
batch of groups into ``(total, parts)`` per completion. Every call of a batch runs at once on one event
loop: async functions are awaited concurrently, sync ones each in a thread, each under
``reward.timeout_s``. A call that raises, returns a bad value or times out scores 0 for its samples (one
sample, or the whole group for a group function), which are kept; it is counted (``reward/errors``,
``reward/timeouts``) and its function's first failure of each kind is logged, so one bad plug-in never
takes a rollout server down or stalls it. What cannot be bounded: a sync function that never returns keeps
its worker thread (the batch goes on without it), and an ``async def`` that blocks without awaiting holds
the event loop, so the batch is given up after the timeout (every call of it scored 0) and a fresh loop
takes over.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib
import inspect
import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from tandem.config import RewardConfig
from tandem.config.rollout import RewardFunction

log = logging.getLogger(__name__)

LOOP_GRACE_S = 5.0  # beyond reward.timeout_s, how long a batch may take before its event loop is given up

Parts = dict[str, float]
Group = tuple[str, Sequence[str], dict[str, Any]]  # (prompt, its completions, its record)


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


def is_async(fn: Callable[..., Any]) -> bool:
    """``async def`` functions, and objects whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


@dataclass(frozen=True)
class Plugin:
    """One configured reward function, loaded."""

    name: str
    fn: Callable[..., Any]
    weight: float
    kwargs: dict[str, Any]
    is_async: bool

    @classmethod
    def load(cls, f: RewardFunction) -> Plugin:
        fn = load_callable(f.path)
        return cls(f.name or part_name(f.path), fn, f.weight, dict(f.kwargs), is_async(fn))


def named_parts(name: str, out: Any) -> Parts:
    """A function's return value as its named parts: ``{name: x}``, or ``{name/key: x}`` for a dict; a value
    that is not a number raises (scored 0 as an error)."""
    if isinstance(out, dict):
        return {f"{name}/{k}": float(v) for k, v in out.items()}
    if isinstance(out, bool) or not isinstance(out, (int, float)):
        raise TypeError(f"returned {type(out).__name__}, not a number or a dict of numbers")
    return {name: float(out)}


def group_parts(name: str, out: Any, n: int) -> list[Parts]:
    """A group function's return value as one set of parts per completion; the wrong length raises."""
    if isinstance(out, (str, bytes, dict)) or not isinstance(out, Sequence):
        raise TypeError(f"returned {type(out).__name__}, not a list of {n} scores")
    if len(out) != n:
        raise ValueError(f"returned {len(out)} scores for a group of {n} completions")
    return [named_parts(name, x) for x in out]


def summed(parts: list[tuple[Plugin, Parts]], clip: float | None) -> tuple[float, Parts]:
    """The weighted total of one completion's parts (non-finite parts count 0), clipped, and the parts."""
    total, named = 0.0, {}
    for plugin, p in parts:
        for k, v in p.items():
            v = v if math.isfinite(v) else 0.0
            named[k] = v
            total += plugin.weight * v
    return clip_reward(total, clip), named


def in_thread(call: Callable[[], Any]) -> asyncio.Future[Any]:
    """``call()`` in a daemon thread of its own, as a future of the running loop. Not an executor's worker:
    those are joined at exit, so a sync function that never returns would hold the server's exit too."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(out: Any, error: BaseException | None) -> None:
        if not future.done():  # not timed out meanwhile
            future.set_exception(error) if error is not None else future.set_result(out)

    def run() -> None:
        try:
            out, error = call(), None
        except BaseException as e:
            out, error = None, e
        with contextlib.suppress(RuntimeError):  # the loop was closed meanwhile
            loop.call_soon_threadsafe(settle, out, error)

    threading.Thread(target=run, name="reward-sync", daemon=True).start()
    return future


class RewardFunctions:
    """The configured reward functions (per completion and per group), weighted and summed."""

    def __init__(self, cfg: RewardConfig) -> None:
        self.fns = [Plugin.load(f) for f in cfg.functions]
        self.group_fns = [Plugin.load(f) for f in cfg.group_functions]
        self.clip, self.timeout_s = cfg.clip, cfg.timeout_s
        self.errors = self.timeouts = 0  # calls that raised or returned a bad value; calls timed out
        self._reported: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    def score(self, prompt: str, completion: str, record: dict[str, Any]) -> tuple[float, Parts]:
        """One completion (a group function sees it as a group of one)."""
        return self.score_groups([(prompt, [completion], record)])[0][0]

    def score_group(
        self, prompt: str, completions: Sequence[str], record: dict[str, Any]
    ) -> list[tuple[float, Parts]]:
        return self.score_groups([(prompt, completions, record)])[0]

    def score_groups(self, groups: Sequence[Group]) -> list[list[tuple[float, Parts]]]:
        """``(total, parts)`` of every completion of every group, every call of the batch at once."""
        if not self.fns and not self.group_fns:
            return [[(clip_reward(0.0, self.clip), {}) for _ in cs] for _, cs, _ in groups]
        loop = self.event_loop()
        future = asyncio.run_coroutine_threadsafe(self._score(groups), loop)
        try:
            return future.result(self.timeout_s + LOOP_GRACE_S)
        except concurrent.futures.TimeoutError:  # an async function blocked the loop: give it up
            future.cancel()
            self.abandon_loop(loop)
            calls = sum(len(cs) for _, cs, _ in groups) * len(self.fns) + len(groups) * len(self.group_fns)
            self.timeouts += calls
            log.error(
                "reward functions held their event loop past %.0fs: %d calls scored 0", self.timeout_s, calls
            )
            zero = [(p, {p.name: 0.0}) for p in self.fns + self.group_fns]
            return [[summed(zero, self.clip) for _ in cs] for _, cs, _ in groups]

    async def _score(self, groups: Sequence[Group]) -> list[list[tuple[float, Parts]]]:
        per_sample = [
            [[self._call(f, (p, c, r), named_parts) for f in self.fns] for c in cs] for p, cs, r in groups
        ]
        per_group = [
            [self._call(f, (p, list(cs), r), partial(group_parts, n=len(cs))) for f in self.group_fns]
            for p, cs, r in groups
        ]
        flat = [c for g in per_sample for s in g for c in s] + [c for g in per_group for c in g]
        done = iter(await asyncio.gather(*flat))
        sample_parts = [[[(f, next(done)) for f in self.fns] for _ in g] for g in per_sample]
        group_parts_ = [[(f, next(done)) for f in self.group_fns] for _ in per_group]
        return [
            [summed(s + [(f, each[i]) for f, each in gp], self.clip) for i, s in enumerate(sp)]
            for sp, gp in zip(sample_parts, group_parts_, strict=True)
        ]

    async def _call(self, f: Plugin, args: tuple[Any, ...], parse: Callable[[str, Any], Any]) -> Any:
        """``f(*args)`` under the timeout, parsed; on failure the zero parts ``parse`` would give."""
        try:
            if f.is_async:
                out = await asyncio.wait_for(f.fn(*args, **f.kwargs), self.timeout_s)
            else:
                out = await asyncio.wait_for(in_thread(partial(f.fn, *args, **f.kwargs)), self.timeout_s)
            return parse(f.name, out)
        except asyncio.TimeoutError:
            self.timeouts += 1
            self.report(f.name, "timeout", f"did not return within reward.timeout_s={self.timeout_s:g}s")
        except Exception as e:  # a plug-in bug costs its samples' reward, not the server
            self.errors += 1
            self.report(f.name, "error", f"raised {e!r}", exc_info=e)
        zero = 0.0 if parse is named_parts else [0.0] * len(args[1])
        return parse(f.name, zero)

    def metrics(self) -> dict[str, float]:
        """Failures so far, and what each plug-in reports of itself: a function's ``metrics()`` attribute
        (the judge's calls and cache hits)."""
        out = {"reward/errors": float(self.errors), "reward/timeouts": float(self.timeouts)}
        for f in self.fns + self.group_fns:
            if callable(own := getattr(f.fn, "metrics", None)):
                out |= own()
        return out

    def report(self, name: str, kind: str, what: str, exc_info: BaseException | None = None) -> None:
        """Log the first failure of each kind per function (later ones are only counted)."""
        if (name, kind) in self._reported:
            return
        self._reported.add((name, kind))
        log.warning(
            "reward function %s %s; its samples score 0 (later %ss of it are counted in reward/%ss only)",
            name, what, kind, kind, exc_info=exc_info,
        )  # fmt: skip

    def event_loop(self) -> asyncio.AbstractEventLoop:
        """The loop every batch runs on, started on first use in a thread of its own (so async clients a
        plug-in keeps, like the judge's, live on one loop)."""
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="reward-loop", daemon=True).start()
            return self._loop

    def abandon_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            if self._loop is loop:
                loop.call_soon_threadsafe(loop.stop)  # once whatever blocks it returns
                self._loop = None

    def close(self) -> None:
        with self._lock:
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._loop = None


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
