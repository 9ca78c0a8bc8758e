"""A run, top to bottom, the same for every backend (docs/design.md §1.5).

Validate (done by the caller), let the backend check the plan fits (before anything starts), create
``runs/<name>-<time>/``, start the embedded Redis (or use ``redis.url``), write the per-process config,
fill the prompt stream, start every role through the backend, wait until each is ready, supervise
(restart a crashed embedded Redis, top up prompts, show progress, let the backend restart crashed
servers and the learner) until the learner ends, stop everything, and summarize. Every tick survives a
Redis that is down: the next tick restarts it (docs/design.md §6.3).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import logging
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import redis
import yaml

from buffer.redis_server import EmbeddedRedis
from buffer.retry import RedisUnavailable, connect_run
from launcher.backends import Backend, Outcome, StartError
from launcher.console import Console, status_line, summarize
from launcher.feeder import Feeders, PromptSet
from launcher.prepare import how_to_make
from launcher.run_plan import RunPlan, plan_run
from launcher.supervision import RestartPolicy, Restarts
from tandem.config import Config, ConfigError, adapter_run_dir, dump_config, write_private
from tandem.config.checks import vision_checks_for
from tandem.procs import alive, reap_group
from tandem.telemetry import ready_key, stop_key

log = logging.getLogger("launch")
ROOT = Path(__file__).resolve().parent.parent
SUPERVISE_TICK_S = 0.25
MOVED = 3  # run's exit code when a watch stopped it to continue under another placement
# Sees each new learner step of a supervised run (the step, the run's Redis and its name); returns a reason
# to stop it cleanly, to be resumed, or None.
Watch = Callable[[int, redis.Redis, str], str | None]
# The driver restarts the embedded Redis itself, so its own client gives up on a dead one quickly and
# the next tick restarts it; an external Redis is retried as long as every other client does.
DRIVER_RECONNECT_S = 2.0


def check_inputs(cfg: Config) -> None:
    """Paths the children will load, checked before anything starts."""
    for field_path, p in (
        ("model.actor", cfg.model.actor),
        ("model.critic", cfg.model.critic),
        ("model.reference", cfg.model.reference),
        ("model.teacher", cfg.model.teacher),
        ("model.reward_model", cfg.model.reward_model),
    ):
        if p is not None and not (Path(p) / "config.json").is_file():
            raise ConfigError(
                f"{field_path}: {p} is not a checkpoint directory (no config.json); {how_to_make(cfg, p)}"
            )
    if cfg.model.teacher is not None:  # distillation: the teacher scores the actor's token ids
        from tandem.tokenizer_match import check_same_tokenizer  # transformers: not at the launcher's import

        check_same_tokenizer(
            cfg.model.actor, cfg.model.teacher, trust_remote_code=cfg.model.trust_remote_code
        )
    check_context(cfg)
    for check in vision_checks_for(cfg.recipe):  # again: a prepare step may have made the actor since
        try:
            check(cfg)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if not Path(cfg.data.prompts).is_file():
        raise ConfigError(f"data.prompts: {cfg.data.prompts} not found; {how_to_make(cfg, cfg.data.prompts)}")
    if cfg.eval.prompts is not None and not Path(cfg.eval.prompts).is_file():
        raise ConfigError(f"eval.prompts: {cfg.eval.prompts} not found; {how_to_make(cfg, cfg.eval.prompts)}")


def check_context(cfg: Config) -> None:
    """A prompt and its response fit the actor's context (``max_position_embeddings`` of its config.json)."""
    from tandem.data import model_limits

    context = model_limits(cfg.model.actor)[1]
    longest = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    if context is not None and cfg.recipe == "ppo" and longest > context:
        raise ConfigError(
            f"data.max_prompt_tokens ({cfg.data.max_prompt_tokens}) + rollout.max_new_tokens "
            f"({cfg.rollout.max_new_tokens}) = {longest} exceeds the context of model.actor "
            f"({context} tokens, max_position_embeddings of {Path(cfg.model.actor) / 'config.json'})"
        )


