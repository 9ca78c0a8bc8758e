"""The rollout server's OpenAI-compatible HTTP API: the FastAPI app and its routes (docs/design.md §1.3).

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (non-streaming and SSE streaming,
``n``, ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stop``, ``seed``, ``logprobs``; on chat,
function calling with ``tools``, ``tool_choice`` and ``parallel_tool_calls``, docs/environments.md §10.8),
``POST /v1/messages`` and ``POST /v1/responses`` (Anthropic's Messages API and OpenAI's Responses API,
each translated onto the chat path in a module of its own, docs/environments.md §10.10),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text from the server's own registry),
and ``POST /v1/sessions/{id}/finish`` (a black-box agent's session as a trajectory, docs/environments.md §10.6:
calls carrying an ``X-Session-Id`` header or a ``session_id`` field are generated from the session's exact
tokens, :mod:`rollout.http.sessions`).
The same engine serves the rollout loop; the engine serialises the two (the hf engine per decode step).

Hardening (docs/design.md §6.4): binds to loopback by default; an optional bearer token guards ``/v1/*``; bodies
over ``max_request_bytes`` get 413 before they are read (:mod:`rollout.http.middleware`); a body that is not
UTF-8, or holds a string with a lone surrogate or NUL (any field, nested or not), gets 400 naming the field
(:mod:`rollout.http.schemas`); ``max_tokens`` is bounded by ``max_tokens_limit`` and the model's context; a
request holds at most ``max_prompts_per_request`` prompts and asks for at most
``max_total_tokens_per_request`` tokens (prompts × n × max_tokens); past ``max_concurrent_requests``
requests in flight, the next gets 429 at once. A client that disconnects cancels its generation, streamed
or not (between decode steps, on engines that offer them). Every failure is a JSON error in OpenAI's shape
``{"error": {"message", "type", "param", "code"}}`` with a 4xx status, and the server keeps serving.

Departures from OpenAI: ``top_logprobs`` lists only the sampled token (engines record the behaviour
logprob of what they sampled, not alternatives); streamed choices send their ``finish_reason`` once the
whole request has finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import PreTrainedTokenizerBase

from buffer.schema import Trajectory
from rollout.engines.base import Completion, Engine, SamplingParams, cut_at_stop
from rollout.engines.constraint import Constraint
from rollout.http import limits, messages_api, responses_api
from rollout.http.chat_prompt import ChatPrompts
from rollout.http.constraints import constraint_for
from rollout.http.middleware import BodyLimit, Guard
from rollout.http.parsers import TOOL_FORMATS, ChatReader, ParsedCall, kept_specials, think
from rollout.http.schemas import (
    APIError,
    ChatRequest,
    CompletionRequest,
    FinishRequest,
    SamplingFields,
    error_response,
    text_problem,
)
from rollout.http.sessions import SessionError, SessionStore
from rollout.metrics import ServerMetrics
from tandem.config import HTTPConfig
from tandem.rewards import clip_reward

log = logging.getLogger(__name__)

CLIENT_GONE_STATUS = 499  # nginx's "client closed request": nobody reads it, the metrics count it
DISCONNECT_POLL_S = 0.1


@dataclass
class _Choice:
    """One streamed choice: the tokens so far and how much of their text was sent."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sent_chars: int = 0
    sent_tokens: int = 0
    stopped: bool = False


def _openai_call(c: ParsedCall) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": c.name, "arguments": c.arguments},
    }


