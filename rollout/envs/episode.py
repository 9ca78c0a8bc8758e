"""Many multi-turn episodes at once: the engine batches each round of model turns (docs/environments.md §10.3).

:meth:`EpisodeRunner.run` reads top to bottom:

1. **reset** every episode's environment (all started at once in worker threads, each read within its own
   step timeout);
2. **model turn**: one engine call for every live episode's whole context (prompt + turns so far, as token
   ids: nothing is re-tokenised), with per-token behaviour logprobs and versions; an in-flight weight
   update stamps later tokens with the new version;
3. **environment turn**: every live episode's ``step`` at once, each read within its timeout; the observation's
   tokens are appended with ``loss_mask`` 0;
4. **between turns**: the caller's hook (the rollout loop applies a pending weight update here, so the next
   turn is generated, and prefilled, by the new weights); back to 2 while any episode lives.

That is ``env.progression: rounds``: a round waits for its slowest environment step, and a finished
episode idles until its batch is done. With ``independent``, :meth:`EpisodeRunner.run_independent` gives
every episode a thread of its own that plays it through (reset, then model turn and environment turn
until it ends); its next turn goes to the engine as soon as its environment step returns and joins the
engine's running batch at its next step (continuous batching: vLLM's and SGLang's schedulers, the hf
engine's :mod:`~rollout.engines.hf_batch`). The caller's between-turns hook runs before each turn's call,
one at a time (:class:`~rollout.agents.batching.BatchingEngine`, which gathers the turns that are ready
into one call for an engine that does not batch concurrent calls).

An episode ends when its environment says ``done`` (finish ``stop``), at ``env.max_turns`` model turns or
``env.max_total_tokens`` tokens (``length``), or when its environment fails: raises, times out, or returns
a malformed result (``abort``: the learner masks it out, docs/environments.md §10.1). ``meta["end_reason"]``
records which. Every environment is closed once, whatever happened.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from buffer.schema import Trajectory, Turns
from rollout.agents.batching import BatchingEngine
from rollout.engines.base import BetweenSteps, Engine, SamplingParams, cut_at_stop
from rollout.envs.base import Action, Env, StepResult, Task

log = logging.getLogger(__name__)


class EnvFailure(Exception):
    """An environment call that raised, hung or returned garbage; the message is the recorded reason."""


@dataclass
class Episode(Turns):
    """One episode's state: the prompt and everything after it (model and env turns), aligned per token."""

    task: Task
    env: Env
    prompt: list[int]
    turn_rewards: list[float] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)  # each reward's turn: its last generated token
    metrics: dict[str, float] = field(default_factory=dict)
    turns: int = 0
    last_action: Action | None = None
    finish_reason: str = ""  # set when the episode ends
    end_reason: str = ""

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)

    @property
    def context(self) -> list[int]:
        return self.prompt + self.tokens

    def end(self, finish_reason: str, reason: str) -> None:
        self.finish_reason, self.end_reason = finish_reason, reason

    def trajectory(
        self, prompt_id: str, group_id: str, server_id: str, clip: Callable[[float], float] = float
    ) -> Trajectory:
        """The episode as a wire record: its return (sum of turn rewards, clipped) is the reward."""
        reward = clip(sum(self.turn_rewards))
        generated = self.generated_versions()
        return self.as_trajectory(
            self.prompt,
            prompt_id=prompt_id,
            group_id=group_id,
            reward=reward,
            reward_parts={"env": reward},
            finish_reason=self.finish_reason or "abort",
            server_id=server_id,
            meta={
                "version": generated[0] if generated else 0,
                "turns": self.turns,
                "end_reason": self.end_reason,
                "turn_rewards": self.turn_rewards,
                # For algorithm.credit=turn: each turn's reward on its last generated token.
                "turn_credit": [
                    [i, clip(r)] for i, r in zip(self.turn_ends, self.turn_rewards, strict=True) if i >= 0
                ],
                **{f"env/{k}": v for k, v in self.metrics.items()},
            },
        )

    def rewarded(self, reward: float) -> None:
        """The environment's reward for the turn just taken, kept with that turn's last generated token
        (-1 before the model has said anything)."""
        self.turn_rewards.append(reward)
        self.turn_ends.append(next((i for i in range(len(self.mask) - 1, -1, -1) if self.mask[i]), -1))


class DaemonWorkers:
    """Daemon threads that are reused. A job takes an idle thread, or starts one when none is idle, so a
    hung job keeps its thread (abandoned: a daemon never blocks exit) and never starves the others.
    Starting a thread per environment call cost a quarter of a multi-turn episode's time on a tiny model."""

    def __init__(self, name: str, max_idle: int = 256) -> None:
        self.name, self.max_idle = name, max_idle
        self._idle: list[queue.SimpleQueue[Callable[[], None]]] = []
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._work, args=(inbox,), name=self.name, daemon=True).start()
        inbox.put(job)

    def _work(self, inbox: queue.SimpleQueue[Callable[[], None]]) -> None:
        while True:
            inbox.get()()  # jobs catch their own exceptions
            with self._lock:
                if len(self._idle) >= self.max_idle:
                    return
                self._idle.append(inbox)


