"""The vLLM engine adapter: a managed ``vllm serve`` (vLLM 0.33.0) driven over HTTP.

Why a subprocess and not an in-process ``AsyncLLM``: see ``rollout/engines/_http.py`` (the learner must reach
the weight-transfer routes directly; crash isolation; a replayable protocol).

Generation: ``POST /v1/completions`` with token-id prompts, ``logprobs=0`` (the sampled token only),
``return_token_ids`` and ``return_weight_versions``. The server runs with ``--logprobs-mode
processed_logprobs``, so each logprob is of the distribution actually sampled from (after temperature,
top-k, top-p); ``--generation-config vllm`` stops the checkpoint's ``generation_config.json`` from
silently adding a repetition penalty or a top-p the learner knows nothing about. Token versions come from the
engine's own ``weight_versions`` spans, so a request that straddles an update (pause mode ``keep``) is
stamped exactly.

Weight updates (docs/design.md §5.5, docs/engines.md §5):
- ``update.path`` set (shm transport): ``/pause?mode=<pause_mode>`` → ``/collective_rpc reload_weights``
  (checkpoint-format reload in place, ``GPUModelRunner.reload_weights(weights_path=...)``) →
  ``/reset_prefix_cache`` (KV from old weights is dropped and recomputed) → ``/update_weight_version`` →
  ``/resume``.
- ``update.path`` None (dist transport): the learner's ``weightsync.engines.EnginePublisher`` has already run
  pause → ``/start_weight_update`` → ``/update_weights`` per bucket (NCCL broadcast) →
  ``/finish_weight_update {weight_version}`` → ``/resume`` against this server's URL, because the broadcast
  must run while ``/update_weights`` blocks. Here we only confirm through ``/weight_info`` that the engine
  holds the version and record it.

The RL routes (``/pause``, weight transfer, ``/collective_rpc``) exist only with ``VLLM_SERVER_DEV_MODE=1``,
which we set; bind the server to loopback (the default) unless a learner on another host must reach it.

The weight-transfer backend is always ``nccl``. vLLM's ``ipc`` backend (same GPU) needs pickled CUDA-IPC
handles over HTTP (``VLLM_ALLOW_INSECURE_SERIALIZATION=1``), and we never unpickle across processes; a
learner sharing the GPU with the engine uses the shm transport and ``reload_weights`` instead.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout.engines._http import (
    Api,
    EngineClient,
    EngineHTTPError,
    ManagedServer,
    engine_port,
    engine_url,
    expand_version_spans,
    payload_fields,
    replay_tokens,
    to_json,
    wait_for_weight_version,
)
from rollout.engines.base import BetweenSteps, Completion, FinishReason, OnToken, SamplingParams
from tandem.config import Config
from weightsync.base import Update

VLLM_VERSION = "0.33.0"
LABEL = f"vLLM {VLLM_VERSION}"
SERVED_NAME = "tandem-actor"


# ------------------------------------------------------------------------------------- typed payloads


@dataclass(frozen=True)
class CompletionBody:
    """``vllm.entrypoints.openai.completion.protocol.CompletionRequest`` (the fields we send)."""

    model: str
    prompt: list[list[int]]
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
    return_token_ids: bool
    return_weight_versions: bool


@dataclass(frozen=True)
class CollectiveRpcBody:
    """``/collective_rpc``: string args only (vLLM refuses anything else over HTTP)."""

    method: str
    kwargs: dict[str, str]
    timeout: float


@dataclass(frozen=True)
class WeightVersionBody:
    new_version: str


# Every route, request field, flag, function and literal this adapter (and the vLLM half of
# weightsync/engines.py) uses; tests/test_engines_contract.py checks each row against the vLLM 0.33.0 source.
VLLM_API: tuple[Api, ...] = (
    Api("route", "vllm.entrypoints.openai.completion.api_router", "POST /v1/completions"),
    Api(
        "fields",
        "vllm.entrypoints.openai.completion.protocol",
        "CompletionRequest",
        payload_fields(CompletionBody),
    ),
    Api(
        "fields",
        "vllm.entrypoints.openai.completion.protocol",
        "CompletionResponseChoice",
        ("index", "token_ids", "logprobs", "finish_reason", "weight_versions"),
    ),
    Api("fields", "vllm.entrypoints.openai.completion.protocol", "CompletionLogProbs", ("token_logprobs",)),
    Api("fields", "vllm.outputs", "WeightVersionSpan", ("version", "start", "end")),
    Api("route", "vllm.entrypoints.serve.instrumentator.health", "GET /health"),
    Api("route", "vllm.entrypoints.rl.online.api_router", "POST /pause", ("mode",)),
    Api("literal", "vllm.v1.engine", "PauseMode", ("keep", "abort", "wait")),
    Api("route", "vllm.entrypoints.rl.online.api_router", "POST /resume"),
    Api("route", "vllm.entrypoints.rl.online.api_router", "POST /update_weight_version", ("new_version",)),
    Api("route", "vllm.entrypoints.rl.online.api_router", "GET /weight_info"),
    Api("route", "vllm.entrypoints.rl.online.api_router", "GET /get_world_size", ("include_dp",)),
    Api("route", "vllm.entrypoints.serve.dev.rpc.api_router", "POST /collective_rpc"),
    Api("function", "vllm.v1.worker.gpu_worker", "Worker.reload_weights"),
    Api("function", "vllm.v1.worker.gpu_model_runner", "GPUModelRunner.reload_weights", ("weights_path",)),
    Api(
        "route",
        "vllm.entrypoints.serve.dev.cache.api_router",
        "POST /reset_prefix_cache",
        ("reset_running_requests",),
    ),
    # weightsync/engines.py: the NCCL weight-transfer routes and the trainer-side communicator.
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
        ("master_address", "master_port", "rank_offset", "world_size", "packed"),
    ),
    Api(
        "fields",
        "vllm.distributed.weight_transfer.nccl_engine",
        "NCCLWeightTransferUpdateInfo",
        ("names", "dtype_names", "shapes"),
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
        ),
    ),
    Api("fields", "vllm.entrypoints.common.cli_args", "FrontendArgs", ("host", "port", "api_key")),
    Api("literal", "vllm.config.model", "LogprobsMode", ("processed_logprobs",)),
    Api("literal", "vllm.config.weight_transfer", "WeightTransferConfig.backend", ("nccl",)),
    Api("name", "vllm.envs", "VLLM_SERVER_DEV_MODE"),
    Api("function", "vllm.entrypoints.cli.main", "main"),
)

_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


def serve_argv(cfg: Config, model_path: str, host: str, port: int) -> list[str]:
    """The ``vllm serve`` command line, run with this interpreter so it uses the engine's environment."""
    v = cfg.rollout.vllm
    argv = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model_path,
        "--host", host,
        "--port", str(port),
        "--served-model-name", SERVED_NAME,
        "--logprobs-mode", "processed_logprobs",
        "--generation-config", "vllm",
        "--weight-transfer-config", '{"backend": "nccl"}',
        "--gpu-memory-utilization", str(v.gpu_memory_utilization),
        "--tensor-parallel-size", str(v.tensor_parallel_size),
        "--seed", str(cfg.run.seed),
    ]  # fmt: skip
    if cfg.model.dtype != "auto":
        argv += ["--dtype", cfg.model.dtype]
    if cfg.model.trust_remote_code:
        argv.append("--trust-remote-code")
    if v.api_key:
        argv += ["--api-key", v.api_key]
    return argv + list(v.extra_args)


