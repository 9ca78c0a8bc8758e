"""The SGLang engine adapter: a managed ``sglang.launch_server`` (SGLang 0.5.23) driven over HTTP.

Why a subprocess and not an in-process ``sglang.Engine``: see ``rollout/engines/_http.py``. (``Engine`` also
has no pause/continue methods in 0.5.23; those live on the HTTP server.)

Generation: ``POST /generate`` with ``input_ids`` and ``return_logprob``; tokens and logprobs come from
``meta_info.output_token_logprobs`` (``[logprob, token_id, text]`` triples), versions from
``meta_info.weight_versions`` spans (or ``weight_version``). One request per prompt, all in flight together
(the scheduler batches them), so a prompt's group is scored while slower ones still generate; each of its
``n`` samples is its own batch entry (the prompt repeated, the radix cache shares its KV), so the reply
order is ours and a seed can differ per sample. ``--sampling-defaults openai`` keeps the checkpoint's
``generation_config.json`` from changing the sampling distribution behind the learner's back.

**Logprob semantics.** SGLang returns ``log_softmax(logits / temperature)``: temperature applied, top-p /
top-k *not* applied (``srt/layers/sampler.py``). With truncation the sampled distribution is the truncated,
renormalised one, so the returned number is *lower* than the true behaviour logprob by ``log`` of the kept
mass, and ``behav_logp`` would bias the importance weight ``exp(prox_logp - behav_logp)`` upward. The
adapter therefore refuses ``top_p < 1`` or ``top_k > 0`` at startup and per call with a clear error, unless
``rollout.sglang.allow_truncated_sampling`` accepts the bias knowingly. (0.5.23 also has an experimental
``return_sampling_mask`` that reports the truncated-distribution logprob; unverified without a GPU, unused.)

Weight updates (docs/design.md §5.5, docs/engines.md §5):
- ``update.path`` set (shm transport): ``/pause_generation {mode}`` → ``/update_weights_from_disk
  {model_path, weight_version, flush_cache}`` → ``/continue_generation``.
- ``update.path`` None (dist transport): the learner's ``weightsync.engine_push.EnginePublisher`` has run
  ``/pause_generation`` → ``/begin_weight_update`` → ``/update_weights_from_distributed`` per bucket →
  ``/end_weight_update`` → ``/flush_cache`` → ``/continue_generation`` against this server; we confirm the
  version through ``/model_info`` and record it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout.engines._http import (
    FINISH_REASONS,
    Api,
    HttpEngine,
    api_key_file,
    device_env,
    expand_version_spans,
    payload_fields,
    shared_flags,
)
from rollout.engines._prometheus import StatSamples
from rollout.engines.base import Completion, SamplingParams
from tandem.config import Config
from tandem.net import EngineHTTPError, to_json
from weightsync.base import Update
from weightsync.engine_push import SGLangDistUpdate, SGLangInitGroup

SGLANG_VERSION = "0.5.23"
LABEL = f"SGLang {SGLANG_VERSION}"
# The scheduler's state in ``GET /metrics`` (served with ``--enable-metrics``;
# sglang/srt/observability/metrics_collector.py). ``token_usage`` is the fullest of the KV pools (full
# attention, sliding window, Mamba); a retracted request is SGLang's preempted one (KV freed, re-queued).
SGLANG_STATS = StatSamples(
    kv_cache_usage="sglang:token_usage",
    preemptions="sglang:num_retracted_requests_total",
    requests_running="sglang:num_running_reqs",
    requests_waiting="sglang:num_queue_reqs",
)


# ------------------------------------------------------------------------------------- typed payloads


@dataclass(frozen=True)
class SamplingBody:
    """``sglang.api.v1.api_types.SamplingParams`` (unknown keys are rejected there)."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int | None  # None: SGLang's default (disabled)
    min_p: float
    repetition_penalty: float
    stop: list[str]
    stop_token_ids: list[int]
    sampling_seed: int | None
    json_schema: str | None = None  # a constraint (rollout/engines/constraint.py), one of the two
    structural_tag: str | None = None


@dataclass(frozen=True)
class GenerateBody:
    """``sglang.api.v1.api_types.GenerateRequest`` / ``io_struct.GenerateReqInput`` (the fields we send)."""

    input_ids: list[list[int]]
    sampling_params: list[dict[str, Any]]
    return_logprob: bool