class API:
    """The endpoints, bound to one engine and tokenizer."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: PreTrainedTokenizerBase,
        *,
        model_name: str,
        http: HTTPConfig,
        metrics: ServerMetrics,
        max_context: int | None,
        aliases: tuple[str, ...] = (),
        sink: Callable[[Trajectory], None] | None = None,
        reward_clip: float | None = None,
    ) -> None:
        self.engine, self.tokenizer, self.http, self.metrics = engine, tokenizer, http, metrics
        self.reward_clip = reward_clip
        self.sessions, self.sink = SessionStore(tokenizer, on_rewrite=http.session.on_rewrite), sink
        self.prompts = ChatPrompts(tokenizer)
        self.tool_parser = TOOL_FORMATS[http.tool_parser] if http.tool_parser else None
        self.reasoning_parser = http.reasoning_parser
        self.special_ids = set(tokenizer.all_special_ids)
        # The special tokens a format is written in (harmony's, Mistral's [TOOL_CALLS]) survive decoding.
        names = list(kept_specials(http.reasoning_parser, http.tool_parser))
        kept = set(tokenizer.convert_tokens_to_ids(names))
        special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special} | self.special_ids
        self.kept_ids, self.skipped_ids = kept & special, special - kept
        self.model_name, self.names = model_name, {model_name, *aliases}
        self.max_context = max_context
        self.created = int(time.time())
        self.active = 0  # requests holding a generation slot
        self._slots_lock = threading.Lock()

    # -------------------------------------------------------------------------------------- validation

    def check_model(self, name: str) -> None:
        if name not in self.names:
            raise APIError(404, f"The model '{name}' does not exist", param="model", code="model_not_found")

    def sampling(
        self, req: SamplingFields, max_tokens: int | None, prompts: list[list[int]]
    ) -> SamplingParams:
        longest = max(map(len, prompts))
        room = (self.max_context - longest) if self.max_context else self.http.max_tokens_limit
        if room < 1:
            raise APIError(
                400,
                f"the prompt has {longest} tokens; this model's context is {self.max_context}",
                param="prompt",
                code="context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = min(room, self.http.max_tokens_limit)
        if max_tokens > self.http.max_tokens_limit:
            raise APIError(
                400,
                f"max_tokens {max_tokens} exceeds the server's limit of {self.http.max_tokens_limit}",
                param="max_tokens",
            )
        if max_tokens > room:
            raise APIError(
                400,
                f"prompt ({longest} tokens) + max_tokens ({max_tokens}) exceeds this model's context of {self.max_context}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        # Every row holds its prompt's KV as well as its own tokens: the prompt counts n times.
        prompt_tokens = sum(map(len, prompts))
        total = (prompt_tokens + len(prompts) * max_tokens) * req.n
        if total > self.http.max_total_tokens_per_request:
            raise APIError(
                400,
                f"({prompt_tokens} prompt tokens + {len(prompts)} prompt(s) × max_tokens={max_tokens}) × "
                f"n={req.n} = {total} tokens exceeds the server's limit of "
                f"{self.http.max_total_tokens_per_request} per request (max_total_tokens_per_request)",
                param="max_tokens",
                code="request_too_large",
            )
        constraint = self.constraint(req)
        return SamplingParams(
            n=req.n,
            max_new_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            # The grammar ends a constrained reply; a stop string meant for free text ("\n") would cut a
            # forced call's own markup or a JSON string into what the request did not ask for.
            stop=[] if constraint is not None else req.stop_list(),
            seed=req.seed,
            constraint=constraint,
        )

    def constraint(self, req: SamplingFields) -> Constraint | None:
        """What the reply must match: forced tool calls or ``response_format`` (rollout/http/constraints.py)."""
        if isinstance(req, ChatRequest):
            tools = [t.model_dump() for t in req.tools or []]
            return constraint_for(
                tools,
                req.tool_choice,
                req.response_format,
                self.http.tool_parser,
                parallel_tool_calls=req.parallel_tool_calls,
            )
        return constraint_for(None, None, req.response_format, None)

    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        p = req.prompt
        if isinstance(p, str):
            prompts = [p]
        elif p and all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        else:
            prompts = p  # type: ignore[assignment]
        limit = self.http.max_prompts_per_request
        if not prompts or len(prompts) > limit:
            raise APIError(400, f"prompt must hold 1..{limit} prompts (got {len(prompts)})", param="prompt")
        out = [
            x if isinstance(x, list) else self.tokenizer(x, add_special_tokens=False).input_ids
            for x in prompts
        ]
        if not all(out):
            raise APIError(400, "a prompt is empty", param="prompt")
        return out

    def tool_calls(self, req: ChatRequest) -> ChatReader | None:
        """How to read the request's completions for tool calls; None: not at all (no tools, or
        ``tool_choice: "none"``). Checks ``tools`` and ``tool_choice`` against each other."""
        names = [t.function.name for t in req.tools or []]
        if dup := sorted({x for x in names if names.count(x) > 1}):
            raise APIError(400, f"tools: the function {dup[0]!r} is defined more than once", param="tools")
        named = req.tool_choice_name()
        if (req.tool_choice == "required" or named is not None) and not names:
            raise APIError(400, f"tool_choice: {req.tool_choice!r} needs tools", param="tool_choice")
        if named is not None and named not in names:
            raise APIError(
                400,
                f"tool_choice: the function {named!r} is not among tools ({', '.join(names)})",
                param="tool_choice",
            )
        if not names or req.tool_choice == "none":
            return None
        if self.tool_parser is None:
            raise APIError(
                400,
                'tools: this server reads no tool calls (rollout.http.tool_parser is null); use tool_choice "none"',
                param="tools",
            )
        tools = [t.function for t in req.tools or [] if named in (None, t.function.name)]
        allowed = {f.name: f.parameters or {} for f in tools}  # qwen3_coder types values by the schema
        return ChatReader(tools=self.tool_parser, allowed=allowed, parallel=req.parallel_tool_calls)

    def reader(self, tools: ChatReader | None, prompt: list[int]) -> ChatReader | None:
        """How to read a chat completion: ``tools`` (:meth:`tool_calls`) and the server's reasoning format,
        told whether the prompt's last tokens opened a ``<think>`` block; None: as plain content."""
        if self.reasoning_parser is None:
            return tools
        inside = self.reasoning_parser == "think" and think.opened(self.tokenizer.decode(prompt[-32:]))
        return replace(tools or ChatReader(), reasoning=self.reasoning_parser, inside=inside)

    # ---------------------------------------------------------------------------------------- generation

    async def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, request: Request
    ) -> list[list[Completion]]:
        """Generate for a non-streaming request; a client that disconnects meanwhile cancels the work."""
        cancelled = threading.Event()

        def between_steps() -> None:
            if cancelled.is_set():
                raise _ClientGone

        watcher = asyncio.create_task(_watch_disconnect(request, cancelled))
        try:
            out = await run_in_threadpool(
                self.engine.generate, prompts, sampling, between_steps=between_steps
            )
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None
        finally:
            watcher.cancel()
        self.metrics.generated_tokens.labels(source="http").inc(sum(len(c.token_ids) for g in out for c in g))
        return out

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        """One of ``max_concurrent_requests`` generation slots, or 429 at once (no unbounded queue)."""
        limit = self.http.max_concurrent_requests
        with self._slots_lock:
            if self.active >= limit:
                raise APIError(
                    429,
                    f"the server is generating for {limit} requests (max_concurrent_requests); retry later",
                    type="rate_limit_error",
                    code="rate_limit_exceeded",
                )
            self.active += 1
        try:
            yield
        finally:
            with self._slots_lock:
                self.active -= 1

    async def stream_tokens(
        self, prompts: list[list[int]], sampling: SamplingParams
    ) -> AsyncIterator[tuple[int, int, float]]:
        """Tokens ``(row, token, logprob)`` as the engine samples them; closing the iterator cancels."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, int, float] | None] = asyncio.Queue()
        cancelled = threading.Event()

        def between_steps() -> None:
            if cancelled.is_set():
                raise _ClientGone

        def on_token(row: int, token: int, logp: float) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (row, token, logp))

        future = loop.run_in_executor(
            None,
            lambda: self.engine.generate(prompts, sampling, between_steps=between_steps, on_token=on_token),
        )
        future.add_done_callback(lambda _: queue.put_nowait(None))  # runs after every queued token
        # A client gone mid-stream leaves nobody to await the future: mark its _ClientGone as seen.
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        tokens = 0
        try:
            while (item := await queue.get()) is not None:
                tokens += 1
                yield item
            await future  # re-raise an engine error
        finally:
            cancelled.set()
            self.metrics.generated_tokens.labels(source="http").inc(tokens)

    def decode(self, token_ids: list[int]) -> str:
        """A completion's text: special tokens skipped, but those the parsers read (``kept_specials``)."""
        if not self.kept_ids:
            return self.tokenizer.decode(token_ids, skip_special_tokens=True)
        return self.tokenizer.decode([t for t in token_ids if t not in self.skipped_ids])

    def text_and_finish(self, c: Completion, stop: list[str]) -> tuple[str, str]:
        text, hit = cut_at_stop(self.decode(c.token_ids), stop)
        return text, "stop" if hit or c.finish_reason == "stop" else "length"

    def matched_stop(self, token_ids: list[int], stop: list[str]) -> str | None:
        """The stop string the completion ended at (the first to occur), or None: vLLM's ``stop_reason``."""
        text = self.decode(token_ids)
        found = [(text.find(s), k, s) for k, s in enumerate(stop) if s and s in text]
        return min(found)[2] if found else None

    def token_entries(
        self, tokens: list[int], logprobs: list[float], limit_chars: int | None = None
    ) -> list[tuple[str, float, int]]:
        """``(text, logprob, offset)`` per non-special token, up to ``limit_chars`` of text."""
        out, offset = [], 0
        for t, lp in zip(tokens, logprobs, strict=True):
            if t in self.special_ids:
                continue
            if limit_chars is not None and offset >= limit_chars:
                break
            s = self.tokenizer.decode([t])
            out.append((s, lp, offset))
            offset += len(s)
        return out

    @staticmethod
    def completion_logprobs(entries: list[tuple[str, float, int]], base: int = 0) -> dict[str, Any]:
        return {
            "tokens": [s for s, _, _ in entries],
            "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{s: lp} for s, lp, _ in entries],
            "text_offset": [base + off for _, _, off in entries],
        }

    @staticmethod
    def chat_logprobs(entries: list[tuple[str, float, int]], top: bool) -> dict[str, Any]:
        return {
            "content": [
                {
                    "token": s,
                    "logprob": lp,
                    "bytes": list(s.encode()),
                    "top_logprobs": [{"token": s, "logprob": lp, "bytes": list(s.encode())}] if top else [],
                }
                for s, lp, _ in entries
            ]
        }

    # ------------------------------------------------------------------------------------------ endpoints

    async def completions(self, req: CompletionRequest, request: Request) -> Any:
        self.check_model(req.model)
        if session := self.session_id(req, request):
            if not isinstance(req.prompt, str):
                raise APIError(400, "a session's prompt must be one string", param="prompt")
            return await self.session_call(req, request, session, req.prompt, req.max_tokens, chat=False)
        prompts = self.completion_prompts(req)
        sampling = self.sampling(req, req.max_tokens, prompts)
        rid = f"cmpl-{uuid.uuid4().hex}"
        head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": req.model}
        if req.stream:
            return await self.sse(self.completion_chunks(head, prompts, sampling, req.logprobs is not None))
        with self.slot():
            out = await self.generate(prompts, sampling, request)
        choices = []
        for i, c in enumerate(c for g in out for c in g):
            text, finish = self.text_and_finish(c, sampling.stop)
            lp = None
            if req.logprobs is not None:
                lp = self.completion_logprobs(self.token_entries(c.token_ids, c.logprobs, len(text)))
            choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": finish})
        return {**head, "choices": choices, "usage": self.usage(prompts, out, sampling.n)}

    async def chat(self, req: ChatRequest, request: Request) -> Any:
        self.check_model(req.model)
        tools = self.tool_calls(req)
        if session := self.session_id(req, request):
            text = self.prompts.text(req, replay=self.sessions.tool_turns(session))
            max_tokens = req.max_completion_tokens or req.max_tokens
            return await self.session_call(req, request, session, text, max_tokens, chat=True, tools=tools)
        prompt = self.prompts.token_ids(req)
        tools = self.reader(tools, prompt)
        sampling = self.sampling(req, req.max_completion_tokens or req.max_tokens, [prompt])
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        head = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": req.model}
        if req.stream:
            head["object"] = "chat.completion.chunk"
            usage = req.stream_options is not None and req.stream_options.include_usage
            return await self.sse(
                self.chat_chunks(head, prompt, sampling, req.logprobs, bool(req.top_logprobs), tools, usage)
            )
        with self.slot():
            out = await self.generate([prompt], sampling, request)
        choices = []
        for i, c in enumerate(out[0]):
            text, finish = self.text_and_finish(c, sampling.stop)
            lp = None
            if req.logprobs:
                lp = self.chat_logprobs(
                    self.token_entries(c.token_ids, c.logprobs, len(text)), bool(req.top_logprobs)
                )
            message, finish = self.chat_message(text, finish, tools)
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": lp,
                    "finish_reason": finish,
                    "stop_reason": self.matched_stop(c.token_ids, sampling.stop),
                }
            )
        return {**head, "choices": choices, "usage": self.usage([prompt], out, sampling.n)}

    @staticmethod
    def chat_message(text: str, finish: str, tools: ChatReader | None) -> tuple[dict[str, Any], str]:
        """The assistant message of a completion's text, and its finish reason (``tool_calls`` with calls)."""
        if tools is None:
            return {"role": "assistant", "content": text}, finish
        read = tools.read(text)
        message: dict[str, Any] = {"role": "assistant", "content": read.content}
        if tools.reasoning is not None:
            message["reasoning_content"] = read.reasoning
        if not read.calls:
            return message, finish
        return {**message, "tool_calls": [_openai_call(c) for c in read.calls]}, "tool_calls"

    # ------------------------------------------------------------------------------ agent sessions (§10.6)

    @staticmethod
    def session_id(req: SamplingFields, request: Request) -> str | None:
        sid = request.headers.get("x-session-id") or req.session_id
        if sid is not None and not 0 < len(sid) <= 128:
            raise APIError(400, "X-Session-Id must be 1..128 characters", param="session_id")
        if sid is not None and (problem := text_problem(sid)):
            raise APIError(400, f"session_id: {problem}", param="session_id")
        return sid

    async def session_call(
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
            context = self.sessions.context(session, text)
        except SessionError as e:
            raise APIError(400, str(e), param="session_id") from None
        sampling = self.sampling(req, max_tokens, [context])
        if chat:
            tools = self.reader(tools, context)
        with self.slot():
            ((c,),) = await self.generate([context], sampling, request)
        returned, finish = self.text_and_finish(c, sampling.stop)
        self.sessions.record(session, text, c, returned, context=context)
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": req.model,
            "usage": self.usage([context], [[c]], 1),
        }
        if chat:
            message, finish = self.chat_message(returned, finish, tools)
            if message.get("tool_calls"):
                self.sessions.remember_tool_turn(session, [x["id"] for x in message["tool_calls"]], returned)
            choice = {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": self.matched_stop(c.token_ids, sampling.stop),
            }
            return {**head, "object": "chat.completion", "choices": [choice]}
        choice = {"index": 0, "text": returned, "logprobs": None, "finish_reason": finish}
        return {**head, "object": "text_completion", "choices": [choice]}

    async def open_session(self) -> dict[str, Any]:
        """Open a session; calls and the finish name it by the id issued here (no other id is taken)."""
        try:
            return {"id": self.sessions.issue(), "object": "session"}
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
            segments = self.sessions.finish(
                session_id, clip_reward(req.reward, self.reward_clip), req.group_id
            )
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

    @staticmethod
    def usage(prompts: list[list[int]], out: list[list[Completion]], n: int) -> dict[str, int]:
        prompt_tokens = sum(len(p) for p in prompts) * n
        completion_tokens = sum(len(c.token_ids) for g in out for c in g)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    # ------------------------------------------------------------------------------------------ streaming

    def finish_reason(self, ch: _Choice, max_tokens: int) -> str:
        ended_early = ch.stopped or len(ch.tokens) < max_tokens or ch.tokens[-1] in self.special_ids
        return "stop" if ended_early else "length"

    async def completion_chunks(
        self, head: dict[str, Any], prompts: list[list[int]], sampling: SamplingParams, logprobs: bool
    ) -> AsyncIterator[dict[str, Any]]:
        choices = [_Choice() for _ in range(len(prompts) * sampling.n)]
        async for row, text, entries, ch in self._tracked(prompts, sampling, choices):
            lp = self.completion_logprobs(entries, ch.sent_chars - len(text)) if logprobs else None
            yield {**head, "choices": [{"index": row, "text": text, "logprobs": lp, "finish_reason": None}]}
        for row, ch in enumerate(choices):
            reason = self.finish_reason(ch, sampling.max_new_tokens)
            yield {**head, "choices": [{"index": row, "text": "", "logprobs": None, "finish_reason": reason}]}

    async def chat_chunks(
        self,
        head: dict[str, Any],
        prompt: list[int],
        sampling: SamplingParams,
        logprobs: bool,
        top: bool,
        tools: ChatReader | None = None,
        usage: bool = False,
    ) -> AsyncIterator[dict[str, Any]]:
        """Chat chunks. With a reader (tools, a reasoning format), each choice's text goes through its
        :class:`ChatStream`: reasoning as ``reasoning_content`` deltas, content until a call could begin;
        when the choice ends its calls are sent as one ``tool_calls`` delta.
        ``usage``: a last chunk without choices carries the usage (``stream_options.include_usage``)."""
        choices = [_Choice() for _ in range(sampling.n)]
        streams = [tools.stream() for _ in choices] if tools else []
        held: list[list[tuple[str, float, int]]] = [[] for _ in choices]  # logprobs not sent yet
        started: set[int] = set()  # choices whose first delta (which carries the role) was sent

        def delta(row: int, **content: Any) -> dict[str, Any]:
            first = row not in started
            started.add(row)
            return {"role": "assistant", **content} if first else content

        def chunk(
            row: int, entries: list[tuple[str, float, int]] | None, reason: str | None = None, **content: Any
        ) -> dict[str, Any]:
            lp = self.chat_logprobs(entries, top) if logprobs and entries is not None else None
            choice = {"index": row, "delta": delta(row, **content), "logprobs": lp, "finish_reason": reason}
            return {**head, "choices": [choice]}

        async for row, text, entries, _ in self._tracked([prompt], sampling, choices):
            if not streams:
                yield chunk(row, entries, content=text)
                continue
            held[row] += entries
            for d in streams[row].feed(text):
                yield chunk(row, held[row], **d)
                held[row] = []
        for row, ch in enumerate(choices):
            reason = self.finish_reason(ch, sampling.max_new_tokens)
            for d in streams[row].finish() if streams else []:
                if "tool_calls" in d:
                    reason = "tool_calls"
                    calls = enumerate(d.pop("tool_calls"))
                    d = {"tool_calls": [{"index": k, **_openai_call(c)} for k, c in calls]}
                yield chunk(row, held[row], **d)
                held[row] = []
            last = chunk(row, held[row] or None, reason)
            last["choices"][0]["stop_reason"] = self.matched_stop(ch.tokens, sampling.stop)
            yield last
        if usage:
            out = [[Completion(ch.tokens, ch.logprobs, "stop", []) for ch in choices]]
            yield {**head, "choices": [], "usage": self.usage([prompt], out, sampling.n)}

    async def _tracked(
        self, prompts: list[list[int]], sampling: SamplingParams, choices: list[_Choice]
    ) -> AsyncIterator[tuple[int, str, list[tuple[str, float, int]], _Choice]]:
        """Text deltas per row. Text that could be the start of a stop string (or an incomplete character)
        is held back until it cannot be, so no stop string ever leaks into the stream."""
        hold = max(map(len, sampling.stop), default=1) - 1
        async for row, token, logp in self.stream_tokens(prompts, sampling):
            ch = choices[row]
            if ch.stopped:
                continue
            ch.tokens.append(token)
            ch.logprobs.append(logp)
            text, ch.stopped = cut_at_stop(self.decode(ch.tokens), sampling.stop)
            safe = len(text) if ch.stopped else len(text) - hold
            while safe > ch.sent_chars and text[safe - 1] == "\ufffd":  # an incomplete multi-byte character
                safe -= 1
            entries = self.token_entries(ch.tokens[ch.sent_tokens :], ch.logprobs[ch.sent_tokens :])
            ch.sent_tokens = len(ch.tokens)
            new = text[ch.sent_chars : max(safe, ch.sent_chars)]
            ch.sent_chars += len(new)
            if new or entries:
                yield row, new, entries, ch
        for row, ch in enumerate(choices):  # held-back text that no stop string followed
            text, _ = cut_at_stop(self.decode(ch.tokens), sampling.stop)
            if len(text) > ch.sent_chars:
                new, ch.sent_chars = text[ch.sent_chars :], len(text)
                yield row, new, [], ch

    async def sse(self, chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
        """Stream chunks as server-sent events. The first chunk is awaited before the response starts, so
        an engine that rejects the request still gets a proper 400 rather than an in-band error. The
        stream holds a generation slot until it ends or the client goes away."""
        chunks = self._holding_slot(chunks)
        try:
            first = await anext(chunks)
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None

        async def events() -> AsyncIterator[str]:
            yield f"data: {json.dumps(first)}\n\n"
            try:
                async for chunk in chunks:
                    yield f"data: {json.dumps(chunk)}\n\n"
            except Exception as e:  # headers are sent: report in-band, as OpenAI does
                log.exception("streaming failed")
                error = {"message": str(e), "type": "server_error", "param": None, "code": None}
                yield f"data: {json.dumps({'error': error})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def _holding_slot(self, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        with self.slot():
            async for chunk in chunks:
                yield chunk

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "tandem"}
            ],
        }


