"""An OpenEnv environment (the real ``openenv-core`` API) through the episode runner (docs/environments.md §10.7).

OpenEnv's shipped environments live in their own packages and containers fetched from a hub, so the one
here is written against its API: a ``openenv.core.env_server.Environment`` subclass with its own pydantic
Action and Observation. The reference for rewards is a fresh instance of the same environment replaying the
episode's model turns (as the decoded text the adapter gave it); for the mask, the observations' text
tokenised on its own.
"""

from __future__ import annotations

import random
import re
from typing import Any

import pytest
from pydantic import Field, field_validator

openenv_server = pytest.importorskip("openenv.core.env_server")  # the `openenv` extra

from openenv.core.env_server import Action as OEAction  # noqa: E402
from openenv.core.env_server import Environment, Observation, State  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from rollout.engines.hf import HFEngine  # noqa: E402
from rollout.envs.base import Action, Task  # noqa: E402
from rollout.envs.episode import Episode  # noqa: E402
from rollout.envs.openenv_adapter import OpenEnvAdapter  # noqa: E402
from tests.test_env_episode import runner  # noqa: E402

GAME = "tests.test_env_openenv:GuessDigitEnvironment"
GUESS = "tests.test_env_openenv:GuessAction"


class GuessAction(OEAction):
    guess: str = Field(description="the model's turn; its first digit is the guess")

    @field_validator("guess")
    @classmethod
    def not_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("empty guess")
        return v


class GuessObservation(Observation):
    message: str = Field(default="", description="what the game says")


class GuessDigitEnvironment(Environment[GuessAction, GuessObservation, State]):
    """Guess the secret digit; told "higher"/"lower". Reward 1 when right, else 0.1 × closeness."""

    def __init__(self, max_guesses: int = 3) -> None:
        super().__init__()
        self.max_guesses = max_guesses
        self._state = State()
        self.secret = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kw: Any) -> GuessObservation:
        self.secret = random.Random(seed).randint(0, 9)
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(message="guess a digit")

    def step(self, action: GuessAction, timeout_s: float | None = None, **kw: Any) -> GuessObservation:
        self._state.step_count += 1
        out_of_guesses = self._state.step_count >= self.max_guesses
        m = re.search(r"\d", action.guess)
        if m is None:
            return GuessObservation(message="say a digit", reward=0.0, done=out_of_guesses,
                                    metadata={"guesses": self._state.step_count})  # fmt: skip
        g = int(m.group())
        if g == self.secret:
            return GuessObservation(message="right", reward=1.0, done=True, metadata={"guesses": 1.0})
        return GuessObservation(
            message="higher" if g < self.secret else "lower",
            reward=0.1 * (1 - abs(g - self.secret) / 9),
            done=out_of_guesses,
            metadata={"guesses": self._state.step_count},
        )

    @property
    def state(self) -> State:
        return self._state


def test_adapter_maps_reset_step_and_invalid_actions() -> None:
    env = OpenEnvAdapter(GAME, GUESS, action_field="guess")
    task = Task("play:", (1, 2), {"id": "g0", "seed": 3})
    assert env.reset(task) == "play:guess a digit\n"
    secret = random.Random(3).randint(0, 9)
    refused = env.step(Action("  ", (5,), "stop"))  # the Action model refuses it: told so, not ended
    assert (refused.observation, refused.reward, refused.done) == ("invalid action\n", 0.0, False)
    wrong = (secret + 1) % 10
    r = env.step(Action(f"{wrong}\n", (5,), "stop"))
    assert r.observation == ("higher\n" if wrong < secret else "lower\n") and not r.done
    assert r.reward == pytest.approx(0.1 * (1 - abs(wrong - secret) / 9))
    r = env.step(Action(f"it is {secret}", (5,), "stop"))
    assert (r.reward, r.done, r.info["metrics"]["guesses"]) == (1.0, True, 1.0)


def test_openenv_episodes_run_with_exact_rewards_and_masks(tiny_ckpt) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_ckpt["actor"])
    engine = HFEngine(str(tiny_ckpt["actor"]), device="cpu", seed=0)
    run = runner(engine, tok, max_turns=3, turn_tokens=4)
    eps = []
    for i in range(12):
        ids = tok("play:", add_special_tokens=False)["input_ids"]
        env = OpenEnvAdapter(GAME, GUESS, action_field="guess", env_kwargs={"max_guesses": 3})
        eps.append(Episode(Task("play:", tuple(ids), {"id": f"g{i}", "seed": i}), env, list(ids)))
    run.run(eps)

    opening = tok("play:guess a digit\n", add_special_tokens=False)["input_ids"]
    for i, e in enumerate(eps):
        assert e.prompt == opening  # the reset observation follows the prompt
        assert e.end_reason in {"done", "max_turns"}, e.end_reason
        # Replay: split the response into turns by the mask; a fresh game gets the same texts.
        ref = OpenEnvAdapter(GAME, GUESS, action_field="guess")
        ref.reset(Task("play:", (), {"id": f"g{i}", "seed": i}))
        runs, cur = [], [e.mask[0], []]
        for t, m in zip(e.tokens, e.mask, strict=True):
            if m != cur[0]:
                runs.append(cur)
                cur = [m, []]
            cur[1].append(t)
        runs.append(cur)
        model_turns = [ids for m, ids in runs if m == 1]
        env_turns = [ids for m, ids in runs if m == 0]
        assert len(model_turns) == e.turns
        expected_obs, expected_rewards = [], []
        for ids in model_turns:
            r = ref.step(Action(run.text(ids), tuple(ids), "stop"))
            expected_rewards.append(r.reward)
            if not r.done:
                expected_obs.append(tok(r.observation, add_special_tokens=False)["input_ids"])
        assert e.turn_rewards == pytest.approx(expected_rewards)
        assert env_turns == expected_obs  # every env token, and only those, masked 0
        assert all(
            v == -1 and lp == 0.0 for v, lp, m in zip(e.versions, e.logp, e.mask, strict=True) if not m
        )
    assert any(r > 0 for e in eps for r in e.turn_rewards)  # some guesses scored: rewards pass through
