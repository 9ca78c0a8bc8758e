"""Generation: the rollout servers and their engines (hf, vLLM, SGLang), the OpenAI-compatible HTTP API
they serve, multi-turn environments and black-box agents, the rewards scored on them, and held-out
evaluation on the servers.
"""

from __future__ import annotations

import ipaddress
import os
from typing import Any, Literal

from pydantic import Field, model_validator

from tandem.config.base import Section


class ServerConfig(Section):
    """What a managed engine server (vLLM, SGLang) needs, whichever it is: where it listens, how it is
    reached, and how long each kind of call may take."""

    extra_args: list[str] = Field(
        default_factory=list,
        description="Extra command-line arguments for the engine server (`vllm serve`, `sglang.launch_server`).",
    )
    url: str | None = Field(
        None,
        description="URL of an already running engine server to use instead of starting one (server_id is then ignored).",
    )
    host: str = Field(
        "127.0.0.1",
        description="Bind address of the managed engine server; 0.0.0.0 when a learner on another host drives its weight updates.",
    )
    port: int = Field(
        0,
        ge=0,
        le=65535,
        description="HTTP port of server 0 (server i uses port+i); 0 picks a free port.",
    )
    api_key: str | None = Field(
        None,
        description="Bearer token of the engine server's routes (passed as --api-key and sent by every client).",
    )
    startup_timeout_s: float = Field(
        900.0,
        gt=0,
        description="How long to wait for the engine server to load the model and answer /health.",
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="Longest wait for one generate call or control route of the engine server."
    )
    update_timeout_s: float = Field(
        600.0, gt=0, description="Longest wait for a weight reload or for a pushed weight version to appear."
    )

    @model_validator(mode="after")
    def _key_from_environment(self) -> ServerConfig:
        """A null key falls back to ``$TANDEM_ENGINE_API_KEY``, so shipped configs hold no secret."""
        if self.api_key is None and (key := os.environ.get(ENGINE_API_KEY_ENV)):
            self.api_key = key
        return self


class SGLangConfig(ServerConfig):
    mem_fraction_static: float = Field(
        0.7, gt=0, le=1, description="Fraction of GPU memory SGLang reserves for weights and KV cache."
    )
    tp_size: int = Field(1, ge=1, description="Tensor-parallel degree of each SGLang server.")
    pause_mode: Literal["abort", "retract", "in_place"] = Field(
        "retract",
        description="How generation pauses for a weight update (retract recomputes in-flight KV with the new weights).",
    )
    allow_truncated_sampling: bool = Field(
        False,
        description="Allow top_p<1 / top_k>0 although SGLang's logprobs then ignore the truncation (biased behav_logp).",
    )


class VLLMConfig(ServerConfig):
    gpu_memory_utilization: float = Field(0.7, gt=0, le=1, description="Fraction of GPU memory vLLM may use.")
    tensor_parallel_size: int = Field(1, ge=1, description="Tensor-parallel degree of each vLLM server.")
    pause_mode: Literal["keep", "abort", "wait"] = Field(
        "keep", description="How generation pauses for a weight update (keep resumes in-flight requests)."
    )


class SessionConfig(Section):
    """Agent sessions on the HTTP API, and the agent runner's (docs/environments.md §10.6)."""

    on_rewrite: Literal["split", "refuse"] = Field(
        "split",
        description="A session call whose prompt does not extend what the model sampled so far (a thinking model's chat template that drops earlier reasoning): split starts a new segment of the same episode, trained as its own token-exact trajectory with the episode's reward; refuse answers 400.",
    )


