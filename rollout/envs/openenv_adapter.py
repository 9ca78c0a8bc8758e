"""OpenEnv environments (``openenv-core``) run through the episode runner, used as they are (docs/environments.md §10.7).

An OpenEnv environment is a ``openenv.core.env_server.Environment``: ``reset(seed=, episode_id=, **kw) ->
Observation`` and ``step(action) -> Observation``, where the observation is a pydantic model carrying
``reward`` and ``done`` next to its own fields, and the action is the environment's own pydantic ``Action``
class. :class:`OpenEnvAdapter` is a tandem :class:`~rollout.envs.base.Env` around one instance, made fresh
per episode in this process:

- ``reset``: the task's record may carry ``seed`` and ``reset_kwargs``; the first observation, rendered
  through ``observation_format``, follows the prompt when ``show_reset`` (else the prompt alone is the
  model's context);
- ``step``: the model turn's text becomes ``action_cls(**{action_field: text})``; a turn the action class
  refuses (pydantic validation) is answered with ``invalid_action`` so the model can react, as a tool error
  would be; the observation's ``reward`` (None counts 0) and ``done`` pass through, numeric ``metadata``
  entries become ``env/<name>`` metrics.

The environment's own failures (it raises, hangs) are the episode runner's to contain (§10.3).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from rollout.envs.base import Action, Env, StepResult, Task
from tandem.rewards import load_callable


class OpenEnvAdapter(Env):
    """``env`` and ``action`` are ``module:Name`` paths: the OpenEnv Environment class (or a factory) and its
    Action class; ``env_kwargs`` go to the environment's constructor."""

    def __init__(
        self,
        env: str,
        action: str,
        *,
        env_kwargs: dict[str, Any] | None = None,
        action_field: str = "message",
        observation_format: str = "{message}\n",
        show_reset: bool = True,
        invalid_action: str = "invalid action\n",
    ) -> None:
        self.env = load_callable(env, what="env.kwargs.env")(**(env_kwargs or {}))
        self.action_cls = load_callable(action, what="env.kwargs.action")
        self.action_field, self.observation_format = action_field, observation_format
        self.show_reset, self.invalid_action = show_reset, invalid_action
        self.metrics: dict[str, float] = {}

    def reset(self, task: Task) -> str:
        r = task.record
        obs = self.env.reset(
            seed=r.get("seed"), episode_id=str(r.get("id", "")) or None, **(r.get("reset_kwargs") or {})
        )
        return task.prompt + self.render(obs) if self.show_reset else task.prompt

    def step(self, action: Action) -> StepResult:
        try:
            act = self.action_cls(**{self.action_field: action.text.strip()})
        except ValidationError:
            return StepResult(self.invalid_action, 0.0, False, {"metrics": self.metrics})
        obs = self.env.step(act)
        for k, v in (getattr(obs, "metadata", None) or {}).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self.metrics[str(k)] = float(v)
        done = bool(obs.done)
        return StepResult(
            "" if done else self.render(obs), float(obs.reward or 0.0), done, {"metrics": self.metrics}
        )

    def render(self, obs: Any) -> str:
        return self.observation_format.format(**obs.model_dump())

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()
