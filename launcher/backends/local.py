"""The ``local`` backend: every role as subprocesses of launch.py on this machine (the default).

The learner is ``python -m learner.train`` (``torchrun --nproc_per_node N`` for N ranks), each server
``python -m rollout.server``. GPUs: the learner's ranks first, then ``tp`` GPUs per server, round-robin
when too few; on CPU, ``OMP_NUM_THREADS`` splits the cores. A crashed server is restarted after
``min(30, 2^k)`` s up to its restart limit; children run in their own sessions and die with launch.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from buffer.redis_server import free_port
from launcher.backends import Outcome
from launcher.plan import Role, RunPlan
from tandem.config import Config, ConfigError
from tandem.procs import DETACHED
from tandem.telemetry import ready_key

log = logging.getLogger("launch")
ROOT = Path(__file__).resolve().parents[2]


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


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def _command(role: Role) -> list[str]:
    py = sys.executable
    if role.processes > 1:
        torchrun = ["-m", "torch.distributed.run", f"--nproc_per_node={role.processes}"]
        return [py, *torchrun, f"--master_port={free_port()}", "-m", role.module, *role.argv]
    return [py, "-m", role.module, *role.argv]


def plan_children(plan: RunPlan) -> list[Child]:
    """The learner and the servers as subprocesses, with their commands, environments and devices."""
    gpus = _gpu_count() if plan.cfg.run.device != "cpu" else 0
    base = {**os.environ, **plan.env}
    base.setdefault("WANDB_SILENT", "true")
    children, next_gpu = [], 0
    for role in plan.roles:
        env = {**base, "OMP_NUM_THREADS": str(role.threads)}
        if gpus and role.gpus:
            # The learner's ranks take the first GPUs, each server the next tp; too few: round-robin.
            count = role.processes * role.gpus
            if role.is_learner:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(min(count, gpus)))
            else:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str((next_gpu + k) % gpus) for k in range(count))
            next_gpu += count
        log_path = plan.run_dir / "logs" / f"{role.name}.log"
        children.append(Child(role.name, _command(role), env, log_path, restart_limit=role.restart_limit))
    return children


class LocalBackend:
    name = "local"

    def __init__(self) -> None:
        self.children: list[Child] = []
        self.cfg: Config | None = None
        self.client: redis.Redis | None = None

    def prepare(self, cfg: Config) -> Config:
        return cfg

    def redis_host(self) -> str:
        return "127.0.0.1"  # every process is on this machine: loopback only

    def describe(self, plan: RunPlan) -> list[str]:
        shown = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "TANDEM_RUN_GROUP")
        blocks = []
        for c in plan_children(plan):
            env = " ".join(f"{k}={v}" for k, v in c.env.items() if k in shown)
            blocks.append(f"# {c.name}\n{env} {shlex.join(c.cmd)}")
        return blocks

    def start(self, plan: RunPlan, client: redis.Redis, config_text: str) -> None:
        self.cfg, self.client = plan.cfg, client
        self.children = plan_children(plan)
        for c in self.children:
            c.start()

    def exited_before_ready(self, name: str) -> str | None:
        c = next(c for c in self.children if c.name == name)
        if c.running:
            return None
        return f"{c.name} exited with code {c.proc.returncode} before it was ready; last lines of {c.log_path}:\n{c.log_tail()}"

    def poll(self, stopping: bool) -> Outcome | None:
        learner, servers = self.children[0], self.children[1:]
        if not learner.running:
            code = learner.proc.returncode
            if code == 0:
                return Outcome(True, "learner finished")
            return Outcome(
                False,
                f"learner exited with code {code}; last lines of {learner.log_path}:\n{learner.log_tail()}",
            )
        for s in servers:
            if s.running or stopping:
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
                self.client.delete(ready_key(self.cfg.run.name, s.name))
                s.start()
        return None

    def placement(self) -> dict[str, str]:
        return {}  # one machine: nothing to record

    def stop(self, grace_s: float) -> None:
        for sig, wait in ((None, grace_s), (signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
            if sig is not None:
                for c in self.children:
                    c.signal(sig)
            deadline = time.monotonic() + wait
            while any(c.running for c in self.children) and time.monotonic() < deadline:
                time.sleep(0.2)
            if not any(c.running for c in self.children):
                return

    def close(self) -> None:
        pass


def make(address: str | None) -> LocalBackend:
    if address:
        raise ConfigError("--backend local: takes no address")
    return LocalBackend()
