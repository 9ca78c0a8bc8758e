"""``launch.py --attach RUN_DIR --servers +K``: grow a running run's rollout fleet (docs/design.md §1.8).

Reads the run's per-process config (``RUN_DIR/config.yaml``: its Redis URL and everything else), checks
the run is live (its learner is ready and no stop was asked), takes ``K`` fresh server ids from the run
(``tandem/fleet.py``) and runs ``python -m rollout.server`` for each, under the run's restart policy for
servers (``supervision.*``, launcher/supervision.py), until the run ends: its stop key is set,
or its Redis has not answered for ``REDIS_GONE_S``. Each joiner takes the learner's current weights
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

from buffer.retry import connect
from launcher.backends.local import Child, plan_children
from launcher.plan import Role, RunPlan, server_tp
from placement.local import thread_split
from tandem import fleet
from tandem.config import Config, ConfigError, load_config, redact
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
    client = connect(cfg.redis.url, reconnect_s=cfg.supervision.reconnect_s, socket_timeout=10)
    try:
        client.ping()
    except redis.RedisError as e:
        print(f"[attach] the run's Redis at {redact(cfg.redis.url)} does not answer ({e}): has it ended?")
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
    children = plan_children(plan)
    for c in children:
        client.delete(ready_key(run, c.name))
        c.start()
    print(f"[attach] started {', '.join(c.name for c in children)} in run {run}; logs in {run_dir / 'logs'}")

    leave = leave or threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: leave.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code, why = supervise(client, run, children, leave)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stop(children)
        client.close()
    print(f"[attach] {why}")
    return code


def supervise(
    client: redis.Redis, run: str, children: list[Child], leave: threading.Event
) -> tuple[int, str]:
    """Restart crashed servers until the run ends or we are told to leave; (exit code, why)."""
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
        now = time.monotonic()
        for c in children:
            if c.running:
                continue
            step = c.tend(now)
            if step == "refused":
                return 1, f"{c.restarts.refusal()}; last lines of {c.log_path}:\n{c.log_tail()}"
            if step == "restart":
                client.delete(ready_key(run, c.name))
                c.start(again=True)
                print(f"[attach] restarted {c.name} (restart {c.restarts.total})", flush=True)
    return 0, "left the run: the attached servers handed back what they held"


def stop(children: list[Child]) -> None:
    """SIGTERM (a graceful leave), then SIGKILL for any server still there after the grace."""
    for sig, wait in ((signal.SIGTERM, LEAVE_GRACE_S), (signal.SIGKILL, 5.0)):
        for c in children:
            c.signal(sig)
        deadline = time.monotonic() + wait
        while any(c.running for c in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not any(c.running for c in children):
            return
