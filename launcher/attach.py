"""``launch.py --attach RUN_DIR --servers +K``: grow a running run's rollout fleet (docs/design.md §1.8).

Reads the run's per-process config (``RUN_DIR/config.yaml``: its Redis URL and everything else), checks
the run is live (its learner is ready and no stop was asked), takes ``K`` fresh server ids from the run
(``tandem/fleet.py``) and runs ``python -m rollout.server`` for each with the local backend
(``launcher/backends/local.py``), under the run's restart policy for servers (``supervision.*``,
``launcher/supervision.py``), until the run ends: its stop key is set, or its Redis has not answered for
``REDIS_GONE_S``. Each joiner takes the learner's current weights
before its first token (§5.7). Ctrl-C or SIGTERM make the attached servers leave gracefully: they hand
back the prompts and admission they hold. A server killed outright leaves too; its prompts are claimed
by the others after ``redis.claim_idle_ms``.

On another host: copy ``RUN_DIR/config.yaml`` into a directory there, make sure the run's Redis and the
``model.actor`` path are reachable from it, and run the same command against that directory.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import redis

from buffer.retry import RedisUnavailable, connect_run
from launcher.backends.local import LocalBackend
from launcher.run_plan import Role, RunPlan, server_tp
from placement.configured import thread_split
from tandem import fleet
from tandem.config import Config, ConfigError, load_config
from tandem.telemetry import ready_key, stop_key

TICK_S = 0.5
REDIS_GONE_S = 120.0  # Redis silent this long: the run is over (a supervised restart takes far less)
LEAVE_GRACE_S = 60.0  # a leaving server finishes the batch in hand


def parse_count(text: str) -> int:
    """``+2`` or ``2``: how many servers to add."""
    try:
        n = int(text.removeprefix("+"))
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"--servers: want +K with K >= 1 (got {text!r})")
    return n


def server_roles(cfg: Config, run_dir: Path, ids: list[int]) -> list[Role]:
    """Roles as launch.py's own servers have them (same threads and devices), new ids."""
    threads, _ = thread_split(cfg)
    config = str(run_dir / "config.yaml")
    return [
        Role(
            name=f"server-{i}",
            module="rollout.server",
            argv=("--config", config, "--server-id", str(i), "--run-dir", str(run_dir)),
            processes=1,
            threads=threads,
            gpus=server_tp(cfg) if cfg.run.device != "cpu" else 0,
        )
        for i in ids
    ]


def attach(run_dir: Path, count: int, *, leave: threading.Event | None = None) -> int:
    """Add ``count`` servers to the run in ``run_dir`` until it ends (or ``leave`` is set); exit code."""
    run_dir = run_dir.resolve()
    cfg = load_config(run_dir / "config.yaml")
    run = cfg.run.name
    if cfg.redis.url is None:
        raise ConfigError(f"{run_dir / 'config.yaml'}: redis.url is not set (not a launched run's config?)")
    try:
        client = connect_run(cfg.redis.url, reconnect_s=cfg.supervision.reconnect_s, socket_timeout=10)
    except RedisUnavailable as e:
        print(f"[attach] the run's Redis at {e.url} does not answer ({e.reason}): has it ended?")
        return 1
    if client.exists(stop_key(run)):
        print(f"[attach] run {run} is stopping; nothing to join")
        return 1
    if not client.exists(ready_key(run, "learner")):
        print(f"[attach] run {run} has no ready learner; start or resume it first")
        return 1

    ids = fleet.allocate_ids(client, run, count, first=cfg.rollout.num_servers)
    plan = RunPlan(cfg, run_dir, run_dir / "config.yaml", server_roles(cfg, run_dir, ids))
    plan.env.update({"TANDEM_RUN_GROUP": run, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"})
    for role in plan.roles:
        client.delete(ready_key(run, role.name))
    backend = LocalBackend(label="attach")
    backend.start(plan, client, "")
    names = ", ".join(c.name for c in backend.children)
    print(f"[attach] started {names} in run {run}; logs in {run_dir / 'logs'}")

    leave = leave or threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: leave.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code, why = supervise(client, run, backend, leave)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        backend.stop(LEAVE_GRACE_S, ask=signal.SIGTERM)  # a graceful leave, then SIGKILL after the grace
        client.close()
    print(f"[attach] {why}")
    return code


def supervise(
    client: redis.Redis, run: str, backend: LocalBackend, leave: threading.Event
) -> tuple[int, str]:
    """Restart crashed servers (``backend.poll``) until the run ends or we are told to leave; (exit
    code, why)."""
    silent_since: float | None = None
    while not leave.wait(TICK_S):
        try:
            stopping = bool(client.exists(stop_key(run)))
            silent_since = None
        except redis.RedisError:
            silent_since = silent_since or time.monotonic()
            if time.monotonic() - silent_since > REDIS_GONE_S:
                return 0, f"the run's Redis has not answered for {REDIS_GONE_S:.0f}s: the run is over"
            continue
        if stopping:
            return 0, "the run stopped; its servers leave with it"
        outcome = backend.poll(stopping=False)  # a server past its restart budget ends the attach
        if outcome is not None:
            return int(not outcome.ok), outcome.message
    return 0, "left the run: the attached servers handed back what they held"
