"""Anthropic's Messages API, ``POST /v1/messages``, as a translation onto the chat path (docs/environments.md §10.10).

A request becomes a chat request: ``system`` (a string or text blocks) the system message; ``text``
blocks content; an assistant's ``tool_use`` blocks its ``tool_calls`` (``input`` as the arguments); a user's
``tool_result`` blocks tool messages; ``tools`` (``input_schema``) functions; ``tool_choice`` ``auto``,
``any``, ``tool`` and ``none`` the chat's ``auto``, ``required``, named and ``none``
(``disable_parallel_tool_use``: ``parallel_tool_calls`` false); ``stop_sequences`` stop strings. The chat
path generates (sessions and the ``X-Session-Id`` header included), and its completion becomes a message:
``thinking`` (when the chat message carries ``reasoning_content``), ``text`` and ``tool_use`` blocks,
``stop_reason`` ``tool_use``, ``end_turn``, ``max_tokens`` or ``stop_sequence`` (with the sequence), and
the usage. A stream is the chat stream translated into Anthropic's events. Tool-use ids are the chat path's
call ids, so a session replays an echoed ``tool_use`` as the text the model sampled.

Refused with 400 naming the field: a block type other than ``text``, ``tool_use``, ``tool_result`` and
``thinking`` (images, documents), a tool that is not a custom tool (Anthropic's server tools), and a
``tool_result`` that holds anything but text. Errors answer in Anthropic's shape,
``{"type": "error", "error": {"type", "message"}}``, with the chat path's wording (which names the field).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field

from rollout.http.schemas import (
    ANTHROPIC_PATH,
    MAX_STOP,
    APIError,
    SamplingFields,
    anthropic_error,
)
from rollout.http.surface import call_arguments, chat_chunks, chat_request, parsed, sse

# the chat path's finish reason -> Anthropic's stop reason
STOP_REASONS = {"tool_calls": "tool_use", "stop": "end_turn", "length": "max_tokens"}
BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TextBlock(_Strict):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[dict[str, Any]] = ""
    is_error: bool = False


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


_BLOCKS: dict[str, type[_Strict]] = {
    "text": TextBlock,
    "tool_use": ToolUseBlock,
    "tool_result": ToolResultBlock,
    "thinking": ThinkingBlock,
}


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class Tool(_Strict):
    type: str | None = None  # "custom" or absent; Anthropic's server tools are refused
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class MessagesRequest(SamplingFields):
    """Anthropic's request; ``max_tokens`` is required, as Anthropic requires it. The shared sampling
    fields keep their bounds, except that ``temperature`` is at most 1, as Anthropic bounds it."""

    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP)
    temperature: float = Field(1.0, ge=0, le=1, allow_inf_nan=False)
    tools: list[dict[str, Any]] | None = None  # checked as :class:`Tool` once their type is known
    tool_choice: ToolChoice | None = None


# ---------------------------------------------------------------------------------------- the request


def chat_fields(req: MessagesRequest) -> dict[str, Any]:
    """The chat request ``req`` stands for, as fields of :class:`ChatRequest`."""
    messages = [] if req.system is None else [{"role": "system", "content": _system_text(req.system)}]
    for i, m in enumerate(req.messages):
        messages += _chat_messages(i, m)
    fields: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_tokens": req.max_tokens,
        "stream": req.stream,
        **req.model_dump(include={"temperature", "top_p", "top_k", "seed", "session_id"}, exclude_none=True),
    }
    if req.stream:
        fields["stream_options"] = {"include_usage": True}
    if req.stop_sequences:
        fields["stop"] = req.stop_sequences
    if req.tools:
        fields["tools"] = [_tool(i, t) for i, t in enumerate(req.tools)]
    if (c := req.tool_choice) is not None:
        if c.type == "tool" and not c.name:
            raise APIError(400, 'tool_choice.name: a "tool" choice names the tool', param="tool_choice.name")
        named = {"type": "function", "function": {"name": c.name}}
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(c.type, named)
        fields["parallel_tool_calls"] = not c.disable_parallel_tool_use
    return fields


def _tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    """A custom tool as a chat function; Anthropic's server tools (typed, without a schema) get 400."""
    if tool.get("type") not in (None, "custom"):
        param = f"tools.{i}.type"
        raise APIError(
            400, f"{param}: {tool['type']!r} tools are not served here; only custom tools", param=param
        )
    t = parsed(Tool, tool, f"tools.{i}")
    # in the chat API's key order, so a template that prints the tool's JSON prints the same prompt
    described = {} if t.description is None else {"description": t.description}
    return {"type": "function", "function": {"name": t.name, **described, "parameters": t.input_schema}}