def fixed_run_dir(cfg: Config) -> Path | None:
    """``run.dir``, resolved like ``run.output_dir`` (relative to the repository); None when unset."""
    if cfg.run.dir is None:
        return None
    run_dir = (ROOT / cfg.run.dir).resolve()
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", run_dir.name):
        raise ConfigError(f"run.dir: {cfg.run.dir}: its last part names the run: letters, digits, _ . - only")
    return run_dir


def started_before(run_dir: Path | None) -> bool:
    """Whether ``run_dir`` holds a run that was started (what ``--resume`` continues)."""
    return run_dir is not None and (run_dir / "config.public.yaml").is_file()


def unfinished_runs(cfg: Config) -> list[Path]:
    """Run directories of this run's name under ``run.output_dir`` (``<name>-<time>``) that were started,
    are not running now and never reached their own ``learner.total_steps`` in a committed checkpoint
    (``checkpoints/latest.json``), oldest first: what ``--resume`` would continue."""
    parent = ROOT / cfg.run.output_dir
    if not parent.is_dir():
        return []
    name = re.compile(rf"{re.escape(cfg.run.name)}-\d{{8}}-\d{{6}}(\.\d+)?")
    found = []
    for run_dir in sorted(p for p in parent.iterdir() if name.fullmatch(p.name) and started_before(p)):
        try:
            learner = yaml.safe_load((run_dir / "config.public.yaml").read_text())["learner"]
            total = int(learner.get("total_steps", 100))
            ckpt_dir = Path(learner.get("checkpoint_dir") or run_dir / "checkpoints")
        except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError):
            continue
        try:
            version = int(json.loads((ckpt_dir / "latest.json").read_text())["version"])
        except (OSError, ValueError, KeyError, TypeError):
            version = -1
        if version < total and not locked(run_dir):
            found.append(run_dir)
    return found


