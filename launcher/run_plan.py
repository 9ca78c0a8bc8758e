"""The run plan: which roles a run has, how each is started, what it needs, and when it counts as ready.

Computed from the config alone, so every backend starts the same thing and ``--dry-run`` can show it.
A role is ready when its ``{run}:ready:<name>`` key exists (``tandem/telemetry.py``); the learner's
processes are its ranks (rank 0 marks it ready); a server is one process, and so is the reference worker
(``placement.reference: own``). Restart policy per role:
``launcher/supervision.py`` (a restarted learner runs with ``--resume``, :attr:`Role.resume_argv`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from placement.configured import aux_threads, thread_split
from tandem.config import Config

SYNC_SPINCOUNT = 10_000  # libgomp busy-wait spins in sync mode, about 0.1 ms (GOMP_SPINCOUNT)


@dataclass(frozen=True)
class Role:
    name: str  # "learner", "server-<i>", "reference" or "reward_model": its ready, stats and history keys' and its log's name
    module: str  # entry point: ``python -m <module> *argv`` or ``<module>.main(argv)`` in-process
    argv: tuple[str, ...]
    processes: int  # learner ranks; 1 for a server
    threads: int  # CPU threads per process (OMP_NUM_THREADS) when on CPU
    gpus: int  # GPUs per process: 1 per learner rank on CUDA, the tensor-parallel degree per server

    @property
    def is_server(self) -> bool:
        return self.name.startswith("server-")

    @property
    def is_learner(self) -> bool:
        return self.name == "learner"

    @property
    def resume_argv(self) -> tuple[str, ...]:
        """The arguments of a restart after a crash: the learner continues from its last checkpoint."""
        return (*self.argv, "--resume") if self.is_learner and "--resume" not in self.argv else self.argv


@dataclass
class RunPlan:
    cfg: Config
    run_dir: Path
    config_path: Path  # the resolved per-process config (mode 0600; it holds the Redis password)
    roles: list[Role]
    env: dict[str, str] = field(default_factory=dict)  # what every process gets on top of its environment

    @property
    def learner(self) -> Role:
        return self.roles[0]

    @property
    def servers(self) -> list[Role]:
        return [r for r in self.roles if r.is_server]

    @property
    def workers(self) -> list[Role]:
        """Roles beside the learner and the servers: the reference worker (``placement.reference: own``)."""
        return [r for r in self.roles[1:] if not r.is_server]


def server_tp(cfg: Config) -> int:
    """GPUs per rollout server: the engine's tensor-parallel degree (1 for hf)."""
    return {"vllm": cfg.rollout.vllm.tensor_parallel_size, "sglang": cfg.rollout.sglang.tp_size}.get(
        cfg.rollout.engine, 1
    )


def plan_run(
    cfg: Config, run_dir: Path, config_path: Path, *, resume: bool, cores: int | None = None
) -> RunPlan:
    """The learner first, then the servers, then any worker, with entry points, resources and restart
    policy."""
    server_threads, learner_threads = thread_split(cfg, cores)
    on_gpu = cfg.run.device != "cpu"
    common = ("--config", str(config_path), "--run-dir", str(run_dir))
    learner = Role(
        name="learner",
        module="learner.train",
        argv=(*common, *(["--resume"] if resume else [])),
        processes=cfg.learner.num_ranks,
        threads=learner_threads,
        gpus=1 if on_gpu else 0,
    )
    servers = [
        Role(
            name=f"server-{i}",
            module="rollout.server",
            argv=("--config", str(config_path), "--server-id", str(i), "--run-dir", str(run_dir)),
            processes=1,
            threads=server_threads,
            gpus=server_tp(cfg) if on_gpu else 0,
        )
        for i in range(cfg.rollout.num_servers)
    ]
    workers = [  # each scores every trajectory as it arrives (rollout/own_scorer.py)
        Role(
            name=role,
            module="rollout.own_scorer",
            argv=("--role", role, *common),
            processes=1,
            threads=aux_threads(cfg, cores),
            gpus=1 if on_gpu else 0,
        )
        for role in cfg.own_scorers
    ]
    env = {"TANDEM_RUN_GROUP": run_dir.name, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    if cfg.placement_mode == "colocate" and "OMP_WAIT_POLICY" not in os.environ:
        # Sync processes share every core by turns: an OpenMP thread spinning after its phase ended would
        # take a core from the phase that started (measured 1.29 -> 1.12x TRL's s/step on the tiny demo).
        env["OMP_WAIT_POLICY"] = "PASSIVE"
        if "GOMP_SPINCOUNT" not in os.environ:
            # Yet a thread that sleeps at once must be woken for each of a step's many small ops: libgomp
            # (torch's OpenMP) spinning ~0.1 ms bridges those gaps and still sleeps soon after a phase
            # (the tiny demo's learner and generation steps ran 17-23% slower with no spin at all).
            env["GOMP_SPINCOUNT"] = str(SYNC_SPINCOUNT)
    return RunPlan(cfg, run_dir, config_path, [learner, *servers, *workers], env)
