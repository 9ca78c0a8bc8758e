"""Engine stats (KV-cache use, preemptions, running and waiting requests) and how the server exports them.

- hf: a real tiny checkpoint; the bytes it reports mid-generation are checked against the KV size computed
  by hand from the model config (2 tensors x layers x rows x kv heads x cached tokens x head dim x 4 bytes).
- vLLM: its ``/metrics`` text is parsed here from a payload built with ``prometheus_client`` under vLLM's
  metric names and labels; the real server is in ``tests/test_vllm.py``.
- SGLang cannot run here (CUDA-only wheel, docs/engines.md §8): the adapter reads a stand-in ``/metrics``
  served over HTTP, built the same way under SGLang 0.5.23's names and labels. That those names, the
  ``/metrics`` mount and ``--enable-metrics`` exist in the real package is checked by
  ``tests/test_engines_contract.py`` (the rows of ``SGLANG_API``).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rollout.engines._prometheus import parse_stats
from rollout.engines.base import EngineStats, SamplingParams
from rollout.engines.hf import HFEngine
from rollout.engines.sglang import SGLangEngine, launch_argv
from rollout.engines.vllm import VLLM_STATS
from rollout.metrics import ServerMetrics
from tandem.config import Config, load_config


@pytest.fixture(scope="module")
def engine(tiny_ckpt: dict[str, Path]) -> HFEngine:
    return HFEngine(str(tiny_ckpt["actor"]), device="cpu", seed=0)


def kv_bytes_by_hand(engine: HFEngine, rows: int, tokens: int) -> int:
    c = engine.model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * rows * c.num_key_value_heads * tokens * head_dim * 4  # float32


# ------------------------------------------------------------------------------------------------ hf


def test_hf_reports_the_kv_bytes_of_the_rows_decoding(engine):
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]  # left-padded to 7
    sampling = SamplingParams(n=2, max_new_tokens=12, temperature=1.0, seed=3)
    seen: list[tuple[EngineStats, int, int]] = []  # (stats, rows that sampled this step, step)
    sampled_this_step = []

    def on_token(row: int, token: int, logprob: float) -> None:
        sampled_this_step.append(row)

    def between_steps() -> None:  # after step s's forward: the cache holds 7 + s tokens of each row
        seen.append((engine.stats(), len(sampled_this_step), len(seen)))
        sampled_this_step.clear()

    engine.generate(prompts, sampling, between_steps=between_steps, on_token=on_token)
    assert len(seen) >= 3
    for stats, rows, step in seen:
        assert stats.kv_cache_bytes == kv_bytes_by_hand(engine, rows, 7 + step)
        assert stats.requests_running == rows
    assert seen[0][0].requests_running == 4  # 2 prompts x n=2
    after = engine.stats()  # the call's rows are gone from the batch, and their cache with them
    assert after == EngineStats(kv_cache_bytes=0, preemptions=0, requests_running=0, requests_waiting=0)
    assert after.kv_cache_usage is None  # no pool


def test_hf_calls_running_at_once_share_one_batch_and_decode_as_alone(engine):
    """A call whose thread is held in its hook still advances: the second call takes the batch over and its
    steps decode the first call's row too. Every row, joined mid-decode to a batch of another width,
    samples what it samples alone."""
    inside = threading.Event()
    release = threading.Event()

    def hold() -> None:  # the first call stops after its first step, its row left in the batch
        inside.set()
        release.wait(30)

    first_out = []
    first = threading.Thread(
        target=lambda: first_out.extend(
            engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=6, temperature=0), between_steps=hold)
        )
    )
    first.start()
    assert inside.wait(30)
    seen = []
    second_out = engine.generate(
        [[8, 9, 10, 11, 12]],
        SamplingParams(n=3, max_new_tokens=2, temperature=0),
        between_steps=lambda: seen.append(engine.stats()),
    )
    # Its rows waited while the first call's thread held the batch in its hook, then it took over.
    assert (seen[0].requests_running, seen[0].requests_waiting) == (1, 3)
    # One batch of 4 rows: the first call's 3 + 1 fed tokens left-padded to the second's 5 columns.
    joined = next(s for s in seen if s.requests_running == 4)
    assert joined.kv_cache_bytes == kv_bytes_by_hand(engine, 4, 5)
    assert engine.stats().requests_running == 1  # the first call's row, advanced by the second's steps
    release.set()
    first.join(30)
    (c,) = first_out[0]
    assert len(c.token_ids) == 6
    alone = [
        engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=6, temperature=0))[0][0],
        engine.generate([[8, 9, 10, 11, 12]], SamplingParams(max_new_tokens=2, temperature=0))[0][0],
    ]
    for got, ref in [(c, alone[0]), *((s, alone[1]) for s in second_out[0])]:
        assert got.token_ids == ref.token_ids
        assert got.logprobs == pytest.approx(ref.logprobs, abs=1e-5)


# ------------------------------------------------------------------------------------- vLLM payload


def vllm_payload(usage: list[float], preempted: list[int], running: list[int], waiting: list[int]) -> str:
    """``/metrics`` as vLLM's PrometheusStatLogger writes it: labels model_name and engine, one set per
    data-parallel engine; the preemption counter declared as ``vllm:num_preemptions``."""
    r = CollectorRegistry()
    labels = ["model_name", "engine"]
    gauges = {
        "vllm:kv_cache_usage_perc": usage,
        "vllm:num_requests_running": running,
        "vllm:num_requests_waiting": waiting,
    }
    for name, values in gauges.items():
        g = Gauge(name, name, labels, registry=r)
        for i, v in enumerate(values):
            g.labels("tandem-actor", str(i)).set(v)
    c = Counter("vllm:num_preemptions", "preemptions", labels, registry=r)
    for i, v in enumerate(preempted):
        c.labels("tandem-actor", str(i)).inc(v)
    Gauge("vllm:cache_config_info", "info", ["block_size"], registry=r).labels("128").set(1)
    by_reason = Gauge("vllm:num_requests_waiting_by_reason", "by reason", [*labels, "reason"], registry=r)
    for i, v in enumerate(waiting):  # their sum is vllm:num_requests_waiting: not to be counted twice
        by_reason.labels("tandem-actor", str(i), "capacity").set(v)
    return generate_latest(r).decode()


def test_vllm_payload_is_averaged_and_summed_over_engines():
    text = vllm_payload(usage=[0.25, 0.75], preempted=[3, 4], running=[5, 6], waiting=[0, 2])
    assert parse_stats(text, VLLM_STATS) == EngineStats(
        kv_cache_usage=0.5, preemptions=7, requests_running=11, requests_waiting=2
    )


def test_a_metric_the_reply_lacks_is_none_not_zero():
    text = vllm_payload(usage=[0.4], preempted=[1], running=[2], waiting=[3])
    only_usage = "\n".join(line for line in text.splitlines() if "kv_cache_usage" in line) + "\n"
    assert parse_stats(only_usage, VLLM_STATS) == EngineStats(kv_cache_usage=0.4)
    assert parse_stats("", VLLM_STATS) == EngineStats()


# ------------------------------------------------------------------------------------ SGLang (mock)


def sglang_payload(usage: list[float], retracted: list[int], running: list[int], queued: list[int]) -> str:
    """``/metrics`` as SGLang 0.5.23's SchedulerMetricsCollector writes it (one label set per DP rank's
    scheduler; gauges in ``mostrecent`` mode carry no pid). The counter is declared with ``_total``."""
    r = CollectorRegistry()
    labels = ["model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank", "dp_rank"]
    gauges = {
        "sglang:token_usage": usage,
        "sglang:num_running_reqs": running,
        "sglang:num_queue_reqs": queued,
        "sglang:num_used_tokens": [123] * len(usage),
    }
    for name, values in gauges.items():
        g = Gauge(name, name, labels, registry=r)
        for dp, v in enumerate(values):
            g.labels("m", "unified", "0", "0", "0", str(dp)).set(v)
    c = Counter("sglang:num_retracted_requests_total", "retracted", labels, registry=r)
    for dp, v in enumerate(retracted):
        c.labels("m", "unified", "0", "0", "0", str(dp)).inc(v)
    return generate_latest(r).decode()


class StandIn(BaseHTTPRequestHandler):
    """The two routes the SGLang adapter calls here: ``/update_weight_version`` at start, ``/metrics``."""

    payload = ""
    status = 200
    requests: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        type(self).requests.append(f"GET {self.path}")
        body = (self.payload if self.status == 200 else "Not Found").encode()
        self.send_response(self.status if self.path == "/metrics" else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        type(self).requests.append(f"POST {self.path}")
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def stand_in() -> Iterator[type[StandIn]]:
    handler = type("Handler", (StandIn,), {"requests": [], "payload": "", "status": 200})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    handler.url = f"http://127.0.0.1:{server.server_port}"
    yield handler
    server.shutdown()
    server.server_close()


def sglang_cfg(tmp_path: Path, url: str | None = None) -> Config:
    raw = {
        "run": {"output_dir": str(tmp_path)},
        "model": {"actor": "/models/none"},
        "data": {"prompts": "/data/none.jsonl"},
        "reward": {"functions": [{"path": "toy.tasks.echo:reward"}]},
        "rollout": {"engine": "sglang", "sglang": {"url": url}},
    }
    return load_config(None, raw=raw)


def test_sglang_stats_from_its_metrics_route(stand_in, tmp_path):
    stand_in.payload = sglang_payload(usage=[0.5, 1.0], retracted=[2, 5], running=[8, 9], queued=[1, 0])
    engine = SGLangEngine(sglang_cfg(tmp_path, stand_in.url), "m", server_index=0, device=None)
    assert engine.stats() == EngineStats(
        kv_cache_usage=0.75, preemptions=7, requests_running=17, requests_waiting=1
    )
    assert stand_in.requests[-1] == "GET /metrics"
    engine.close()


def test_sglang_server_we_start_serves_metrics(tmp_path):
    argv = launch_argv(sglang_cfg(tmp_path), "/models/m", "127.0.0.1", 30000)
    assert "--enable-metrics" in argv  # without it SGLang has no /metrics route


# ------------------------------------------------------------------------------ the server's export


def sample_family(text: str, name: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                return s.value
    return None


def test_server_exports_what_the_engine_reports_and_logs_peaks(engine):
    metrics = ServerMetrics(engine)
    assert metrics.engine_row() == {}  # nothing sampled yet
    peaks = []

    def sample_mid_call() -> None:
        peaks.append(metrics.engine_stats.sample().kv_cache_bytes)

    engine.generate([[5, 6, 7, 8]], SamplingParams(n=2, max_new_tokens=6, temperature=1.0, seed=1),
                    between_steps=sample_mid_call)  # fmt: skip
    metrics.engine_stats.sample()  # after the call: no cache held
    row = metrics.engine_row()
    assert row["server/kv_cache_bytes"] == 0
    assert row["server/kv_cache_bytes_peak"] == max(peaks) > 0
    assert row["server/preemptions"] == 0 and row["server/requests_running"] == 0
    assert "server/kv_cache_usage" not in row and row["server/requests_waiting"] == 0  # hf: no pool
    assert metrics.engine_row()["server/kv_cache_bytes_peak"] == 0  # the peak restarts at each row

    text = generate_latest(metrics.registry).decode()
    assert sample_family(text, "tandem_engine_kv_cache_bytes") == 0
    assert sample_family(text, "tandem_engine_preemptions_total") == 0
    assert sample_family(text, "tandem_engine_kv_cache_usage") is None  # not exported as 0


def test_sampler_thread_survives_an_engine_without_metrics(stand_in, tmp_path, caplog):
    stand_in.payload = sglang_payload(usage=[0.3], retracted=[4], running=[1], queued=[0])
    engine = SGLangEngine(sglang_cfg(tmp_path, stand_in.url), "m", server_index=0, device=None)
    metrics = ServerMetrics(engine)
    metrics.engine_stats.interval_s = 0.05
    metrics.engine_stats.start()
    deadline = time.monotonic() + 10
    while metrics.engine_stats.latest is None and time.monotonic() < deadline:
        time.sleep(0.02)
    stand_in.status = 404  # e.g. restarted without --enable-metrics: samples fail, the last one is kept
    n = len(stand_in.requests)
    while len(stand_in.requests) < n + 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    metrics.engine_stats.stop()
    engine.close()
    assert metrics.engine_row()["server/preemptions"] == 4
    text = generate_latest(metrics.registry).decode()
    assert sample_family(text, "tandem_engine_kv_cache_usage") == pytest.approx(0.3)
    warnings = [r for r in caplog.records if "engine stats unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "404" in warnings[0].getMessage()  # once per outage, not per sample


# ---------------------------------------------------------------------- the rollout loop's telemetry


def test_each_batch_row_carries_the_engine_stats(
    redis_server, redis_client, run_id, tiny_ckpt, tmp_path, engine
):
    """A rollout loop over Redis with the sampler running: the rows it logs (mirrored to Redis) carry
    ``server/*`` from the latest sample (the hf engine: bytes, rows, 0 preemptions; no usage share)."""
    from tests.test_rollout_loop import Harness, Learner, make_cfg, queue_prompts
    from weightsync import make_subscriber

    cfg = make_cfg(run_id, redis_server.url, tiny_ckpt, tmp_path, **{"algorithm.max_staleness": 4})
    weights = {k: v.clone() for k, v in engine.model.state_dict().items() if k != "lm_head.weight"}
    learner = Learner(cfg, redis_client, weights)
    queue_prompts(learner.buffer, engine, 4)
    harness = Harness(cfg, redis_client, engine, make_subscriber(cfg, redis_client, "server-0"))
    sampler = harness.loop.metrics.engine_stats
    sampler.interval_s = 0.01
    sampler.start()
    try:
        with harness:
            learner.take(4)
    finally:
        sampler.stop()
    rows = [json.loads(r) for r in redis_client.lrange(f"{run_id}:history:server-0", 0, -1)]
    assert rows and all(r["server/preemptions"] == 0 for r in rows)
    assert all(r["server/kv_cache_bytes_peak"] >= r["server/kv_cache_bytes"] >= 0 for r in rows)
    assert all("server/requests_running" in r and "server/kv_cache_usage" not in r for r in rows)
    # the batch's longest response, generation's pace for the planner: at least the mean, at most the cap
    cap = cfg.rollout.max_new_tokens
    assert all(r["rollout/response_len"] <= r["rollout/longest_response"] <= cap for r in rows)
