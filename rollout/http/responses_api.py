"""OpenAI's Responses API, ``POST /v1/responses``, as a translation onto the chat path (docs/environments.md §10.10).

A request becomes a chat request: ``instructions`` the system message; ``input`` a user message (a string)
or items: messages (``input_text`` / ``output_text`` parts or a string), ``function_call`` items (an
assistant's ``tool_calls``, consecutive ones one message) and ``function_call_output`` items (tool
messages); function tools in the Responses' flat shape; ``tool_choice``, ``parallel_tool_calls``,
``max_output_tokens``. The chat path generates (sessions and the ``X-Session-Id`` header included), and its
completion becomes output items: ``reasoning`` (when the chat message carries ``reasoning_content``), a
``message`` with ``output_text``, and ``function_call`` items whose ``call_id`` is the chat path's call id,
so a session replays an echoed call as the text the model sampled. A stream is the chat stream translated
into the Responses' events.

The server is stateless: ``previous_response_id``, ``conversation`` and ``store: true`` are refused with a
400 naming the field (send the whole conversation as ``input``), as are item types other than those above
(images, files, built-in tools' items), tools other than functions, and a ``text.format`` other than text.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from rollout.http.schemas import APIError, FunctionDefinition, SamplingFields
from rollout.http.surface import chat_chunks, chat_request, parsed, sse

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
_PART_TYPES = {
    "user": "input_text",
    "system": "input_text",
    "developer": "input_text",
    "assistant": "output_text",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class FunctionTool(FunctionDefinition):
    """A function tool in the Responses' flat shape: ``{"type": "function", "name", "parameters", ...}``."""

    type: Literal["function"]


class NamedChoice(_Strict):
    type: Literal["function"]
    name: str


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[dict[str, Any]]


class ResponsesRequest(SamplingFields):
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedChoice | None = None
    parallel_tool_calls: bool = True
    # stateless: refused unless absent (or null, or false for store)
    previous_response_id: str | None = None
    conversation: Any = None
    store: bool | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None


# ---------------------------------------------------------------------------------------- the request


def chat_fields(req: ResponsesRequest) -> dict[str, Any]:
    """The chat request ``req`` stands for, as fields of :class:`ChatRequest`; what a stateless server
    cannot serve gets 400 naming the field."""
    for name, refused in (
        ("previous_response_id", req.previous_response_id is not None),
        ("conversation", req.conversation is not None),
        ("store", req.store is True),
    ):
        if refused:
            raise APIError(
                400,
                f"{name}: this server keeps no responses (stateless); send the whole conversation as input"
                + (" and leave store unset or false" if name == "store" else ""),
                param=name,
            )
    if req.text is not None and (req.text.get("format") or {}).get("type", "text") != "text":
        raise APIError(400, "text.format: only plain text output is served here", param="text.format")
    messages = [] if req.instructions is None else [{"role": "system", "content": req.instructions}]
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
    else:
        for i, item in enumerate(req.input):
            _add_item(messages, i, item)
    fields: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "stream": req.stream,
        "parallel_tool_calls": req.parallel_tool_calls,
        # ``stop`` and ``top_k`` are extensions, as on the chat API
        **req.model_dump(
            include={"temperature", "top_p", "top_k", "seed", "stop", "session_id"}, exclude_none=True
        ),
    }
    if req.max_output_tokens is not None:
        fields["max_tokens"] = req.max_output_tokens
    if req.stream:
        fields["stream_options"] = {"include_usage": True}
    if req.tools:
        fields["tools"] = [_tool(i, t) for i, t in enumerate(req.tools)]
    if isinstance(c := req.tool_choice, NamedChoice):
        fields["tool_choice"] = {"type": "function", "function": {"name": c.name}}
    elif c is not None:
        fields["tool_choice"] = c
    return fields


def _tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        param = f"tools.{i}.type"
        raise APIError(
            400, f"{param}: {tool.get('type')!r} tools are not served here; only function tools", param=param
        )
    t = parsed(FunctionTool, tool, f"tools.{i}")
    return {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}


