"""Black-box agent sessions over HTTP (docs/environments.md §10.6): ``POST /v1/sessions`` opens one,
calls carrying an ``X-Session-Id`` header or a ``session_id`` field are generated from the session's
exact tokens, and ``POST /v1/sessions/{id}/finish`` closes it into trajectories for the server's sink.

The tokens themselves are kept by :class:`rollout.http.sessions.SessionStore`; this module checks the
id a call names, renders its prompt, and answers it through the same engine path and choices as any
other call (:class:`rollout.http.app.API`, :class:`rollout.http.choices.Choices`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from buffer.schema import Trajectory
from rollout.engines.base import Completion, SamplingParams
from rollout.http.chat_prompt import ChatPrompts
from rollout.http.choices import Choices, completion_choice, usage
from rollout.http.inputs import EngineInputs
from rollout.http.parsers import ChatReader
from rollout.http.schemas import (
    APIError,
    ChatRequest,
    CompletionRequest,
    FinishRequest,
    SamplingFields,
    text_problem,
)
from rollout.http.sessions import SessionError, SessionStore
from tandem.config import HTTPConfig
from tandem.rewards import clip_reward

# Generation for one request under a slot: (prompts, sampling, request) -> completions per prompt.
Generate = Callable[[list[list[int]], SamplingParams, Request], Awaitable[list[list[Completion]]]]


class SessionAPI:
    """The session routes and session calls of one server, over its ``store``."""

    def __init__(
        self,
        store: SessionStore,
        *,
        inputs: EngineInputs,
        choices: Choices,
        prompts: ChatPrompts,
        generate: Generate,
        http: HTTPConfig,
        sink: Callable[[Trajectory], None] | None = None,
        reward_clip: float | None = None,
    ) -> None:
        self.store, self.inputs, self.choices, self.prompts = store, inputs, choices, prompts
        self.generate, self.http, self.sink, self.reward_clip = generate, http, sink, reward_clip

    @staticmethod
    def session_id(req: SamplingFields, request: Request) -> str | None:
        """The session a call names (header first), or None for a call outside sessions."""
        sid = request.headers.get("x-session-id") or req.session_id
        if sid is not None and not 0 < len(sid) <= 128:
            raise APIError(400, "X-Session-Id must be 1..128 characters", param="session_id")
        if sid is not None and (problem := text_problem(sid)):
            raise APIError(400, f"session_id: {problem}", param="session_id")
        return sid

    async def completion(self, req: CompletionRequest, request: Request, session: str) -> dict[str, Any]:
        if not isinstance(req.prompt, str):
            raise APIError(400, "a session's prompt must be one string", param="prompt")
        return await self.call(req, request, session, req.prompt, req.max_tokens, chat=False)

    async def chat(
        self, req: ChatRequest, request: Request, session: str, tools: ChatReader | None
    ) -> dict[str, Any]:
        """A chat call: its messages rendered to text, the session's tool turns as the model sampled them."""
        text = self.prompts.text(req, replay=self.store.tool_turns(session))
        max_tokens = req.max_completion_tokens or req.max_tokens
        return await self.call(req, request, session, text, max_tokens, chat=True, tools=tools)

    async def call(
        self,
        req: SamplingFields,
        request: Request,
        session: str,
        text: str,
        max_tokens: int | None,
        *,
        chat: bool,
        tools: ChatReader | None = None,
    ) -> dict[str, Any]:
        """One call of a black-box agent's session: generate from the session's exact tokens. Tool calls
        are parsed for the response only; the session keeps the sampled tokens, and the text they decode
        to stands for the calls when the agent sends them back (:class:`ChatPrompts`)."""
        if req.n != 1 or req.stream:
            raise APIError(400, "a session call takes n=1 and no streaming", param="session_id")
        try:
            context = self.store.context(session, text)
        except SessionError as e:
            raise APIError(400, str(e), param="session_id") from None
        sampling = self.inputs.sampling(req, max_tokens, [context])
        if chat:
            tools = self.choices.reader(tools, context)
        ((c,),) = await self.generate([context], sampling, request)
        returned, finish = self.choices.text_and_finish(c, sampling.stop)
        self.store.record(session, text, c, returned, context=context)
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": req.model,
            "usage": usage([context], [[c]], 1),
        }
        if chat:
            choice = self.choices.chat_choice(0, c, returned, finish, sampling.stop, tools)
            if calls := choice["message"].get("tool_calls"):
                self.store.remember_tool_turn(session, [x["id"] for x in calls], returned)
            return {**head, "object": "chat.completion", "choices": [choice]}
        choice = completion_choice(0, returned, finish, None)
        return {**head, "object": "text_completion", "choices": [choice]}

    async def open_session(self) -> dict[str, Any]:
        """Open a session; calls and the finish name it by the id issued here (no other id is taken)."""
        try:
            return {"id": self.store.issue(), "object": "session"}
        except SessionError as e:
            raise APIError(403, str(e), type="permission_error", param="session_id") from None

    async def finish_session(self, session_id: str, req: FinishRequest) -> dict[str, Any]:
        """Close a session into its segments' trajectories (one unless a prompt rewrote history, §10.6) with
        the agent's reward; the server's sink takes each."""
        if problem := text_problem(session_id):  # the path's id; the body's strings were checked already
            raise APIError(400, f"session_id: {problem}", param="session_id")
        if self.sink is not None and self.http.api_key is None:
            raise APIError(
                403,
                "finishing a session adds a trajectory to the run's training data, which needs the API key: "
                "set rollout.http.api_key (or TANDEM_API_KEY) and send it as a bearer token",
                type="permission_error",
                code="api_key_required",
            )
        try:
            segments = self.store.finish(session_id, clip_reward(req.reward, self.reward_clip), req.group_id)
        except SessionError as e:
            raise APIError(404, str(e), param="session_id") from None
        if self.sink is not None:
            for t in segments:
                await run_in_threadpool(self.sink, t)
        # The first segment's figures at the top, as for a session of one segment; calls in all.
        rows = [
            {
                "traj_id": t.traj_id,
                "prompt_tokens": len(t.prompt_tokens),
                "response_tokens": len(t.response_tokens),
                "generated_tokens": int(t.loss_mask.sum()),
                "calls": t.meta["calls"],
            }
            for t in segments
        ]
        return {**rows[0], "calls": sum(r["calls"] for r in rows), "segments": rows}
