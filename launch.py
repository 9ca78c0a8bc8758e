"""launch.py — one command for a whole run: Redis, K rollout servers, the learner, progress, shutdown.

    python launch.py configs/tiny.yaml [key.sub=value ...] [--mode sync|async] [--dry-run]
    python launch.py --resume runs/tiny-20261122-101500

What it does, top to bottom (docs/design.md §1.5): validate the config; create ``runs/<name>-<time>/`` with the
resolved config; start the embedded Redis (or use ``redis.url``); keep the prompt stream topped up from
the dataset; start the learner (torchrun for several ranks) and the rollout servers (each with its own
GPUs or share of CPU threads); wait until all report ready; supervise — a crashed rollout server is
restarted with backoff up to ``rollout.restart_limit`` times, a crashed learner stops the run with its
log tail shown; stop every child cleanly on Ctrl-C or when training ends (the learner writes its final
checkpoint), leaving no process behind; print a summary and write the reward plot.

``--mode sync`` runs the same components in lock-step: ``Config.max_staleness`` is 0, so admission
lets the servers generate exactly one batch per learner version (generate with v, train, publish v+1).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from buffer.redis_server import EmbeddedRedis, free_port
from tandem.config import Config, ConfigError, dump_config, load_config
from tandem.procs import DETACHED
from tandem.telemetry import history_key, ready_key, setup_logging, stats_key, stop_key

log = logging.getLogger("launch")
ROOT = Path(__file__).resolve().parent
# ------------------------------------------------------------------------------------------ processes


@dataclass
class Child:
    name: str
    cmd: list[str]
    env: dict[str, str]
    log_path: Path
    restart_limit: int = 0
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    restart_at: float | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        out = self.log_path.open("ab")
        out.write(f"\n=== {time.strftime('%H:%M:%S')} start: {shlex.join(self.cmd)}\n".encode())
        out.flush()
        self.proc = subprocess.Popen(
            self.cmd,
            env=self.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            **DETACHED,  # Ctrl-C reaches launch.py only, which stops children in order; they die with it
        )
        out.close()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def log_tail(self, n: int = 25) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


def _thread_split(cfg: Config) -> tuple[int, int]:
    """CPU threads for each server and for the learner: servers first, the learner takes what is left."""
    cores = os.cpu_count() or 1
    per_server = cfg.rollout.threads or max(1, cores // (cfg.rollout.num_servers + 1))
    learner = max(1, cores - per_server * cfg.rollout.num_servers)
    return per_server, learner


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def plan_processes(cfg: Config, run_dir: Path, config_path: Path, *, resume: bool) -> list[Child]:
    """The learner and the servers, with their commands, environments and devices."""
    py = sys.executable
    server_threads, learner_threads = _thread_split(cfg)
    gpus = _gpu_count() if cfg.run.device != "cpu" else 0
    base_env = {
        **os.environ,
        "TANDEM_RUN_GROUP": run_dir.name,
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    base_env.setdefault("WANDB_SILENT", "true")

    ranks = cfg.learner.num_ranks
    learner_args = ["--config", str(config_path), "--run-dir", str(run_dir)] + (
        ["--resume"] if resume else []
    )
    if ranks > 1:
        torchrun = [
            py,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={ranks}",
            f"--master_port={free_port()}",
        ]
        learner_cmd = [*torchrun, "-m", "learner.train", *learner_args]
    else:
        learner_cmd = [py, "-m", "learner.train", *learner_args]
    learner_env = {**base_env, "OMP_NUM_THREADS": str(learner_threads)}
    if gpus:
        learner_env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(min(ranks, gpus)))
    children = [Child("learner", learner_cmd, learner_env, run_dir / "logs" / "learner.log")]

    tp = {"vllm": cfg.rollout.vllm.tensor_parallel_size, "sglang": cfg.rollout.sglang.tp_size}.get(
        cfg.rollout.engine, 1
    )
    for i in range(cfg.rollout.num_servers):
        env = {**base_env, "OMP_NUM_THREADS": str(server_threads)}
        if gpus:
            # Servers take the GPUs after the learner's; with too few, they share round-robin.
            first = ranks + i * tp
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str((first + k) % gpus) for k in range(tp))
        cmd = [
            py,
            "-m",
            "rollout.server",
            "--config",
            str(config_path),
            "--server-id",
            str(i),
            "--run-dir",
            str(run_dir),
        ]
        children.append(
            Child(
                f"server-{i}",
                cmd,
                env,
                run_dir / "logs" / f"server-{i}.log",
                restart_limit=cfg.rollout.restart_limit,
            )
        )
    return children


# -------------------------------------------------------------------------------------------- prompts


@dataclass
class PromptSet:
    """The dataset's records and their token ids, checked against ``data.max_prompt_tokens`` up front."""

    records: list[dict]
    tokens: list[list[int]]

    @classmethod
    def load(cls, cfg: Config) -> PromptSet:
        """Raises ConfigError naming the record and field, before any process starts."""
        from transformers import AutoTokenizer

        from tandem.data import DatasetError, load_prompts, prompt_token_ids

        d = cfg.data
        try:
            records = load_prompts(d.prompts, d.prompt_field)
        except DatasetError as e:
            raise ConfigError(f"data.prompts: {e}") from None
        tokenizer = AutoTokenizer.from_pretrained(
            cfg.model.actor, trust_remote_code=cfg.model.trust_remote_code
        )
        if d.chat_template and not tokenizer.chat_template:
            raise ConfigError(f"data.chat_template: the tokenizer of {cfg.model.actor} has no chat template")
        tokens = []
        for rec in records:
            ids = prompt_token_ids(tokenizer, rec[d.prompt_field], chat_template=d.chat_template)
            if len(ids) > d.max_prompt_tokens:
                raise ConfigError(
                    f"data.max_prompt_tokens: record {rec['id']} of {d.prompts} has {len(ids)} tokens"
                    f" > {d.max_prompt_tokens}"
                )
            tokens.append(ids)
        return cls(records, tokens)