def completion_body(prompts: list[list[int]], sampling: SamplingParams) -> CompletionBody:
    return CompletionBody(
        model=SERVED_NAME,
        prompt=prompts,
        n=sampling.n,
        max_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        min_p=0.0,
        repetition_penalty=1.0,
        seed=sampling.seed,
        stop=list(sampling.stop),
        stop_token_ids=list(sampling.stop_token_ids),
        logprobs=0,
        return_token_ids=True,
        return_weight_versions=True,
    )


def parse_completions(body: Any, n_prompts: int, n: int, where: str) -> list[list[Completion]]:
    """``CompletionResponse`` → per prompt, ``n`` completions. Choices come prompt-major (index = i*n + j)."""
    choices = sorted(body["choices"], key=lambda c: c["index"])
    if len(choices) != n_prompts * n:
        raise EngineHTTPError(f"{where}: {len(choices)} choices for {n_prompts} prompts x n={n}")
    out: list[list[Completion]] = [[] for _ in range(n_prompts)]
    for c in choices:
        ids = [int(t) for t in c["token_ids"]]
        lps = c["logprobs"]["token_logprobs"] if c["logprobs"] else None
        reason = _FINISH.get(c["finish_reason"])
        if lps is None or len(lps) != len(ids) or any(x is None for x in lps):
            raise EngineHTTPError(f"{where}: choice {c['index']} has no logprob for every token")
        if reason is None:
            raise EngineHTTPError(f"{where}: choice {c['index']} finished with {c['finish_reason']!r}")
        if c.get("weight_versions") is None:
            raise EngineHTTPError(f"{where}: no weight_versions in the reply (needs vLLM >= {VLLM_VERSION})")
        versions = expand_version_spans(c["weight_versions"], len(ids), where=where)
        out[c["index"] // n].append(Completion(ids, [float(x) for x in lps], reason, versions))
    return out


class VLLMEngine:
    """The Engine Protocol over a managed ``vllm serve`` (or an already running one at ``vllm.url``)."""

    def __init__(self, cfg: Config, model_path: str, *, server_id: int, device: str | None) -> None:
        v = cfg.rollout.vllm
        self.cfg = cfg
        self.server_id = server_id
        self._version = 0
        self._pause_mode = v.pause_mode
        self.server: ManagedServer | None = None
        if v.url is None:
            port = engine_port(v.port, server_id, v.host)
            url = engine_url(v.host, port)
            env = {"VLLM_SERVER_DEV_MODE": "1"}
            if device is not None and device.startswith("cuda:") and v.tensor_parallel_size == 1:
                env["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
            log = Path(cfg.run.output_dir) / f"vllm-server{server_id}.log"
            argv = serve_argv(cfg, model_path, v.host, port)
            self.server = ManagedServer(f"vllm serve (server {server_id})", argv, env=env, log_path=log)
        else:
            url = v.url
        self.client = EngineClient(url, LABEL, timeout=v.request_timeout_s, api_key=v.api_key)
        try:
            if self.server is not None:
                self.server.wait_healthy(self.client, "/health", v.startup_timeout_s)
            # Label the initial weights 0, so every token's version parses as the policy version.
            self.client.post("/update_weight_version", to_json(WeightVersionBody("0")))
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        """The engine control URL the learner's EnginePublisher drives (register it in Redis)."""
        return self.client.base_url

    def world_size(self) -> int:
        """Inference workers of this server (TP x PP x DP): its share of the NCCL weight-transfer group."""
        return int(self.client.get("/get_world_size", params={"include_dp": "true"})["world_size"])

    @property
    def version(self) -> int:
        return self._version

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        *,
        between_steps: BetweenSteps | None = None,
        on_token: OnToken | None = None,
    ) -> list[list[Completion]]:
        """One HTTP call for the whole batch; the engine schedules it. Thread-safe (httpx pools connections).

        The engine's decode steps are out of our reach, so ``between_steps`` runs once before the call (a
        pending update then applies first) and ``on_token`` replays the tokens after it.
        """
        if not prompts:
            return []
        if between_steps is not None:
            between_steps()
        body = self.client.post("/v1/completions", to_json(completion_body(prompts, sampling)))
        out = parse_completions(body, len(prompts), sampling.n, f"{LABEL} {self.url} /v1/completions")
        if on_token is not None:
            replay_tokens(out, on_token)
        return out

    def update_weights(self, update: Update) -> None:
        if update.path is None:
            self._await_pushed_version(update.version)
            return
        timeout = self.cfg.rollout.vllm.update_timeout_s
        ctx = f"weight version {update.version}"
        self.pause()
        self.client.post(
            "/collective_rpc",
            to_json(CollectiveRpcBody("reload_weights", {"weights_path": update.path}, timeout)),
            timeout=timeout + 30,
            context=ctx,
        )
        self.client.post(
            "/reset_prefix_cache", params={"reset_running_requests": "true"}, timeout=timeout, context=ctx
        )
        self.client.post(
            "/update_weight_version", to_json(WeightVersionBody(str(update.version))), context=ctx
        )
        self._version = update.version
        self.resume()

    def _await_pushed_version(self, version: int) -> None:
        """dist: the learner pushed the weights itself; wait until the engine reports ``version``."""
        timeout = self.cfg.rollout.vllm.update_timeout_s
        self._version = wait_for_weight_version(self.client, "/weight_info", version, timeout, LABEL)

    def pause(self) -> None:
        self.client.post("/pause", params={"mode": self._pause_mode}, context=f"mode={self._pause_mode}")

    def resume(self) -> None:
        self.client.post("/resume")

    def close(self) -> None:
        self.client.close()
        if self.server is not None:
            self.server.stop()
