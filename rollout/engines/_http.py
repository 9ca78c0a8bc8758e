"""Shared plumbing of the vLLM and SGLang adapters: a managed engine subprocess, an HTTP client, the API table,
and :class:`HttpEngine`, the Engine Protocol's half that does not depend on the engine.

Both adapters drive an engine's own HTTP server (``vllm serve``, ``sglang.launch_server``) rather than an
in-process engine object, for three reasons:

- the learner's weight publisher (``weightsync/engine_push.py``) must reach the engine's weight-transfer routes
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
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rollout.engines._prometheus import StatSamples, parse_stats
from rollout.engines.base import (
    BetweenSteps,
    Completion,
    EngineExited,
    EngineStats,
    FinishReason,
    OnPrompt,
    OnToken,
    SamplingParams,
)
from tandem.config import Config, ServerConfig
from tandem.net import EngineClient, EngineHTTPError, free_port, to_json
from tandem.procs import DETACHED, reap_group, record_group
from weightsync.base import Update, WeightSyncError

log = logging.getLogger(__name__)

ApiKind = Literal["route", "fields", "function", "literal", "name"]
STATS_TIMEOUT_S = 5.0
# Prompts of one generate call in flight at once (one HTTP request each); the engine batches them.
MAX_CONCURRENT_REQUESTS = 64


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


# Both engines name finish reasons as we do.
FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


def shared_flags(cfg: Config, settings: ServerConfig) -> list[str]:
    """The server flags both engines spell alike: the model's dtype, remote code. Never the API key: a
    command line is readable by every local user (``/proc/PID/cmdline``); see :func:`api_key_file`."""
    argv = []
    if cfg.model.dtype != "auto":
        argv += ["--dtype", cfg.model.dtype]
    if cfg.model.trust_remote_code:
        argv.append("--trust-remote-code")
    return argv


def api_key_file(settings: ServerConfig, path: Path) -> list[str]:
    """``--config PATH`` naming a YAML file (mode 0600) that holds the engine's API key (SGLang reads flags
    from one; vLLM takes the key from ``VLLM_API_KEY``); nothing without a key."""
    if not settings.api_key:
        return []
    from tandem.config import write_private

    path.parent.mkdir(parents=True, exist_ok=True)
    write_private(path, json.dumps({"api-key": settings.api_key}) + "\n")  # JSON is YAML
    return ["--config", str(path)]


def device_env(device: str | None, tp_size: int) -> dict[str, str]:
    """A single-GPU server sees only its own device; a tensor-parallel one picks its GPUs itself."""
    if device is not None and device.startswith("cuda:") and tp_size == 1:
        return {"CUDA_VISIBLE_DEVICES": device.split(":", 1)[1]}
    return {}


class ManagedServer:
    """An engine server subprocess that we start, health-check and stop, and that dies with us.

    ``PR_SET_PDEATHSIG`` fires when the *thread* that forked exits, so construct this from a long-lived thread
    (the rollout server's main thread). Its process group is recorded beside its log (``.group``), and
    what an earlier server with the same log left of its group is killed before this one starts
    (tandem/procs.py, :func:`reap_group`): a rollout server SIGKILLed while its engine starts leaves one.
    """

    def __init__(
        self, name: str, argv: Sequence[str], *, env: Mapping[str, str], log_path: str | os.PathLike[str]
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.group_file = self.log_path.with_suffix(".group")
        if left := reap_group(self.group_file):
            log.warning("%s: killed %d process(es) an earlier server left", name, len(left))
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
        record_group(self.group_file, self.proc.pid)
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

    def exit_code(self, within_s: float = 0.0) -> int | None:
        """The process's exit code once it has exited, waiting up to ``within_s`` for it; ``None`` while it
        runs. A SIGKILLed server's sockets close a moment before its parent can reap it."""
        try:
            return self.proc.wait(timeout=within_s) if within_s > 0 else self.proc.poll()
        except subprocess.TimeoutExpired:
            return None

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
            self.group_file.unlink(missing_ok=True)
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


class HttpEngine:
    """What the vLLM and SGLang adapters share around their engine-specific routes, bodies and parsing.

    A subclass sets ``weight_info_route`` and ``stat_samples``, starts its server with :meth:`_start` (or
    uses the one at ``settings.url``), connects with :meth:`_connect`, and implements ``_label_weights``,
    ``_generate_each``, ``_load_weights``, ``pause`` and ``resume``.
    """

    continuous_batching = True  # the server's scheduler batches concurrent requests
    adapters: tuple[str, ...] = ()  # LoRA adapters a request may name (SamplingParams.adapter)
    weight_info_route: str  # GET route whose JSON has ``weight_version`` (the dist path)
    stat_samples: StatSamples  # where the scheduler's state is in ``GET /metrics``
    client: EngineClient

    def __init__(self, cfg: Config, settings: ServerConfig, *, server_index: int) -> None:
        self.cfg = cfg
        self.settings = settings
        self.server_index = server_index
        self.server: ManagedServer | None = None
        self._version = 0
        self._asleep = False
        self._requests = ThreadPoolExecutor(
            MAX_CONCURRENT_REQUESTS, thread_name_prefix=f"{type(self).__name__}{server_index}"
        )

    def _start(
        self, name: str, argv: Callable[[int], list[str]], *, env: dict[str, str], log_path: Path
    ) -> str:
        """Start a managed server unless ``settings.url`` names a running one; return the URL to use.
        ``argv(port)`` is its command line."""
        s = self.settings
        if s.url is not None:
            return s.url
        port = engine_port(s.port, self.server_index, s.host)
        self.server = ManagedServer(
            f"{name} (server {self.server_index})", argv(port), env=env, log_path=log_path
        )
        return engine_url(s.host, port)

    def _connect(self, url: str, label: str) -> None:
        """Open the client, wait for a managed server's ``/health``, label its weights; on failure, stop it."""
        s = self.settings
        self.client = EngineClient(url, label, timeout=s.request_timeout_s, api_key=s.api_key)
        try:
            if self.server is not None:
                self.server.wait_healthy(self.client, "/health", s.startup_timeout_s)
            self._label_weights()
        except BaseException:
            self.close()
            raise

    def _label_weights(self) -> None:
        """Label the weights the server holds now version 0, like a fresh managed one."""
        raise NotImplementedError

    @property
    def url(self) -> str:
        """The engine control URL the learner's EnginePublisher drives (register it in Redis)."""
        return self.client.base_url

    @property
    def version(self) -> int:
        return self._version

    def stats(self) -> EngineStats:
        """The scheduler's gauges and preemption counter from ``GET /metrics``."""
        text = self.client.get("/metrics", timeout=STATS_TIMEOUT_S)
        return parse_stats(str(text), self.stat_samples)

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        *,
        between_steps: BetweenSteps | None = None,
        on_token: OnToken | None = None,
        on_prompt: OnPrompt | None = None,
    ) -> list[list[Completion]]:
        """The whole batch in flight at once; the engine schedules it. Thread-safe (httpx pools connections).

        The engine's decode steps are out of our reach, so ``between_steps`` runs once before the call (a
        pending update then applies first) and ``on_token`` replays the tokens after it. ``on_prompt`` hears
        of each prompt as its reply arrives.
        """
        if sampling.adapter is not None and sampling.adapter not in self.adapters:
            raise ValueError(
                f"LoRA adapter {sampling.adapter!r}: not served here (adapters: {list(self.adapters)}); an engine "
                "server serves the adapters of learner.lora.adapters (vllm) or --lora (hf)"
            )
        if not prompts:
            return []
        if between_steps is not None:
            between_steps()
        out: list[list[Completion]] = [[] for _ in prompts]
        try:
            for i, group in self._generate_each(prompts, sampling):
                out[i] = group
                if on_prompt is not None:
                    on_prompt(i, group)
        except EngineHTTPError as e:
            self._raise_if_exited(e)
            raise
        if on_token is not None:
            replay_tokens(out, on_token)
        return out

    def _generate_each(
        self, prompts: list[list[int]], sampling: SamplingParams
    ) -> Iterator[tuple[int, list[Completion]]]:
        """``(prompt index, its n completions)`` for every prompt, in the order they finish."""
        raise NotImplementedError

    def _raise_if_exited(self, error: EngineHTTPError) -> None:
        """:class:`EngineExited` when a call failed because our managed server has died: the rollout loop
        counts other engine errors and retries, which a dead server would turn into a retry loop forever."""
        if self.server is None:
            return
        # Unanswered: the server may have died; allow the moment between its sockets closing and its exit.
        code = self.server.exit_code(within_s=1.0 if error.status is None else 0.0)
        if code is not None:
            raise EngineExited(
                f"{self.server.name} exited with code {code} ({error}); log {self.server.log_path}:\n"
                f"{self.server.log_tail()}"
            ) from error

    def _each_reply(
        self,
        route: str,
        prompts: list[list[int]],
        sampling: SamplingParams,
        body: Callable[[list[int], SamplingParams, int | None], Any],
        parse: Callable[[Any, int, str], list[Completion]],
    ) -> Iterator[tuple[int, list[Completion]]]:
        """One ``POST route`` per prompt, all in flight together (the server's scheduler batches them), each
        yielded as its reply arrives: a group is scored while the slower ones still generate.

        ``body(prompt, sampling, seed)`` is prompt ``i``'s request, its samples seeded from
        ``seed + i * n``; ``parse(reply, n, where)`` reads its ``n`` completions. A request whose
        connection broke unanswered is sent once more (nobody saw the lost reply).
        """
        where = f"{self.client.label} {self.url} {route}"

        def one(i: int) -> list[Completion]:
            seed = None if sampling.seed is None else sampling.seed + i * sampling.n
            reply = self.client.post(route, to_json(body(prompts[i], sampling, seed)), resend=True)
            return parse(reply, sampling.n, f"{where} (prompt {i})")

        replies = {self._requests.submit(one, i): i for i in range(len(prompts))}
        for reply in as_completed(replies):
            yield replies[reply], reply.result()

    def update_weights(self, update: Update) -> None:
        """shm (``update.path`` set): pause, load, record the version, resume. dist: the learner pushed the
        weights itself; wait until the engine reports ``update.version``."""
        timeout = self.settings.update_timeout_s
        if update.path is None:
            self._version = wait_for_weight_version(
                self.client, self.weight_info_route, update.version, timeout, self.client.label
            )
            return
        # Asleep (weights woken, KV cache not): the sleep already stopped scheduling and dropped the KV
        # cache, so there is nothing to pause or flush, and waking the KV cache resumes it.
        asleep = self._asleep
        if not asleep:
            self.pause()
        self._load_weights(update, asleep=asleep)
        self._version = update.version
        if not asleep:
            self.resume()

    def _load_weights(self, update: Update, *, asleep: bool) -> None:
        """Load ``update.path`` into the paused (or asleep) server and label it ``update.version``."""
        raise NotImplementedError

    def pause(self) -> None:
        raise NotImplementedError

    def resume(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._requests.shutdown(wait=False, cancel_futures=True)
        self.client.close()
        if self.server is not None:
            self.server.stop()
