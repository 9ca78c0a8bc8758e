"""The whole run configuration: :class:`Config`, one field per section in the order the config reference
lists them, the properties every process reads (the placement, staleness bound and weight path in
force), and path resolution. Its cross-section checks are the functions of ``checks.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from tandem.config.algorithm import OFFLINE_RECIPES, Algorithm, AlgorithmConfig, DistillConfig
from tandem.config.base import Section
from tandem.config.checks import checks_for
from tandem.config.learner import LearnerConfig, WeightSyncConfig
from tandem.config.placement import ClusterConfig, PlacementConfig
from tandem.config.rollout import (
    AgentConfig,
    EnvConfig,
    EvalConfig,
    RewardConfig,
    RewardFunction,
    RolloutConfig,
)
from tandem.config.run import (
    DataConfig,
    LoggingConfig,
    ModelConfig,
    PrepareStep,
    RedisConfig,
    RunConfig,
    SupervisionConfig,
)


def served_paths(reward: RewardConfig, fix: Callable[[str | None], str | None]) -> RewardConfig:
    """A reward function's ``serve`` kwarg (the judge's checkpoint, tandem/judge.py) is a path like a model's."""

    def fixed(fns: list[RewardFunction]) -> list[RewardFunction]:
        return [
            f.model_copy(update={"kwargs": {k: fix(v) if k == "serve" else v for k, v in f.kwargs.items()}})
            for f in fns
        ]

    return reward.model_copy(
        update={"functions": fixed(reward.functions), "group_functions": fixed(reward.group_functions)}
    )


def adapter_run_dir(run_dir: str | os.PathLike[str], name: str) -> Path:
    """Where adapter ``name``'s run (``learner.lora.adapters``) keeps its checkpoints, ``trained.jsonl``,
    history and final model, inside the run directory."""
    return Path(run_dir) / "adapters" / name