class PromptFeeder:
    """Keeps the prompt stream a few batches deep, pass after pass over the dataset (seeded shuffles).

    Its position (pass, index) lives in Redis, so a resumed run continues where it stopped.
    """

    def __init__(self, cfg: Config, prompts: PromptSet, buffer, client: redis.Redis) -> None:
        self.cfg, self.buffer, self.client = cfg, buffer, client
        self.records, self.tokens = prompts.records, prompts.tokens
        groups_per_step = cfg.algorithm.batch_size // cfg.rollout.n_samples
        # Deep enough that servers never wait on the feeder between two top-ups (prompts are tiny records).
        self.depth = max(
            256, 16 * groups_per_step, 16 * cfg.rollout.num_servers * cfg.rollout.prompts_per_batch
        )
        self.key = f"{cfg.run.name}:feeder"

    def top_up(self) -> int:
        import random

        from buffer.schema import PromptRecord

        missing = self.depth - self.buffer.prompts_pending()
        if missing <= 0:
            return 0
        saved = self.client.hmget(self.key, "epoch", "index")
        epoch, index = (int(saved[0]), int(saved[1])) if saved[0] is not None else (0, 0)
        batch = []
        while len(batch) < missing and epoch < self.cfg.data.epochs:
            order = list(range(len(self.records)))
            if self.cfg.data.shuffle:
                random.Random(self.cfg.run.seed * 100_003 + epoch).shuffle(order)
            i = order[index]
            rec = self.records[i]
            batch.append(
                PromptRecord(
                    prompt_id=f"{rec['id']}@{epoch}",
                    text=rec[self.cfg.data.prompt_field],
                    tokens=self.tokens[i],
                    record=rec,
                )
            )
            index += 1
            if index == len(order):
                epoch, index = epoch + 1, 0
        if batch:
            self.buffer.put_prompts(batch)
            self.client.hset(self.key, mapping={"epoch": epoch, "index": index})
        return len(batch)


# -------------------------------------------------------------------------------------------- console


class Console:
    """A live progress bar over learner steps with reward, staleness and throughput (rich)."""

    def __init__(self, cfg: Config, enabled: bool) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.enabled = enabled and sys.stdout.isatty()
        self.plain_every, self.last_plain = 10.0, 0.0
        self.total = cfg.learner.total_steps
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[stats]}"),
        )
        self.task = self.progress.add_task("train", total=self.total, stats="starting")
        if self.enabled:
            self.progress.start()

    def update(self, step: int, stats: str) -> None:
        self.progress.update(self.task, completed=min(step, self.total), stats=stats)
        if not self.enabled and time.monotonic() - self.last_plain > self.plain_every:
            self.last_plain = time.monotonic()
            print(f"[launch] step {step}/{self.total} {stats}", flush=True)

    def close(self) -> None:
        if self.enabled:
            self.progress.stop()


def _read_stats(client: redis.Redis, run: str, proc: str) -> dict[str, float]:
    raw = client.hgetall(stats_key(run, proc))
    return {k.decode(): json.loads(v) for k, v in raw.items()}


def _status_line(client: redis.Redis, cfg: Config) -> tuple[int, str]:
    learner = _read_stats(client, cfg.run.name, "learner")
    servers = [_read_stats(client, cfg.run.name, f"server-{i}") for i in range(cfg.rollout.num_servers)]
    gen = sum(s.get("rollout/tokens_per_s", 0.0) for s in servers)
    step = int(learner.get("learner/version", 0))
    stats = (
        f"reward {learner.get('reward/mean', float('nan')):.3f} | staleness {learner.get('staleness/mean', 0.0):.2f}"
        f" | gen {gen:,.0f} tok/s | train {learner.get('throughput/train_tokens_per_s', 0.0):,.0f} tok/s"
    )
    return step, stats