@dataclass(frozen=True)
class PauseBody:
    mode: str  # abort | retract | in_place


@dataclass(frozen=True)
class ContinueBody:
    torch_empty_cache: bool


@dataclass(frozen=True)
class DiskUpdateBody:
    """``io_struct.UpdateWeightFromDiskReqInput``."""

    model_path: str
    weight_version: str
    flush_cache: bool
    abort_all_requests: bool


@dataclass(frozen=True)
class MemoryTagsBody:
    """``io_struct.ReleaseMemoryOccupationReqInput`` / ``ResumeMemoryOccupationReqInput``."""

    tags: list[str] | None  # weights, kv_cache (cuda_graph too); None: all


@dataclass(frozen=True)
class WeightVersionBody:
    new_version: str
    abort_all_requests: bool


IO = "sglang.srt.managers.io_struct"
HTTP = "sglang.srt.entrypoints.http_server"

# Every route, request field, flag and literal this adapter (and the SGLang half of weightsync/engine_push.py)
# uses; tests/test_engines_contract.py checks each row against the SGLang 0.5.23 source.
SGLANG_API: tuple[Api, ...] = (
    Api("route", HTTP, "POST /generate"),
    Api("fields", "sglang.api.v1.api_types", "GenerateRequest", payload_fields(GenerateBody)),
    Api("fields", IO, "GenerateReqInput", payload_fields(GenerateBody)),
    Api("fields", "sglang.api.v1.api_types", "SamplingParams", payload_fields(SamplingBody)),
    Api("route", HTTP, "GET /health"),
    # GET /metrics: a Prometheus app mounted with --enable-metrics, and the metrics we read from it.
    Api("fields", "sglang.srt.arg_groups.fields", "*", ("enable_metrics",)),
    Api("name", "sglang.srt.utils.common", "/metrics"),
    Api("name", "sglang.srt.observability.metrics_collector", "sglang:token_usage"),
    Api("name", "sglang.srt.observability.metrics_collector", "sglang:num_retracted_requests_total"),
    Api("name", "sglang.srt.observability.metrics_collector", "sglang:num_running_reqs"),
    Api("name", "sglang.srt.observability.metrics_collector", "sglang:num_queue_reqs"),
    Api("route", HTTP, "GET /model_info"),
    Api("route", HTTP, "POST /pause_generation"),
    Api("fields", IO, "PauseGenerationReqInput", payload_fields(PauseBody)),
    Api("literal", IO, "PauseGenerationReqInput.mode", ("abort", "retract", "in_place")),
    Api("route", HTTP, "POST /continue_generation"),
    Api("fields", IO, "ContinueGenerationReqInput", payload_fields(ContinueBody)),
    Api("route", HTTP, "POST /update_weights_from_disk"),
    Api("fields", IO, "UpdateWeightFromDiskReqInput", payload_fields(DiskUpdateBody)),
    Api("route", HTTP, "POST /update_weight_version"),
    Api("fields", IO, "UpdateWeightVersionReqInput", payload_fields(WeightVersionBody)),
    Api("route", HTTP, "POST /flush_cache"),
    # Memory release (colocated runs, docs/placement.md §11.1); tags from sglang.srt.constants.
    Api("route", HTTP, "POST /release_memory_occupation"),
    Api("fields", IO, "ReleaseMemoryOccupationReqInput", payload_fields(MemoryTagsBody)),
    Api("route", HTTP, "POST /resume_memory_occupation"),
    Api("fields", IO, "ResumeMemoryOccupationReqInput", payload_fields(MemoryTagsBody)),
    Api("name", "sglang.srt.constants", "weights"),  # GPU_MEMORY_TYPE_WEIGHTS
    Api("name", "sglang.srt.constants", "kv_cache"),  # GPU_MEMORY_TYPE_KV_CACHE
    # Keys of the /generate reply's meta_info that we read.
    Api("name", "sglang.srt.managers.tokenizer_manager", "output_token_logprobs"),
    Api("function", "sglang.srt.utils.weight_versions", "add_weight_versions_to_meta_info"),
    # weightsync/engine_push.py: the distributed update group.
    Api("route", HTTP, "POST /init_weights_update_group"),
    Api("fields", IO, "InitWeightsUpdateGroupReqInput", payload_fields(SGLangInitGroup)),
    Api("route", HTTP, "POST /destroy_weights_update_group"),
    Api("fields", IO, "DestroyWeightsUpdateGroupReqInput", ("group_name",)),
    Api("route", HTTP, "POST /begin_weight_update"),
    Api("route", HTTP, "POST /end_weight_update"),
    Api("route", HTTP, "POST /update_weights_from_distributed"),
    Api("fields", IO, "UpdateWeightsFromDistributedReqInput", payload_fields(SGLangDistUpdate)),
    # Our copy of the trainer-side rendezvous must match the engine side's (PrefixStore(group_name, store)).
    Api(
        "function",
        "sglang.srt.utils.common",
        "init_custom_process_group",
        ("backend", "init_method", "timeout", "world_size", "rank", "group_name"),
    ),
    # `sglang.launch_server` flags (ServerArgs fields, declared across arg_groups/fields/*.py).
    Api(
        "fields",
        "sglang.srt.arg_groups.fields",
        "*",
        (
            "model_path",
            "host",
            "port",
            "tp_size",
            "mem_fraction_static",
            "random_seed",
            "weight_version",
            "sampling_defaults",
            "dtype",
            "trust_remote_code",
            "api_key",
            "enable_memory_saver",
        ),
    ),
    Api("name", "sglang.launch_server", "__main__"),
)