class Config(Section):
    run: RunConfig = Field(default_factory=RunConfig, description="Run identity and mode.")
    redis: RedisConfig = Field(default_factory=RedisConfig, description="The buffer and control plane.")
    model: ModelConfig = Field(..., description="Checkpoints, all loaded by path.")
    data: DataConfig = Field(..., description="The prompt dataset.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Rollout servers.")
    env: EnvConfig = Field(default_factory=EnvConfig, description="Multi-turn environment (off by default).")
    agent: AgentConfig = Field(default_factory=AgentConfig, description="Black-box agent (off by default).")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Reward functions and model.")
    algorithm: Algorithm = Field(
        default_factory=AlgorithmConfig,
        description="The training recipe and its settings: ppo (default) or the offline sft, rm, dpo.",
    )
    learner: LearnerConfig = Field(default_factory=LearnerConfig, description="The DeepSpeed learner.")
    weightsync: WeightSyncConfig = Field(
        default_factory=WeightSyncConfig, description="Actor-weight broadcast."
    )
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Held-out evaluation on the servers.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Console, logs and wandb.")
    placement: PlacementConfig = Field(
        default_factory=PlacementConfig,
        description="Devices of generation and learning, and where each model runs.",
    )
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="Placement on a Ray cluster.")
    supervision: SupervisionConfig = Field(
        default_factory=SupervisionConfig, description="Restarts of crashed processes and Redis reconnects."
    )
    prepare: list[PrepareStep] = Field(
        default_factory=list,
        description="Steps that make the run's inputs, in order, before it starts: each a name, command, "
        "produces and reduced (launcher/prepare.py); skipped when all its paths exist.",
    )

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        for check in checks_for(self.algorithm.recipe):
            check(self)
        return self

    @property
    def recipe(self) -> str:
        return self.algorithm.recipe

    @property
    def placement_mode(self) -> Literal["separate", "colocate"]:
        """The placement in force: ``placement.mode``, or what ``run.mode`` implies (sync takes turns)."""
        if self.placement.mode in ("separate", "colocate"):
            return self.placement.mode
        return "colocate" if self.run.mode == "sync" else "separate"  # auto: until launch.py resolves it

    @property
    def reference_scorer(self) -> Literal["learner", "server", "own"] | None:
        """Who computes the reference log-probabilities (docs/placement.md §11.1): None without one (no KL
        penalty, or not PPO); else the learner (``placement.reference`` learner or learner_cpu), the rollout
        servers, or the reference worker (``own``)."""
        if self.algorithm.recipe != "ppo" or self.algorithm.kl_coef <= 0:
            return None
        at = self.placement.reference
        return "learner" if at == "learner_cpu" else at

    @property
    def critic_own(self) -> bool:
        """The critic scores and trains beside the actor on threads of its own (``placement.critic: own``)."""
        return self.placement.critic == "own" and self.recipe == "ppo" and self.algorithm.advantage == "gae"

    @property
    def distill(self) -> DistillConfig | None:
        """On-policy distillation in force (``algorithm.distill``); None off, and for the offline recipes,
        whose algorithm sections have no such field."""
        return self.algorithm.distill if isinstance(self.algorithm, AlgorithmConfig) else None

    @property
    def own_scorers(self) -> list[str]:
        """The roles that score the stream on workers of their own (rollout/own_scorer.py), in the
        order the learner reads their scores: ``reference``, ``reward_model``."""
        own = ["reference"] if self.reference_scorer == "own" else []
        if self.model.reward_model is not None and self.placement.reward_model == "own":
            own.append("reward_model")
        return own

    @property
    def max_staleness(self) -> int:
        """The staleness bound in force: ``algorithm.max_staleness``, or 0 in sync mode (on-policy).

        Every process reads it here, so sync mode is the same code path with one number changed. With
        ``auto`` it is ``algorithm.staleness_max``, the hard limit (the take-time screen, the servers'
        freshness floor); admission reads the bound the learner publishes below it (docs/design.md §3.7).
        """
        if self.run.mode == "sync" or self.algorithm.recipe != "ppo":
            return 0
        a = self.algorithm
        return a.staleness_max if a.max_staleness == "auto" else a.max_staleness

    @property
    def auto_staleness(self) -> bool:
        """Whether the learner steers admission's bound (``algorithm.max_staleness: auto``, async)."""
        return self.max_staleness > 0 and self.algorithm.max_staleness == "auto"

    @property
    def episode_progression(self) -> Literal["rounds", "independent"]:
        """``env.progression`` with ``auto`` resolved: independent on vllm and sglang, whose schedulers run
        beside this process; rounds on hf, whose every forward is paid on the server's own cores, so turns
        that arrive together and stay in step (an environment that answers at once) decode in fewer, fuller
        forwards than turns joining the batch one by one (docs/benchmarks.md, ``bench/episodes.py``)."""
        p = self.env.progression
        if p == "auto":
            return "rounds" if self.rollout.engine == "hf" else "independent"
        return p

    @property
    def releases_memory(self) -> bool:
        """Whether each colocated side frees its memory while the other runs (docs/placement.md §11.1):
        ``placement.release_memory``, colocated, with full weights over shm, which refill a woken engine and
        which it can read again. Adapter-only updates (``learner.lora.sync: adapter``) refill only the
        adapted layers, so their servers keep their weights."""
        adapter_only = self.learner.lora.rank > 0 and self.learner.lora.sync == "adapter"
        return (
            self.placement_mode == "colocate"
            and self.placement.release_memory
            and self.weight_path == "shm"
            and not adapter_only
        )

    @property
    def weight_path(self) -> Literal["shm", "dist", "engine"]:
        """How weights reach the engines (docs/design.md §5): ``shm`` files a server maps, a ``dist``
        broadcast a server receives, or ``engine``: the learner pushes straight into vLLM/SGLang over their
        own NCCL groups (``weightsync.transport: dist`` with such an engine)."""
        if self.weightsync.transport == "dist" and self.rollout.engine in ("vllm", "sglang"):
            return "engine"
        return self.weightsync.transport

    def adapter_runs(self) -> dict[str, Config]:
        """Each of ``learner.lora.adapters`` as a run of its own, by adapter name (docs/stages.md §5.1): run
        ``<run.name>.<name>`` (its Redis keys, weight versions and wandb run), its prompts, rewards, learning
        rate and seed, and one adapter; ``learner.checkpoint_dir``, when set, gets a folder per adapter."""
        out = {}
        for a in self.learner.lora.adapters:
            ln = self.learner
            update = {
                "run": self.run.model_copy(
                    update={
                        "name": f"{self.run.name}.{a.name}",
                        "seed": self.run.seed if a.seed is None else a.seed,
                    }
                ),
                "data": self.data.model_copy(update={"prompts": a.prompts or self.data.prompts}),
                "reward": self.reward.model_copy(update={"functions": a.reward or self.reward.functions}),
                "learner": ln.model_copy(
                    update={
                        "actor_lr": a.actor_lr or ln.actor_lr,
                        "lora": ln.lora.model_copy(update={"adapters": []}),
                        "checkpoint_dir": ln.checkpoint_dir and str(Path(ln.checkpoint_dir) / a.name),
                    }
                ),
            }
            out[a.name] = self.model_copy(update=update)
        return out

    def resolve_paths(self, base: Path) -> Config:
        """Make relative file paths (checkpoints, prompts) absolute against ``base`` (the YAML's folder's parent project)."""

        def fix(p: str | None) -> str | None:
            if p is None or os.path.isabs(p):
                return p
            return str((base / p).resolve())

        m = self.model
        update = {
            "model": m.model_copy(
                update={
                    k: fix(getattr(m, k)) for k in ("actor", "reference", "teacher", "critic", "reward_model")
                }
            ),
            "data": self.data.model_copy(update={"prompts": fix(self.data.prompts)}),
            "eval": self.eval.model_copy(update={"prompts": fix(self.eval.prompts)}),
            "reward": served_paths(self.reward, fix),
        }
        ln = self.learner
        if ln.lora.adapters:
            adapters = [
                a.model_copy(
                    update={
                        "prompts": fix(a.prompts),
                        "reward": a.reward and served_paths(RewardConfig(functions=a.reward), fix).functions,
                    }
                )
                for a in ln.lora.adapters
            ]
            lora = ln.lora.model_copy(update={"adapters": adapters})
            update["learner"] = ln.model_copy(update={"lora": lora})
        a = self.algorithm
        if a.recipe in OFFLINE_RECIPES:
            files = {k: fix(getattr(a, k)) for k in ("train_file", "eval_file")}
            if a.recipe == "rm":
                files["init"] = fix(a.init)
            update["algorithm"] = a.model_copy(update=files)
        return self.model_copy(update=update)