# ----------------------------------------------------------------------------------------------- run


@dataclass
class Outcome:
    ok: bool
    message: str


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


def supervise(
    cfg: Config, children: list[Child], client: redis.Redis, feeder: PromptFeeder, console: Console
) -> Outcome:
    """Until the learner exits: keep prompts flowing, restart crashed servers, show progress."""
    learner, servers = children[0], children[1:]
    while True:
        feeder.top_up()
        step, stats = _status_line(client, cfg)
        console.update(step, stats)
        if not learner.running:
            code = learner.proc.returncode
            if code == 0:
                return Outcome(True, f"learner finished at step {step}")
            return Outcome(
                False,
                f"learner exited with code {code}; last lines of {learner.log_path}:\n{learner.log_tail()}",
            )
        for s in servers:
            if s.running or client.exists(stop_key(cfg.run.name)):
                continue
            if s.restart_at is None:
                if s.restarts >= s.restart_limit:
                    return Outcome(
                        False,
                        f"{s.name} crashed {s.restarts + 1} times (limit {s.restart_limit}); last lines of {s.log_path}:\n{s.log_tail()}",
                    )
                s.restart_at = time.monotonic() + min(30.0, 2.0**s.restarts)
                log.warning(
                    "%s exited with code %s; restarting in %.0fs",
                    s.name,
                    s.proc.returncode,
                    s.restart_at - time.monotonic(),
                )
            elif time.monotonic() >= s.restart_at:
                s.restarts += 1
                s.restart_at = None
                client.delete(ready_key(cfg.run.name, s.name))
                s.start()
        time.sleep(0.25)


def wait_ready(cfg: Config, children: list[Child], client: redis.Redis) -> Outcome:
    deadline = time.monotonic() + cfg.run.ready_timeout_s
    pending = {c.name for c in children}
    while pending:
        for c in children:
            if c.name in pending and client.exists(ready_key(cfg.run.name, c.name)):
                pending.discard(c.name)
                log.info("%s ready", c.name)
            elif c.name in pending and not c.running:
                return Outcome(
                    False,
                    f"{c.name} exited with code {c.proc.returncode} before it was ready; last lines of {c.log_path}:\n{c.log_tail()}",
                )
        if time.monotonic() > deadline:
            return Outcome(
                False, f"not ready after run.ready_timeout_s={cfg.run.ready_timeout_s}s: {sorted(pending)}"
            )
        time.sleep(0.2)
    return Outcome(True, "ready")