WORKERS = DaemonWorkers("episode")


class EnvCall:
    """``fn(arg)`` (awaited if it returns a coroutine) started at once in a daemon thread; :meth:`result`
    waits for it until ``timeout_s`` after the start.

    A hung call is abandoned, not killed (Python cannot kill a thread); being a daemon, it cannot keep the
    server from exiting. Starting every episode's call before waiting for any is one thread hand-off per
    call, and each keeps its own deadline.
    """

    def __init__(self, fn: Callable[..., Any], arg: Any, what: str) -> None:
        self.what, self.started = what, time.monotonic()
        self._out: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=1)

        def target() -> None:
            try:
                result = fn(arg)
                if inspect.isawaitable(result):
                    result = asyncio.run(_await(result))
                self._out.put((True, result))
            except BaseException as e:  # anything the env raises is its failure, reported, never ours
                self._out.put((False, e))

        WORKERS.submit(target)

    def result(self, timeout_s: float) -> Any:
        """The call's return value, or EnvFailure (``env_timeout``, ``env_error``) naming what failed."""
        try:
            ok, value = self._out.get(timeout=max(0.0, self.started + timeout_s - time.monotonic()))
        except queue.Empty:
            raise EnvFailure(
                f"env_timeout: {self.what} took longer than env.step_timeout_s={timeout_s:g}s"
            ) from None
        if not ok:
            raise EnvFailure(f"env_error: {self.what} raised {type(value).__name__}: {value}")
        return value


async def _await(aw: Any) -> Any:
    return await aw


def parallel(calls: list[Callable[[], None]], timeout_s: float | None, what: str) -> None:
    """Run the calls on threads of their own and wait for all, ``timeout_s`` at most in total.

    Each call bounds its environment's time itself (:class:`EnvCall`); this bound is the backstop
    for the runner's own work around it, so a stage can never wait forever. ``None``: calls that generate
    are bounded by the engine, as a round's model turn is.
    """
    left = len(calls)
    cv = threading.Condition()

    def run(call: Callable[[], None]) -> None:
        nonlocal left
        try:
            call()
        except BaseException:  # a stage's calls report their own failures; this one's is logged
            log.exception("episode %s", what)
        finally:
            with cv:
                left -= 1
                cv.notify_all()

    for c in calls:
        WORKERS.submit(lambda c=c: run(c))
    with cv:
        if not cv.wait_for(lambda: left == 0, timeout=timeout_s):
            raise TimeoutError(
                f"episode {what}: {left} of {len(calls)} calls still running after {timeout_s:g}s "
                "(env.step_timeout_s plus slack)"
            )


