"""ASGI middlewares of the HTTP API: the body-size limit, and the bearer token with the request count.

Both are pure ASGI rather than ``@app.middleware("http")``: Starlette's BaseHTTPMiddleware hides the
client's disconnect from the endpoint, and a disconnect must cancel the generation (docs/design.md §6.4).
"""

from __future__ import annotations

import json
import secrets

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rollout.http.schemas import ANTHROPIC_PATH, anthropic_error, error_response
from rollout.metrics import ServerMetrics


class BodyLimit:
    """ASGI middleware: 413 for bodies over ``limit`` bytes, by Content-Length or by counting a chunked body."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await self._reject(send)
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise _TooLarge
            return message

        try:
            await self.app(scope, counting_receive, send)
        except _TooLarge:
            await self._reject(send)

    async def _reject(self, send: Send) -> None:
        body = json.dumps(
            {
                "error": {
                    "message": f"request body exceeds {self.limit} bytes",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "request_too_large",
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})


class Guard:
    """Pure ASGI middleware: the bearer token on ``/v1/*``, and a request count by route and status.

    Not ``@app.middleware("http")``: Starlette's BaseHTTPMiddleware hides the client's disconnect from
    the endpoint, and a disconnect must cancel the generation.
    """

    def __init__(self, app: ASGIApp, api_key: str | None, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()
        self.key = None if api_key is None else api_key.encode()  # Anthropic's clients send x-api-key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.expected is not None and scope["path"].startswith("/v1/"):
            headers = dict(scope["headers"])
            bearer = secrets.compare_digest(headers.get(b"authorization", b""), self.expected)
            if not (bearer or secrets.compare_digest(headers.get(b"x-api-key", b""), self.key)):
                self.metrics.requests.labels(route=scope["path"], status="401").inc()
                message = "invalid or missing API key (Authorization: Bearer <key>, or x-api-key: <key>)"
                if scope["path"] == ANTHROPIC_PATH:
                    response = anthropic_error(401, message)
                else:
                    response = error_response(401, message, "invalid_request_error", code="invalid_api_key")
                await response(scope, receive, send)
                return
        status = 500

        async def send_recording_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_recording_status)
        finally:
            route = scope.get("route")
            path = route.path if route is not None else "unmatched"
            self.metrics.requests.labels(route=path, status=str(status)).inc()


class _TooLarge(Exception):
    pass