def check_sampling(top_p: float, top_k: int, allow_truncated: bool, where: str) -> None:
    """Refuse truncated sampling, whose logprobs SGLang reports without the truncation (module docstring)."""
    if (top_p < 1.0 or top_k > 0) and not allow_truncated:
        raise ValueError(
            f"{where}: top_p={top_p}, top_k={top_k} with the sglang engine: SGLang {SGLANG_VERSION} returns "
            "logprobs with temperature but without top-p/top-k, so behav_logp would be biased. Use top_p=1 "
            "and top_k=0, or set rollout.sglang.allow_truncated_sampling=true to accept the bias."
        )


def launch_argv(cfg: Config, model_path: str, host: str, port: int) -> list[str]:
    s = cfg.rollout.sglang
    argv = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", model_path,
        "--host", host,
        "--port", str(port),
        "--tp-size", str(s.tp_size),
        "--mem-fraction-static", str(s.mem_fraction_static),
        "--random-seed", str(cfg.run.seed),
        "--weight-version", "0",
        "--sampling-defaults", "openai",
        "--enable-metrics",  # GET /metrics, read by stats()
    ]  # fmt: skip
    argv += shared_flags(cfg, s)
    if releases(cfg):  # torch_memory_saver: what release/resume_memory_occupation act on
        argv.append("--enable-memory-saver")
    return argv + list(s.extra_args)


def releases(cfg: Config) -> bool:
    """Whether a managed server is started able to release memory: colocated runs with
    ``placement.release_memory`` that own their server (an external one's flags are its own)."""
    return cfg.releases_memory and cfg.rollout.sglang.url is None


def _constraint(sampling: SamplingParams) -> dict[str, str]:
    """SGLang's structured-output sampling parameters for the request's constraint (none without one)."""
    c = sampling.constraint
    if c is None:
        return {}
    return {"json_schema": c.spec} if c.kind == "json_schema" else {"structural_tag": c.spec}


def generate_body(prompt: list[int], sampling: SamplingParams, seed: int | None) -> GenerateBody:
    """One prompt's request: its ``n`` samples are ``n`` batch entries, sample ``j`` seeded ``seed + j``."""
    n = sampling.n
    params = []
    for j in range(n):
        params.append(
            to_json(
                SamplingBody(
                    max_new_tokens=sampling.max_new_tokens,
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    top_k=sampling.top_k or None,
                    min_p=0.0,
                    repetition_penalty=1.0,
                    stop=list(sampling.stop),
                    stop_token_ids=list(sampling.stop_token_ids),
                    sampling_seed=None if seed is None else seed + j,
                    **_constraint(sampling),
                )
            )
        )
    return GenerateBody(input_ids=[prompt] * n, sampling_params=params, return_logprob=True)