class EpisodeRunner:
    """Runs batches of episodes against one engine under the ``env`` config's budgets."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: PreTrainedTokenizerBase,
        sampling: SamplingParams,
        *,
        max_turns: int,
        max_total_tokens: int,
        step_timeout_s: float,
        vocab_size: int,
        progression: str = "rounds",
        gather_s: float = 0.002,
    ) -> None:
        self.engine, self.tokenizer, self.sampling = engine, tokenizer, sampling
        self.max_turns, self.max_total_tokens = max_turns, max_total_tokens
        self.step_timeout_s, self.vocab_size = step_timeout_s, vocab_size
        self.progression, self.gather_s = progression, gather_s

    def run(
        self,
        episodes: list[Episode],
        *,
        between_steps: BetweenSteps | None = None,
        between_turns: Callable[[], None] | None = None,
    ) -> list[Episode]:
        if self.progression == "independent":
            return self.run_independent(episodes, between_steps=between_steps, between_turns=between_turns)
        try:
            for e, call in [(e, EnvCall(e.env.reset, e.task, "reset")) for e in episodes]:
                self.reset(e, call)
            while live := [e for e in episodes if not e.done]:
                self.model_turn(live, between_steps)
                steps = [(e, EnvCall(e.env.step, e.last_action, "step")) for e in live if not e.done]
                for e, call in steps:  # every step runs at once; each is read within its own deadline
                    self.env_turn(e, call)
                if between_turns is not None and any(not e.done for e in episodes):
                    between_turns()
        finally:
            self.close_all(episodes)
        return episodes

    def run_independent(
        self,
        episodes: list[Episode],
        *,
        between_steps: BetweenSteps | None = None,
        between_turns: Callable[[], None] | None = None,
    ) -> list[Episode]:
        """Every episode plays at its own pace; the engine takes whichever turns are ready.

        Turns go through the engine front (:class:`BatchingEngine`), which runs the caller's hooks and hands
        each turn straight to an engine that batches concurrent calls itself (all three engines); for one
        that does not, it gathers the turns that arrive together into one call.
        """
        front = BatchingEngine(
            self.engine, gather_s=self.gather_s, between_steps=between_steps, between_batches=between_turns
        )
        try:
            parallel([lambda e=e: self.play(e, front) for e in episodes], None, "play")
        finally:
            front.close()
            self.close_all(episodes)
        return episodes

    def play(self, e: Episode, engine: Engine) -> None:
        """One episode from reset to its end: model turn, environment turn, and again."""
        self.reset(e)
        while not e.done:
            self.model_turn([e], None, engine)
            if not e.done:
                self.env_turn(e)

    # ----------------------------------------------------------------------------------------- stages

    def reset(self, e: Episode, call: EnvCall | None = None) -> None:
        """The episode's first observation (``call``: its reset, already started)."""
        try:
            obs = (call or EnvCall(e.env.reset, e.task, "reset")).result(self.step_timeout_s)
            if obs is not None and obs != e.task.prompt:
                e.prompt = self.observation_tokens(obs, "reset")
                if not e.prompt:
                    raise EnvFailure("env_garbage: reset returned an empty observation")
        except EnvFailure as err:
            self.fail(e, str(err))

    def model_turn(
        self, live: list[Episode], between_steps: BetweenSteps | None, engine: Engine | None = None
    ) -> None:
        """One engine call per distinct token allowance (usually one call for all live episodes)."""
        by_room: dict[int, list[Episode]] = {}
        for e in live:
            room = min(self.sampling.max_new_tokens, self.max_total_tokens - len(e.context))
            if room < 1:
                e.end("length", "max_total_tokens")
            else:
                by_room.setdefault(room, []).append(e)
        for room, eps in by_room.items():
            sampling = SamplingParams(**{**vars(self.sampling), "n": 1, "max_new_tokens": room})
            out = (engine or self.engine).generate(
                [e.context for e in eps], sampling, between_steps=between_steps
            )
            for e, (c,) in zip(eps, out, strict=True):
                e.add(c.token_ids, c.logprobs, c.versions, generated=True)
                e.turns += 1
                e.last_action = Action(self.text(c.token_ids), tuple(c.token_ids), c.finish_reason)
                if c.finish_reason == "abort":
                    e.end("abort", "engine_abort")

    def env_turn(self, e: Episode, call: EnvCall | None = None) -> None:
        """The environment's answer to the model's turn (``call``: that step, already started)."""
        try:
            result = (call or EnvCall(e.env.step, e.last_action, "step")).result(self.step_timeout_s)
            reward, done, obs = self.check(result)
            e.rewarded(reward)
            for k, v in (result.info.get("metrics") or {}).items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    e.metrics[str(k)] = float(v)  # the episode so far: the last step's value stands
            if done:
                e.end("stop", "done")
                return
            ids = self.observation_tokens(obs, "step")
        except EnvFailure as err:
            self.fail(e, str(err))
            return
        room = self.max_total_tokens - len(e.context)
        e.add(ids[:room], [], [], generated=False)
        if len(ids) >= room:
            e.end("length", "max_total_tokens")
        elif e.turns >= self.max_turns:
            e.end("length", "max_turns")

    def close_all(self, episodes: list[Episode]) -> None:
        """Every episode's ``close``, all at once, each within its own deadline."""
        calls = [(e, EnvCall(lambda env: env.close(), e.env, "close")) for e in episodes]
        for e, call in calls:
            try:
                call.result(self.step_timeout_s)
            except EnvFailure as err:
                log.warning("episode of %s: %s", e.task.record.get("id", "?"), err)

    # ---------------------------------------------------------------------------------------- helpers

    @staticmethod
    def check(result: Any) -> tuple[float, bool, Any]:
        """A step's result, or EnvFailure naming what is malformed."""
        if not isinstance(result, StepResult):
            raise EnvFailure(f"env_garbage: step returned {type(result).__name__}, expected StepResult")
        r = result.reward
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
            raise EnvFailure(f"env_garbage: reward {r!r} is not a finite number")
        if not isinstance(result.done, bool):
            raise EnvFailure(f"env_garbage: done {result.done!r} is not a bool")
        if not isinstance(result.info, dict):
            raise EnvFailure(f"env_garbage: info is {type(result.info).__name__}, expected a dict")
        return float(r), result.done, result.observation

    def observation_tokens(self, obs: Any, what: str) -> list[int]:
        """Text is tokenised once, here; token ids are appended verbatim after a range check."""
        if isinstance(obs, str):
            return [int(t) for t in self.tokenizer(obs, add_special_tokens=False)["input_ids"]]
        if isinstance(obs, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in obs
        ):
            if any(not 0 <= t < self.vocab_size for t in obs):
                raise EnvFailure(
                    f"env_garbage: {what} observation has token ids outside [0, {self.vocab_size})"
                )
            return list(obs)
        raise EnvFailure(
            f"env_garbage: {what} observation is {type(obs).__name__}, expected str or token ids"
        )

    def text(self, token_ids: list[int]) -> str:
        """What the environment reads of a model turn (as the OpenAI API would return it)."""
        return cut_at_stop(self.tokenizer.decode(token_ids, skip_special_tokens=True), self.sampling.stop)[0]

    @staticmethod
    def fail(e: Episode, reason: str) -> None:
        log.warning("episode of %s ended: %s", e.task.record.get("id", "?"), reason)
        e.end("abort", reason[:500])
