"""Black-box agents trained in a run: ``n`` episodes per prompt, each one agent function's session
(docs/environments.md §10.9).

The agent is a plain function written against the OpenAI SDK, named by ``agent.path``::

    async def agent(client: openai.AsyncOpenAI, record: dict, *, model: str, **kwargs) -> float | dict

``client`` is bound to a session of its own on this server's OpenAI-compatible API, ``record`` is the
prompt's dataset record, ``model`` the served model's name and ``kwargs`` are ``agent.kwargs``. It returns
its reward: a number, or a dict of reward parts (numbers, summed).

:meth:`AgentRunner.run` reads top to bottom:

1. **open** one session per episode on the runner's own API: a loopback HTTP server with a bearer token,
   over the server's engine through :class:`~rollout.agents.batching.BatchingEngine`, so the engine
   batches the calls of every live agent. Its sampling is the run's (``rollout.temperature``, ``top_p``,
   ``top_k``, whatever the agent asks: the learner scores the tokens under them), and a longer
   ``max_tokens`` is cut to ``rollout.max_new_tokens``;
2. **play** every episode at once, each on a thread with its own event loop, so an agent that blocks its
   loop holds up only itself;
3. **end**: an agent that raises, runs past ``agent.timeout_s``, returns a malformed reward, makes no model
   call, or returns while one of its calls is still running (leaves its session open) ends its episode
   as ``abort``, with the reason in ``meta["end_reason"]`` (the learner masks it out, docs/environments.md
   §10.1); never the server;
4. **close** every session into trajectories, one per segment (one unless a prompt rewrote the history,
   ``rollout.http.session.on_rewrite``): the session's exact tokens (the agent's added text with
   ``loss_mask`` 0), and the agent's reward, clipped. A call still running on a closed session is refused
   or dropped (:class:`~rollout.http.sessions.SessionStore`, strict).
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import ssl
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from transformers import AutoConfig, PreTrainedTokenizerBase

from buffer.schema import Trajectory, Turns
from rollout.agents.batching import BatchingEngine
from rollout.engines.base import BetweenSteps, Engine
from rollout.http.app import create_app
from rollout.http.serve import HTTPServer
from rollout.http.sessions import Segment, Session, SessionStore, segment_meta
from rollout.metrics import ServerMetrics
from tandem.config import Config, HTTPConfig
from tandem.rewards import load_callable
from tandem.timing import timed

log = logging.getLogger(__name__)

# What an episode may take beyond agent.timeout_s before its thread is given up on (an agent that blocks
# its own event loop cannot be cancelled, only abandoned: the thread is a daemon).
JOIN_SLACK_S = 10.0
EXIT_POLL_S = 0.1  # how often the runner looks, while agents play, whether the engine's process died


@dataclass
class AgentEpisode:
    """One agent call's state: the prompt's record and, once ended, its reward or the reason it failed."""

    record: dict[str, Any]
    prompt_tokens: list[int]  # the feeder's, the trajectory's prompt only when the agent made no call
    session_id: str = field(default_factory=lambda: f"agent-{uuid.uuid4().hex}")
    reward: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)
    end_reason: str = ""
    session: Session | None = None
    seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def aborted(self) -> bool:
        return self.end_reason != "done"

    def end(self, reason: str, reward: float = 0.0, parts: dict[str, float] | None = None) -> None:
        """The first end stands (a timed-out agent's thread may return later)."""
        with self._lock:
            if self.end_reason:
                return
            self.end_reason, self.reward, self.parts = reason[:500], reward, parts or {}
        if reason != "done":
            log.warning("agent episode of %s ended: %s", self.record.get("id", "?"), reason)

    def trajectories(
        self, prompt_id: str, group_id: str, server_id: str, clip: Callable[[float], float] = float
    ) -> list[Trajectory]:
        """One trajectory per segment of the episode's session (one unless a prompt rewrote the history,
        docs/environments.md §10.6), each with the episode's reward. The episode's metrics ride on the last
        one only, so the learner's means count an episode once. An episode without a completion is one
        empty trajectory on the feeder's prompt."""
        s = self.session if self.session is not None and self.session.calls else None
        segments = s.segments() if s is not None else [Segment(self.prompt_tokens, Turns(), 0)]
        reward = clip(self.reward)
        # the learner averages episode metrics over each batch it trains on (docs/environments.md §10.3)
        metrics = {
            f"env/{k.removeprefix('agent/')}": v for k, v in self.metrics().items() if k != "agent/seconds"
        }
        episode_reward = {"env/reward": reward, **{f"env/reward/{k}": v for k, v in self.parts.items()}}
        out = []
        for i, x in enumerate(segments):
            # Text after the segment's last completion (no completion answered it) is cut.
            last = max((i for i, m in enumerate(x.turns.mask) if m), default=-1) + 1
            generated = x.turns.generated_versions()
            out.append(
                x.turns.as_trajectory(
                    x.prompt,
                    prompt_id=prompt_id,
                    group_id=group_id,
                    upto=last,
                    reward=reward,
                    reward_parts={"agent": reward, **{f"agent/{k}": v for k, v in self.parts.items()}},
                    finish_reason="abort" if self.aborted else "stop",
                    server_id=server_id,
                    meta={
                        "version": min(generated) if generated else 0,
                        "session_id": self.session_id,
                        "calls": x.calls,
                        "end_reason": self.end_reason,
                        "seconds": self.seconds,
                        **segment_meta(i, len(segments)),
                        **(metrics | episode_reward if i == len(segments) - 1 else {}),
                    },
                )
            )
        return out

    def metrics(self) -> dict[str, float]:
        """The episode's figures; ``agent/segments`` and ``agent/rewrites`` count its session's segments
        and the calls that started one (docs/environments.md §10.6)."""
        s = self.session
        calls, tool = (s.calls, s.tool_call_turns) if s is not None else (0, 0)
        segments = len(s.segments()) if s is not None else 0
        return {
            "agent/calls": float(calls),
            "agent/tool_calls": float(tool),
            "agent/tool_used": float(tool > 0),
            "agent/segments": float(segments),
            "agent/rewrites": float(s.rewrites if s is not None else 0),
            "agent/aborted": float(self.aborted),
            "agent/seconds": self.seconds,
        }


def check_reward(result: Any) -> tuple[float, dict[str, float]]:
    """An agent's return as ``(reward, parts)``; ValueError names what is malformed."""

    def number(x: Any, what: str) -> float:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            raise ValueError(f"{what} {x!r} is not a finite number")
        return float(x)

    if isinstance(result, dict):
        if not result:
            raise ValueError("the agent returned an empty dict of reward parts")
        parts = {str(k): number(v, f"reward part {k!r}") for k, v in result.items()}
        return sum(parts.values()), parts
    return number(result, "the agent's reward"), {}


class _Counting(httpx.AsyncBaseTransport):
    """The agent client's transport: counts its requests still waiting for a response."""

    def __init__(self, tls: ssl.SSLContext) -> None:
        self.inner = httpx.AsyncHTTPTransport(verify=tls)
        self.inflight = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.inflight += 1
        try:
            return await self.inner.handle_async_request(request)
        finally:
            self.inflight -= 1

    async def aclose(self) -> None:
        await self.inner.aclose()


class AgentRunner:
    """Runs batches of agent episodes against one engine, through the runner's own API."""

    def __init__(
        self,
        cfg: Config,
        engine: Engine,
        tokenizer: PreTrainedTokenizerBase,
        *,
        metrics: ServerMetrics,
        between_steps: BetweenSteps | None = None,
        between_batches: Callable[[], None] | None = None,
        batches: int = 1,
    ) -> None:
        """``batches``: how many batches of episodes may play at once (the loop's batches in flight)."""
        import openai  # only agent runs need the SDK

        a, r = cfg.agent, cfg.rollout
        assert a.path is not None
        self.openai = openai
        self.fn = load_callable(a.path, what="agent.path")
        self.kwargs, self.timeout_s = dict(a.kwargs), a.timeout_s
        self.engine = BatchingEngine(
            engine,
            gather_s=a.gather_ms / 1000,
            between_steps=between_steps,
            between_batches=between_batches,
            sampling={"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k},
            max_new_tokens=r.max_new_tokens,
        )
        self.model_name = Path(cfg.model.actor).name
        self.api_key = secrets.token_hex(16)
        # httpx builds an SSL context for every transport unless handed one: about 35 ms of CPU, on the cores
        # the engine uses, for each episode's client of a plain-http loopback API. One serves every episode.
        self.tls = httpx.create_ssl_context()
        episodes = r.prompts_per_batch * r.n_samples * batches
        # An agent does not know the run's limits: a longer max_tokens is cut to rollout.max_new_tokens
        # (by the engine front), not refused; the model's context still bounds a call.
        self.http = http = HTTPConfig(
            api_key=self.api_key,
            max_tokens_limit=1 << 30,
            max_total_tokens_per_request=1 << 30,
            max_concurrent_requests=max(16, 2 * episodes),
            session=cfg.rollout.http.session,
        )
        max_context = AutoConfig.from_pretrained(
            cfg.model.actor, trust_remote_code=cfg.model.trust_remote_code
        ).max_position_embeddings
        app = create_app(
            self.engine,
            tokenizer,
            model_name=self.model_name,
            http=http,
            metrics=metrics,
            max_context=max_context,
            aliases=(str(cfg.model.actor),),
        )
        self.sessions = app.state.api.sessions.store = SessionStore(
            tokenizer, strict=True, on_rewrite=cfg.rollout.http.session.on_rewrite
        )
        self.server = HTTPServer(app, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.server.port}/v1"

    def run(self, episodes: list[AgentEpisode]) -> list[AgentEpisode]:
        """Play every episode at once; each ends done or aborted with a reason, and holds its session."""
        for e in episodes:
            self.sessions.open(e.session_id)
        threads = [threading.Thread(target=self.play, args=(e,), name="agent", daemon=True) for e in episodes]
        for t in threads:
            t.start()
        deadline = time.monotonic() + self.timeout_s + JOIN_SLACK_S
        for e, t in zip(episodes, threads, strict=True):
            # Once the engine's process has died no call can succeed: the batch ends then, not when the
            # last agent gives up (an agent that retries or sleeps would hold it to agent.timeout_s).
            while t.is_alive() and self.engine.exited is None and time.monotonic() < deadline:
                t.join(min(EXIT_POLL_S, max(0.0, deadline - time.monotonic())))
            if self.engine.exited is not None:
                break
            if t.is_alive():
                e.seconds = self.timeout_s + JOIN_SLACK_S
                e.end(
                    f"agent_timeout: still running after agent.timeout_s={self.timeout_s:g}s "
                    f"(+{JOIN_SLACK_S:g}s); an agent that blocks its event loop cannot be cancelled"
                )
        for e in episodes:
            e.session = self.sessions.close(e.session_id)
        if self.engine.exited is not None:  # no later episode can succeed: the server must restart
            raise self.engine.exited
        for e in episodes:
            if not e.aborted and (e.session is None or not e.session.calls):  # a reward for nothing
                e.end_reason, e.reward, e.parts = (
                    "no_calls: the agent made no model call on its session",
                    0.0,
                    {},
                )
        return episodes

    def play(self, e: AgentEpisode) -> None:
        with timed() as span:
            try:
                asyncio.run(self.episode(e))
            except BaseException as err:  # what the agent leaves behind is its failure, not the server's
                e.end(f"agent_error: {type(err).__name__}: {err}")
        e.seconds = span.seconds

    async def episode(self, e: AgentEpisode) -> None:
        transport = _Counting(self.tls)
        async with httpx.AsyncClient(transport=transport, timeout=self.timeout_s) as http:
            client = self.openai.AsyncOpenAI(
                base_url=self.url,
                api_key=self.api_key,
                http_client=http,
                max_retries=0,
                default_headers={"X-Session-Id": e.session_id},
            )
            try:
                result = await asyncio.wait_for(
                    self.fn(client, dict(e.record), model=self.model_name, **self.kwargs), self.timeout_s
                )
            except TimeoutError:
                e.end(f"agent_timeout: the agent ran past agent.timeout_s={self.timeout_s:g}s")
                return
            except Exception as err:
                e.end(f"agent_error: {type(err).__name__}: {err}")
                return
            if transport.inflight:
                e.end(
                    f"session_left_open: the agent returned with {transport.inflight} call(s) still running"
                )
                return
            try:
                reward, parts = check_reward(result)
            except ValueError as err:
                e.end(f"agent_garbage: {err}")
                return
            e.end("done", reward, parts)

    def close(self) -> None:
        self.server.stop()
        self.engine.close()