class _ClientGone(Exception):
    """Raised inside the engine's decode loop when the client went away: the rest of the work is dropped."""


async def _watch_disconnect(request: Request, cancelled: threading.Event) -> None:
    """Set ``cancelled`` once the client of ``request`` disconnects (cancel this task to stop watching)."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    cancelled.set()


def create_app(
    engine: Engine,
    tokenizer: PreTrainedTokenizerBase,
    *,
    model_name: str,
    http: HTTPConfig,
    metrics: ServerMetrics,
    max_context: int | None = None,
    aliases: tuple[str, ...] = (),
    sink: Callable[[Trajectory], None] | None = None,
    reward_clip: float | None = None,
) -> FastAPI:
    """The FastAPI app of one server. ``max_context`` bounds prompt + max_tokens (None: no check here);
    ``reward_clip``: a finished session's reward is clipped to [-clip, clip] (``reward.clip``)."""
    api = API(
        engine,
        tokenizer,
        model_name=model_name,
        http=http,
        metrics=metrics,
        max_context=max_context,
        aliases=aliases,
        sink=sink,
        reward_clip=reward_clip,
    )
    app = FastAPI(title="tandem rollout server", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, api_key=http.api_key, metrics=metrics)
    app.add_middleware(BodyLimit, limit=http.max_request_bytes)
    add_error_handlers(app)
    add_routes(app, api, engine, metrics, model_name)
    return app


