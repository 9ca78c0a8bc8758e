"""A run's private state stays its owner's: secret files 0600 in 0700 folders, no Redis admin commands,
weight files no other local user can plant or change, stores that listen on the run's address only, and
no secret on a command line or in ``--dry-run`` (docs/design.md §6.8)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
from datetime import timedelta
from pathlib import Path

import pytest
import redis
import torch

from buffer.redis_server import DISABLED_COMMANDS, EmbeddedRedis
from weightsync.base import WeightSyncError
from weightsync.dist import bound_store
from weightsync.shm import ROOT_NOTE, ShmPublisher, ShmSubscriber, default_root, noted_root

ROOT = Path(__file__).resolve().parent.parent
SECRET = "k3y-that-must-not-leak"


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


# ------------------------------------------------------------------------------------------------- Redis


def test_embedded_redis_files_are_private(redis_server: EmbeddedRedis, redis_client: redis.Redis) -> None:
    redis_client.set("private-state", b"x")
    redis_server.wait_aof_written()
    assert mode(redis_server.data_dir) == 0o700
    for name in ("redis.conf", "redis.password", "tandem.aof", "redis.log"):
        assert mode(redis_server.data_dir / name) == 0o600, name
    assert redis_server.password in (redis_server.data_dir / "redis.conf").read_text()


@pytest.mark.parametrize(
    "command", [("CONFIG", "SET", "dir", "/tmp"), ("MODULE", "LOAD", "/x.so"), ("DEBUG", "SLEEP", "0")]
)
def test_redis_admin_commands_fail_even_with_the_password(redis_client: redis.Redis, command) -> None:
    assert command[0] in DISABLED_COMMANDS
    with pytest.raises(redis.ResponseError, match="unknown command"):
        redis_client.execute_command(*command)
    assert redis_client.ping()  # the commands the run uses still work


# -------------------------------------------------------------------------------------------------- shm


@pytest.fixture
def shm_root(tmp_path: Path, run_id: str):
    """The run's /dev/shm folder as the learner makes it (noted in the run dir), removed afterwards."""
    if not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm on this machine")
    root = default_root(run_id, tmp_path)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def weights() -> dict[str, torch.Tensor]:
    return {"a": torch.arange(16, dtype=torch.float32), "b": torch.ones(4, 4)}


def test_shm_root_is_random_private_and_reopened_only_if_still_private(
    shm_root: Path, tmp_path: Path, run_id: str
) -> None:
    assert shm_root.parent == Path("/dev/shm") and shm_root.name.startswith(f"tandem-{run_id}-")
    assert shm_root.name != f"tandem-{run_id}"  # a name another user cannot guess and take first
    assert mode(shm_root) == 0o700 and mode(tmp_path / ROOT_NOTE) == 0o600
    assert default_root(run_id, tmp_path) == shm_root == noted_root(tmp_path)  # a restart finds it again
    os.chmod(shm_root, 0o755)
    with pytest.raises(WeightSyncError, match="must be 700"):
        default_root(run_id, tmp_path)
    os.chmod(shm_root, 0o700)


def test_shm_shards_are_private_and_a_planted_link_is_refused(
    shm_root: Path, redis_client: redis.Redis, run_id: str
) -> None:
    pub = ShmPublisher(redis_client, run_id, shm_root, keep_versions=4)
    pub.publish(weights().items(), 1)
    shard = shm_root / "v00000001" / "model.safetensors"
    assert mode(shard) == 0o600
    assert ShmSubscriber(redis_client, run_id, "s0").poll() is not None

    # The same bytes, behind a link: a reader that followed it could be handed another file's contents.
    decoy = shm_root / "decoy.safetensors"
    shutil.copyfile(shard, decoy)
    pub.publish(weights().items(), 2)
    planted = shm_root / "v00000002" / "model.safetensors"
    planted.unlink()
    planted.symlink_to(decoy)
    sub = ShmSubscriber(redis_client, run_id, "s1")
    assert sub.poll() is None and sub.rejected == 1  # refused, kept what it had (nothing)
    pub.close()
    sub.close()


def test_a_weights_folder_that_is_a_link_is_refused(tmp_path: Path, redis_client: redis.Redis, run_id: str):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(WeightSyncError, match="not a folder"):
        ShmPublisher(redis_client, run_id, tmp_path / "link")


# ----------------------------------------------------------------------------------------------- stores


def other_address() -> str | None:
    """A non-loopback IPv4 address of this machine, if it has one."""
    candidates = set()
    with contextlib.suppress(OSError):
        candidates |= {i[4][0] for i in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # no packet is sent: it only picks the route
        candidates.add(s.getsockname()[0])
    return next((a for a in sorted(candidates) if not a.startswith("127.") and a != "0.0.0.0"), None)


def test_a_weight_store_listens_on_the_run_address_only() -> None:
    store = bound_store("127.0.0.1", 0, timedelta(seconds=5))
    with socket.create_connection(("127.0.0.1", store.port), timeout=2):
        pass
    address = other_address()
    if address is None:
        pytest.skip("this machine has no non-loopback address to try the store on")
    with pytest.raises(OSError), socket.create_connection((address, store.port), timeout=2):
        pass


# --------------------------------------------------------------------------------------------- command lines


def test_engine_api_keys_stay_off_command_lines(tmp_path: Path) -> None:
    from rollout.engines._http import api_key_file, shared_flags
    from tandem.config import ServerConfig, load_config

    cfg = load_config(ROOT / "configs/tiny.yaml", ["model.actor=unused", "data.prompts=unused"])
    settings = ServerConfig(api_key=SECRET)
    assert SECRET not in " ".join(shared_flags(cfg, settings))
    argv = api_key_file(settings, tmp_path / "key.yaml")
    assert argv == ["--config", str(tmp_path / "key.yaml")] and SECRET not in " ".join(argv)
    assert mode(tmp_path / "key.yaml") == 0o600 and SECRET in (tmp_path / "key.yaml").read_text()


def test_dry_run_prints_no_secret(tiny_ckpt, tmp_path: Path, capsys) -> None:
    import launch
    from tandem.data import write_prompts

    prompts = write_prompts(tmp_path / "p.jsonl", [{"prompt": "say b:"}])
    code = launch.main(
        [
            str(ROOT / "configs/tiny.yaml"),
            f"model.actor={tiny_ckpt['actor']}",
            f"model.critic={tiny_ckpt['critic']}",
            f"data.prompts={prompts}",
            f"redis.url=redis://:{SECRET}@127.0.0.1:1/0",
            f"rollout.vllm.api_key={SECRET}",
            "--dry-run",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "per-process config" in out
    assert SECRET not in out
