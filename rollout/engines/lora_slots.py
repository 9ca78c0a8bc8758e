"""Which LoRA adapter versions a vLLM server holds, and which version each new request uses.

Adapter-only weight sync into vLLM (``learner.lora.sync: adapter``, rollout/engines/vllm.py) loads each
version's adapter beside the others instead of overwriting weights, so a request keeps the adapter it started
with and every one of its tokens is of that version. This is the bookkeeping, free of HTTP so it is tested
without vLLM: the newest ``keep`` versions stay loaded (``max_staleness + 1``: every version the learner may
still train on); an older one is unloaded once no request in flight uses it. Version 0 is the base model
(no adapter), so it is never loaded or unloaded.
"""

from __future__ import annotations

import threading


def lora_name(version: int, adapter: str | None = None) -> str | None:
    """The ``model`` a request for ``version`` names: ``v<N>``, or ``<adapter>-v<N>`` for one of several
    adapters' runs (``learner.lora.adapters``); None (the base model) for version 0, which is every adapter
    before its first update (B = 0)."""
    if version == 0:
        return None
    return f"v{version}" if adapter is None else f"{adapter}-v{version}"


class AdapterSlots:
    """Loaded adapter versions, the current one, and requests in flight per version. Thread-safe."""

    def __init__(self, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep}: at least the current version stays loaded")
        self.keep = keep
        self.current = 0
        self.loaded: list[int] = []  # adapter versions the server holds, oldest first
        self._in_flight: dict[int, int] = {}
        self._lock = threading.Lock()

    def acquire(self) -> int:
        """The version a new request uses (the current one), counted in flight until :meth:`release`."""
        with self._lock:
            v = self.current
            self._in_flight[v] = self._in_flight.get(v, 0) + 1
            return v

    def release(self, version: int) -> list[int]:
        """A request of ``version`` finished; returns the versions to unload now."""
        with self._lock:
            n = self._in_flight[version] - 1
            if n:
                self._in_flight[version] = n
            else:
                del self._in_flight[version]
            return self._unloadable()

    def loaded_as(self, version: int) -> list[int]:
        """``version`` is loaded and new requests use it; returns the versions to unload now."""
        with self._lock:
            if version <= self.current:
                raise ValueError(f"adapter v{version} is not newer than the current v{self.current}")
            self.current = version
            self.loaded.append(version)
            return self._unloadable()

    def in_flight(self, version: int) -> int:
        with self._lock:
            return self._in_flight.get(version, 0)

    def _unloadable(self) -> list[int]:
        # Beyond the newest ``keep`` and unused; taken off ``loaded`` here, under the lock, so two releases
        # racing never both hand out the same version for the caller to unload.
        out = [v for v in self.loaded[: -self.keep] if not self._in_flight.get(v)]
        self.loaded = [v for v in self.loaded if v not in out]
        return out
