"""The weight-sync boundary: a Publisher on learner rank 0, a Subscriber on each rollout server (DESIGN §5).

Transports (``shm``, ``dist``) implement these two Protocols and pass the same tests; the config chooses
one. An :class:`Update` is what a subscriber hands to an engine's ``update_weights``: the version, the
manifest and a one-shot iterator of ``(name, tensor)`` in manifest order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch


class WeightSyncError(RuntimeError):
    """A failed or timed-out sync; the message names the peer and the version."""


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32", "bfloat16"
    shape: tuple[int, ...]
    checksum: str | None = None  # hex digest of the raw bytes (shm); None where the transport has none


@dataclass
class Update:
    """One version of the actor's weights, ready to apply. ``tensors()`` may be iterated once."""

    version: int
    manifest: list[TensorMeta]
    _iter: Callable[[], Iterator[tuple[str, torch.Tensor]]] = field(repr=False)
    # Where the weights also exist as a HF-loadable directory (shm); lets vLLM/SGLang reload from disk.
    path: str | None = None

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._iter()


class Publisher(Protocol):
    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Send one version. Returns when every live subscriber can read it (shm) or has received it (dist)."""
        ...

    def close(self) -> None: ...


class Subscriber(Protocol):
    def poll(self, timeout: float = 0.0) -> Update | None:
        """The newest version above the one last applied, or None if none arrived within ``timeout`` s."""
        ...

    def close(self) -> None: ...
