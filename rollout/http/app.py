"""The rollout server's OpenAI-compatible HTTP API: the FastAPI app, its routes and error handlers, and
the :class:`API` that serves them on one engine (docs/design.md §1.3).

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (non-streaming and SSE streaming,
``n``, ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stop``, ``seed``, ``logprobs``; on chat,
function calling with ``tools``, ``tool_choice`` and ``parallel_tool_calls``, docs/environments.md §10.8),
``POST /v1/messages`` and ``POST /v1/responses`` (Anthropic's Messages API and OpenAI's Responses API,
each translated onto the chat path in a module of its own, docs/environments.md §10.10),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text from the server's own registry),
and ``POST /v1/sessions`` and ``POST /v1/sessions/{id}/finish`` (a black-box agent's session as a
trajectory, docs/environments.md §10.6, :mod:`rollout.http.session_api`).
The same engine serves the rollout loop; the engine serialises the two (the hf engine per decode step).

A request goes one way, whatever its route: its model, prompts and sampling parameters are checked and
turned into the engine's inputs (:mod:`rollout.http.inputs`); it generates holding one of
``max_concurrent_requests`` slots (:meth:`API.slot`, no queue); the engine's completions come back as
OpenAI's choices (:mod:`rollout.http.choices`), whole or streamed as chunks (:mod:`rollout.http.streaming`).

Hardening (docs/design.md §6.4): binds to loopback by default; an optional bearer token guards ``/v1/*``; bodies
over ``max_request_bytes`` get 413 before they are read (:mod:`rollout.http.middleware`); a body that is not
UTF-8, or holds a string with a lone surrogate or NUL (any field, nested or not), gets 400 naming the field
(:mod:`rollout.http.schemas`); ``max_tokens``, prompts and tokens per request are bounded
(:mod:`rollout.http.inputs`); past ``max_concurrent_requests`` requests in flight, the next gets 429 at
once. A client that disconnects cancels its generation, streamed or not (:mod:`rollout.http.disconnect`).
Every failure is a JSON error in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` with a
4xx status, and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import PreTrainedTokenizerBase

from buffer.schema import Trajectory
from rollout.engines.base import Completion, Engine, SamplingParams
from rollout.http import limits, messages_api, responses_api
from rollout.http.chat_prompt import ChatPrompts
from rollout.http.choices import Choices, usage
from rollout.http.disconnect import CLIENT_GONE_STATUS, ClientGone, between_steps, watch_disconnect
from rollout.http.images import read_images
from rollout.http.inputs import EngineInputs
from rollout.http.middleware import BodyLimit, Guard
from rollout.http.schemas import APIError, ChatRequest, CompletionRequest, error_response
from rollout.http.session_api import SessionAPI
from rollout.http.sessions import SessionStore
from rollout.http.streaming import Images, Streaming, sse, with_images
from rollout.metrics import ServerMetrics
from tandem.config import HTTPConfig
from tandem.vision import VisionProcessor

log = logging.getLogger(__name__)


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
        adapters: tuple[str, ...] = (),
        sink: Callable[[Trajectory], None] | None = None,
        reward_clip: float | None = None,
    ) -> None:
        self.engine, self.http, self.metrics = engine, http, metrics
        self.model_name, self.created, self.adapters = model_name, int(time.time()), adapters
        self.inputs = EngineInputs(
            tokenizer, http, names={model_name, *aliases}, max_context=max_context, adapters=adapters
        )
        self.prompts = ChatPrompts(tokenizer)
        self.choices = Choices(tokenizer, http)
        self.streaming = Streaming(engine, metrics, self.choices)
        self.sessions = SessionAPI(
            SessionStore(tokenizer, on_rewrite=http.session.on_rewrite),
            inputs=self.inputs,
            choices=self.choices,
            prompts=self.prompts,
            generate=self.generate,
            http=http,
            sink=sink,
            reward_clip=reward_clip,
        )
        self.vision: VisionProcessor | None = getattr(engine, "vision", None)  # a vision-language model's
        self.active = 0  # requests holding a generation slot
        self._slots_lock = threading.Lock()

    # ------------------------------------------------------------------------------------ generation

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

    async def _holding_slot(self, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        """A stream holds a generation slot until it ends or the client goes away."""
        with self.slot():
            async for chunk in chunks:
                yield chunk

    async def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, request: Request, images: Images = None
    ) -> list[list[Completion]]:
        """Generate for a non-streaming request, under a slot; a client that disconnects meanwhile
        cancels the work. ``images``: each prompt's image inputs, for a vision-language model."""
        with self.slot():
            cancelled = threading.Event()
            watcher = asyncio.create_task(watch_disconnect(request, cancelled))
            try:
                out = await run_in_threadpool(
                    self.engine.generate,
                    prompts,
                    sampling,
                    between_steps=between_steps(cancelled),
                    **with_images(images),
                )
            except ValueError as e:
                raise APIError(400, str(e), param="prompt") from None
            finally:
                watcher.cancel()
            tokens = sum(len(c.token_ids) for g in out for c in g)
            self.metrics.generated_tokens.labels(source="http").inc(tokens)
        return out

    # ------------------------------------------------------------------------------------- endpoints

    async def completions(self, req: CompletionRequest, request: Request) -> Any:
        self.inputs.check_model(req.model)
        if session := self.sessions.session_id(req, request):
            return await self.sessions.completion(req, request, session)
        prompts = self.inputs.completion_prompts(req)
        sampling = self.inputs.sampling(req, req.max_tokens, prompts)
        rid = f"cmpl-{uuid.uuid4().hex}"
        head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": req.model}
        logprobs = req.logprobs is not None
        if req.stream:
            chunks = self.streaming.completion_chunks(head, prompts, sampling, logprobs)
            return await sse(self._holding_slot(chunks))
        out = await self.generate(prompts, sampling, request)
        choices = self.choices.completion_choices(out, sampling.stop, logprobs)
        return {**head, "choices": choices, "usage": usage(prompts, out, sampling.n)}

    async def chat(self, req: ChatRequest, request: Request) -> Any:
        self.inputs.check_model(req.model)
        tools = self.choices.tool_calls(req)
        pictures = read_images(req, self.vision)
        if session := self.sessions.session_id(req, request):
            if pictures:
                raise APIError(400, "an agent session takes no images yet", param="session_id")
            return await self.sessions.chat(req, request, session, tools)
        images: Images = None
        if pictures:  # the template's placeholders, each expanded to the tokens its image fills
            prompt, vision = self.vision.expand(self.prompts.text(req), pictures)
            images = [vision]
        else:
            prompt = self.prompts.token_ids(req)
        tools = self.choices.reader(tools, prompt)
        sampling = self.inputs.sampling(req, req.max_completion_tokens or req.max_tokens, [prompt])
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        head = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": req.model}
        top = bool(req.top_logprobs)
        if req.stream:
            head["object"] = "chat.completion.chunk"
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            chunks = self.streaming.chat_chunks(
                head, prompt, sampling, req.logprobs, top, tools, include_usage, images
            )
            return await sse(self._holding_slot(chunks))
        out = await self.generate([prompt], sampling, request, images)
        choices = self.choices.chat_choices(out[0], sampling.stop, req.logprobs, top, tools)
        return {**head, "choices": choices, "usage": usage([prompt], out, sampling.n)}

    def models(self) -> dict[str, Any]:
        """The base model, then each served LoRA adapter with the base as its ``parent`` (as vLLM lists them)."""
        card = {"object": "model", "created": self.created, "owned_by": "tandem"}
        return {
            "object": "list",
            "data": [
                {"id": self.model_name, **card},
                *({"id": name, **card, "parent": self.model_name} for name in self.adapters),
            ],
        }


def create_app(
    engine: Engine,
    tokenizer: PreTrainedTokenizerBase,
    *,
    model_name: str,
    http: HTTPConfig,
    metrics: ServerMetrics,
    max_context: int | None = None,
    aliases: tuple[str, ...] = (),
    adapters: tuple[str, ...] = (),
    sink: Callable[[Trajectory], None] | None = None,
    reward_clip: float | None = None,
) -> FastAPI:
    """The FastAPI app of one server. ``max_context`` bounds prompt + max_tokens (None: no check here);
    ``adapters``: the LoRA adapters the engine serves, each a ``model`` of its own; ``reward_clip``: a
    finished session's reward is clipped to [-clip, clip] (``reward.clip``)."""
    api = API(
        engine,
        tokenizer,
        model_name=model_name,
        http=http,
        metrics=metrics,
        max_context=max_context,
        aliases=aliases,
        adapters=adapters,
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

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, e: ClientGone) -> Response:
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
    app.post("/v1/sessions")(api.sessions.open_session)
    app.post("/v1/sessions/{session_id}/finish")(api.sessions.finish_session)
    app.include_router(messages_api.router(api))
    app.include_router(responses_api.router(api))
    app.state.api = api

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model_name, "version": engine.version}

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
