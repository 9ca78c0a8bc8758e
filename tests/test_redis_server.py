"""The embedded Redis: loopback, password, AOF, restart on the same directory, clear errors."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from buffer.redis_server import EmbeddedRedis, RedisBinaryNotFound, find_redis_server


def test_loopback_with_password_and_aof(redis_server: EmbeddedRedis, redis_client: redis.Redis):
    assert redis_client.ping()
    # CONFIG is renamed away (tests/test_private_state.py): the server's own config file says it.
    conf = (redis_server.data_dir / "redis.conf").read_text().splitlines()
    assert {"bind 127.0.0.1", "appendonly yes", "appendfsync everysec"} <= set(conf)
    assert redis_client.info("persistence")["aof_enabled"] == 1
    assert len(redis_server.password) >= 24
    pw_file = redis_server.data_dir / "redis.password"
    assert stat.S_IMODE(pw_file.stat().st_mode) == 0o600
    for password in (None, "wrong"):
        # No retries: redis-py retries authentication failures with backoff by default.
        stranger = redis.Redis(
            host="127.0.0.1", port=redis_server.port, password=password, retry=Retry(NoBackoff(), 0)
        )
        with pytest.raises(redis.AuthenticationError):
            stranger.ping()


def test_restart_on_same_dir_keeps_data_and_password(tmp_path: Path):
    first = EmbeddedRedis(tmp_path).start()
    first.client().set("k", b"v1")
    first.client().xadd("s", {"d": b"x"})
    password = first.password
    first.stop()
    first.stop()  # idempotent
    second = EmbeddedRedis(tmp_path).start()
    try:
        assert second.password == password
        assert second.client().get("k") == b"v1"
        assert second.client().xlen("s") == 1
    finally:
        second.stop()


def test_data_survives_a_hard_kill(tmp_path: Path):
    """SIGKILL loses nothing the AOF file holds: the page cache outlives the process (fsync every second
    only matters to a host crash). ``everysec`` may postpone the write behind a slow fsync: wait for it."""
    server = EmbeddedRedis(tmp_path).start()
    server.client().set("k", b"before-kill")
    server.wait_aof_written()
    server.kill()
    with EmbeddedRedis(tmp_path) as again:
        assert again.client().get("k") == b"before-kill"


def test_non_executable_binary_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    fake = tmp_path / "redis-server"
    fake.write_text("not a program")
    os.chmod(fake, 0o644)
    monkeypatch.setenv("TANDEM_REDIS_SERVER", str(fake))
    with pytest.raises(RedisBinaryNotFound, match="is not an executable file") as e:
        EmbeddedRedis(tmp_path / "data").start()
    assert str(fake) in str(e.value)


def test_binary_found_without_configuration(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("TANDEM_REDIS_SERVER", raising=False)
    assert os.access(find_redis_server(), os.X_OK)


def test_port_in_use_fails_naming_the_port(redis_server: EmbeddedRedis, tmp_path: Path):
    clash = EmbeddedRedis(tmp_path, port=redis_server.port)
    with pytest.raises(RuntimeError, match=f"port {redis_server.port}"):
        clash.start(timeout_s=10)
