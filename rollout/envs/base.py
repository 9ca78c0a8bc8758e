"""The environment API: Gymnasium's ``Env`` shape, in token space, for multi-turn episodes (docs/environments.md §10.2).

An environment is one episode's state. The rollout server makes one per episode (``n`` per prompt), calls
``reset(task)`` once, then alternates a model turn with ``step(action)`` until ``done``:

- ``reset(task) -> observation``: the first observation, usually the task's prompt. Returning
  ``task.prompt`` (or None) keeps the feeder's token ids; any other text is tokenised once.
- ``step(action) -> StepResult(observation, reward, done, info)``: the model's turn as text *and* the exact
  token ids it sampled; the observation (text, or token ids to append verbatim) is the environment's turn.
  ``reward`` is this turn's; the episode's return is the sum over turns.

Either method may be a coroutine function; the runner awaits it in a worker thread. A method that raises,
hangs past ``env.step_timeout_s`` or returns something malformed ends its episode with a recorded reason,
never the server (:mod:`rollout.envs.episode`). A *tool* that fails is the environment's business: the
shipped ones answer with an error observation so the model can react.
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from tandem.rewards import load_callable

Observation = str | list[int]


@dataclass(frozen=True)
class Task:
    """What an episode is about: the prompt's text and token ids and the dataset record it came from."""

    prompt: str
    prompt_tokens: tuple[int, ...]
    record: dict[str, Any]


@dataclass(frozen=True)
class Action:
    """One model turn: the text the environment reads (special tokens skipped, cut before a stop string)
    and the token ids the engine sampled (the stop string's tokens included)."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str


@dataclass
class StepResult:
    """What ``step`` returns. ``observation`` is ignored once ``done``. ``info["metrics"]`` (name -> number,
    describing the episode so far: the last step's values stand) is averaged over episodes into the
    server's telemetry (``env/<name>``)."""

    observation: Observation = ""
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Env:
    """Base class of an environment; subclasses implement ``reset`` and ``step`` (sync or async)."""

    def reset(self, task: Task) -> Observation | Awaitable[Observation | None] | None:
        return task.prompt

    def step(self, action: Action) -> StepResult | Awaitable[StepResult]:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the episode held (called once, whatever the episode's end)."""


def load_env_factory(path: str, kwargs: dict[str, Any]) -> Any:
    """``module:Class`` (or a factory function) to a zero-argument callable making a fresh Env."""
    factory = load_callable(path, what="env.path")
    return lambda: factory(**kwargs)
