"""The Engine Protocol every inference backend implements (docs/design.md §8).

``generate`` takes token ids and returns, per prompt, ``n`` completions with the behaviour log-probability
of each sampled token under the distribution actually sampled from (after temperature / top-k / top-p,
renormalised) and the policy version that produced each token. Greedy decoding (temperature 0) reports
the log-probability under the untempered distribution (``log_softmax(logits)``), as vLLM's processed
logprobs do, since the point mass it actually samples from would say 0 for every token.

Three optional hooks let the caller act during a call without knowing the engine's internals:
- ``between_steps()`` is called at every safe point inside ``generate`` (between decode steps for ``hf``);
  the rollout loop uses it to apply a pending weight update mid-sequence (PipelineRL's in-flight updates),
  so later tokens carry the new version. Engines without such points may call it once per call or never;
  the loop also applies updates between calls.
- ``on_token(row, token_id, logprob)`` is called for each sampled token as it is produced (``row`` indexes
  the flattened ``prompt × n`` list); the HTTP API streams from it. Engines that cannot stream may call it
  for every token once generation has finished.
- ``on_prompt(index, completions)`` is called once per prompt, from the calling thread, as soon as that
  prompt's ``n`` completions are done, so a caller can score and store a group while the others still
  generate (the pipelined rollout loop, docs/design.md §1.3): vLLM as each prompt's request returns, hf
  as a prompt's last row leaves the running batch. Engines that finish a call's prompts together (SGLang,
  one request per call) call it for each once generation has finished.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

from weightsync.base import Update

if TYPE_CHECKING:
    import numpy as np

    from rollout.engines.constraint import Constraint

FinishReason = Literal["stop", "length", "abort"]
BetweenSteps = Callable[[], None]
OnToken = Callable[[int, int, float], None]


class EngineExited(RuntimeError):
    """The engine's own process is gone (killed, crashed). Nothing in the rollout server can bring it back,
    so the server must exit and be restarted with a fresh engine; retrying the call would only fail again."""


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
    constraint: Constraint | None = None  # what the completion must match (rollout/engines/constraint.py)
    adapter: str | None = (
        None  # the served LoRA adapter its rows take (hf: rollout/engines/hf_lora.py); None: none
    )


@dataclass
class Completion:
    token_ids: list[int]  # includes the stop token (EOS or the one completing a stop string)
    logprobs: list[float]  # behaviour logprob of each token in token_ids
    finish_reason: FinishReason
    versions: list[int]  # policy version that produced each token (same length as token_ids)
    # (P + R - 1, layers, k): the experts each MoE layer routed every fed position to (prompt, then each
    # generated token but the last, which is never fed); only from an engine recording routing (hf, vllm)
    routed_experts: np.ndarray | None = None


OnPrompt = Callable[[int, list[Completion]], None]


@dataclass(frozen=True)
class EngineStats:
    """KV-cache use and scheduler counts of an engine at one moment (:meth:`Engine.stats`).

    ``None`` means the engine does not report that quantity, which is not the same as 0.
    """

    kv_cache_usage: float | None = None  # share of the KV-cache pool in use, 0..1 (vLLM, SGLang)
    kv_cache_bytes: int | None = None  # bytes of KV cache the running requests hold (hf)
    preemptions: int | None = None  # requests preempted since the engine started (their KV freed)
    requests_running: int | None = None  # sequences being decoded
    requests_waiting: int | None = None  # requests queued for the scheduler (preempted ones included)


def cut_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """``text`` up to the first stop string (excluded, as OpenAI's API returns it) and whether one occurred."""
    cuts = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)


class Engine(Protocol):
    # True when calls running at once share decode steps (vLLM's and SGLang's schedulers add a request to
    # the running batch); False when each call decodes on its own (hf), so callers that want one batch
    # must gather their calls first (rollout/agents/batching.py).
    continuous_batching: bool

    @property
    def version(self) -> int: ...

    def stats(self) -> EngineStats:
        """KV-cache use and scheduler counts now. Cheap enough to call every second, not per token."""
        ...

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        *,
        between_steps: BetweenSteps | None = None,
        on_token: OnToken | None = None,
        on_prompt: OnPrompt | None = None,
    ) -> list[list[Completion]]:
        """For each prompt, ``sampling.n`` completions. Safe to call from several threads."""
        ...

    def update_weights(self, update: Update) -> None:
        """Load the update's tensors in place; afterwards ``version == update.version``."""
        ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    # Colocated runs free the engine's memory while the learner trains (docs/placement.md §11.1): ``sleep``
    # releases the weights and the KV cache; ``wake_up(["weights"])``, a full ``update_weights``, then
    # ``wake_up(["kv_cache"])`` bring them back (vLLM's tags and order, so the cache is never allocated
    # beside a stale copy of the weights). An engine that cannot release says ``supports_sleep = False``
    # (vLLM's CPU build) and is never put to sleep; one without the attribute counts as False.
    supports_sleep: bool

    def sleep(self) -> None:
        """Free the weights and the KV cache; ``generate`` is refused until woken and refilled."""
        ...

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Re-allocate what ``tags`` names (``weights``, ``kv_cache``; None: both)."""
        ...

    def close(self) -> None: ...
