"""A run, top to bottom, the same for every backend (docs/design.md §1.5).

Validate (done by the caller), let the backend check the plan fits (before anything starts), create
``runs/<name>-<time>/``, start the embedded Redis (or use ``redis.url``), write the per-process config,
fill the prompt stream, start every role through the backend, wait until each is ready, supervise
(top up prompts, show progress, let the backend restart crashed servers) until the learner ends, stop
everything, and summarize.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import sys
import time
from pathlib import Path

import redis

from buffer.redis_server import EmbeddedRedis
from launcher.backends import Backend, Outcome, StartError
from launcher.console import Console, status_line, summarize
from launcher.feeder import PromptFeeder, PromptSet
from launcher.plan import RunPlan, plan_run
from tandem.config import Config, ConfigError, dump_config
from tandem.telemetry import ready_key, stop_key

log = logging.getLogger("launch")
ROOT = Path(__file__).resolve().parent.parent
SUPERVISE_TICK_S = 0.25


def check_inputs(cfg: Config) -> None:
    """Paths the children will load, checked before anything starts."""
    for field_path, p in (
        ("model.actor", cfg.model.actor),
        ("model.critic", cfg.model.critic),
        ("model.reference", cfg.model.reference),
        ("model.reward_model", cfg.model.reward_model),
    ):
        if p is not None and not (Path(p) / "config.json").is_file():
            raise ConfigError(
                f"{field_path}: {p} is not a checkpoint directory (no config.json); build the demo's with `python -m tandem make-tiny assets/tiny`"
            )
    if not Path(cfg.data.prompts).is_file():
        raise ConfigError(f"data.prompts: {cfg.data.prompts} not found")
    if cfg.eval.prompts is not None and not Path(cfg.eval.prompts).is_file():
        raise ConfigError(f"eval.prompts: {cfg.eval.prompts} not found")


def prepare_run_dir(cfg: Config, resume: Path | None) -> Path:
    if resume is not None:
        return resume.resolve()
    run_dir = (ROOT / cfg.run.output_dir / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    suffix = 1
    while run_dir.exists():
        run_dir = run_dir.with_name(f"{run_dir.name.rsplit('.', 1)[0]}.{suffix}")
        suffix += 1
    (run_dir / "logs").mkdir(parents=True)
    return run_dir


def write_process_config(cfg: Config, run_dir: Path) -> Path:
    """The resolved config every child reads. It holds the Redis password, so it is private (0600)."""
    path, tmp = run_dir / "config.yaml", run_dir / ".config.yaml.tmp"
    tmp.touch(mode=0o600)
    tmp.write_text(dump_config(cfg))
    tmp.rename(path)  # atomic: a reader sees no config or the whole config, never the password half-written
    return path


def dry_run_plan(cfg: Config, resume: bool) -> RunPlan:
    run_dir = ROOT / cfg.run.output_dir / f"{cfg.run.name}-<time>"
    return plan_run(cfg, run_dir, run_dir / "config.yaml", resume=resume)


def wait_ready(cfg: Config, plan: RunPlan, backend: Backend, client: redis.Redis) -> Outcome:
    deadline = time.monotonic() + cfg.run.ready_timeout_s
    pending = [r.name for r in plan.roles]
    while pending:
        for name in list(pending):
            if client.exists(ready_key(cfg.run.name, name)):
                pending.remove(name)
                log.info("%s ready", name)
            elif (why := backend.exited_before_ready(name)) is not None:
                return Outcome(False, why)
        if time.monotonic() > deadline:
            return Outcome(
                False, f"not ready after run.ready_timeout_s={cfg.run.ready_timeout_s}s: {sorted(pending)}"
            )
        time.sleep(0.2)
    return Outcome(True, "ready")


def supervise(
    cfg: Config, backend: Backend, client: redis.Redis, feeder: PromptFeeder, console: Console
) -> Outcome:
    """Until the learner exits: keep prompts flowing, let the backend restart crashed servers, show progress."""
    while True:
        feeder.top_up()
        step, stats = status_line(client, cfg)
        console.update(step, stats)
        outcome = backend.poll(stopping=bool(client.exists(stop_key(cfg.run.name))))
        if outcome is not None:
            if outcome.ok:
                outcome.message = f"{outcome.message} at step {status_line(client, cfg)[0]}"
            return outcome
        time.sleep(SUPERVISE_TICK_S)


def forget_dead_publisher(client: redis.Redis, run: str) -> None:
    """A resumed run's servers must not join the crashed learner's last ``dist`` offer: its store is gone
    (a connect would wait out ``weightsync.timeout_s``) and its ``go`` names versions past the checkpoint
    (joiners of the resumed versions would think they came too late). The new learner offers afresh."""
    from weightsync.base import weights_key

    client.delete(weights_key(run, "offer"), weights_key(run, "go"))


def remove_shared_weights(cfg: Config, run_dir: Path) -> None:
    """The shm transport's files live outside the run dir (in /dev/shm, i.e. RAM): free them at the end.
    A later --resume re-publishes the checkpoint's weights, so nothing is lost."""
    if cfg.weightsync.transport == "shm" and cfg.weightsync.shm_dir is None:
        from weightsync.shm import default_root

        root = default_root(cfg.run.name, run_dir)
        if root.is_relative_to("/dev/shm"):
            shutil.rmtree(root, ignore_errors=True)


