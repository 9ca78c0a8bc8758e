"""One adapter's view of an engine that serves several (``learner.lora.adapters``, docs/stages.md §5.1).

Each adapter's run has a rollout loop of its own (rollout/server.py ``serve_adapter_runs``), and a loop drives
an :class:`~rollout.engines.base.Engine`: its view generates with the adapter named in every call, reads that
adapter's version, and turns the run's weight updates into updates of that adapter alone. The engine under it
is the hf engine (rollout/engines/hf_lora.py: each row of its running batch takes its own adapter) or vLLM
(rollout/engines/vllm.py: each version loaded as a LoRA ``<name>-v<N>``, rows batched by vLLM).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rollout.engines.base import Completion, EngineStats, SamplingParams
    from weightsync.base import Update


class ServesAdapters(Protocol):
    """What an engine serving several adapters' runs offers beyond the Engine protocol."""

    continuous_batching: bool
    adapters: tuple[str, ...]

    def adapter_version(self, adapter: str) -> int: ...

    def update_adapter(self, adapter: str, update: Update) -> None: ...

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, **kw: Any
    ) -> list[list[Completion]]: ...

    def stats(self) -> EngineStats: ...


class AdapterEngine:
    """One adapter's view of the shared engine, what its run's rollout loop drives."""

    supports_sleep = False  # the base is shared: no adapter's run may free it
    vision = None

    def __init__(self, engine: ServesAdapters, adapter: str) -> None:
        if adapter not in engine.adapters:
            raise ValueError(
                f"adapter {adapter!r} is not served by this engine (serves {list(engine.adapters)})"
            )
        self.engine, self.adapter = engine, adapter
        self.continuous_batching = engine.continuous_batching

    @property
    def version(self) -> int:
        return self.engine.adapter_version(self.adapter)

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, **kw: Any
    ) -> list[list[Completion]]:
        return self.engine.generate(prompts, dataclasses.replace(sampling, adapter=self.adapter), **kw)

    def update_weights(self, update: Update) -> None:
        self.engine.update_adapter(self.adapter, update)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def close(self) -> None:
        """Nothing: the server closes the shared engine once every run's loop has ended."""
