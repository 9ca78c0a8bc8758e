"""Metrics out of every process: wandb (one group per launch) plus the latest values in Redis for the console.

:class:`Telemetry` is a null-object-friendly logger (after nanochat): call sites always call ``log``; with
wandb disabled and no Redis it does nothing. Keys are namespaced (``reward/mean``, ``time/train``, ...).

Run-level Redis keys every process shares (all prefixed by the run id):
- ``{run}:ready:{proc}``  JSON set once the process is ready (pid, and the HTTP port for servers);
- ``{run}:stats:{proc}``  hash of the latest metric values (JSON numbers), read by launch.py's console;
- ``{run}:history:{proc}`` list of every logged row (JSON, with ``step`` and ``time``), for the summary and plots;
- ``{run}:stop``          set by launch.py to ask every process to finish cleanly.

When a run ends, launch.py writes each process's history to ``<proc>_history.jsonl`` in the run directory
(:func:`history_path`); :func:`read_history` reads it back.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import redis

from tandem.config import Config, public_dict, redact

log = logging.getLogger(__name__)
HISTORY_LEN = 100_000
HISTORY_SUFFIX = "_history.jsonl"  # <proc>_history.jsonl in a run directory


def ready_key(run: str, proc: str) -> str:
    return f"{run}:ready:{proc}"


def stats_key(run: str, proc: str) -> str:
    return f"{run}:stats:{proc}"


def history_key(run: str, proc: str) -> str:
    return f"{run}:history:{proc}"


def stop_key(run: str) -> str:
    return f"{run}:stop"


def latest_stats(client: redis.Redis, run: str, proc: str) -> dict[str, float]:
    """The latest metrics ``proc`` of ``run`` logged, as mirrored into Redis (:meth:`Telemetry.log`)."""
    return {k.decode(): json.loads(v) for k, v in client.hgetall(stats_key(run, proc)).items()}


def history_path(run_dir: str | os.PathLike[str], proc: str) -> Path:
    """The file a run's history of ``proc`` (``learner``, ``server-0``, ``reference``, ...) is written to."""
    return Path(run_dir) / f"{proc}{HISTORY_SUFFIX}"


def history_procs(run_dir: str | os.PathLike[str], pattern: str) -> list[str]:
    """The processes matching the glob ``pattern`` (``server-*``) whose history the run holds, by name."""
    return sorted(
        p.name.removesuffix(HISTORY_SUFFIX) for p in Path(run_dir).glob(f"{pattern}{HISTORY_SUFFIX}")
    )


def read_history(run_dir: str | os.PathLike[str], proc: str) -> list[dict[str, Any]]:
    """Every row ``proc`` logged in the run at ``run_dir``, in order; none where no history was written (a
    run still going, or one whose driver was killed). A last line still being written is left out."""
    return read_rows(history_path(run_dir, proc))


def read_rows(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The rows of a JSON-lines history that may still be written to (this one, or an offline learner's
    ``history.jsonl``): none without the file, a half-written last line left out, a broken one before it an
    error."""
    path = Path(path)
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    rows = [json.loads(line) for line in lines[:-1]]
    with contextlib.suppress(json.JSONDecodeError):
        rows += [json.loads(line) for line in lines[-1:]]
    return rows


class RedactSecrets(logging.Filter):
    """Replaces URL passwords in every record a handler emits, whoever logged it (our code or a library)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RedactSecrets) for f in handler.filters):
            handler.addFilter(RedactSecrets())
    # httpx2 is the openai client's: a line per request (an LLM judge's, one per completion)
    for noisy in ("httpx", "httpx2", "urllib3", "filelock", "DeepSpeed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def without_wandb(cfg: Config) -> Config:
    """``cfg`` logging nothing to wandb: for a :class:`Telemetry` that only marks readiness or mirrors
    metrics into Redis beside a process's own wandb run."""
    return cfg.model_copy(update={"logging": cfg.logging.model_copy(update={"wandb_mode": "disabled"})})


class Telemetry:
    """Log metrics to wandb and mirror the latest values into Redis."""

    def __init__(
        self,
        cfg: Config,
        proc: str,
        client: redis.Redis | None = None,
        *,
        run_dir: str | None = None,
        job_type: str | None = None,
    ) -> None:
        self.run = cfg.run.name
        self.proc = proc
        self.client = client
        self._wandb = None
        if cfg.logging.wandb_mode != "disabled":
            import wandb

            self._wandb = wandb.init(
                project=cfg.logging.wandb_project,
                mode=cfg.logging.wandb_mode,
                group=os.environ.get("TANDEM_RUN_GROUP", cfg.run.name),
                name=f"{os.environ.get('TANDEM_RUN_GROUP', cfg.run.name)}-{proc}",
                job_type=job_type or proc.split("-")[0],
                dir=run_dir,
                config=public_dict(cfg),  # never the Redis password or API keys
                reinit="create_new",
            )

    def mark_ready(self, **info: Any) -> None:
        if self.client is not None:
            self.client.set(
                ready_key(self.run, self.proc), json.dumps({"pid": os.getpid(), "time": time.time(), **info})
            )

    def log(self, metrics: dict[str, float], step: int | None = None) -> None:
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if self.client is not None and metrics:
            payload = {k: json.dumps(float(v)) for k, v in metrics.items() if isinstance(v, (int, float))}
            if step is not None:
                payload["step"] = json.dumps(step)
            row = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
            row.update(step=step, time=time.time())
            try:
                pipe = self.client.pipeline(transaction=False)
                pipe.hset(stats_key(self.run, self.proc), mapping=payload)
                pipe.rpush(history_key(self.run, self.proc), json.dumps(row))
                pipe.ltrim(history_key(self.run, self.proc), -HISTORY_LEN, -1)
                pipe.execute()
            except redis.RedisError as e:  # the console view is best-effort; training goes on
                log.warning("could not mirror metrics to redis: %s", e)

    def log_table(self, key: str, columns: list[str], rows: list[list[Any]], step: int | None = None) -> None:
        """A table of text rows (sampled completions) to wandb; Redis holds numbers only, so not mirrored."""
        if self._wandb is not None:
            import wandb

            self._wandb.log({key: wandb.Table(columns=columns, data=rows)}, step=step)

    def stop_requested(self) -> bool:
        return bool(self.client is not None and self.client.exists(stop_key(self.run)))

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
