"""Networking helpers every layer uses: a free local port, and a JSON client for an engine's HTTP server.

The client lives here, below ``rollout`` and ``weightsync``, because both the rollout server's engine
adapters (``rollout/engines/``) and the learner's weight publisher (``weightsync/engine_push.py``) talk to the
same engine routes.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from collections.abc import Mapping
from typing import Any, Literal

import httpx

# vLLM's and SGLang's servers (uvicorn) close a connection that has been idle for 5 s
# (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, uvicorn's ``timeout_keep_alive``), and httpx keeps one for 5 s by
# default: a request could then leave on a connection the server is closing at that very moment, and fail
# with "Server disconnected without sending a response". Ours are dropped well before the server drops them.
KEEPALIVE_EXPIRY_S = 2.0
# Keep as many connections as one generate call sends at once (one per prompt), so a batch does not open
# new ones after the last batch's were closed (httpx keeps 20).
MAX_CONNECTIONS = 100
# A connection that broke before any answer came back. Besides a server closing an idle one, httpcore's
# pool (1.0.9) can close a connection that another thread's request has just been handed, when it expires
# at that instant; the request then reads a closed socket ("Bad file descriptor", seen once on 2026-11-28).
UNANSWERED = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the engine binds it a little later; a clash fails health checks)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def local_address(peer: str) -> str:
    """This machine's address on the route to ``peer`` (a host name or an IP): the one ``peer`` can dial
    back. A UDP connect sends no packet; it only picks the route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(peer), 9))
        return s.getsockname()[0]


def to_json(payload: Any) -> dict[str, Any]:
    """A payload dataclass as a JSON body; ``None`` fields (nested ones too) are left out so the engine's
    defaults apply."""

    def drop_none(d: dict[str, Any]) -> dict[str, Any]:
        return {k: drop_none(v) if isinstance(v, dict) else v for k, v in d.items() if v is not None}

    return drop_none(dataclasses.asdict(payload))


class EngineHTTPError(RuntimeError):
    """An engine route answered with an error, timed out or could not be reached. ``status``: the HTTP
    status of an answer, or ``None`` when none came back (a timeout, a refused or broken connection)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class EngineClient:
    """A small synchronous JSON client for one engine server; every call has a timeout and a clear error.

    ``label`` names the engine and the API version we target (``"vLLM 0.33.0"``) so an error says which
    contract was broken. Thread-safe: httpx pools connections across threads.
    """

    def __init__(self, base_url: str, label: str, *, timeout: float, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.label = label
        self.timeout = timeout
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(
            max_connections=MAX_CONNECTIONS,
            max_keepalive_connections=MAX_CONNECTIONS,
            keepalive_expiry=KEEPALIVE_EXPIRY_S,
        )
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout, limits=limits)

    def call(
        self,
        method: Literal["GET", "POST"],
        route: str,
        *,
        json: Mapping[str, Any] | None = None,
        params: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        context: str = "",
        resend: bool = False,
    ) -> Any:
        """Send one request; return the decoded JSON (or text) body, raise EngineHTTPError otherwise.

        A body of the form ``{"success": false, "message": ...}`` is an error even with status 200 (SGLang's
        control routes report failures that way). ``resend``: the request is harmless to repeat (a read, a
        generation whose lost reply nobody saw), so it is sent once more when its connection broke before
        any answer; a timeout is never resent (the engine may still be working on it).
        """
        where = f"{self.label} server {self.base_url}: {method} {route}{f' ({context})' if context else ''}"
        t = self.timeout if timeout is None else timeout
        try:
            try:
                resp = self._http.request(method, route, json=json, params=params, timeout=t)
            except UNANSWERED as e:
                if not resend:
                    raise
                log.warning("%s: %s: %s; sending it once more", where, type(e).__name__, e)
                resp = self._http.request(method, route, json=json, params=params, timeout=t)
        except httpx.TimeoutException:
            raise EngineHTTPError(f"{where}: no answer within {t:.0f} s") from None
        except httpx.HTTPError as e:
            raise EngineHTTPError(f"{where}: {type(e).__name__}: {e}") from None
        try:
            body: Any = resp.json()
        except ValueError:
            body = resp.text
        if resp.status_code >= 400:
            raise EngineHTTPError(f"{where}: HTTP {resp.status_code}: {str(body)[:500]}", resp.status_code)
        if isinstance(body, dict) and body.get("success") is False:
            raise EngineHTTPError(
                f"{where}: refused: {str(body.get('message', body))[:500]}", resp.status_code
            )
        return body

    def post(self, route: str, json: Mapping[str, Any] | None = None, **kw: Any) -> Any:
        return self.call("POST", route, json=json, **kw)

    def get(self, route: str, *, resend: bool = True, **kw: Any) -> Any:
        """A read: resent once by default when its connection broke unanswered."""
        return self.call("GET", route, resend=resend, **kw)

    def close(self) -> None:
        self._http.close()