class HTTPConfig(Section):
    enabled: bool = Field(True, description="Serve the OpenAI-compatible HTTP API from each rollout server.")
    host: str = Field("127.0.0.1", description="Bind address; loopback by default.")
    port: int = Field(
        0, ge=0, le=65535, description="Port of server 0 (server i uses port+i); 0 picks a free port."
    )
    api_key: str | None = Field(None, description="Bearer token required on every request when set.")
    max_request_bytes: int = Field(1 << 20, ge=1024, description="Requests with larger bodies get 413.")
    max_tokens_limit: int = Field(4096, ge=1, description="Upper bound on max_tokens a request may ask for.")
    max_prompts_per_request: int = Field(
        64, ge=1, description="Most prompts one /v1/completions request may hold."
    )
    max_total_tokens_per_request: int = Field(
        65_536,
        ge=1,
        description="Most tokens one request may ask the engine to generate: prompts × n × max_tokens.",
    )
    max_concurrent_requests: int = Field(
        16, ge=1, description="Requests generating at once; more are answered 429 at once (retry later)."
    )
    tool_parser: Literal["hermes", "qwen3_coder", "llama3_json", "mistral", "harmony"] | None = Field(
        "hermes",
        description="How tool calls are read from the model's text on /v1/chat/completions "
        "(hermes: <tool_call>{json}</tool_call>; qwen3_coder: <function=f><parameter=a>; llama3_json; "
        "mistral: [TOOL_CALLS]; harmony: gpt-oss); null refuses tools unless tool_choice is none.",
    )
    reasoning_parser: Literal["think", "harmony"] | None = Field(
        None,
        description="How reasoning is split from the content on /v1/chat/completions, as reasoning_content "
        "(think: <think>...</think>, Qwen3 / DeepSeek-R1; harmony: gpt-oss's analysis channel); "
        "null leaves it in the content.",
    )
    session: SessionConfig = Field(
        default_factory=SessionConfig, description="Agent sessions (X-Session-Id calls)."
    )

    @model_validator(mode="after")
    def _harmony_together(self) -> HTTPConfig:
        """Harmony is one format for reasoning and calls: the other parser cannot read it."""
        pair = {"reasoning_parser": self.reasoning_parser, "tool_parser": self.tool_parser}
        if "harmony" in pair.values() and any(v not in ("harmony", None) for v in pair.values()):
            raise ValueError(
                f"rollout.http: reasoning_parser={self.reasoning_parser!r} with tool_parser={self.tool_parser!r}; "
                "gpt-oss's harmony format is read by harmony for both (or null for either)"
            )
        if self.tool_parser == "harmony" and self.reasoning_parser is None:
            raise ValueError(
                "rollout.http.tool_parser=harmony needs reasoning_parser: harmony (the format's channels are "
                "read together)"
            )
        return self

    @model_validator(mode="after")
    def _key_off_loopback(self) -> HTTPConfig:
        """The key falls back to ``$TANDEM_API_KEY``; a bind other hosts can reach needs one."""
        if self.api_key is None and (key := os.environ.get(API_KEY_ENV)):
            self.api_key = key
        if self.enabled and self.api_key is None and not is_loopback(self.host):
            raise ValueError(
                f"rollout.http.host={self.host!r} can be reached from other hosts, and the API has no key: "
                "anyone who reaches it could generate and, in a run, add training data. Set a key "
                f"(rollout.http.api_key, --api-key standalone, or the environment variable {API_KEY_ENV}), "
                "or bind to 127.0.0.1"
            )
        return self


