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

from tandem.net import KEEPALIVE_EXPIRY_S, EngineClient, free_port, local_address


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
