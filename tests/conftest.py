"""Shared fixtures: a real redis-server for the whole session and tiny checkpoints built locally."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from buffer.redis_server import EmbeddedRedis


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    """A real redis-server (AOF on) shared by the session; tests isolate themselves by run id."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_client(redis_server: EmbeddedRedis):
    client = redis_server.client()
    yield client
    client.close()


@pytest.fixture
def run_id() -> str:
    """A unique run id, so keys of different tests never meet in the shared Redis."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``{"actor": path, "critic": path}``: a tiny Qwen2 causal LM and a scalar-head model, saved by path."""
    from toy.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny"))