def add_error_handlers(app: FastAPI) -> None:
    """Every failure answers in OpenAI's error shape (400 for what the client sent, 500 for our bugs),
    and a client that went away is logged rather than answered."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0]
        loc = [str(x) for x in err["loc"] if x != "body"]
        if err["type"] == "json_invalid":
            return error_response(
                400, "the request body is not valid JSON", "invalid_request_error", code="invalid_json"
            )
        if err["type"] == "invalid_text":  # raised on the whole body, naming the field itself
            param = err["ctx"]["param"] or None
            return error_response(400, f"{param or 'body'}: {err['msg']}", "invalid_request_error", param)
        if not loc:
            return error_response(400, "the request body must be a JSON object", "invalid_request_error")
        param = ".".join(loc)
        return error_response(400, f"{param}: {err['msg']}", "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        if isinstance(e.__cause__, RecursionError):  # json.loads recursed past the stack
            return error_response(
                400,
                f"the request body nests too deep to parse; the limit is {limits.MAX_JSON_DEPTH} "
                "levels (max_json_depth)",
                "invalid_request_error",
                code="json_limit_exceeded",
            )
        if isinstance(bad := e.__cause__, UnicodeDecodeError):  # FastAPI's 400 for a body json.loads refused
            return error_response(
                400,
                f"the request body is not valid UTF-8: {bad.reason} at byte {bad.start}",
                "invalid_request_error",
                code="invalid_utf8",
            )
        return error_response(e.status_code, str(e.detail), "invalid_request_error")

    @app.exception_handler(_ClientGone)
    async def client_gone(request: Request, e: _ClientGone) -> Response:
        log.info("%s: the client disconnected; generation cancelled", request.url.path)
        return Response(status_code=CLIENT_GONE_STATUS)

    @app.exception_handler(Exception)
    async def crashed(request: Request, e: Exception) -> JSONResponse:
        log.exception("request failed")
        return error_response(500, f"internal error: {type(e).__name__}", "server_error")


def add_routes(app: FastAPI, api: API, engine: Engine, metrics: ServerMetrics, model_name: str) -> None:
    """The OpenAI routes (``api``'s methods), and the health and Prometheus endpoints beside them."""
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat)
    app.get("/v1/models")(api.models)
    app.post("/v1/sessions")(api.open_session)
    app.post("/v1/sessions/{session_id}/finish")(api.finish_session)
    app.include_router(messages_api.router(api))
    app.include_router(responses_api.router(api))
    app.state.api = api

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model_name, "version": engine.version}

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