def locked(run_dir: Path) -> bool:
    """Whether a launch.py holds ``run_dir``'s :class:`RunLock` now (the run is going on)."""
    try:
        fd = os.open(run_dir / ".launch.lock", os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the probe's own lock
    return False


def resume_note(cfg: Config) -> str | None:
    """The line launch.py prints when a new run starts beside an interrupted one of the same name."""
    if cfg.run.dir is not None:  # a fixed run directory resumes by itself
        return None
    runs = unfinished_runs(cfg)
    if not runs:
        return None
    run_dir = runs[-1]
    with contextlib.suppress(ValueError):
        run_dir = run_dir.relative_to(Path.cwd())
    return f"note: {run_dir} did not finish; resume it with: python launch.py --resume {run_dir}"


def print_resume_note(cfg: Config, resume: Path | None) -> None:
    """Print :func:`resume_note` when a new run starts (``resume`` None) and there is one."""
    if resume is None and (note := resume_note(cfg)):
        print(note, flush=True)


def prepare_run_dir(cfg: Config, resume: Path | None, *, fresh: bool = False) -> Path:
    """The run directory, made (or found) owner-only: it holds ``config.yaml`` with the run's secrets."""
    run_dir = _run_dir(cfg, resume, fresh=fresh)
    if run_dir.is_dir():  # a --resume of a missing directory is refused later, by name
        run_dir.chmod(0o700)
    return run_dir


def _run_dir(cfg: Config, resume: Path | None, *, fresh: bool) -> Path:
    if resume is not None:
        return resume.resolve()
    run_dir = fixed_run_dir(cfg)
    if run_dir is not None:  # fixed: the caller resumes a run started there before, unless --fresh
        if fresh and run_dir.exists() and any(run_dir.iterdir()):
            RunLock(run_dir).release()  # refused while a driver runs it
            wait_for_leftovers(run_dir)  # a dead driver's children would write into the new run
            aside = run_dir.with_name(f"{run_dir.name}.{time.strftime('%Y%m%d-%H%M%S')}")
            run_dir.rename(aside)
            print(f"[launch] --fresh: the earlier run in {run_dir} moved to {aside}", flush=True)
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        return run_dir
    run_dir = (ROOT / cfg.run.output_dir / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    suffix = 1
    while run_dir.exists():
        run_dir = run_dir.with_name(f"{run_dir.name.rsplit('.', 1)[0]}.{suffix}")
        suffix += 1
    (run_dir / "logs").mkdir(parents=True)
    return run_dir


def checkpointed_version(cfg: Config, run_dir: Path) -> int | None:
    """The version of the run's newest committed checkpoint (``latest.json``); None: none yet. With
    ``learner.lora.adapters``, the lowest of the adapters' (each resumes from its own)."""
    if runs := cfg.adapter_runs():
        versions = [checkpointed_version(run, adapter_run_dir(run_dir, name)) for name, run in runs.items()]
        return None if None in versions else min(v for v in versions if v is not None)
    latest = Path(cfg.learner.checkpoint_dir or run_dir / "checkpoints") / "latest.json"
    try:
        return int(json.loads(latest.read_text())["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


class RunLock:
    """One driver per run directory: an exclusive ``flock`` on ``<run dir>/.launch.lock``, held while the
    driver lives (the kernel drops it when the driver dies, even by SIGKILL)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / ".launch.lock"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self.fd)
            raise ConfigError(
                f"{run_dir} is in use by another launch.py (pid {holder}); stop it first"
            ) from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, str(os.getpid()).encode(), 0)

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def leftovers(run_dir: Path) -> list[int]:
    """Processes of an earlier driver of this run that are still there: its children (``--run-dir
    RUN_DIR`` in their arguments) and its embedded redis-server (by the port in the old config)."""
    port = None
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError, AttributeError, IndexError):
        url = yaml.safe_load((run_dir / "config.yaml").read_text())["redis"]["url"]
        port = url.rsplit(":", 1)[1].split("/")[0]
    found = []
    for pid in os.listdir("/proc") if Path("/proc").is_dir() else []:
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        ours = any(a == "--run-dir" and b == str(run_dir) for a, b in itertools.pairwise(args))
        redis_of_run = port is not None and "redis-server" in args[0] and any(f":{port}" in a for a in args)
        if ours or redis_of_run:
            found.append(int(pid))
    return found


def wait_for_leftovers(run_dir: Path, timeout_s: float = 15.0) -> None:
    """Before a run is resumed: the processes of a driver that died (they stop by themselves within seconds,
    tandem/procs.py) must be gone, or two of them would share the run's files; past ``timeout_s``, killed."""
    deadline = time.monotonic() + timeout_s
    pids = leftovers(run_dir)
    if pids:
        print(
            f"[launch] waiting for {len(pids)} process(es) of the run's previous driver to exit", flush=True
        )
    while pids and time.monotonic() < deadline:
        time.sleep(0.2)
        pids = [p for p in pids if alive(p)]
    for pid in pids:
        log.warning("process %d of the run's previous driver is still there: killing it", pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def write_process_config(cfg: Config, run_dir: Path) -> Path:
    """The resolved config every child reads. It holds the Redis password, so it is private (0600)."""
    path = run_dir / "config.yaml"
    write_private(path, dump_config(cfg))
    return path


def dry_run_plan(cfg: Config, resume: bool) -> RunPlan:
    run_dir = fixed_run_dir(cfg) or ROOT / cfg.run.output_dir / f"{cfg.run.name}-<time>"
    return plan_run(cfg, run_dir, run_dir / "config.yaml", resume=resume)


class RedisKeeper:
    """Restarts the embedded redis-server when it dies, on its port, password and AOF, per its policy.
    An external ``redis.url`` is its operator's to supervise: clients only retry for reconnect_s."""

    def __init__(self, cfg: Config, embedded: EmbeddedRedis | None) -> None:
        self.embedded = embedded
        self.restarts = Restarts("redis", RestartPolicy.for_role(cfg, "redis"))

    def tick(self) -> Outcome | None:
        """Restart a dead embedded Redis when its backoff is over; an Outcome once past the limit."""
        e = self.embedded
        if e is None or e.alive:
            return None
        step = self.restarts.tend(time.monotonic(), f"redis-server exited with code {e.proc.returncode}")
        if step == "refused":
            return Outcome(False, f"{self.restarts.refusal()}; last lines of its log:{e.log_tail()}")
        if step == "restart":
            try:  # from the main thread: the child's death signal follows the thread that forked
                e.restart()
            except (RuntimeError, TimeoutError) as err:
                return Outcome(False, f"redis could not be restarted: {err}")
            print(f"[launch] restarted redis (restart {self.restarts.total})", flush=True)
        return None

    @property
    def up(self) -> bool:
        return self.embedded is None or self.embedded.alive


def tick(
    cfg: Config, backend: Backend, client: redis.Redis, keeper: RedisKeeper, feeder: Feeders
) -> Outcome | None:
    """One supervision step: Redis first, then prompts, then the backend's processes."""
    if (outcome := keeper.tick()) is not None:
        return outcome
    stopping = False
    if keeper.up:
        with contextlib.suppress(redis.ConnectionError):  # died just now: the next tick restarts it
            feeder.top_up()
            stopping = bool(client.exists(stop_key(cfg.run.name)))
            if stopping and cfg.learner.lora.adapters:  # {run}:stop asks every adapter's run to finish
                client.mset({stop_key(run.run.name): "1" for run in runs_of(cfg)})
    return backend.poll(stopping=stopping)


def wait_ready(
    cfg: Config,
    plan: RunPlan,
    backend: Backend,
    client: redis.Redis,
    keeper: RedisKeeper,
    feeder: Feeders,
) -> Outcome:
    """Every role ready within run.ready_timeout_s; one that dies meanwhile is restarted like any crash."""
    deadline = time.monotonic() + cfg.run.ready_timeout_s
    pending = [r.name for r in plan.roles]
    while pending:
        if (outcome := tick(cfg, backend, client, keeper, feeder)) is not None:
            return outcome
        with contextlib.suppress(redis.ConnectionError):
            for name in list(pending):
                if keeper.up and client.exists(ready_key(cfg.run.name, name)):
                    pending.remove(name)
                    log.info("%s ready", name)
        if time.monotonic() > deadline:
            return Outcome(
                False, f"not ready after run.ready_timeout_s={cfg.run.ready_timeout_s}s: {sorted(pending)}"
            )
        time.sleep(0.2)
    return Outcome(True, "ready")


def supervise(
    cfg: Config,
    backend: Backend,
    client: redis.Redis,
    keeper: RedisKeeper,
    feeder: Feeders,
    console: Console,
    watch: Watch | None = None,
) -> Outcome:
    """Until the learner finishes (or a role crashes past its limit): keep Redis up and prompts flowing,
    let the backend restart crashed processes, show progress. ``watch`` sees every new learner step and
    may end the run early, cleanly (a re-plan, docs/placement.md §11.3)."""
    step = seen = 0
    while True:
        outcome = tick(cfg, backend, client, keeper, feeder)
        if keeper.up:
            with contextlib.suppress(redis.ConnectionError):
                step, stats = status_line(client, cfg)
                console.update(step, stats)
        if outcome is not None:
            if outcome.ok:
                outcome.message = f"{outcome.message} at step {step}"
            return outcome
        if watch is not None and step > seen:
            seen = step
            if (why := watch(step, client, cfg.run.name)) is not None:
                return Outcome(True, f"stopped at step {step} to move: {why}", moved=True)
        time.sleep(SUPERVISE_TICK_S)


def count_rejected(run_dir: Path) -> None:
    """``data/rejected`` in ``summary.json``: the prompt records set aside (``rejected_prompts.jsonl``)."""
    rejected = run_dir / "rejected_prompts.jsonl"
    if not rejected.is_file():
        return
    path = run_dir / "summary.json"
    with contextlib.suppress(OSError, ValueError):
        summary = json.loads(path.read_text()) if path.is_file() else {}
        summary["data/rejected"] = sum(1 for line in rejected.open() if line.strip())
        path.write_text(json.dumps(summary, indent=2))


def remove_shared_weights(cfg: Config, run_dir: Path) -> None:
    """The shm transport's files live outside the run dir (in /dev/shm, i.e. RAM): free them at the end.
    A later --resume re-publishes the checkpoint's weights, so nothing is lost."""
    if cfg.weightsync.transport == "shm" and cfg.weightsync.shm_dir is None:
        from weightsync.shm import ROOT_NOTE, WeightSyncError, check_private, noted_root

        root = noted_root(run_dir)  # the learner's publisher made it and noted it in the run dir
        if root is not None and root.is_relative_to("/dev/shm"):
            with contextlib.suppress(WeightSyncError):  # never another user's folder
                check_private(root)
                shutil.rmtree(root, ignore_errors=True)
            (run_dir / ROOT_NOTE).unlink(missing_ok=True)


def run(
    cfg: Config,
    prompts: PromptSet,
    backend: Backend,
    *,
    resume: Path | None,
    console_enabled: bool,
    fresh: bool = False,
    watch: Watch | None = None,
) -> int:
    """One run through ``backend``; returns launch.py's exit code (0 when the learner finished, ``MOVED``
    when ``watch`` stopped it to continue under another placement). ``resume``: the run directory of a run
    to continue; ``fresh``: a fixed ``run.dir`` holding an earlier run is moved aside first."""
    try:
        cfg = backend.prepare(cfg)  # a placement that cannot fit is refused here, before anything starts
        run_dir = prepare_run_dir(cfg, resume, fresh=fresh)
        lock = RunLock(run_dir)  # one driver per run directory
    except ConfigError as e:
        backend.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        if resume is not None:
            wait_for_leftovers(run_dir)  # a driver killed just now: its children are on their way out
            v = checkpointed_version(cfg, run_dir)
            since = (
                f"version {v} (its newest checkpoint)" if v is not None else "version 0 (no checkpoint yet)"
            )
            print(f"[launch] resuming the run in {run_dir} from {since}", flush=True)
        return _run(
            cfg, prompts, backend, run_dir, resume=resume, console_enabled=console_enabled, watch=watch
        )
    finally:
        lock.release()
        backend.close()


def _run(
    cfg: Config,
    prompts: PromptSet,
    backend: Backend,
    run_dir: Path,
    *,
    resume: Path | None,
    console_enabled: bool,
    watch: Watch | None = None,
) -> int:
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": run_dir.name})})
    record_config(cfg, run_dir, resumed=resume is not None)
    if (rejected := prompts.write_rejected(run_dir)) is not None:
        print(f"[launch] {len(prompts.rejected)} bad prompt record(s) set aside in {rejected}", flush=True)
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
        reconnect_s = DRIVER_RECONNECT_S if embedded is not None else cfg.supervision.reconnect_s
        client = connect_run(cfg.redis.url, reconnect_s=reconnect_s)
        keeper = RedisKeeper(cfg, embedded)
        forget_last_life(cfg, client)
        config_path = write_process_config(cfg, run_dir)

        feeder = Feeders(cfg, prompts, client)
        feeder.top_up()
        plan = plan_run(cfg, run_dir, config_path, resume=resume is not None)
        for role in plan.roles:
            client.delete(ready_key(cfg.run.name, role.name))
        started = True
        backend.start(plan, client, dump_config(cfg))
        print(f"[launch] started {', '.join(r.name for r in plan.roles)}; logs in {run_dir / 'logs'}")
        outcome = wait_ready(cfg, plan, backend, client, keeper, feeder)
        if outcome.ok:
            outcome = supervise_with_console(cfg, backend, client, keeper, feeder, console_enabled, watch)
    except StartError as e:
        outcome = Outcome(False, f"could not start: {e}")
    except RedisUnavailable as e:  # an external redis.url that does not answer: no process was started
        outcome = Outcome(False, f"could not start: {e}")
    except KeyboardInterrupt:
        outcome = Outcome(False, "interrupted (Ctrl-C): stopping every process")
    finally:
        stop_run(cfg, backend, run_dir, embedded, client, started=started)
    print(f"[launch] {outcome.message}")
    print(
        f"[launch] logs: {run_dir / 'logs'}; wandb files: {run_dir / 'wandb'} (mode {cfg.logging.wandb_mode})"
    )
    return MOVED if outcome.moved else 0 if outcome.ok else 1


def record_config(cfg: Config, run_dir: Path, *, resumed: bool) -> None:
    """Write what a later run of the same command or --resume starts from (without the embedded Redis's
    URL, added later); a resumed run in its own directory keeps the config it started with, a fixed
    run.dir the config of its latest command. Owner-only: a redis.url or API key the user gave is in it,
    as --resume needs it."""
    if not resumed or cfg.run.dir is not None:
        write_private(run_dir / "config.public.yaml", dump_config(cfg))
    print(f"[launch] run directory: {run_dir}")


def forget_last_life(cfg: Config, client: redis.Redis) -> None:
    """Clear what a previous life of this run left in Redis that would stop or mislead this one: its stop
    request, and the weight publisher that died with it."""
    from weightsync.dist import forget_dead_publisher  # torch: not at the launcher's import

    for run in runs_of(cfg):
        client.delete(stop_key(run.run.name))
        forget_dead_publisher(client, run.run.name)


def runs_of(cfg: Config) -> list[Config]:
    """The run, and with ``learner.lora.adapters`` each adapter's run (each its own Redis keys)."""
    return [cfg, *cfg.adapter_runs().values()]


def supervise_with_console(
    cfg: Config,
    backend: Backend,
    client: redis.Redis,
    keeper: RedisKeeper,
    feeder: Feeders,
    console_enabled: bool,
    watch: Watch | None,
) -> Outcome:
    """Supervise the ready run with its console, which is closed however the run ends."""
    console = Console(cfg, enabled=console_enabled)
    try:
        return supervise(cfg, backend, client, keeper, feeder, console, watch)
    finally:
        console.close()


def stop_run(
    cfg: Config,
    backend: Backend,
    run_dir: Path,
    embedded: EmbeddedRedis | None,
    client: redis.Redis | None,
    *,
    started: bool,
) -> None:
    """However the run ended: ask every process to finish, stop them, summarize what was learned so far,
    and free Redis and the shared weights. Each step copes with what was never started."""
    print("[launch] stopping ...", flush=True)
    if embedded is not None and not embedded.alive and started:
        with contextlib.suppress(Exception):  # the processes still flushing need it, and the summary
            embedded.restart()
    if client is not None:
        with contextlib.suppress(redis.RedisError):  # ask everyone to finish (the learner checkpoints)
            for run in runs_of(cfg):
                client.set(stop_key(run.run.name), "1")
    if started:
        backend.stop(grace_s=60.0)
        # engine servers a killed rollout server left behind (tandem/procs.py)
        if left := [pid for group in (run_dir / "logs").glob("*.group") for pid in reap_group(group)]:
            log.warning("killed %d process(es) of engine servers whose rollout server was gone", len(left))
    if client is not None:  # also after Ctrl-C or a crash: what was learned so far
        with contextlib.suppress(redis.RedisError):
            summarize(cfg, client, run_dir, backend.placement())
    count_rejected(run_dir)
    if embedded is not None:
        embedded.stop()
    remove_shared_weights(cfg, run_dir)
    for name, run in cfg.adapter_runs().items():
        remove_shared_weights(run, adapter_run_dir(run_dir, name))