def _system_text(system: str | list[dict[str, Any]]) -> str:
    if isinstance(system, str):
        return system
    return "".join(parsed(TextBlock, b, f"system.{j}").text for j, b in enumerate(system))


def _blocks(i: int, m: Message) -> list[_Strict]:
    """The message's content blocks, each checked; a type this server does not take gets 400 naming it."""
    if isinstance(m.content, str):
        return [TextBlock(type="text", text=m.content)]
    out = []
    for j, b in enumerate(m.content):
        kind = b.get("type")
        if kind not in _BLOCKS:
            param = f"messages.{i}.content.{j}.type"
            raise APIError(
                400,
                f"{param}: {kind!r} blocks are not served here; the types taken are {', '.join(BLOCK_TYPES)}",
                param=param,
            )
        out.append(parsed(_BLOCKS[kind], b, f"messages.{i}.content.{j}"))
    return out


def _chat_messages(i: int, m: Message) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: an assistant's text and calls are one message; a user's
    tool results are tool messages, in order, around the user's text."""
    blocks = _blocks(i, m)
    allowed = {"user": (TextBlock, ToolResultBlock), "assistant": (TextBlock, ToolUseBlock, ThinkingBlock)}
    for j, b in enumerate(blocks):
        if not isinstance(b, allowed[m.role]):
            param = f"messages.{i}.content.{j}.type"
            raise APIError(400, f"{param}: a {m.role} message holds no {b.type!r} blocks", param=param)
    if m.role == "assistant":  # earlier thinking is dropped, as chat templates drop earlier reasoning
        text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
        calls = [
            {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
            for b in blocks
            if isinstance(b, ToolUseBlock)
        ]
        return (
            [{"role": "assistant", "content": text or None, "tool_calls": calls}]
            if calls
            else [{"role": "assistant", "content": text}]
        )
    out: list[dict[str, Any]] = []
    for j, b in enumerate(blocks):
        if isinstance(b, ToolResultBlock):
            content = _result_text(b, f"messages.{i}.content.{j}.content")
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": content})
        elif out and out[-1]["role"] == "user":
            out[-1]["content"] += b.text  # type: ignore[union-attr]
        else:
            out.append({"role": "user", "content": b.text})  # type: ignore[union-attr]
    return out


def _result_text(b: ToolResultBlock, param: str) -> str:
    if isinstance(b.content, str):
        return b.content
    for k, part in enumerate(b.content):
        if part.get("type") != "text":
            raise APIError(
                400,
                f"{param}.{k}.type: a tool result holds text blocks only (got {part.get('type')!r})",
                param=f"{param}.{k}.type",
            )
    return "".join(parsed(TextBlock, p, f"{param}.{k}").text for k, p in enumerate(b.content))


# --------------------------------------------------------------------------------------- the response


def message(chat: dict[str, Any], model: str) -> dict[str, Any]:
    """A ``chat.completion`` as Anthropic's message."""
    (choice,) = chat["choices"]
    m = choice["message"]
    content: list[dict[str, Any]] = []
    if m.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": m["reasoning_content"], "signature": ""})
    if m.get("content"):
        content.append({"type": "text", "text": m["content"]})
    for c in m.get("tool_calls") or []:
        f = c["function"]
        content.append(
            {"type": "tool_use", "id": c["id"], "name": f["name"], "input": call_arguments(f["arguments"])}
        )
    return {
        **_head(model, chat["id"]),
        "content": content,
        **stop(choice),
        "usage": {
            "input_tokens": chat["usage"]["prompt_tokens"],
            "output_tokens": chat["usage"]["completion_tokens"],
        },
    }


def stop(choice: dict[str, Any]) -> dict[str, Any]:
    """``stop_reason`` and ``stop_sequence`` of a chat choice; the chat path names the stop string it met
    in ``stop_reason`` (vLLM's field), which is Anthropic's ``stop_sequence``."""
    hit = choice.get("stop_reason") if choice["finish_reason"] == "stop" else None
    if isinstance(hit, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": hit}
    return {"stop_reason": STOP_REASONS[choice["finish_reason"]], "stop_sequence": None}


def _head(model: str, chat_id: str) -> dict[str, Any]:
    return {
        "id": f"msg_{chat_id.removeprefix('chatcmpl-') or uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "stop_reason": None,
        "stop_sequence": None,
    }


async def events(
    chunks: AsyncIterator[dict[str, Any]], model: str
) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """The chat stream's chunks as Anthropic's stream: ``message_start``, for each content block a
    ``content_block_start``, its deltas and a ``content_block_stop``, then ``message_delta`` (stop reason,
    usage) and ``message_stop``; an in-band chat error becomes an ``error`` event."""
    blocks = _Blocks()
    usage, started = {"input_tokens": 0, "output_tokens": 0}, False
    reason = {"stop_reason": "end_turn", "stop_sequence": None}
    async for chunk in chunks:
        if "error" in chunk:
            yield (
                "error",
                {"type": "error", "error": {"type": "api_error", "message": chunk["error"]["message"]}},
            )
            return
        if not started:
            started = True
            start = {**_head(model, chunk["id"]), "content": [], "usage": dict(usage)}
            yield "message_start", {"type": "message_start", "message": start}
        if chunk.get("usage"):
            usage = {
                "input_tokens": chunk["usage"]["prompt_tokens"],
                "output_tokens": chunk["usage"]["completion_tokens"],
            }
        for choice in chunk["choices"]:
            for event in blocks.feed(choice["delta"]):
                yield event
            if choice["finish_reason"] is not None:
                reason = stop(choice)
    for event in blocks.close():
        yield event
    yield (
        "message_delta",
        {"type": "message_delta", "delta": reason, "usage": usage},
    )
    yield "message_stop", {"type": "message_stop"}


class _Blocks:
    """The content blocks of a stream: a delta of another kind than the open block closes it and opens one."""

    def __init__(self) -> None:
        self.index, self.open = -1, None  # the open block's index and kind

    def feed(self, delta: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        out = []
        if text := delta.get("reasoning_content"):
            out += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": text}))
        if text := delta.get("content"):
            out += self._start("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": text}))
        for c in delta.get("tool_calls") or []:  # the chat stream sends each call whole
            out += self._start(
                None, {"type": "tool_use", "id": c["id"], "name": c["function"]["name"], "input": {}}
            )
            self.open = "tool_use"
            out.append(self._delta({"type": "input_json_delta", "partial_json": c["function"]["arguments"]}))
        return out

    def close(self) -> list[tuple[str, dict[str, Any]]]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _start(self, kind: str | None, block: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        if kind is not None and self.open == kind:
            return []
        out = self.close()
        self.index, self.open = self.index + 1, kind
        return [
            *out,
            (
                "content_block_start",
                {"type": "content_block_start", "index": self.index, "content_block": block},
            ),
        ]

    def _delta(self, delta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}


# ------------------------------------------------------------------------------------------ the route


class AnthropicErrors(APIRoute):
    """A route whose failures answer in Anthropic's error shape: the app's own handler words the error
    (OpenAI's shape, naming the field), and its message and status are carried over."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as e:
                handlers = request.app.exception_handlers
                answer = next((handlers[c] for c in type(e).__mro__ if c in handlers), None)
                if answer is None:
                    raise
                response = await answer(request, e)
                if not isinstance(response, JSONResponse):  # a client gone: nobody reads it
                    return response
                return anthropic_error(response.status_code, json.loads(response.body)["error"]["message"])

        return route


def router(api: Any) -> APIRouter:
    """``POST /v1/messages`` on ``api`` (:class:`rollout.http.app.API`)."""
    routes = APIRouter(route_class=AnthropicErrors)

    @routes.post(ANTHROPIC_PATH)
    async def messages(req: MessagesRequest, request: Request) -> Any:
        answer = await api.chat(chat_request(chat_fields(req)), request)
        if isinstance(answer, StreamingResponse):
            return sse(events(chat_chunks(answer), req.model))
        return message(answer, req.model)

    return routes
