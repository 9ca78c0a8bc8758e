"""``tandem/net.py``: the one free-port and route-address helpers every layer uses, and the engine client's
connection pool against a real uvicorn server."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI, Request

from tandem.net import KEEPALIVE_EXPIRY_S, EngineClient, EngineHTTPError, free_port, local_address


def test_free_port_can_be_bound_at_once() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # raises when the port is taken
    assert 0 < port < 65536


def test_local_address_is_the_route_towards_the_peer() -> None:
    assert local_address("127.0.0.1") == "127.0.0.1"
    assert local_address("localhost") == "127.0.0.1"  # a host name is resolved first
    assert local_address("127.0.0.2") == "127.0.0.1"  # the loopback route, not the peer's own address


@pytest.fixture
def port_server() -> Iterator[str]:
    """A uvicorn server with the engines' keep-alive (5 s) whose one route answers with the caller's port,
    so a test sees which connection a request went out on."""
    app = FastAPI()

    @app.get("/port")
    def caller_port(request: Request) -> int:
        assert request.client is not None
        return request.client.port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning", timeout_keep_alive=5))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_an_idle_connection_is_dropped_before_the_engine_server_would_drop_it(port_server: str) -> None:
    client = EngineClient(port_server, "uvicorn", timeout=10)
    try:
        first = client.get("/port")
        assert client.get("/port") == first  # a busy connection is reused
        time.sleep(KEEPALIVE_EXPIRY_S + 0.5)  # idle past our expiry, still inside the server's 5 s
        assert client.get("/port") != first  # a fresh connection, never one the server may be closing
    finally:
        client.close()


@pytest.fixture
def dropping_client() -> Iterator[tuple[EngineClient, list[str]]]:
    """A raw HTTP server that closes the connection of the first request to each route after reading it,
    without an answer (a connection broken under a request), and answers every later one with
    ``{"ok": true}``. It records each request line it read; the test gets a client of it."""
    seen: list[str] = []
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # the listener was closed: the test is over
                return
            with conn:
                request = conn.recv(65536).decode(errors="replace")
                line = request.split("\r\n", 1)[0]
                seen.append(line)
                if seen.count(line) > 1:
                    body = b'{"ok": true}'
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                        + f"Content-Length: {len(body)}\r\n\r\n".encode()
                        + body
                    )

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = EngineClient(f"http://127.0.0.1:{port}", "raw", timeout=10)
    yield client, seen
    client.close()
    listener.close()
    thread.join(5)


def test_a_request_safe_to_repeat_is_resent_once_when_its_connection_broke_unanswered(
    dropping_client: tuple[EngineClient, list[str]],
) -> None:
    client, seen = dropping_client
    assert client.post("/generate", {"n": 1}, resend=True) == {"ok": True}
    assert seen == ["POST /generate HTTP/1.1"] * 2  # the same request, sent twice


def test_a_request_not_safe_to_repeat_fails_with_the_broken_connection_named(
    dropping_client: tuple[EngineClient, list[str]],
) -> None:
    client, seen = dropping_client
    with pytest.raises(EngineHTTPError, match=r"raw server .*: POST /pause: RemoteProtocolError"):
        client.post("/pause")  # a control route: the engine may have acted on it
    assert seen == ["POST /pause HTTP/1.1"]
    assert client.get("/version") == {"ok": True}  # a read is resent by default
    assert seen[1:] == ["GET /version HTTP/1.1"] * 2
