"""The ``local`` backend: every role as subprocesses of launch.py on this machine (the default).

The learner is ``python -m learner.train`` (``torchrun --nproc_per_node N`` for N ranks), each server
``python -m rollout.server``. GPUs: the learner's ranks first, then ``tp`` GPUs per server, round-robin
when too few; on CPU, ``OMP_NUM_THREADS`` splits the cores. A crashed process (a server, also one that
died before it was ready, or the learner, which comes back with ``--resume``) is restarted per its
role's policy (``launcher/supervision.py``); children run in their own sessions and die with launch.py.
``launch.py --attach`` runs its servers with this backend too: one restart state machine
(``Restarts.tend``) and one stop ladder (:meth:`LocalBackend.stop`) for every local process.
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

from launcher.backends import Outcome
from launcher.run_plan import Role, RunPlan
from launcher.supervision import (
    RestartPolicy,
    Restarts,
    Step,
    learner_progress,
)
from tandem.config import Config, ConfigError
from tandem.net import free_port
from tandem.procs import STACKS_SIGNAL, STACKS_WAIT_S, driver_env, popen
from tandem.telemetry import ready_key

log = logging.getLogger("launch")
ROOT = Path(__file__).resolve().parents[2]
TERM_S = 15.0  # after SIGTERM: a process exits (a learner may be mid-checkpoint) before SIGKILL
KILL_S = 5.0  # after SIGKILL: the kernel reaps it


@dataclass
class Child:
    role: Role
    env: dict[str, str]
    log_path: Path
    restarts: Restarts
    proc: subprocess.Popen[bytes] | None = None

    @property
    def name(self) -> str:
        return self.role.name

    @property
    def cmd(self) -> list[str]:
        return _command(self.role)

    def start(self, *, again: bool = False) -> None:
        cmd = _command(self.role, resume=again)  # a fresh torchrun port each time
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        out = self.log_path.open("ab")
        out.write(f"\n=== {time.strftime('%H:%M:%S')} start: {shlex.join(cmd)}\n".encode())
        out.flush()
        # Its own session: Ctrl-C reaches launch.py only, which stops children in order; they die with it.
        self.proc = popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        out.close()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def tend(self, now: float) -> Step:
        """For a child that is not running: its role's restart state machine (``Restarts.tend``)."""
        return self.restarts.tend(now, f"exited with code {self.proc.returncode}")

    def log_tail(self, n: int = 25) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def _command(role: Role, *, resume: bool = False) -> list[str]:
    py = sys.executable
    argv = role.resume_argv if resume else role.argv
    if role.processes > 1:
        torchrun = ["-m", "torch.distributed.run", f"--nproc_per_node={role.processes}"]
        return [py, *torchrun, f"--master_port={free_port()}", "-m", role.module, *argv]
    return [py, "-m", role.module, *argv]


def plan_children(plan: RunPlan) -> list[Child]:
    """The learner and the servers as subprocesses, with their commands, environments and devices."""
    gpus = _gpu_count() if plan.cfg.run.device != "cpu" else 0
    # The launcher owns its children's rendezvous (torchrun for a multi-rank learner, an in-memory store
    # for a lone one). Inherited from a torchrun or SLURM step, these would send a lone learner to bind the
    # parent's MASTER_PORT, which a process still holding it turns into EADDRINUSE on every restart.
    base = {**{k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARS}, **plan.env, **driver_env()}
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
        restarts = Restarts(role.name, RestartPolicy.for_role(plan.cfg, role.name))
        children.append(Child(role, env, log_path, restarts))
    return children


class LocalBackend:
    name = "local"

    def __init__(self, label: str = "launch") -> None:
        self.label = label  # the tag of its printed lines: [launch], or [attach] under --attach
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
        cfg = plan.cfg
        ckpt_dir = Path(cfg.learner.checkpoint_dir or plan.run_dir / "checkpoints")
        for c in self.children:  # a learner restart after which it trained on was no crash loop
            if c.role.is_learner:
                c.restarts.progress = learner_progress(client, cfg.run.name, ckpt_dir)
        for c in self.children:
            c.start()

    def poll(self, stopping: bool) -> Outcome | None:
        """The learner's clean exit ends the run; any other exit (before or after ready, a server's clean
        one included) is restarted per policy. Without a learner (``--attach``) only the latter applies."""
        learner = next((c for c in self.children if c.role.is_learner), None)
        # One look at each child: a learner that exits between two looks is seen as finished, never as
        # crashed with code 0 (which would be restarted, at once under a zero backoff).
        down = [c for c in self.children if not c.running]
        if learner in down and learner.proc.returncode == 0:
            return Outcome(True, "learner finished")
        now = time.monotonic()
        for c in down:
            if stopping and c is not learner:
                continue
            if stopping:  # asked to stop, and the learner crashed instead of checkpointing: no restart
                return Outcome(
                    False, f"learner exited with code {c.proc.returncode} while stopping{self._tail(c)}"
                )
            step = c.tend(now)
            if step == "refused":
                return Outcome(False, f"{c.restarts.refusal()}{self._tail(c)}")
            if step == "restart":
                self._restart(c)
        return None

    def _restart(self, c: Child) -> None:
        with contextlib.suppress(redis.ConnectionError):  # Redis is down: the child waits for it anyway
            self.client.delete(ready_key(self.cfg.run.name, c.name))
            if c.role.is_learner:
                from weightsync.dist import forget_dead_publisher  # torch: not at the launcher's import

                forget_dead_publisher(self.client, self.cfg.run.name)
        c.start(again=True)
        print(f"[{self.label}] restarted {c.name} (restart {c.restarts.total})", flush=True)

    @staticmethod
    def _tail(c: Child) -> str:
        return f"; last lines of {c.log_path}:\n{c.log_tail()}"

    def placement(self) -> dict[str, str]:
        return {}  # one machine: nothing to record

    def stop(self, grace_s: float, *, ask: signal.Signals | None = None) -> None:
        """The stop ladder: up to ``grace_s`` for the children to exit by themselves, then SIGTERM, then
        SIGKILL, until none is left. ``ask``: a signal that asks them to exit at the start of the grace
        (SIGTERM: an attached server leaves gracefully); None when ``{run}:stop`` already asked."""
        ladder = [(ask, grace_s), (signal.SIGTERM, TERM_S), (signal.SIGKILL, KILL_S)]
        if ask == signal.SIGTERM:
            del ladder[1]  # asked with SIGTERM already: the next rung is SIGKILL
        for sig, wait in ladder:
            if sig == signal.SIGKILL:
                self.dump_stacks()
            if sig is not None:
                for c in self.children:
                    c.signal(sig)
            deadline = time.monotonic() + wait
            while any(c.running for c in self.children) and time.monotonic() < deadline:
                time.sleep(0.2)
            if not any(c.running for c in self.children):
                return

    def dump_stacks(self) -> None:
        """Before SIGKILL: each child still running writes its threads' stacks to its log (tandem/procs.py
        ``STACKS_SIGNAL``), so a hang at shutdown leaves where it hung."""
        if stuck := [c for c in self.children if c.running]:
            print(
                f"[{self.label}] {', '.join(c.name for c in stuck)} did not stop: their stacks go to their logs"
            )
            for c in stuck:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(c.proc.pid, STACKS_SIGNAL)  # the child alone, not the rest of its group
            time.sleep(STACKS_WAIT_S)

    def close(self) -> None:
        pass


def make(address: str | None) -> LocalBackend:
    if address:
        raise ConfigError("--backend local: takes no address")
    return LocalBackend()