def _add_item(messages: list[dict[str, Any]], i: int, item: dict[str, Any]) -> None:
    """Append input item ``i`` to the chat ``messages``."""
    kind = item.get("type", "message")
    if kind not in ITEM_TYPES:
        param = f"input.{i}.type"
        raise APIError(
            400,
            f"{param}: {kind!r} items are not served here; the types taken are {', '.join(ITEM_TYPES)}",
            param=param,
        )
    if kind == "reasoning":  # earlier reasoning is dropped, as chat templates drop it
        return
    if kind == "function_call":
        c = parsed(FunctionCallItem, item, f"input.{i}")
        call = {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and "content" in last:
            last.setdefault("tool_calls", []).append(call)
            last["content"] = last["content"] or None
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        return
    if kind == "function_call_output":
        o = parsed(FunctionCallOutputItem, item, f"input.{i}")
        messages.append(
            {
                "role": "tool",
                "tool_call_id": o.call_id,
                "content": _text(o.output, f"input.{i}.output", "input_text"),
            }
        )
        return
    m = parsed(MessageItem, item, f"input.{i}")
    messages.append({"role": m.role, "content": _text(m.content, f"input.{i}.content", _PART_TYPES[m.role])})


def _text(content: str | list[dict[str, Any]], param: str, part_type: str) -> str:
    """The text of a string or of text parts (``input_text``, or ``output_text`` in an assistant's)."""
    if isinstance(content, str):
        return content
    out = []
    for k, part in enumerate(content):
        if part.get("type") != part_type or not isinstance(part.get("text"), str):
            raise APIError(
                400,
                f"{param}.{k}: takes {part_type} parts with text only (got {part.get('type')!r})",
                param=f"{param}.{k}",
            )
        out.append(part["text"])
    return "".join(out)


# --------------------------------------------------------------------------------------- the response


def output_items(m: dict[str, Any], status: str = "completed") -> list[dict[str, Any]]:
    """A chat message's reasoning, text and calls as output items."""
    items = []
    if m.get("reasoning_content"):
        items.append(_reasoning(m["reasoning_content"], status))
    if m.get("content"):
        items.append(_message(m["content"], status))
    items += [_call(c, status) for c in m.get("tool_calls") or []]
    return items


def _reasoning(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {
        "id": item_id or f"rs_{uuid.uuid4().hex}",
        "type": "reasoning",
        "summary": [],
        "content": content,
        "status": status,
    }


def _message(text: str | None, status: str, item_id: str | None = None) -> dict[str, Any]:
    parts = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {
        "id": item_id or f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": parts,
    }


def _call(c: dict[str, Any], status: str, arguments: str | None = None) -> dict[str, Any]:
    f = c["function"]
    return {
        "id": f"fc_{c['id'].removeprefix('call_')}",
        "type": "function_call",
        "call_id": c["id"],
        "name": f["name"],
        "arguments": f["arguments"] if arguments is None else arguments,
        "status": status,
    }


def response(
    req: ResponsesRequest,
    rid: str,
    output: list[dict[str, Any]],
    usage: dict[str, int] | None,
    finish: str | None,
) -> dict[str, Any]:
    """The response object; ``finish`` None: still in progress; ``length``: incomplete."""
    status = "in_progress" if finish is None else "incomplete" if finish == "length" else "completed"
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "model": req.model,
        "output": output,
        "instructions": req.instructions,
        "tools": req.tools or [],
        "tool_choice": req.tool_choice.model_dump()
        if isinstance(req.tool_choice, NamedChoice)
        else req.tool_choice or "auto",
        "parallel_tool_calls": req.parallel_tool_calls,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "max_output_tokens": req.max_output_tokens,
        "previous_response_id": None,
        "metadata": req.metadata or {},
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "usage": None
        if usage is None
        else {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        },
    }


def answer(req: ResponsesRequest, chat: dict[str, Any]) -> dict[str, Any]:
    """A ``chat.completion`` as the Responses' response object."""
    (choice,) = chat["choices"]
    finish = choice["finish_reason"]
    output = output_items(choice["message"], "incomplete" if finish == "length" else "completed")
    return response(req, f"resp_{uuid.uuid4().hex}", output, chat["usage"], finish)


async def events(
    req: ResponsesRequest, chunks: AsyncIterator[dict[str, Any]]
) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """The chat stream's chunks as the Responses' stream: ``response.created``, ``response.in_progress``,
    for each output item ``response.output_item.added``, its parts and deltas and
    ``response.output_item.done``, then ``response.completed`` (``response.incomplete`` at the token
    limit); an in-band chat error becomes an ``error`` event and ``response.failed``."""
    out = _Items()
    rid, usage, finish = f"resp_{uuid.uuid4().hex}", None, "stop"
    yield out.event("response.created", response=response(req, rid, [], None, None))
    yield out.event("response.in_progress", response=response(req, rid, [], None, None))
    async for chunk in chunks:
        if "error" in chunk:
            e = chunk["error"]
            yield out.event("error", code=e.get("code"), message=e["message"], param=e.get("param"))
            failed = response(req, rid, out.done, None, "stop") | {
                "status": "failed",
                "error": {"code": "server_error", "message": e["message"]},
            }
            yield out.event("response.failed", response=failed)
            return
        usage = chunk.get("usage") or usage
        for choice in chunk["choices"]:
            for event in out.feed(choice["delta"]):
                yield event
            finish = choice["finish_reason"] or finish
    for event in out.close():
        yield event
    done = response(req, rid, out.done, usage, finish)
    yield out.event("response.incomplete" if finish == "length" else "response.completed", response=done)


class _Items:
    """The output items of a stream, numbered as they open; every event gets the next sequence number."""

    def __init__(self) -> None:
        self.seq = 0
        self.done: list[dict[str, Any]] = []  # closed items, in order
        self.kind: str | None = None  # the open item's kind: "reasoning" or "message"
        self.item_id, self.text = "", ""

    def event(self, name: str, **fields: Any) -> tuple[str, dict[str, Any]]:
        self.seq += 1
        return name, {"type": name, "sequence_number": self.seq - 1, **fields}

    def feed(self, delta: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        out = []
        if text := delta.get("reasoning_content"):
            out += self._open("reasoning")
            out.append(self.event("response.reasoning_text.delta", **self._at(), content_index=0, delta=text))
            self.text += text
        if text := delta.get("content"):
            out += self._open("message")
            out.append(
                self.event(
                    "response.output_text.delta", **self._at(), content_index=0, delta=text, logprobs=[]
                )
            )
            self.text += text
        for c in delta.get("tool_calls") or []:  # the chat stream sends each call whole
            out += self.close()
            item = _call(c, "completed")
            at = {"output_index": len(self.done), "item_id": item["id"]}
            out.append(
                self.event(
                    "response.output_item.added",
                    output_index=at["output_index"],
                    item=_call(c, "in_progress", ""),
                )
            )
            out.append(self.event("response.function_call_arguments.delta", **at, delta=item["arguments"]))
            out.append(self.event("response.function_call_arguments.done", **at, arguments=item["arguments"]))
            out.append(self.event("response.output_item.done", output_index=at["output_index"], item=item))
            self.done.append(item)
        return out

    def close(self) -> list[tuple[str, dict[str, Any]]]:
        """Events that close the open item, if any."""
        if self.kind is None:
            return []
        at, out = self._at(), []
        if self.kind == "message":
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
            out.append(
                self.event("response.output_text.done", **at, content_index=0, text=self.text, logprobs=[])
            )
            out.append(self.event("response.content_part.done", **at, content_index=0, part=part))
            item = _message(self.text, "completed", self.item_id)
        else:
            out.append(self.event("response.reasoning_text.done", **at, content_index=0, text=self.text))
            item = _reasoning(self.text, "completed", self.item_id)
        out.append(self.event("response.output_item.done", output_index=at["output_index"], item=item))
        self.done.append(item)
        self.kind = None
        return out

    def _open(self, kind: str) -> list[tuple[str, dict[str, Any]]]:
        if self.kind == kind:
            return []
        out = self.close()
        self.kind, self.text = kind, ""
        self.item_id = f"{'msg' if kind == 'message' else 'rs'}_{uuid.uuid4().hex}"
        item = (
            _message(None, "in_progress", self.item_id)
            if kind == "message"
            else _reasoning("", "in_progress", self.item_id)
        )
        out.append(self.event("response.output_item.added", output_index=len(self.done), item=item))
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(self.event("response.content_part.added", **self._at(), content_index=0, part=part))
        return out

    def _at(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": len(self.done)}


def router(api: Any) -> APIRouter:
    """``POST /v1/responses`` on ``api`` (:class:`rollout.http.app.API`); errors in OpenAI's shape."""
    routes = APIRouter()

    @routes.post("/v1/responses")
    async def responses(req: ResponsesRequest, request: Request) -> Any:
        result = await api.chat(chat_request(chat_fields(req)), request)
        if isinstance(result, StreamingResponse):
            return sse(events(req, chat_chunks(result)))
        return answer(req, result)

    return routes
