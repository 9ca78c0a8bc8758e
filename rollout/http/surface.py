"""What the Messages and Responses APIs share as translations onto the chat path (docs/environments.md §10.10).

Each of them turns its request into a :class:`ChatRequest`, lets :meth:`rollout.http.app.API.chat` serve
it (the same prompt rendering, engine call, tool parsing and agent sessions), and turns the answer back:
a chat completion, or the chat path's own stream of chunks, read back here as dicts
(:func:`chat_chunks`), so whatever that stream carries is translated from one source.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError

from rollout.http.schemas import APIError, ChatRequest

M = TypeVar("M", bound=BaseModel)


def parsed(model: type[M], value: Any, param: str) -> M:
    """``value`` as ``model``, or 400 naming the field at ``param`` (plus the failing field inside it)."""
    try:
        return model.model_validate(value)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join([param, *(str(x) for x in err["loc"])])
        raise APIError(400, f"{where}: {err['msg']}", param=where) from None


def chat_request(fields: dict[str, Any]) -> ChatRequest:
    """The chat request a translated request stands for (its fields were checked on the way in)."""
    return parsed(ChatRequest, fields, "body")


async def chat_chunks(response: StreamingResponse) -> AsyncIterator[dict[str, Any]]:
    """The chunks of a chat SSE response as dicts (an in-band ``{"error": ...}`` included), up to
    ``[DONE]``. Closing this iterator closes the chat stream, which cancels its generation."""
    body = response.body_iterator
    try:
        async for event in body:
            text = event.decode() if isinstance(event, bytes) else event
            for line in text.splitlines():
                if not line.startswith("data: "):
                    continue
                if (data := line[len("data: ") :]) == "[DONE]":
                    return
                yield json.loads(data)
    finally:
        await body.aclose()  # type: ignore[attr-defined]


def sse(events: AsyncIterator[tuple[str, dict[str, Any]]]) -> StreamingResponse:
    """Named server-sent events (``event: <name>`` then ``data: <json>``), as both APIs stream them."""

    async def lines() -> AsyncIterator[str]:
        async for name, data in events:
            yield f"event: {name}\ndata: {json.dumps(data)}\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream")


def call_arguments(arguments: str) -> dict[str, Any]:
    """A parsed call's arguments (the parser guarantees a JSON object) as an object."""
    value = json.loads(arguments)
    return value if isinstance(value, dict) else {}