def parse_generate(body: Any, n: int, where: str) -> list[Completion]:
    """One prompt's /generate reply (a list, one dict per batch entry, in order) → its ``n`` completions."""
    if not isinstance(body, list) or len(body) != n:
        raise EngineHTTPError(f"{where}: expected {n} results, got {str(body)[:200]}")
    out: list[Completion] = []
    for k, item in enumerate(body):
        meta = item["meta_info"]
        triples = meta.get("output_token_logprobs")
        if triples is None:
            raise EngineHTTPError(f"{where}: result {k} has no meta_info.output_token_logprobs")
        ids = [int(t[1]) for t in triples]
        lps = [float(t[0]) for t in triples]
        if "output_ids" in item and [int(t) for t in item["output_ids"]] != ids:
            raise EngineHTTPError(f"{where}: result {k}: output_ids and output_token_logprobs disagree")
        fr = meta.get("finish_reason")
        reason = FINISH_REASONS.get(fr["type"]) if isinstance(fr, dict) else None
        if reason is None:
            raise EngineHTTPError(f"{where}: result {k} finished with {fr!r}")
        spans = meta.get("weight_versions") or [
            {"version": meta["weight_version"], "start": 0, "end": len(ids)}
        ]
        versions = expand_version_spans(spans, len(ids), where=where)
        out.append(Completion(ids, lps, reason, versions))
    return out


class SGLangEngine(HttpEngine):
    """The Engine Protocol over a managed ``sglang.launch_server`` (or a running one at ``sglang.url``)."""

    weight_info_route = "/model_info"
    # A server we did not start must run with ``--enable-metrics``; a gauge appears once the scheduler
    # has logged a step.
    stat_samples = SGLANG_STATS

    def __init__(self, cfg: Config, model_path: str, *, server_index: int, device: str | None) -> None:
        s = cfg.rollout.sglang
        check_sampling(cfg.rollout.top_p, cfg.rollout.top_k, s.allow_truncated_sampling, "rollout config")
        super().__init__(cfg, s, server_index=server_index)
        self._pause_mode = s.pause_mode
        self.supports_sleep = releases(cfg)
        env = device_env(device, s.tp_size)
        log = Path(cfg.run.output_dir) / f"sglang-server{server_index}.log"
        key = api_key_file(s, log.with_name(f".sglang-server{server_index}.key.yaml"))  # not on argv
        url = self._start(
            "sglang.launch_server",
            lambda port: launch_argv(cfg, model_path, s.host, port) + key,
            env=env,
            log_path=log,
        )
        self._connect(url, LABEL)

    def _label_weights(self) -> None:
        if self.server is None:  # an external server: label its current weights 0 like a managed one
            self.client.post("/update_weight_version", to_json(WeightVersionBody("0", False)))

    def world_size(self) -> int:
        """Ranks this server adds to the distributed update group (one per TP rank; SGLang asserts dp=1)."""
        return self.cfg.rollout.sglang.tp_size

    def _generate_each(
        self, prompts: list[list[int]], sampling: SamplingParams
    ) -> Iterator[tuple[int, list[Completion]]]:
        """One ``/generate`` request per prompt, all in flight together, each yielded as its reply arrives.
        A seed gives sample ``j`` of prompt ``i`` the seed ``seed + i * n + j``."""
        check_sampling(
            sampling.top_p, sampling.top_k, self.cfg.rollout.sglang.allow_truncated_sampling, "generate"
        )
        return self._each_reply("/generate", prompts, sampling, generate_body, parse_generate)

    def _load_weights(self, update: Update, *, asleep: bool) -> None:
        self.client.post(
            "/update_weights_from_disk",
            to_json(
                DiskUpdateBody(
                    update.path, str(update.version), flush_cache=not asleep, abort_all_requests=False
                )
            ),
            timeout=self.settings.update_timeout_s,
            context=f"weight version {update.version}",
        )

    def pause(self) -> None:
        self.client.post("/pause_generation", to_json(PauseBody(self._pause_mode)))

    def resume(self) -> None:
        self.client.post("/continue_generation", to_json(ContinueBody(torch_empty_cache=True)))

    def sleep(self) -> None:
        """``/release_memory_occupation`` of weights and KV cache (no CPU backup is kept unless the server
        was started with ``--enable-weights-cpu-backup``: a full update refills the weights)."""
        self.client.post(
            "/release_memory_occupation", to_json(MemoryTagsBody(["weights", "kv_cache"])), context="sleep"
        )
        self._asleep = True

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """``/resume_memory_occupation`` of ``tags`` (None: all)."""
        body = MemoryTagsBody(list(tags) if tags else None)
        self.client.post("/resume_memory_occupation", to_json(body), context=f"tags={body.tags}")
        if not tags or "kv_cache" in tags:
            self._asleep = False
