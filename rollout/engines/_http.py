"""Shared plumbing of the vLLM and SGLang adapters: a managed engine subprocess, an HTTP client, the API table.

Both adapters drive an engine's own HTTP server (``vllm serve``, ``sglang.launch_server``) rather than an
in-process engine object, for three reasons:

- the learner's weight publisher (``weightsync/engines.py``) must reach the engine's weight-transfer routes
  directly, because the NCCL broadcast runs concurrently with the engine's blocking ``update_weights`` call;
  a subprocess with its own HTTP server gives it that URL for free;
- the engines pin their own CUDA torch builds, start worker processes and own their event loops; a crash or
  a CUDA error in them should not take the rollout server (Redis consumer, reward functions) down with it;
- a plain HTTP protocol is what we can replay without a GPU (``tests/engine_replay_server.py``).

:class:`ManagedServer` makes the subprocess die with us: it runs in its own process group (so ``vllm serve``'s
engine-core and worker children are stopped together), gets ``PR_SET_PDEATHSIG`` (SIGTERM if the rollout
server is SIGKILLed), and is stopped by an ``atexit`` hook on normal exit.

:class:`Api` rows are the single list of what an adapter uses from an engine package (routes, request
fields, CLI flags, functions, literal values); ``tests/test_engines_contract.py`` checks every row against the
real package's source, so the table and the code cannot drift apart silently.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tandem.net import EngineClient, EngineHTTPError, free_port
from tandem.procs import DETACHED
from weightsync.base import WeightSyncError

ApiKind = Literal["route", "fields", "function", "literal", "name"]


@dataclass(frozen=True)
class Api:
    """One thing an adapter uses from an engine package.

    - ``route``: ``name`` is ``"POST /path"``; ``params`` are the handler's query/embedded-body parameters.
    - ``fields``: ``name`` is a class (``"*"``: any class in the module or package); ``params`` are field names.
    - ``function``: ``name`` is ``"func"`` or ``"Class.method"``; ``params`` are the parameter names we pass.
    - ``literal``: ``name`` is a module-level alias or ``"Class.field"``; ``params`` are the string values we use.
    - ``name``: ``name`` is defined somewhere in the module (an env variable declaration, a class).
    """

    kind: ApiKind
    module: str  # dotted module (or package, for fields with name "*"); "a|b": whichever the release has
    name: str
    params: tuple[str, ...] = ()


def payload_fields(cls: type) -> tuple[str, ...]:
    """The JSON keys a typed request payload (a dataclass) sends."""
    return tuple(f.name for f in dataclasses.fields(cls))


def engine_port(configured: int, server_index: int, host: str) -> int:
    """Server i uses ``configured + i``; 0 picks a free port."""
    return configured + server_index if configured else free_port(host)


def engine_url(host: str, port: int) -> str:
    """The URL others use: a wildcard bind address is advertised as this host's name (for a remote learner)."""
    reachable = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
    return f"http://{reachable}:{port}"


class ManagedServer:
    """An engine server subprocess that we start, health-check and stop, and that dies with us.

    ``PR_SET_PDEATHSIG`` fires when the *thread* that forked exits, so construct this from a long-lived thread
    (the rollout server's main thread).
    """

    def __init__(
        self, name: str, argv: Sequence[str], *, env: Mapping[str, str], log_path: str | os.PathLike[str]
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (kept open for the child's lifetime)
        self._lock = threading.Lock()
        self.proc = subprocess.Popen(
            self.argv,
            env={**os.environ, **env},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            **DETACHED,  # own process group (killpg reaches the engine's workers); dies with us
        )
        atexit.register(self.stop)

    def log_tail(self, n_bytes: int = 3000) -> str:
        try:
            data = self.log_path.read_bytes()[-n_bytes:]
        except OSError:
            return ""
        return data.decode("utf-8", "replace")

    def wait_healthy(self, client: EngineClient, route: str, timeout: float) -> None:
        """Poll ``route`` until it answers 2xx; fail fast if the process exits, with its log tail."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineHTTPError(
                    f"{self.name} exited with code {self.proc.returncode} before {client.base_url}{route} "
                    f"became healthy; log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                client.get(route, timeout=5.0)
                return
            except EngineHTTPError as e:
                last = str(e)
            time.sleep(1.0)
        self.stop()
        raise EngineHTTPError(
            f"{self.name} at {client.base_url} not healthy on {route} within {timeout:.0f} s "
            f"(last: {last}); log {self.log_path}:\n{self.log_tail()}"
        )

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM the whole process group, SIGKILL it after ``grace_s``. Idempotent."""
        with self._lock:
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(timeout=10.0)
            # Children that ignored SIGTERM while the leader exited still share the group.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            if not self._log.closed:
                self._log.close()
        atexit.unregister(self.stop)


def expand_version_spans(spans: Sequence[Mapping[str, Any]], n_tokens: int, *, where: str) -> list[int]:
    """Per-token integer versions from ``[{version, start, end}, ...]`` spans over output-token indexes.

    Both engines label weights with strings; we always set them to ``str(int)``.
    """
    versions: list[int | None] = [None] * n_tokens
    for span in spans:
        try:
            v = int(span["version"])
        except (TypeError, ValueError):
            raise EngineHTTPError(
                f"{where}: weight version {span['version']!r} is not one tandem set (expected an integer)"
            ) from None
        for i in range(max(0, int(span["start"])), min(n_tokens, int(span["end"]))):
            versions[i] = v
    if any(v is None for v in versions):
        raise EngineHTTPError(f"{where}: weight-version spans {list(spans)} do not cover {n_tokens} tokens")
    return [v for v in versions if v is not None]


def replay_tokens(out: Sequence[Sequence[Any]], on_token: Callable[[int, int, float], None]) -> None:
    """Call ``on_token(row, token_id, logprob)`` for every token, ``row`` indexing the flattened prompt x n list."""
    row = 0
    for comps in out:
        for c in comps:
            for t, lp in zip(c.token_ids, c.logprobs, strict=True):
                on_token(row, t, lp)
            row += 1


def wait_for_weight_version(
    client: EngineClient, route: str, version: int, timeout_s: float, label: str
) -> int:
    """dist path: the learner pushed the weights into the engine itself; poll ``route`` (whose JSON has
    ``weight_version``) until the engine reports ``version`` or later, and return what it holds."""
    deadline = time.monotonic() + timeout_s
    held = None
    while time.monotonic() < deadline:
        held = str(client.get(route)["weight_version"])
        if held.isdigit() and int(held) >= version:
            return int(held)
        time.sleep(0.2)
    raise WeightSyncError(
        f"{label} server {client.base_url}: GET {route} still reports weight_version {held!r}, not {version}, "
        f"after {timeout_s:.0f} s; is the learner's EnginePublisher feeding it?"
    )
