"""Where the run's processes and models go: the devices of generation and learning and where each model
scores (``placement``; ``launch.py plan`` ranks the choices), and placement on a Ray cluster (``cluster``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tandem.config.base import Section

# The planner ranks every placement (placement/plans.py); these are the ones the processes run today, for a
# config to ask for and for placement.mode: auto to choose.
RUNNABLE_PLACEMENT: dict[str, tuple[str, ...]] = {
    "reference": ("learner", "learner_cpu", "server", "own"),
    "critic": ("learner", "own"),
    "reward_model": ("server", "own"),
    "scoring": ("serial", "split"),
}


class PlacementConfig(Section):
    """Where the run's models go (docs/placement.md §11); ``python launch.py plan CONFIG`` ranks the choices."""

    mode: Literal["separate", "colocate", "auto"] | None = Field(
        None,
        description="separate: servers and learner on disjoint devices, overlapping; colocate: both on every device, taking turns (needs run.mode=sync); auto: profile both, then run the predicted best (sets run.mode). null follows run.mode (sync: colocate, async: separate).",
    )
    profile_steps: int = Field(
        10, ge=4, description="auto: learner steps of each of the two probe runs (the profile window)."
    )
    replan_every: int = Field(
        0,
        ge=0,
        description="auto: every this many learner steps, refit the cost laws to the run's own latest steps and move the run to a better placement (a clean stop, then a resume under it) when its predicted saving over the steps left beats twice the measured cost of moving; 0 never re-plans.",
    )
    generation_share: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="separate mode: the fraction of the devices (CPU threads) given to the rollout servers; null gives every process an equal share.",
    )
    aux_share: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="separate mode with a model placed own: the fraction of the devices (CPU threads) given to its worker; null gives it an equal share with every other process.",
    )
    reference: Literal["learner", "learner_cpu", "server", "own"] = Field(
        "learner",
        description="Where the reference runs (with kl_coef > 0): learner (resident on the learner's devices), learner_cpu (on the learner's CPU, moved to its devices for each pass), server (each rollout server holds a second model, the frozen reference, and scores every trajectory's ref_logp next to generation; the learner loads none), own (a reference worker on devices of its own scores every trajectory as it is appended, and the learner reads the numbers; separate mode).",
    )
    critic: Literal["learner", "own"] = Field(
        "learner",
        description="Where the critic scores and trains (with algorithm.advantage=gae): learner (in turn with the actor, on every learner thread); own (at once with the actor, on CPU threads of its own in the learner's process: placement.aux_share of the cores, split with any scoring worker; run.device=cpu, learner.num_ranks=1, separate mode).",
    )
    reward_model: Literal["server", "own"] = Field(
        "server",
        description="Where the reward model scores (with model.reward_model): server (next to generation); own (a reward model worker on devices of its own scores every single-turn trajectory as it is appended, and the learner adds the score to the reward; separate mode, no dynamic_sampling).",
    )
    scoring: Literal["serial", "split"] = Field(
        "serial",
        description="The learner's no-grad forwards of a batch (proximal actor, reference, critic): serial (each on every device in turn); split (each at once on its own share of the learner's CPU threads; one learner rank on CPU).",
    )
    release_memory: bool = Field(
        True,
        description="colocate: each side frees its memory while the other runs (docs/placement.md §11.1). The rollout servers' engines sleep while the learner trains (weights and KV cache freed; woken as weights, then the next version's weights, then KV cache) and the learner offloads optimizer state, gradients and master weights while the servers generate (DeepSpeed offload_states: GPU, zero_stage >= 1). Needs full weights over the shm transport (a server that wakes without a new version reloads its own from there); ignored when separate.",
    )

    @model_validator(mode="after")
    def _runnable(self) -> PlacementConfig:
        for name, runnable in RUNNABLE_PLACEMENT.items():
            if (value := getattr(self, name)) not in runnable:
                raise ValueError(
                    f"placement.{name}={value} is predicted by `launch.py plan` but not yet run by the "
                    f"processes; use {' or '.join(runnable)}"
                )
        return self


class ClusterConfig(Section):
    """Placement on a Ray cluster (``launch.py --ray``; docs/ray.md). The local backend ignores it."""

    learner_nodes: int = Field(
        1, ge=1, description="Nodes the learner's ranks spread over (learner.num_ranks must divide evenly)."
    )
    learner_cpus: float = Field(1.0, gt=0, description="CPUs reserved per learner rank.")
    learner_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each learner node must offer, e.g. {learner: 1} (one bundle per node).",
    )
    server_cpus: float = Field(1.0, gt=0, description="CPUs reserved per rollout server.")
    server_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each rollout server takes, e.g. {rollout: 1}.",
    )
    aux_cpus: float = Field(
        1.0,
        gt=0,
        description="CPUs reserved for each scoring worker (placement.reference or placement.reward_model: own).",
    )
    aux_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each scoring worker takes (placement.reference or placement.reward_model: own), e.g. {aux: 1}.",
    )
    redis_host: str | None = Field(
        None,
        description="Address the embedded Redis binds to under Ray; null: the head node's Ray address (never 0.0.0.0 unless set).",
    )
    start_timeout_s: float = Field(
        600.0, gt=0, description="How long to wait for the placement group and the actors to be scheduled."
    )
    placement: dict[str, str] = Field(
        default_factory=dict,
        description="Written by the launcher, not by you: process -> node, recorded in wandb and summary.json.",
    )
