"""An engine server's Prometheus ``GET /metrics`` text read into :class:`EngineStats` (vLLM, SGLang).

Both engines publish their scheduler's state as Prometheus metrics, updated at every scheduler step; the
sample lines of the four metrics we read are parsed with ``prometheus_client``'s own parser (vLLM's whole
reply is ~50 kB of histograms: parsing all of it cost ~25 ms a sample on a loaded 2-core machine). One metric
may come in several label sets (one per data-parallel engine or rank): the KV-cache usage is their mean (the
pools are of one size, so the mean is the share of the server's whole cache), counts are summed.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from rollout.engines.base import EngineStats


@dataclass(frozen=True)
class StatSamples:
    """The sample names (as they appear in the text: a counter's with ``_total``) of one engine's metrics."""

    kv_cache_usage: str  # gauge, 0..1
    preemptions: str  # counter
    requests_running: str  # gauge
    requests_waiting: str  # gauge


_NAME = re.compile(r"[{ ]")


def parse_stats(text: str, names: StatSamples) -> EngineStats:
    """The stats in one ``/metrics`` reply; a metric the reply lacks is ``None``."""
    wanted = {
        names.kv_cache_usage,
        names.preemptions,
        names.requests_running,
        names.requests_waiting,
    }
    # A sample line is ``name{labels} value`` or ``name value``; comments and other metrics are skipped.
    lines = [line for line in text.splitlines() if _NAME.split(line, 1)[0] in wanted]
    values: dict[str, list[float]] = defaultdict(list)
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        for sample in family.samples:
            if sample.name in wanted:
                values[sample.name].append(sample.value)

    def total(name: str) -> int | None:
        return round(sum(values[name])) if values[name] else None

    usage = values[names.kv_cache_usage]
    return EngineStats(
        kv_cache_usage=sum(usage) / len(usage) if usage else None,
        preemptions=total(names.preemptions),
        requests_running=total(names.requests_running),
        requests_waiting=total(names.requests_waiting),
    )
