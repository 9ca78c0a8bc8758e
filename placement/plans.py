"""A placement plan: which devices generate, which train, and where each frozen or auxiliary model runs.

Vocabulary (docs/placement.md §11):

- **mode.** ``separate``: generation and learning own disjoint devices and overlap asynchronously, so
  the slower side sets the pace. ``colocate``: both use every device and take turns (the hybrid engine),
  so their phases add, plus a switch (the engine sleeps, the learner offloads) each way.
- **groups.** ``generation`` devices run the rollout servers; ``learning`` devices the actor's ranks;
  ``aux`` devices (separate mode only) a worker group of its own for whichever of the reference, critic
  and reward model are placed ``own``: OpenRLHF's ``colocate_critic_reward`` is critic and reward model
  on one such group.
- **where.** The reference runs in the ``learner`` (resident), ``learner_cpu`` (offloaded between uses),
  on the ``server`` (scored next to generation), or on its ``own`` group; the critic in the ``learner``
  or ``own`` (trained in parallel with the actor); the reward model on the ``server`` or ``own``.
- **scoring.** The no-grad forwards of a batch on the learning group (proximal actor, reference, critic
  values) have no data dependency: ``serial`` runs each on every learning device in turn (Puzzle's MBM),
  ``split`` runs them at once on disjoint subsets (Puzzle's SMDD).

Plans are plain frozen values; :func:`candidates` lists every plan a run could use on ``devices``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Literal

Mode = Literal["separate", "colocate"]
ReferenceAt = Literal["learner", "learner_cpu", "server", "own"]
CriticAt = Literal["learner", "own"]
RewardAt = Literal["server", "own"]
Scoring = Literal["serial", "split"]

REFERENCE_AT: tuple[ReferenceAt, ...] = ("learner", "learner_cpu", "server", "own")
CRITIC_AT: tuple[CriticAt, ...] = ("learner", "own")
REWARD_AT: tuple[RewardAt, ...] = ("server", "own")


@dataclass(frozen=True)
class Roles:
    """Which models a run has besides the actor: a reference (KL), a critic (GAE), a reward model."""

    reference: bool = True
    critic: bool = True
    reward_model: bool = True
    proximal: bool = True  # the actor's no-grad proximal forward (skipped when it would equal the first)


@dataclass(frozen=True)
class Plan:
    mode: Mode
    generation: int  # devices of the rollout servers (all of them when colocated)
    learning: int  # devices of the actor's ranks (all of them when colocated)
    aux: int = 0  # devices of the group for roles placed "own" (separate mode only)
    reference: ReferenceAt = "learner"
    critic: CriticAt = "learner"
    reward_model: RewardAt = "server"
    scoring: Scoring = "serial"

    @property
    def devices(self) -> int:
        return self.generation if self.mode == "colocate" else self.generation + self.learning + self.aux

    def own(self, roles: Roles) -> list[str]:
        """The roles this plan puts on the aux group."""
        placed = {"reference": self.reference, "critic": self.critic, "reward_model": self.reward_model}
        return [r for r, at in placed.items() if at == "own" and getattr(roles, r)]

    def learner_scoring(self, roles: Roles) -> list[str]:
        """The no-grad forwards the learning group runs each step (the actor's proximal pass always)."""
        out = ["actor_logp"] if roles.proximal else []
        if roles.reference and self.reference in ("learner", "learner_cpu"):
            out.append("reference")
        if roles.critic and self.critic == "learner":
            out.append("critic_values")
        return out

    def label(self, roles: Roles | None = None) -> str:
        """A short human name: ``separate 2:5+1 ref=own critic=own rm=own split``."""
        roles = roles or Roles()
        if self.mode == "colocate":
            head = f"colocate {self.generation}"
        else:
            head = f"separate {self.generation}:{self.learning}" + (f"+{self.aux}" if self.aux else "")
        parts = [head]
        if roles.reference:
            parts.append(f"ref={self.reference}")
        if roles.critic:
            parts.append(f"critic={self.critic}")
        if roles.reward_model:
            parts.append(f"rm={self.reward_model}")
        parts.append(self.scoring)
        return " ".join(parts)


def validate(plan: Plan, roles: Roles, devices: int) -> str | None:
    """Why ``plan`` cannot run with ``roles`` on ``devices``; None when it can."""
    own = plan.own(roles)
    if plan.mode == "colocate":
        if plan.generation != devices or plan.learning != devices or plan.aux:
            return f"colocate uses every device: generation = learning = {devices}, aux = 0"
        if own:
            return f"colocate shares every device; {', '.join(own)} cannot have an own group"
    else:
        if min(plan.generation, plan.learning) < 1:
            return "separate needs at least one generation and one learning device"
        if plan.devices != devices:
            return f"generation + learning + aux = {plan.devices}, not the {devices} devices"
        if bool(own) != bool(plan.aux):
            return "an aux group exists exactly when some role is placed own"
    forwards = len(plan.learner_scoring(roles))
    if plan.scoring == "split" and forwards < 2:
        return "split scoring needs at least two scoring forwards"
    if plan.scoring == "split" and forwards > plan.learning:
        return "split scoring needs a learning device per scoring forward"
    return None


def candidates(roles: Roles, devices: int) -> Iterator[Plan]:
    """Every valid plan for ``roles`` on ``devices``: a few hundred at 8 devices, exhaustively searchable."""
    refs = REFERENCE_AT if roles.reference else ("learner",)
    critics = CRITIC_AT if roles.critic else ("learner",)
    rms = REWARD_AT if roles.reward_model else ("server",)
    seen: set[Plan] = set()
    for ref, critic, rm, scoring in itertools.product(refs, critics, rms, ("serial", "split")):
        base = Plan("colocate", devices, devices, 0, ref, critic, rm, scoring)
        shapes = [base]
        for gen in range(1, devices):
            for aux in range(devices - gen):
                shapes.append(
                    replace(base, mode="separate", generation=gen, learning=devices - gen - aux, aux=aux)
                )
        for plan in shapes:
            if plan not in seen and validate(plan, roles, devices) is None:
                seen.add(plan)
                yield plan
