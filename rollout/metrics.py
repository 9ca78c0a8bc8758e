"""Prometheus metrics of one rollout server: the rollout loop and the HTTP API (:mod:`rollout.http`) count
into the same registry, served at ``GET /metrics``.

The engine's KV-cache use and preemptions (:meth:`rollout.engines.base.Engine.stats`) are sampled by a
background thread every ``ENGINE_STATS_INTERVAL_S``, never per token: for vLLM and SGLang each sample is one
``GET /metrics`` of the engine's own server. The latest sample is exported as the ``tandem_engine_*``
metrics (only what the engine reports: a ``None`` field is left out, not exported as 0), and the rollout
loop logs it with every batch as ``server/*`` (docs/design.md §1.3), the KV-cache peaks since the last
batch included, so a cache that fills up and drains between two batches still shows.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import fields

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rollout.engines.base import Engine, EngineStats

log = logging.getLogger(__name__)

ENGINE_STATS_INTERVAL_S = 2.0

# EngineStats field -> (exported name, help); preemptions is a counter, the rest are gauges.
ENGINE_METRICS = {
    "kv_cache_usage": ("tandem_engine_kv_cache_usage", "Share of the engine's KV-cache pool in use (0..1)."),
    "kv_cache_bytes": ("tandem_engine_kv_cache_bytes", "Bytes of KV cache the running requests hold."),
    "preemptions": ("tandem_engine_preemptions", "Requests the engine preempted (KV freed, recomputed)."),
    "requests_running": ("tandem_engine_requests_running", "Sequences the engine is decoding."),
    "requests_waiting": ("tandem_engine_requests_waiting", "Requests queued in the engine's scheduler."),
}


class ServerMetrics:
    """Prometheus metrics of one rollout server, in its own registry (several servers or tests never clash)."""

    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.generated_tokens = Counter(
            "tandem_generated_tokens", "Tokens generated, by who asked.", ["source"], registry=r
        )
        self.requests = Counter(
            "tandem_http_requests", "HTTP requests answered.", ["route", "status"], registry=r
        )
        self.rollout_groups = Counter(
            "tandem_rollout_groups", "Prompt groups appended to the buffer.", registry=r
        )
        self.weight_version = Gauge(
            "tandem_weight_version", "Policy version of the served weights.", registry=r
        )
        self.weight_version.set_function(lambda: engine.version)
        self.weight_update_seconds = Histogram(
            "tandem_weight_update_seconds",
            "Time to apply one weight update to the engine.",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30),
            registry=r,
        )
        self.engine_stats = EngineStatsSampler(engine)
        r.register(self.engine_stats)

    def engine_row(self) -> dict[str, float]:
        """The ``server/*`` metrics for the next telemetry row (see :meth:`EngineStatsSampler.row`)."""
        return self.engine_stats.row()


class EngineStatsSampler(Collector):
    """Samples ``engine.stats()`` on a thread of its own; a Prometheus collector of the latest sample.

    A scrape never calls the engine: it reads the latest sample, so ``GET /metrics`` stays fast while the
    engine is busy or unreachable.
    """

    def __init__(self, engine: Engine, interval_s: float = ENGINE_STATS_INTERVAL_S) -> None:
        self.engine = engine
        self.interval_s = interval_s
        self.latest: EngineStats | None = None
        self._peak_usage: float | None = None  # since the last row()
        self._peak_bytes: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    def start(self) -> EngineStatsSampler:
        self._thread = threading.Thread(target=self._run, name="engine-stats", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def sample(self) -> EngineStats | None:
        """Read the engine's stats once; a failure is logged once per outage and the last sample kept."""
        try:
            stats = self.engine.stats()
        except Exception as e:  # an engine restarting or unreachable must not end the sampling
            if not self._failing:
                log.warning("engine stats unavailable (kept sampling every %.0f s): %s", self.interval_s, e)
            self._failing = True
            return None
        self._failing = False
        with self._lock:
            self.latest = stats
            self._peak_usage = _max(self._peak_usage, stats.kv_cache_usage)
            self._peak_bytes = _max(self._peak_bytes, stats.kv_cache_bytes)
        return stats

    def row(self) -> dict[str, float]:
        """Latest values as ``server/<field>``, plus ``server/kv_cache_usage_peak`` and
        ``server/kv_cache_bytes_peak`` since the last call; fields the engine does not report are absent."""
        with self._lock:
            latest, peaks = self.latest, {"usage": self._peak_usage, "bytes": self._peak_bytes}
            self._peak_usage = latest.kv_cache_usage if latest else None
            self._peak_bytes = latest.kv_cache_bytes if latest else None
        if latest is None:
            return {}
        out = {f"server/{k}": float(v) for k, v in _present(latest)}
        if peaks["usage"] is not None:
            out["server/kv_cache_usage_peak"] = float(peaks["usage"])
        if peaks["bytes"] is not None:
            out["server/kv_cache_bytes_peak"] = float(peaks["bytes"])
        return out

    def collect(self) -> Iterator[Metric]:
        latest = self.latest
        if latest is None:
            return
        for key, value in _present(latest):
            name, doc = ENGINE_METRICS[key]
            family = CounterMetricFamily if key == "preemptions" else GaugeMetricFamily
            yield family(name, doc, value=value)


def _present(stats: EngineStats) -> list[tuple[str, float]]:
    values = ((f.name, getattr(stats, f.name)) for f in fields(stats))
    return [(k, v) for k, v in values if v is not None]


def _max(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)
