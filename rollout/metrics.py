"""Prometheus metrics of one rollout server: the rollout loop and the HTTP API (:mod:`rollout.http`) count
into the same registry, served at ``GET /metrics``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rollout.engines.base import Engine


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
