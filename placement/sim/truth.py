"""SIMULATION: the simulator's ground truth, what each phase costs on pretend devices (placement/sim/engine.py).

It is deliberately richer than the planner's laws (placement/cost.py): communication that grows with
``log2(g)``, generation held by the longest of heavy-tailed response lengths, contention between forwards
that run at once, jitter on every phase and on switches. The planner never reads it: it sees only the
phase times and memory peaks a :class:`~placement.sim.engine.SimRun` measures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from placement.configured import CUDA_COPY, CUDA_FLOPS, CUDA_LINK
from placement.cost import Workload

GiB = 2**30


@dataclass(frozen=True)
class PhaseTruth:
    alpha: float  # seconds of fixed cost
    beta: float  # seconds x devices per token
    comm: float = 0.0  # seconds per doubling of the devices (collectives)


@dataclass(frozen=True)
class Truth:
    """The simulator's ground truth (never shown to the planner)."""

    phases: dict[str, PhaseTruth]
    memory: dict[
        str, tuple[float, float]
    ]  # role -> (bytes resident, bytes per token), sharded over its devices
    decode_step_s: float = (
        0.0  # per decode step of the batch's longest response: latency no device count hides
    )
    tail: float = 2.5  # Pareto shape of response lengths (smaller: heavier tail)
    max_len_factor: float = 8.0  # responses are cut at this multiple of the mean (max_new_tokens)
    contention: float = 0.1  # each forward running at once with k-1 others is (1 + c (k-1)) slower
    colocated_slowdown: float = 0.03  # a colocated phase shares caches and host bandwidth with the sleeper
    jitter: float = 0.05  # log-normal sigma on every phase
    switch_jitter: float = 0.2  # log-normal sigma on sleep/wake and offload/reload
    replace_s: float = 0.05  # moving a run to another plan (restart, reshard)

    def lengths(self, rng: np.random.Generator, work: Workload) -> np.ndarray:
        """Heavy-tailed response lengths with mean ``work.response_len`` before the cut."""
        a = self.tail
        raw = (1.0 + rng.pareto(a, work.samples)) * work.response_len * (a - 1) / a
        return np.minimum(raw, self.max_len_factor * work.response_len)

    def time(
        self,
        phase: str,
        tokens: float,
        devices: int,
        rng: np.random.Generator,
        *,
        concurrent: int = 1,
        colocated: bool = False,
        longest: float = 0.0,
    ) -> float:
        p = self.phases[phase]
        t = p.alpha + p.beta * tokens / devices + p.comm * math.log2(devices) + self.decode_step_s * longest
        t *= 1 + self.contention * (concurrent - 1)
        t *= 1 + (self.colocated_slowdown if colocated else 0.0)
        sigma = self.switch_jitter if phase in ("switch", "reference_reload") else self.jitter
        return t * float(rng.lognormal(0.0, sigma))


def example_truth(*, tail: float = 2.5, decode_step_s: float = 8e-6) -> Truth:
    """A ground truth shaped like a ~1.5B-parameter actor with a critic, reference and reward model on
    80 GiB devices, with step times scaled to tens of milliseconds so a sweep runs in minutes."""
    fwd = PhaseTruth(0.0002, 0.4e-6, 0.0001)
    return Truth(
        phases={
            "generate": PhaseTruth(0.0005, 6.0e-6, 0.0001),
            "actor_logp": fwd,
            "reference": fwd,
            "critic_values": fwd,
            "reward_model": fwd,
            "actor_train": PhaseTruth(0.0003, 1.2e-6, 0.0002),
            "critic_train": PhaseTruth(0.0003, 1.2e-6, 0.0002),
            "sync": PhaseTruth(0.001, 0.0, 0.0002),
            "sync_local": PhaseTruth(0.0005, 0.0, 0.0),
            "switch": PhaseTruth(0.0015, 0.0, 0.0),
            "reference_reload": PhaseTruth(0.002, 0.0, 0.0),
        },
        memory={
            "engine": (3 * GiB, 128 * 2**10),
            "actor": (24 * GiB, 128 * 2**10),
            "reference": (3 * GiB, 64 * 2**10),
            "critic": (24 * GiB, 128 * 2**10),
            "reward_model": (3 * GiB, 64 * 2**10),
        },
        decode_step_s=decode_step_s,
        tail=tail,
    )


EXAMPLE_PARAMS = 1.5e9  # the model example_truth is shaped like


def sim_scale() -> float:
    """Simulated seconds per real second: :func:`example_truth`'s training cost per token over the cost
    table's (6 FLOPs a parameter a token at ``CUDA_FLOPS``, placement/configured.py). Its forwards give the same."""
    return example_truth().phases["actor_train"].beta / (6 * EXAMPLE_PARAMS / CUDA_FLOPS)


def sized_truth(params: float, devices: int, *, tail: float = 2.5) -> Truth:
    """:func:`example_truth` for a model of ``params`` parameters (actor, critic, reference and reward
    model alike) on ``devices``, its switch priced from the bytes it moves.

    - **compute** per token grows with the parameters: :func:`example_truth`'s per-token costs and decode
      step times ``params / EXAMPLE_PARAMS`` as large; its fixed costs stay;
    - **memory**: actor and critic 16 bytes a parameter (bf16 weights, fp32 master weights, Adam), the
      engine, reference and reward model 2;
    - **bytes moved**, at the cost table's rates (``CUDA_LINK``, ``CUDA_COPY``) on the simulator's time
      scale (:func:`sim_scale`), on top of :func:`example_truth`'s fixed costs. The colocated switch: the
      learner offloads, then reloads, the actor's and critic's optimizer state and master weights (12
      bytes a parameter each, ZeRO-sharded over ``devices``) over the host link; the engine's level-2
      sleep frees its weights and KV cache and moves nothing (its weights come back by ``sync_local``).
      ``sync_local`` copies a device's share of the bf16 weights within it; ``sync`` broadcasts them
      across devices; ``reference_reload`` moves the reference's share there and back.
    """
    base, k, size = example_truth(tail=tail), sim_scale(), params / EXAMPLE_PARAMS
    weights = 2 * params
    moved = {
        "switch": 2 * 2 * 12 * params / devices / CUDA_LINK,  # actor + critic, there and back
        "sync": weights / CUDA_LINK,
        "sync_local": weights / devices / CUDA_COPY,
        "reference_reload": 2 * weights / devices / CUDA_LINK,
    }
    phases = {
        name: PhaseTruth(p.alpha + k * moved[name], 0.0, p.comm)
        if name in moved
        else PhaseTruth(p.alpha, p.beta * size, p.comm)
        for name, p in base.phases.items()
    }
    memory = {
        role: (per_param * params, base.memory[role][1])
        for role, per_param in (
            ("engine", 2),
            ("actor", 16),
            ("reference", 2),
            ("critic", 16),
            ("reward_model", 2),
        )
    }
    return replace(base, phases=phases, memory=memory, decode_step_s=base.decode_step_s * size)
