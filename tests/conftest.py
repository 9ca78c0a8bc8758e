"""Shared fixtures: a real redis-server for the whole session and tiny checkpoints built locally."""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

import pytest

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from buffer.redis_server import EmbeddedRedis

# The markers of the slower tiers: each tier collects only the files that spell its marker (Makefile).
TIER_MARKERS = ("faults", "presets", "ray", "stages", "vllm")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Before ``-m`` deselects anything: a test carrying a tier's marker in a file that does not spell
    ``mark.<tier>`` (a marker set through a variable, say) would be skipped by its tier without a word, so
    collection fails instead, naming the test."""
    texts: dict[Path, str] = {}
    for item in items:
        for marker in TIER_MARKERS:
            if item.get_closest_marker(marker) is None:
                continue
            text = texts.setdefault(item.path, item.path.read_text())
            if not re.search(rf"mark\.{marker}\b", text):
                raise pytest.UsageError(
                    f"{item.nodeid} is marked {marker}, but its file never spells mark.{marker}: "
                    f"`make test-{marker}` collects only files that do (Makefile, tier_files)"
                )


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