def run(
    cfg: Config, prompts: PromptSet, backend: Backend, *, resume: Path | None, console_enabled: bool
) -> int:
    """One run through ``backend``; returns launch.py's exit code (0 when the learner finished)."""
    try:
        cfg = backend.prepare(cfg)  # a placement that cannot fit is refused here, before anything starts
    except ConfigError as e:
        backend.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return _run(cfg, prompts, backend, resume=resume, console_enabled=console_enabled)
    finally:
        backend.close()


def _run(
    cfg: Config, prompts: PromptSet, backend: Backend, *, resume: Path | None, console_enabled: bool
) -> int:
    run_dir = prepare_run_dir(cfg, resume)
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": run_dir.name})})
    if resume is None:  # what a later --resume starts from (no secrets: the embedded URL is added below)
        (run_dir / "config.public.yaml").write_text(dump_config(cfg))
    print(f"[launch] run directory: {run_dir}")

    embedded = None
    client = None
    started = False
    outcome = Outcome(False, "interrupted")
    try:
        if cfg.redis.url is None:
            embedded = EmbeddedRedis(
                run_dir / "redis", port=cfg.redis.port, host=backend.redis_host()
            ).start()
            cfg = cfg.model_copy(update={"redis": cfg.redis.model_copy(update={"url": embedded.url})})
        client = redis.Redis.from_url(cfg.redis.url, socket_timeout=30)
        client.ping()
        client.delete(stop_key(cfg.run.name))
        forget_dead_publisher(client, cfg.run.name)
        config_path = write_process_config(cfg, run_dir)

        from buffer.streams import ReplayBuffer

        feeder = PromptFeeder(cfg, prompts, ReplayBuffer.from_config(client, cfg, consumer="launch"), client)
        feeder.top_up()
        plan = plan_run(cfg, run_dir, config_path, resume=resume is not None)
        for role in plan.roles:
            client.delete(ready_key(cfg.run.name, role.name))
        started = True
        backend.start(plan, client, dump_config(cfg))
        print(f"[launch] started {', '.join(r.name for r in plan.roles)}; logs in {run_dir / 'logs'}")
        outcome = wait_ready(cfg, plan, backend, client)
        if outcome.ok:
            console = Console(cfg, enabled=console_enabled)
            try:
                outcome = supervise(cfg, backend, client, feeder, console)
            finally:
                console.close()
    except StartError as e:
        outcome = Outcome(False, f"could not start: {e}")
    except KeyboardInterrupt:
        outcome = Outcome(False, "interrupted (Ctrl-C): stopping every process")
    finally:
        print("[launch] stopping ...", flush=True)
        if client is not None:
            with contextlib.suppress(redis.RedisError):
                client.set(stop_key(cfg.run.name), "1")  # ask everyone to finish (the learner checkpoints)
        if started:
            backend.stop(grace_s=60.0)
        if client is not None:  # also after Ctrl-C or a crash: what was learned so far
            with contextlib.suppress(redis.RedisError):
                summarize(cfg, client, run_dir, backend.placement())
        if embedded is not None:
            embedded.stop()
        remove_shared_weights(cfg, run_dir)
    print(f"[launch] {outcome.message}")
    print(
        f"[launch] logs: {run_dir / 'logs'}; wandb files: {run_dir / 'wandb'} (mode {cfg.logging.wandb_mode})"
    )
    return 0 if outcome.ok else 1