API_KEY_ENV = "TANDEM_API_KEY"  # the HTTP API's key when rollout.http.api_key (or --api-key) is not set
ENGINE_API_KEY_ENV = "TANDEM_ENGINE_API_KEY"  # a managed vLLM/SGLang server's key when api_key is not set


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a server reachable from this host only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class RolloutConfig(Section):
    engine: Literal["hf", "vllm", "sglang"] = Field(
        "hf", description="Inference engine of each rollout server."
    )
    num_servers: int = Field(1, ge=1, description="How many rollout servers launch.py starts.")
    n_samples: int = Field(
        4, ge=1, description="Samples per prompt (one group; GRPO/RLOO normalise within it)."
    )
    prompts_per_batch: int = Field(
        4, ge=1, description="Prompt groups each server generates together in one engine call."
    )
    max_new_tokens: int = Field(32, ge=1, description="Maximum response length in tokens.")
    temperature: float = Field(
        1.0,
        ge=0,
        description="Sampling temperature (0 is greedy); behaviour logprobs are of the tempered distribution.",
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Top-k sampling (0 disables).")
    stop: list[str] = Field(
        default_factory=list, description="Stop strings; generation ends when one appears."
    )
    inflight_updates: bool = Field(
        True,
        description="hf engine: apply a pending weight update between decode steps, not only between batches.",
    )
    hf_prefix_cache_mb: float = Field(
        256,
        ge=0,
        description="hf engine: memory (MiB) for the KV of finished sequences, reused by a later call whose "
        "prompt extends one, so a multi-turn episode's next turn prefills only its new tokens (vLLM and SGLang "
        "cache prefixes themselves); least recently used first out, emptied by every weight update; 0 disables. "
        "Used by runs with several turns per episode (env.path, agent.path) and by the standalone server: a "
        "single-turn run never extends a finished sequence, so its engine keeps none (storing each row costs "
        "about 4% of generation on the tiny model).",
    )
    max_inflight_batches: int = Field(
        0,
        ge=0,
        description="Batches a server holds at once (claimed, not yet appended): with more than 1 the next "
        "batch generates while the last is scored and appended (on hf it joins the engine's running batch; "
        "2 pays where generation sets the pace). 0: 1 for hf (in-process, it shares the CPU), 3 for "
        "vllm/sglang (their own process). Always 1 when max_staleness is 0 (sync mode), with environment "
        "episodes played in rounds (env.progression), or without inflight_updates.",
    )
    threads: int = Field(
        0,
        ge=0,
        description="CPU threads per server (0: an equal share of the cores; in sync mode, of all of them).",
    )
    http: HTTPConfig = Field(default_factory=HTTPConfig, description="The server's OpenAI-compatible API.")
    vllm: VLLMConfig = Field(default_factory=VLLMConfig, description="Settings used when engine is vllm.")
    sglang: SGLangConfig = Field(
        default_factory=SGLangConfig, description="Settings used when engine is sglang."
    )


class EnvConfig(Section):
    """Multi-turn episodes against an environment (docs/environments.md §10). Off when ``path`` is null."""

    path: str | None = Field(
        None,
        description="The environment as module:Class (a rollout.envs.base.Env factory); null: single-turn.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments passed to the environment's constructor."
    )
    max_turns: int = Field(4, ge=1, description="Model turns per episode before it ends as length.")
    max_total_tokens: int = Field(
        256,
        ge=2,
        description="Prompt + every turn, in tokens; rollout.max_new_tokens bounds each model turn.",
    )
    step_timeout_s: float = Field(
        10.0, gt=0, description="An environment's reset/step/close taking longer ends its episode (abort)."
    )
    progression: Literal["auto", "rounds", "independent"] = Field(
        "auto",
        description="rounds: every live episode's turn in one engine call, then every environment step, in lockstep; independent: each episode takes its next turn as soon as its environment step returns, and the engine's running batch takes it in at its next step; auto: independent on vllm and sglang, rounds on hf (fewer, fuller forwards when the environment answers at once; independent wins when some steps are slow).",
    )
    gather_ms: float = Field(
        2.0,
        ge=0,
        description="independent progression: how long an idle hf engine waits after a turn arrives for the turns of the same moment to join it before its first step (vllm and sglang schedule themselves).",
    )


class AgentConfig(Section):
    """A black-box agent function trained in the run (docs/environments.md §10.9). Off when ``path`` is null."""

    path: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="The agent as module:function, async def agent(client, record, *, model, **kwargs) "
        "returning its reward (a number, or a dict of reward parts); run n times per prompt through the "
        "server's own OpenAI-compatible API, one session per episode. null: no agent.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments passed to every call of the agent function."
    )
    timeout_s: float = Field(
        60.0, gt=0, description="An episode whose agent has not returned by then ends (abort, agent_timeout)."
    )
    gather_ms: float = Field(
        5.0,
        ge=0,
        description="How long an idle hf engine waits after an agent's call arrives for the calls of the same moment to join it before its first step (vllm and sglang schedule themselves).",
    )


class RewardFunction(Section):
    path: str = Field(
        ...,
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="Dotted path module:function(prompt, completion, record) -> float | dict.",
    )
    weight: float = Field(1.0, description="Weight of this function in the total reward.")
    name: str | None = Field(
        None,
        min_length=1,
        description="Name of its reward parts (reward/<name> in metrics); null uses the module's last component.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments added to every call (a judge's base_url, model, rubric, ...); a relative serve path resolves like model paths.",
    )


class RewardConfig(Section):
    functions: list[RewardFunction] = Field(
        default_factory=list,
        description="Reward plug-ins (sync or async def) called per completion, summed with their weights.",
    )
    group_functions: list[RewardFunction] = Field(
        default_factory=list,
        description="Reward plug-ins called once per group as fn(prompt, completions, record), returning one score per completion; summed with their weights.",
    )
    timeout_s: float = Field(
        60.0,
        gt=0,
        description="A reward call (per completion or per group) not done by then scores 0 for its samples and counts in reward/timeouts.",
    )
    model_weight: float = Field(
        1.0, description="Weight of the reward model's score when model.reward_model is set."
    )
    clip: float | None = Field(
        None, gt=0, description="Clip the total reward to [-clip, clip]; null disables."
    )


class EvalConfig(Section):
    prompts: str | None = Field(
        None, description="JSONL of held-out prompts (same schema as data.prompts); null disables evaluation."
    )
    interval: int = Field(
        10, ge=1, description="Evaluate the weights of every version that is a multiple of this."
    )
    n_samples: int = Field(4, ge=1, description="Completions per held-out prompt (the k of pass@k).")
    temperature: float = Field(0.0, ge=0, description="Sampling temperature of evaluation (0 is greedy).")
    max_new_tokens: int | None = Field(
        None, ge=1, description="Response length limit; null uses rollout.max_new_tokens."
    )
    pass_threshold: float = Field(
        1.0, description="A completion passes (for pass@k) when its reward is at least this."
    )
