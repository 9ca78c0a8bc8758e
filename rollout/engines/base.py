"""The Engine Protocol every inference backend implements (DESIGN §6).

``generate`` takes token ids and returns, per prompt, ``n`` completions with the behaviour log-probability
of each sampled token under the distribution actually sampled from (after temperature / top-k / top-p) and
the policy version that produced each token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

from weightsync.base import Update

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class SamplingParams:
    n: int = 1
    max_new_tokens: int = 32
    temperature: float = 1.0  # 0 is greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 disables
    stop_token_ids: list[int] = field(default_factory=list)  # EOS is always a stop token
    stop: list[str] = field(default_factory=list)  # stop strings (checked on decoded text)
    seed: int | None = None


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # behaviour logprob of each token in token_ids
    finish_reason: FinishReason
    versions: list[int]  # policy version that produced each token (same length as token_ids)


class Engine(Protocol):
    @property
    def version(self) -> int: ...

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[list[Completion]]:
        """For each prompt, ``sampling.n`` completions."""
        ...

    def update_weights(self, update: Update) -> None:
        """Load the update's tensors in place; afterwards ``version == update.version``."""
        ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def close(self) -> None: ...