def shutdown(cfg: Config, children: list[Child], client: redis.Redis | None, grace_s: float = 60.0) -> None:
    """Ask everyone to finish (the learner checkpoints), then SIGTERM, then SIGKILL: no process left behind."""
    if client is not None:
        with contextlib.suppress(redis.RedisError):
            client.set(stop_key(cfg.run.name), "1")
    for sig, wait in ((None, grace_s), (signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        if sig is not None:
            for c in children:
                c.signal(sig)
        deadline = time.monotonic() + wait
        while any(c.running for c in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not any(c.running for c in children):
            return


def remove_shared_weights(cfg: Config, run_dir: Path) -> None:
    """The shm transport's files live outside the run dir (in /dev/shm, i.e. RAM): free them at the end.
    A later --resume re-publishes the checkpoint's weights, so nothing is lost."""
    if cfg.weightsync.transport == "shm" and cfg.weightsync.shm_dir is None:
        from weightsync.shm import default_root

        root = default_root(cfg.run.name, run_dir)
        if root.is_relative_to("/dev/shm"):
            shutil.rmtree(root, ignore_errors=True)


def summarize(cfg: Config, client: redis.Redis, run_dir: Path) -> dict[str, float]:
    """Reward curve summary from the learner's history, a PNG plot, and where everything lives."""
    for proc in ["learner"] + [f"server-{i}" for i in range(cfg.rollout.num_servers)]:
        raw = client.lrange(history_key(cfg.run.name, proc), 0, -1)
        (run_dir / f"{proc}_history.jsonl").write_text("".join(r.decode() + "\n" for r in raw))
    rows = [json.loads(line) for line in (run_dir / "learner_history.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    if not rows:
        print("[launch] no learner steps were logged")
        return {}
    rewards = [r["reward/mean"] for r in rows]
    k = max(1, len(rewards) // 10)
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    t0 = rows[0]["time"]
    summary = {
        "steps": len(rows),
        "reward_first": first,
        "reward_last": last,
        "wall_s": rows[-1]["time"] - t0,
    }
    print(
        f"[launch] reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f} over {len(rows)} steps ({summary['wall_s']:.0f}s)"
    )
    n_marks = min(10, len(rows))
    marks = [rows[round(i * (len(rows) - 1) / max(1, n_marks - 1))] for i in range(n_marks)]
    print("[launch] reward curve: " + "  ".join(f"{int(r['step'])}:{r['reward/mean']:.2f}" for r in marks))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([r["time"] - t0 for r in rows], rewards)
        ax.set_xlabel("wall time (s)")
        ax.set_ylabel("reward/mean")
        ax.set_title(f"{run_dir.name} ({cfg.run.mode})")
        fig.tight_layout()
        fig.savefig(run_dir / "reward.png", dpi=100)
        plt.close(fig)
        print(f"[launch] plot: {run_dir / 'reward.png'}")
    except ImportError:
        pass
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("config", nargs="?", help="YAML config (not needed with --resume)")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    ap.add_argument("--mode", choices=["async", "sync"], help="override run.mode")
    ap.add_argument(
        "--resume", type=Path, metavar="RUN_DIR", help="continue a run from its directory and checkpoints"
    )
    ap.add_argument(
        "--dry-run", action="store_true", help="print the commands and per-process config, start nothing"
    )
    ap.add_argument(
        "--no-console", action="store_true", help="plain log lines instead of the live progress view"
    )
    args = ap.parse_intermixed_args(argv)  # overrides may come before or after any flag
    setup_logging()

    overrides = list(args.overrides) + ([f"run.mode={args.mode}"] if args.mode else [])
    try:
        if args.resume:
            # The public copy: same config, without the embedded Redis URL (restarted on the run's AOF).
            cfg = load_config(args.resume / "config.public.yaml", overrides)
        elif args.config:
            cfg = load_config(args.config, overrides)
        else:
            ap.error("a config file (or --resume RUN_DIR) is required")
        if not args.dry_run:
            check_inputs(cfg)
            prompts = PromptSet.load(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    if args.dry_run:
        run_dir = ROOT / cfg.run.output_dir / f"{cfg.run.name}-<time>"
        for c in plan_processes(cfg, run_dir, run_dir / "config.yaml", resume=bool(args.resume)):
            env = {
                k: v
                for k, v in c.env.items()
                if k in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "TANDEM_RUN_GROUP")
            }
            print(f"# {c.name}\n{' '.join(f'{k}={v}' for k, v in env.items())} {shlex.join(c.cmd)}")
        print("# per-process config (config.yaml)\n" + dump_config(cfg))
        return 0

    run_dir = prepare_run_dir(cfg, args.resume)
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": run_dir.name})})
    if not args.resume:  # what a later --resume starts from (no secrets: the embedded URL is added below)
        (run_dir / "config.public.yaml").write_text(dump_config(cfg))
    print(f"[launch] run directory: {run_dir}")

    embedded = None
    children: list[Child] = []
    client = None
    outcome = Outcome(False, "interrupted")
    try:
        if cfg.redis.url is None:
            embedded = EmbeddedRedis(run_dir / "redis", port=cfg.redis.port).start()
            cfg = cfg.model_copy(update={"redis": cfg.redis.model_copy(update={"url": embedded.url})})
        client = redis.Redis.from_url(cfg.redis.url, socket_timeout=30)
        client.ping()
        client.delete(stop_key(cfg.run.name))
        config_path = write_process_config(cfg, run_dir)

        from buffer.streams import ReplayBuffer

        feeder = PromptFeeder(cfg, prompts, ReplayBuffer.from_config(client, cfg, consumer="launch"), client)
        feeder.top_up()
        children = plan_processes(cfg, run_dir, config_path, resume=bool(args.resume))
        for c in children:
            client.delete(ready_key(cfg.run.name, c.name))
            c.start()
        print(f"[launch] started {', '.join(c.name for c in children)}; logs in {run_dir / 'logs'}")
        outcome = wait_ready(cfg, children, client)
        if outcome.ok:
            console = Console(cfg, enabled=cfg.logging.console and not args.no_console)
            try:
                outcome = supervise(cfg, children, client, feeder, console)
            finally:
                console.close()
    except KeyboardInterrupt:
        outcome = Outcome(False, "interrupted (Ctrl-C): stopping every process")
    finally:
        print("[launch] stopping ...", flush=True)
        shutdown(cfg, children, client)
        if client is not None:  # also after Ctrl-C or a crash: what was learned so far
            with contextlib.suppress(redis.RedisError):
                summarize(cfg, client, run_dir)
        if embedded is not None:
            embedded.stop()
        remove_shared_weights(cfg, run_dir)
    print(f"[launch] {outcome.message}")
    print(
        f"[launch] logs: {run_dir / 'logs'}; wandb files: {run_dir / 'wandb'} (mode {cfg.logging.wandb_mode})"
    )
    return 0 if outcome.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
