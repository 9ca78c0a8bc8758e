"""The HTTP API's server: uvicorn in a daemon thread of the rollout server's process, started and stopped
by the caller (``rollout/server.py``, tests)."""

from __future__ import annotations

import logging
import threading
import time

import uvicorn
from fastapi import FastAPI

log = logging.getLogger(__name__)


class HTTPServer:
    """uvicorn serving an app from a daemon thread of this process."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", access_log=False, timeout_graceful_shutdown=5
        )
        self.server = uvicorn.Server(config)
        self.socket = config.bind_socket()  # bound now, so port 0 resolves to the real port before start
        self.host, self.port = host, self.socket.getsockname()[1]
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, name="http", daemon=True
        )

    def start(self, timeout_s: float = 30.0) -> HTTPServer:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"HTTP API on {self.host}:{self.port} did not start within {timeout_s}s")
            time.sleep(0.02)
        log.info("HTTP API on http://%s:%d", self.host, self.port)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        self.socket.close()
