"""STUB — to be implemented (issue 3). The signatures below are the contract other components code against."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import redis

from buffer.schema import PromptRecord, Trajectory


@dataclass
class Taken:
    """A trajectory taken from the stream, with the id to ack once the optimizer step that used it is done."""

    id: str
    traj: Trajectory


@dataclass
class TakenPrompt:
    id: str
    prompt: PromptRecord


class ReplayBuffer:
    """Redis Streams buffer of one run: trajectories ({run}:traj, group "learner"), prompts ({run}:prompts,
    group "rollout"), the learner version ({run}:version) and admission ({run}:admitted)."""

    def __init__(
        self,
        client: redis.Redis,
        run: str,
        *,
        consumer: str,
        maxlen: int = 100_000,
        claim_idle_ms: int = 60_000,
        put_timeout_s: float = 300.0,
        max_traj_bytes: int = 64 << 20,
    ) -> None:
        raise NotImplementedError

    # trajectories (rollout -> learner)
    def put(self, trajs: Sequence[Trajectory]) -> list[str]: ...
    def take(self, n: int, timeout_s: float, *, max_staleness: int | None = None) -> list[Taken]:
        """Up to n (blocks until n arrive or timeout). With max_staleness, drops (acks + counts) entries whose
        staleness at the current learner version exceeds it. Claims entries idle > claim_idle_ms first."""
        ...

    def ack(self, ids: Sequence[str]) -> None: ...
    def trim(self) -> int: ...

    # prompts (dataset -> rollout)
    def put_prompts(self, prompts: Sequence[PromptRecord]) -> list[str]: ...
    def take_prompts(self, n: int, timeout_s: float) -> list[TakenPrompt]: ...
    def ack_prompts(self, ids: Sequence[str]) -> None: ...

    # versions and admission (DESIGN §3)
    def set_version(self, v: int) -> None: ...
    def get_version(self) -> int: ...
    def admit(self, n: int, *, batch_size: int, max_staleness: int) -> bool: ...
    def wait_admission(
        self, n: int, *, batch_size: int, max_staleness: int, timeout_s: float, should_stop=None
    ) -> bool: ...

    def metrics(self) -> dict[str, float]: ...
