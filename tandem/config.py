"""The typed run configuration: one pydantic model per section, validated once at load.

A YAML file plus ``key.sub=value`` overrides becomes a :class:`Config`. Anything wrong (a missing file,
bad YAML, an unknown key, a wrong type, an out-of-range value) raises :class:`ConfigError` naming the
field path and the reason, before any process starts (docs/design.md §7, after prime-rl's config package).
Every field carries a one-line description; ``python -m tandem config-doc`` prints them all.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)


class ConfigError(ValueError):
    """A configuration problem, with the dotted path of the field at fault."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(Section):
    name: str = Field(
        "tiny",
        min_length=1,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="Run name; prefixes the run directory and every Redis key.",
    )
    seed: int = Field(0, ge=0, description="Base random seed; each process derives its own from it.")
    output_dir: str = Field("runs", description="Parent directory of run directories (runs/<name>-<time>/).")
    dir: str | None = Field(
        None,
        min_length=1,
        description="A fixed run directory instead of <output_dir>/<name>-<time>/ (its last part names the "
        "run): the same launch.py command then resumes the run there, if one was started, unless --fresh.",
    )
    mode: Literal["async", "sync"] = Field(
        "async", description="async overlaps generation and training; sync alternates them (the baseline)."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where models run: cuda when available under auto."
    )
    ready_timeout_s: float = Field(
        600.0, gt=0, description="How long launch.py waits for every process to report ready."
    )


class RedisConfig(Section):
    url: str | None = Field(
        None,
        description="External Redis URL (redis://[:password@]host:port/db); null starts an embedded redis-server.",
    )
    port: int = Field(
        0, ge=0, le=65535, description="Port of the embedded Redis; 0 picks a free loopback port."
    )
    stream_maxlen: int = Field(
        100_000,
        ge=16,
        description="Capacity of the trajectory stream; put() blocks (backpressure) rather than trim unconsumed data.",
    )
    claim_idle_ms: int = Field(
        60_000,
        ge=100,
        description="An entry pending this long on a dead consumer is claimed by another (XAUTOCLAIM).",
    )
    put_timeout_s: float = Field(
        300.0, gt=0, description="How long put() waits for room in a full stream before it raises."
    )
    max_traj_bytes: int = Field(
        64 << 20, ge=1024, description="Entries larger than this are dead-lettered instead of decoded."
    )


class ModelConfig(Section):
    actor: str = Field(
        ...,
        min_length=1,
        description="Path of the actor checkpoint (a Hugging Face directory); also the reference unless `reference` is set.",
    )
    reference: str | None = Field(
        None, description="Path of the frozen reference policy; null uses the actor's initial weights."
    )
    critic: str | None = Field(
        None,
        description="Path of the critic initialisation (a scalar-head checkpoint); null derives it per `critic_init`.",
    )
    reward_model: str | None = Field(
        None,
        description="Path of a scalar-head reward model scored on the rollout servers; null uses only reward functions.",
    )
    critic_init: Literal["reward_model", "actor"] = Field(
        "actor",
        description="When `critic` is null: start the critic from the reward model or the actor's trunk.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Parameter dtype: auto is bfloat16 on GPU and float32 on CPU."
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward to save memory."
    )
    trust_remote_code: bool = Field(
        False, description="Allow custom modelling code shipped inside a checkpoint directory."
    )


class DataConfig(Section):
    prompts: str = Field(
        ..., min_length=1, description="JSONL file of prompt records ({'prompt': ..., 'answer': ..., ...})."
    )
    prompt_field: str = Field("prompt", min_length=1, description="Record field holding the prompt text.")
    max_prompt_tokens: int = Field(
        512,
        ge=1,
        description="Prompts longer than this (in tokens) are rejected at load with their line number.",
    )
    epochs: int = Field(
        1000,
        ge=1,
        description="How many passes over the prompt file are queued (training stops at learner.total_steps first).",
    )
    shuffle: bool = Field(True, description="Shuffle prompts in each pass (seeded by run.seed).")
    chat_template: bool = Field(
        False, description="Wrap each prompt with the tokenizer's chat template before tokenising."
    )


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
    tool_parser: Literal["hermes"] | None = Field(
        "hermes",
        description="How tool calls are read from the model's text on /v1/chat/completions "
        "(hermes: <tool_call>{json}</tool_call>); null refuses tools unless tool_choice is none.",
    )


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
    """Multi-turn episodes against an environment (docs/design.md §10). Off when ``path`` is null."""

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
    """A black-box agent function trained in the run (docs/design.md §10.9). Off when ``path`` is null."""

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


class RewardConfig(Section):
    functions: list[RewardFunction] = Field(
        default_factory=list, description="Rule-based reward plug-ins, summed with their weights."
    )
    model_weight: float = Field(
        1.0, description="Weight of the reward model's score when model.reward_model is set."
    )
    clip: float | None = Field(
        None, gt=0, description="Clip the total reward to [-clip, clip]; null disables."
    )


class AlgorithmConfig(Section):
    """The ``ppo`` recipe: online PPO and its variants against the replay buffer (``learner/ppo.py``)."""

    recipe: Literal["ppo"] = Field(
        "ppo",
        description="Training recipe: ppo (online, rollout servers), sft, rm or dpo (offline, docs/stages.md).",
    )
    advantage: Literal["gae", "grpo", "rloo", "reinforce_pp"] = Field(
        "grpo", description="Advantage estimator; gae trains a critic."
    )
    gamma: float = Field(1.0, ge=0, le=1, description="Discount γ over response tokens (GAE).")
    lam: float = Field(0.95, ge=0, le=1, description="GAE λ.")
    eps_clip_low: float = Field(0.2, gt=0, lt=1, description="PPO clip ε_low: ratio lower bound 1-ε_low.")
    eps_clip_high: float = Field(
        0.28,
        gt=0,
        description="PPO clip ε_high: ratio upper bound 1+ε_high (asymmetric, DAPO's clip-higher).",
    )
    dual_clip: float | None = Field(
        None, gt=1, description="Dual-clip c (>1) bounding the loss for negative advantages; null disables."
    )
    is_cap: float = Field(
        5.0, gt=0, description="Truncation c of the importance weight exp(prox_logp - behav_logp)."
    )
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL penalty to the reference policy.")
    kl_target: float | None = Field(
        None,
        gt=0,
        description="Adaptive KL (Ziegler et al. 2019, learner/kl_control.py): steer kl_coef (its start) so"
        " that policy/kl stays near this; null keeps kl_coef fixed.",
    )
    kl_horizon: float = Field(
        10000.0,
        gt=0,
        description="Adaptive KL horizon: kl_coef moves by at most 20% per this many trajectories.",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator (Schulman's k1/k2/k3).")
    kl_in_reward: bool = Field(
        False, description="Fold the KL into the per-token reward (true) or add it as a loss term (false)."
    )
    credit: Literal["episode", "turn"] = Field(
        "episode",
        description="Multi-turn rewards: episode puts their sum on the last generated token; turn puts each turn's reward on that turn's last generated token, so gae and reinforce_pp credit turns separately.",
    )
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus weight.")
    vf_coef: float = Field(0.5, ge=0, description="Value-loss weight (gae only).")
    value_clip: float | None = Field(0.2, gt=0, description="Clip range of the value update; null disables.")
    max_staleness: int = Field(
        2,
        ge=0,
        description="Largest learner version minus the oldest token version that may be trained on; 0 is on-policy.",
    )
    batch_size: int = Field(
        16, ge=1, description="Trajectories per learner step (a multiple of rollout.n_samples)."
    )
    minibatch_size: int = Field(16, ge=1, description="Trajectories per optimizer step within a PPO epoch.")
    ppo_epochs: int = Field(1, ge=1, description="Passes over each batch.")
    sync_interval: int = Field(1, ge=1, description="Publish actor weights every this many learner steps.")
    normalize_std: bool = Field(True, description="GRPO: divide group-centred rewards by the group std.")
    dynamic_sampling: bool = Field(
        False,
        description="DAPO: drop groups whose rewards are all equal (zero group advantage) and generate fresh ones in their place.",
    )
    overlong_buffer: int | None = Field(
        None,
        ge=1,
        description="DAPO's soft overlong penalty: responses in the last this many tokens before rollout.max_new_tokens lose reward linearly; null disables.",
    )
    overlong_penalty: float = Field(
        1.0, ge=0, description="Reward lost by a response of exactly rollout.max_new_tokens tokens."
    )
    whiten_advantages: bool = Field(
        False,
        description="gae: whiten advantages over the batch's valid tokens (the critic's returns are not).",
    )
    prox_forward: Literal["auto", "always"] = Field(
        "auto",
        description="auto skips the no-grad proximal forward when a batch gets exactly one optimizer step "
        "(prox_logp = logp.detach(), the same math) and the KL is not in the reward; always runs it.",
    )

    @property
    def proximal_pass(self) -> bool:
        """Whether a step runs the actor's no-grad proximal forward. Not when the batch gets one optimizer
        step, which starts from the proximal policy (its forward with gradient computes the same numbers),
        unless the KL is folded into the reward and needed before the first backward."""
        one_step = self.ppo_epochs == 1 and self.minibatch_size == self.batch_size
        return not (self.prox_forward == "auto" and one_step and not (self.kl_in_reward and self.kl_coef > 0))


PPOConfig = AlgorithmConfig


class OfflineConfig(Section):
    """What every offline recipe (sft, rm, dpo) reads: a fixed JSONL dataset, its held-out split, early stop."""

    train_file: str = Field(
        ..., min_length=1, description="JSONL training set in the recipe's schema (docs/stages.md §2)."
    )
    eval_file: str | None = Field(
        None,
        description="Held-out JSONL set (same schema) for validation metrics and early stopping; null skips evaluation.",
    )
    batch_size: int = Field(32, ge=1, description="Examples (pairs for rm and dpo) per optimizer step.")
    epochs: int = Field(
        1, ge=1, description="Passes over train_file (training also stops at learner.total_steps)."
    )
    eval_interval: int = Field(
        20, ge=1, description="Evaluate on eval_file every this many steps, and once more at the end."
    )
    early_stop_patience: int = Field(
        0,
        ge=0,
        description="Stop after this many evaluations in a row without a better validation loss; 0 never stops early.",
    )
    max_tokens: int = Field(
        1024,
        ge=2,
        description="Examples longer than this (prompt + response tokens) are rejected at load, naming the line.",
    )
    chat_template: bool = Field(
        False,
        description="Wrap a prompt/response record's prompt as a user turn of the tokenizer's chat template (messages records always are).",
    )


class SFTConfig(OfflineConfig):
    """The ``sft`` recipe: supervised fine-tuning, loss on response tokens only (``learner/sft.py``)."""

    recipe: Literal["sft"] = Field(..., description="Training recipe: sft.")
    packing: bool = Field(
        False,
        description="Pack each micro-batch into one row (no padding; pays with a varlen attention kernel on GPU, ~9x slower on CPU).",
    )


class RMConfig(OfflineConfig):
    """The ``rm`` recipe: a Bradley–Terry reward model on chosen/rejected pairs (``learner/rm.py``)."""

    recipe: Literal["rm"] = Field(..., description="Training recipe: rm.")
    init: str | None = Field(
        None,
        description="Checkpoint the reward model starts from (a causal LM or scalar-head directory); null is model.actor.",
    )


class DPOConfig(OfflineConfig):
    """The ``dpo`` recipe: direct preference optimisation against a frozen reference (``learner/dpo.py``)."""

    recipe: Literal["dpo"] = Field(..., description="Training recipe: dpo.")
    beta: float = Field(0.1, gt=0, description="DPO β: the strength of the implicit KL to the reference.")
    label_smoothing: float = Field(
        0.0, ge=0, lt=0.5, description="Conservative DPO ε: the assumed rate of flipped preference labels."
    )


def _recipe_tag(value: Any) -> str:
    """The recipe of an ``algorithm`` section; ppo when the key is absent (every pre-recipe config)."""
    if isinstance(value, dict):
        return value.get("recipe", "ppo")
    return getattr(value, "recipe", "ppo")


Algorithm = Annotated[
    Union[  # noqa: UP007 (Tag annotations need the Union spelling)
        Annotated[AlgorithmConfig, Tag("ppo")],
        Annotated[SFTConfig, Tag("sft")],
        Annotated[RMConfig, Tag("rm")],
        Annotated[DPOConfig, Tag("dpo")],
    ],
    Discriminator(_recipe_tag),
]
OFFLINE_RECIPES = ("sft", "rm", "dpo")


class LoRAConfig(Section):
    rank: int = Field(
        0, ge=0, description="LoRA rank r of the actor's adapters (sft, dpo, ppo); 0 trains every weight."
    )
    alpha: float = Field(16.0, gt=0, description="LoRA α: the adapters' update is scaled by α/r.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description="Names of the linear layers that get adapters.",
    )
    modules_to_save: list[str] = Field(
        default_factory=list,
        description="Modules trained in full beside the adapters (name suffixes, e.g. norm: every RMSNorm); synced whole.",
    )
    sync: Literal["adapter", "merged"] = Field(
        "adapter",
        description="ppo: publish only the adapter tensors (hf engine applies W0 + B·A·α/r) or the merged full weights (any engine).",
    )
    merge_final: bool = Field(
        True,
        description="Write the final model with adapters merged (a plain HF directory); false writes the adapter alone.",
    )


class LearnerConfig(Section):
    total_steps: int = Field(
        100, ge=1, description="Learner steps (optimizer-version increments) before the run ends."
    )
    actor_lr: float = Field(1e-5, gt=0, description="Actor learning rate.")
    critic_lr: float = Field(1e-5, gt=0, description="Critic learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Gradient-norm clip.")
    micro_batch_size: int = Field(
        8, ge=1, description="Trajectories per forward/backward; minibatches accumulate micro-batches."
    )
    threads: int = Field(
        0,
        ge=0,
        description="CPU threads per learner rank (0: the cores the servers leave; in sync mode, all).",
    )
    save_hf_interval: int = Field(
        0,
        ge=0,
        description="ppo: also write the actor as a Hugging Face directory every this many versions, in"
        " <run>/snapshots/v<version> (the pipeline's gold-vs-proxy monitor reads them); 0 never.",
    )
    zero_stage: int = Field(0, ge=0, le=3, description="DeepSpeed ZeRO stage of actor and critic.")
    offload_optimizer: bool = Field(
        False,
        description="Keep optimizer state and step on CPU (ZeRO-Offload, zero_stage >= 1): pays on GPU when Adam state does not fit (docs/stages.md §6).",
    )
    num_ranks: int = Field(1, ge=1, description="Learner ranks (processes); >1 launches through torchrun.")
    take_timeout_s: float = Field(
        600.0, gt=0, description="How long a step waits for a batch before failing with a clear error."
    )
    checkpoint_interval: int = Field(
        50,
        ge=0,
        description="Checkpoint every this many steps (0: only at the end). Trained trajectories stay in Redis until the checkpoint holding their update is written (exactly-once).",
    )
    checkpoint_dir: str | None = Field(
        None, description="Where checkpoints go; null is <run dir>/checkpoints."
    )
    save_hf_final: bool = Field(
        True, description="Write the final actor as a Hugging Face directory for serving."
    )
    deepspeed: dict[str, Any] = Field(
        default_factory=dict,
        description="Raw DeepSpeed config merged over the generated one (for anything not modelled here).",
    )
    lora: LoRAConfig = Field(
        default_factory=LoRAConfig, description="LoRA adapters on the actor (docs/stages.md §5)."
    )
    chunked_head: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Log-probs (and PPO's entropy) from the hidden states a chunk of tokens at a time, never the whole (tokens, vocab) logits, in ppo, sft and dpo (docs/design.md §4.8): auto above chunked_head_threshold, on always, off never. Plain logits for a LoRA-adapted head.",
    )
    chunked_head_threshold: int = Field(
        1 << 26,
        ge=0,
        description="auto: the chunked head when vocab size x response tokens of a micro-batch (micro_batch_size x the batch's longest response, or max_tokens_per_micro_batch; the same on every rank) exceeds this (2^26 float32 logits are 256 MiB).",
    )
    chunked_head_chunk: int = Field(
        1 << 24,
        ge=1,
        description="Logits per chunk of the chunked head (tokens per chunk: this / vocab size, at least 1).",
    )
    max_tokens_per_micro_batch: int | None = Field(
        None,
        ge=1,
        description="Micro-batches by a token budget instead of micro_batch_size rows (pairs for rm and dpo): length-sorted rows share a forward pass while rows x longest (pad) or their total length (pack) stays within it. The loss is the same. Must hold the longest sequence the run can produce (checked); an over-budget trajectory that still arrives (an agent session has no cap) is masked out and counted in batch/over_budget (docs/design.md §4.8).",
    )

    @field_validator("chunked_head", mode="before")
    @classmethod
    def _on_off(cls, value: Any) -> Any:
        # YAML reads a bare on/off as true/false: `chunked_head: off` (or learner.chunked_head=off) means "off".
        return ("on" if value else "off") if isinstance(value, bool) else value


# The planner ranks every placement (placement/plan.py); these are the ones the processes run today, for a
# config to ask for and for placement.mode: auto to choose.
RUNNABLE_PLACEMENT: dict[str, tuple[str, ...]] = {
    "reference": ("learner", "learner_cpu", "server", "own"),
    "critic": ("learner", "own"),
    "reward_model": ("server", "own"),
    "scoring": ("serial", "split"),
}


class PlacementConfig(Section):
    """Where the run's models go (docs/design.md §11); ``python launch.py plan CONFIG`` ranks the choices."""

    mode: Literal["separate", "colocate", "auto"] | None = Field(
        None,
        description="separate: servers and learner on disjoint devices, overlapping; colocate: both on every device, taking turns (needs run.mode=sync); auto: profile both, then run the predicted best (sets run.mode). null follows run.mode (sync: colocate, async: separate).",
    )
    profile_steps: int = Field(
        10, ge=4, description="auto: learner steps of each of the two probe runs (the profile window)."
    )
    replan_every: int = Field(
        0,
        ge=0,
        description="auto: every this many learner steps, refit the cost laws to the run's own latest steps and move the run to a better placement (a clean stop, then a resume under it) when its predicted saving over the steps left beats twice the measured cost of moving; 0 never re-plans.",
    )
    generation_share: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="separate mode: the fraction of the devices (CPU threads) given to the rollout servers; null gives every process an equal share.",
    )
    aux_share: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="separate mode with a model placed own: the fraction of the devices (CPU threads) given to its worker; null gives it an equal share with every other process.",
    )
    reference: Literal["learner", "learner_cpu", "server", "own"] = Field(
        "learner",
        description="Where the reference runs (with kl_coef > 0): learner (resident on the learner's devices), learner_cpu (on the learner's CPU, moved to its devices for each pass), server (each rollout server holds a second model, the frozen reference, and scores every trajectory's ref_logp next to generation; the learner loads none), own (a reference worker on devices of its own scores every trajectory as it is appended, and the learner reads the numbers; separate mode).",
    )
    critic: Literal["learner", "own"] = Field(
        "learner",
        description="Where the critic scores and trains (with algorithm.advantage=gae): learner (in turn with the actor, on every learner thread); own (at once with the actor, on CPU threads of its own in the learner's process: placement.aux_share of the cores, split with any scoring worker; run.device=cpu, learner.num_ranks=1, separate mode).",
    )
    reward_model: Literal["server", "own"] = Field(
        "server",
        description="Where the reward model scores (with model.reward_model): server (next to generation); own (a reward model worker on devices of its own scores every single-turn trajectory as it is appended, and the learner adds the score to the reward; separate mode, no dynamic_sampling).",
    )
    scoring: Literal["serial", "split"] = Field(
        "serial",
        description="The learner's no-grad forwards of a batch (proximal actor, reference, critic): serial (each on every device in turn); split (each at once on its own share of the learner's CPU threads; one learner rank on CPU).",
    )
    release_memory: bool = Field(
        True,
        description="colocate: each side frees its memory while the other runs (docs/design.md §11.1). The rollout servers' engines sleep while the learner trains (weights and KV cache freed; woken as weights, then the next version's weights, then KV cache) and the learner offloads optimizer state, gradients and master weights while the servers generate (DeepSpeed offload_states: GPU, zero_stage >= 1). Needs full weights over the shm transport (a server that wakes without a new version reloads its own from there); ignored when separate.",
    )

    @model_validator(mode="after")
    def _runnable(self) -> PlacementConfig:
        for name, runnable in RUNNABLE_PLACEMENT.items():
            if (value := getattr(self, name)) not in runnable:
                raise ValueError(
                    f"placement.{name}={value} is predicted by `launch.py plan` but not yet run by the "
                    f"processes; use {' or '.join(runnable)}"
                )
        return self


class WeightSyncConfig(Section):
    transport: Literal["shm", "dist"] = Field(
        "shm", description="shm: safetensors in a shared directory; dist: torch.distributed broadcast."
    )
    shm_dir: str | None = Field(
        None,
        description="Directory of the shm transport; null is /dev/shm/tandem-<run> (falls back to the run dir).",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="dist backend: auto is nccl on GPU, gloo on CPU."
    )
    bucket_mb: int = Field(
        256, ge=1, description="dist: tensors are packed into buckets of this many MiB per broadcast."
    )
    timeout_s: float = Field(
        300.0,
        gt=0,
        description="Longest wait for a rendezvous, a broadcast or a file before failing with the peer and version named.",
    )
    checksum: bool = Field(True, description="Verify per-tensor checksums on receipt (shm).")
    keep_versions: int | None = Field(
        None,
        ge=1,
        description="shm: versions kept on disk besides those a live subscriber holds; null: 2, or 1 when"
        " the run releases memory (placement.release_memory, colocated), which also deletes retired files"
        " rather than rewriting them.",
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


class LoggingConfig(Section):
    wandb_mode: Literal["online", "offline", "disabled"] = Field(
        "offline", description="wandb mode; offline needs no account."
    )
    wandb_project: str = Field("tandem", min_length=1, description="wandb project.")
    log_interval: int = Field(1, ge=1, description="Log learner metrics every this many steps.")
    console: bool = Field(True, description="Show the live progress view in launch.py.")
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="Python log level of every process."
    )


class ClusterConfig(Section):
    """Placement on a Ray cluster (``launch.py --ray``; docs/ray.md). The local backend ignores it."""

    learner_nodes: int = Field(
        1, ge=1, description="Nodes the learner's ranks spread over (learner.num_ranks must divide evenly)."
    )
    learner_cpus: float = Field(1.0, gt=0, description="CPUs reserved per learner rank.")
    learner_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each learner node must offer, e.g. {learner: 1} (one bundle per node).",
    )
    server_cpus: float = Field(1.0, gt=0, description="CPUs reserved per rollout server.")
    server_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each rollout server takes, e.g. {rollout: 1}.",
    )
    aux_cpus: float = Field(
        1.0,
        gt=0,
        description="CPUs reserved for each scoring worker (placement.reference or placement.reward_model: own).",
    )
    aux_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each scoring worker takes (placement.reference or placement.reward_model: own), e.g. {aux: 1}.",
    )
    redis_host: str | None = Field(
        None,
        description="Address the embedded Redis binds to under Ray; null: the head node's Ray address (never 0.0.0.0 unless set).",
    )
    start_timeout_s: float = Field(
        600.0, gt=0, description="How long to wait for the placement group and the actors to be scheduled."
    )
    placement: dict[str, str] = Field(
        default_factory=dict,
        description="Written by the launcher, not by you: process -> node, recorded in wandb and summary.json.",
    )


class SupervisionConfig(Section):
    """How launch.py restarts what crashes, per role (docs/design.md §6.3): Redis, the learner, each server.

    A role that crashes more than its limit within ``window_s`` seconds stops the run; the k-th restart
    in a row waits ``min(backoff_max_s, backoff_s * 2**(k-1))``.
    """

    server_restarts: int = Field(
        5, ge=0, le=1000, description="Restarts of one rollout server allowed within window_s (0: none)."
    )
    learner_restarts: int = Field(
        3, ge=0, le=1000, description="Restarts of the learner (with --resume) allowed within window_s."
    )
    redis_restarts: int = Field(
        3,
        ge=0,
        le=1000,
        description="Restarts of the embedded redis-server (from its AOF) within window_s; an external redis.url is never restarted.",
    )
    window_s: float = Field(
        600.0, gt=0, le=86_400, description="The sliding window, in seconds, over which restarts are counted."
    )
    backoff_s: float = Field(
        1.0,
        ge=0,
        le=600,
        description="Wait before the first restart of a role; doubles per restart in the window.",
    )
    backoff_max_s: float = Field(30.0, ge=0, le=3600, description="Longest wait before a restart.")
    reconnect_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="How long every client keeps retrying a lost Redis connection (a restart) before it fails.",
    )


class PrepareStep(Section):
    """One step that makes a run's inputs (a data file, a model, a warm start, an earlier stage): launch.py
    runs it first unless every path it produces exists (launcher/prepare.py)."""

    name: str = Field(..., min_length=1, description="What the step makes, shown in its progress line.")
    command: list[str] = Field(
        ...,
        min_length=1,
        description="The command as an argument list, run from the working directory (where relative "
        "config paths resolve); a leading `python` is the interpreter running launch.py.",
    )
    produces: list[str] = Field(
        ...,
        min_length=1,
        description="The paths the command makes, each an argument of the command (or its `KEY=PATH` "
        "value): it writes them under a temporary name, renamed when the command succeeds.",
    )
    reduced: list[str] = Field(
        default_factory=list,
        description="Arguments appended at reduced size (TANDEM_PREPARE=reduced, as the tests run), "
        "e.g. [--steps, '5']; later flags override earlier ones.",
    )

    @model_validator(mode="after")
    def _produces_in_command(self) -> PrepareStep:
        for path in self.produces:
            if not any(a == path or a.endswith(f"={path}") for a in self.command[1:]):
                raise ValueError(
                    f"produces {path!r} is not an argument of the command: the runner writes it under a "
                    "temporary name and renames it when the command succeeds, so a partial one never counts"
                )
        return self


class Config(Section):
    run: RunConfig = Field(default_factory=RunConfig, description="Run identity and mode.")
    redis: RedisConfig = Field(default_factory=RedisConfig, description="The buffer and control plane.")
    model: ModelConfig = Field(..., description="Checkpoints, all loaded by path.")
    data: DataConfig = Field(..., description="The prompt dataset.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Rollout servers.")
    env: EnvConfig = Field(default_factory=EnvConfig, description="Multi-turn environment (off by default).")
    agent: AgentConfig = Field(default_factory=AgentConfig, description="Black-box agent (off by default).")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Reward functions and model.")
    algorithm: Algorithm = Field(
        default_factory=AlgorithmConfig,
        description="The training recipe and its settings: ppo (default) or the offline sft, rm, dpo.",
    )
    learner: LearnerConfig = Field(default_factory=LearnerConfig, description="The DeepSpeed learner.")
    weightsync: WeightSyncConfig = Field(
        default_factory=WeightSyncConfig, description="Actor-weight broadcast."
    )
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Held-out evaluation on the servers.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Console, logs and wandb.")
    placement: PlacementConfig = Field(
        default_factory=PlacementConfig,
        description="Devices of generation and learning, and where each model runs.",
    )
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="Placement on a Ray cluster.")
    supervision: SupervisionConfig = Field(
        default_factory=SupervisionConfig, description="Restarts of crashed processes and Redis reconnects."
    )
    prepare: list[PrepareStep] = Field(
        default_factory=list,
        description="Steps that make the run's inputs, in order, before it starts: each a name, command, "
        "produces and reduced (launcher/prepare.py); skipped when all its paths exist.",
    )

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        a, r = self.algorithm, self.rollout
        if self.placement.mode == "colocate" and self.run.mode != "sync":
            raise ValueError(
                "placement.mode=colocate takes turns on the same devices, which needs run.mode=sync "
                "(max_staleness 0: the servers generate one batch per version, never while the learner trains)"
            )
        if self.reference_scorer == "own" and self.placement_mode == "colocate":
            raise ValueError(
                "placement.reference=own gives the reference devices of its own, beside generation and "
                "learning; colocated (run.mode=sync or placement.mode=colocate) every device is shared: use "
                "placement.reference=learner or server there"
            )
        if self.placement.critic == "own":
            if self.algorithm.advantage != "gae":
                raise ValueError("placement.critic=own needs a critic: algorithm.advantage=gae")
            if self.placement_mode == "colocate":
                raise ValueError(
                    "placement.critic=own gives the critic threads of its own, beside the actor's; colocated "
                    "(run.mode=sync or placement.mode=colocate) every device is shared: use "
                    "placement.critic=learner there"
                )
            if self.run.device == "cuda" or self.learner.num_ranks > 1:
                raise ValueError(
                    "placement.critic=own trains the critic beside the actor on CPU threads of its own in "
                    "the learner's process: it needs run.device=cpu and learner.num_ranks=1 (on devices, "
                    "critic ranks of their own are predicted by `launch.py plan` but not yet run)"
                )
        if self.placement.reward_model == "own":
            if self.model.reward_model is None:
                raise ValueError(
                    "placement.reward_model=own needs model.reward_model (the checkpoint it scores with)"
                )
            if self.placement_mode == "colocate":
                raise ValueError(
                    "placement.reward_model=own gives the reward model devices of its own, beside generation "
                    "and learning; colocated (run.mode=sync or placement.mode=colocate) every device is "
                    "shared: use placement.reward_model=server there"
                )
            if a.dynamic_sampling:
                raise ValueError(
                    "algorithm.dynamic_sampling drops groups of equal rewards on the rollout servers, before "
                    "an own reward model's score exists: use placement.reward_model=server with it"
                )
        if self.placement.scoring == "split" and (self.run.device == "cuda" or self.learner.num_ranks > 1):
            raise ValueError(
                "placement.scoring=split runs the learner's scoring forwards at once on shares of its CPU "
                "threads: it needs run.device=cpu and learner.num_ranks=1 (on devices, disjoint device groups "
                "are the own placements, which `launch.py plan` predicts but runs do not yet use)"
            )
        if self.learner.offload_optimizer and self.learner.zero_stage == 0:
            raise ValueError(
                "learner.offload_optimizer needs learner.zero_stage >= 1 (ZeRO-Offload; DeepSpeed ignores it at stage 0)"
            )
        self._budget_check()
        if a.recipe in OFFLINE_RECIPES:
            return self._offline_checks()
        if a.batch_size % r.n_samples:
            raise ValueError(
                f"algorithm.batch_size ({a.batch_size}) must be a multiple of rollout.n_samples ({r.n_samples}) so groups stay whole"
            )
        if a.batch_size % a.minibatch_size:
            raise ValueError(
                f"algorithm.batch_size ({a.batch_size}) must be a multiple of algorithm.minibatch_size ({a.minibatch_size})"
            )
        if a.advantage in ("grpo", "rloo") and r.n_samples < 2:
            raise ValueError(
                f"algorithm.advantage={a.advantage} needs rollout.n_samples >= 2 (got {r.n_samples})"
            )
        if self.env.path is not None and self.agent.path is not None:
            raise ValueError("env.path and agent.path are exclusive: an episode is either one or the other")
        if (
            not self.reward.functions
            and self.model.reward_model is None
            and self.env.path is None
            and self.agent.path is None
        ):
            raise ValueError(
                "reward: give at least one reward.functions entry, a model.reward_model, an env.path or an "
                "agent.path"
            )
        if a.overlong_buffer is not None and a.overlong_buffer > r.max_new_tokens:
            raise ValueError(
                f"algorithm.overlong_buffer ({a.overlong_buffer}) must be <= rollout.max_new_tokens ({r.max_new_tokens})"
            )
        lora = self.learner.lora
        if lora.rank and lora.sync == "adapter" and r.engine != "hf":
            raise ValueError(
                f"learner.lora.sync=adapter needs rollout.engine=hf (got {r.engine}): only the hf engine applies "
                "adapter-only updates; use learner.lora.sync=merged"
            )
        if a.sync_interval > self.max_staleness + 1:
            why = "run.mode=sync trains on-policy (max_staleness 0)" if self.run.mode == "sync" else ""
            raise ValueError(
                f"algorithm.sync_interval ({a.sync_interval}) must be <= max_staleness + 1 "
                f"({self.max_staleness + 1}{'; ' + why if why else ''}): weights published every "
                f"{a.sync_interval} steps make data up to {a.sync_interval - 1} versions stale, which the "
                "servers' freshness check and the learner's staleness filter refuse"
            )
        if a.minibatch_size % min(self.learner.micro_batch_size, a.minibatch_size):
            raise ValueError(
                f"algorithm.minibatch_size ({a.minibatch_size}) must be a multiple of learner.micro_batch_size ({self.learner.micro_batch_size})"
            )
        if a.credit == "turn" and a.advantage not in ("gae", "reinforce_pp"):
            raise ValueError(
                f"algorithm.credit=turn places rewards on tokens, which only the per-token estimators read "
                f"(gae, reinforce_pp); algorithm.advantage={a.advantage} scores whole sequences"
            )
        return self

    def _budget_check(self) -> None:
        """A token budget below the longest sequence the run can produce would leave that sequence out of
        training (docs/design.md §4.8): refuse it here, naming where the length comes from. Agent sessions
        have no token cap; one over the budget is masked out at run time and counted."""
        budget, a = self.learner.max_tokens_per_micro_batch, self.algorithm
        if budget is None or (a.recipe == "ppo" and self.agent.path is not None):
            return
        if a.recipe in ("rm", "dpo"):  # both sequences of a pair share a forward pass
            longest, source = (
                2 * a.max_tokens,
                f"2 x algorithm.max_tokens ({a.max_tokens}; a pair's two sequences share a pass)",
            )
        elif a.recipe == "sft":
            longest, source = a.max_tokens, "algorithm.max_tokens"
        elif self.env.path is not None:
            e, p = self.env.max_total_tokens, self.data.max_prompt_tokens
            longest = max(e, p)
            source = (
                "env.max_total_tokens" if e >= p else "data.max_prompt_tokens (above env.max_total_tokens)"
            )
        else:
            p, n = self.data.max_prompt_tokens, self.rollout.max_new_tokens
            longest, source = p + n, f"data.max_prompt_tokens ({p}) + rollout.max_new_tokens ({n})"
        if budget < longest:
            raise ValueError(
                f"learner.max_tokens_per_micro_batch ({budget}) is below the longest sequence this run can "
                f"produce, {source} = {longest}: a longer one would not fit a forward pass; raise the budget or "
                "lower that limit"
            )

    def _offline_checks(self) -> Config:
        a = self.algorithm
        if a.batch_size % min(self.learner.micro_batch_size, a.batch_size):
            raise ValueError(
                f"algorithm.batch_size ({a.batch_size}) must be a multiple of learner.micro_batch_size ({self.learner.micro_batch_size})"
            )
        return self

    @property
    def recipe(self) -> str:
        return self.algorithm.recipe

    @property
    def placement_mode(self) -> Literal["separate", "colocate"]:
        """The placement in force: ``placement.mode``, or what ``run.mode`` implies (sync takes turns)."""
        if self.placement.mode in ("separate", "colocate"):
            return self.placement.mode
        return "colocate" if self.run.mode == "sync" else "separate"  # auto: until launch.py resolves it

    @property
    def reference_scorer(self) -> Literal["learner", "server", "own"] | None:
        """Who computes the reference log-probabilities (docs/design.md §11.1): None without one (no KL
        penalty, or not PPO); else the learner (``placement.reference`` learner or learner_cpu), the rollout
        servers, or the reference worker (``own``)."""
        if self.algorithm.recipe != "ppo" or self.algorithm.kl_coef <= 0:
            return None
        at = self.placement.reference
        return "learner" if at == "learner_cpu" else at

    @property
    def critic_own(self) -> bool:
        """The critic scores and trains beside the actor on threads of its own (``placement.critic: own``)."""
        return self.placement.critic == "own" and self.algorithm.advantage == "gae"

    @property
    def own_scorers(self) -> list[str]:
        """The roles that score the stream on workers of their own (rollout/scoring_worker.py), in the
        order the learner reads their scores: ``reference``, ``reward_model``."""
        own = ["reference"] if self.reference_scorer == "own" else []
        if self.model.reward_model is not None and self.placement.reward_model == "own":
            own.append("reward_model")
        return own

    @property
    def max_staleness(self) -> int:
        """The staleness bound in force: ``algorithm.max_staleness``, or 0 in sync mode (on-policy).

        Every process reads it here, so sync mode is the same code path with one number changed.
        """
        if self.run.mode == "sync" or self.algorithm.recipe != "ppo":
            return 0
        return self.algorithm.max_staleness

    @property
    def episode_progression(self) -> Literal["rounds", "independent"]:
        """``env.progression`` with ``auto`` resolved: independent on vllm and sglang, whose schedulers run
        beside this process; rounds on hf, whose every forward is paid on the server's own cores, so turns
        that arrive together and stay in step (an environment that answers at once) decode in fewer, fuller
        forwards than turns joining the batch one by one (docs/benchmarks.md, ``bench/episodes.py``)."""
        p = self.env.progression
        if p == "auto":
            return "rounds" if self.rollout.engine == "hf" else "independent"
        return p

    @property
    def releases_memory(self) -> bool:
        """Whether each colocated side frees its memory while the other runs (docs/design.md §11.1):
        ``placement.release_memory``, colocated, with full weights over shm, which refill a woken engine and
        which it can read again. Adapter-only updates (``learner.lora.sync: adapter``) refill only the
        adapted layers, so their servers keep their weights."""
        adapter_only = self.learner.lora.rank > 0 and self.learner.lora.sync == "adapter"
        return (
            self.placement_mode == "colocate"
            and self.placement.release_memory
            and self.weight_path == "shm"
            and not adapter_only
        )

    @property
    def weight_path(self) -> Literal["shm", "dist", "engine"]:
        """How weights reach the engines (docs/design.md §5): ``shm`` files a server maps, a ``dist``
        broadcast a server receives, or ``engine``: the learner pushes straight into vLLM/SGLang over their
        own NCCL groups (``weightsync.transport: dist`` with such an engine)."""
        if self.weightsync.transport == "dist" and self.rollout.engine in ("vllm", "sglang"):
            return "engine"
        return self.weightsync.transport

    def resolve_paths(self, base: Path) -> Config:
        """Make relative file paths (checkpoints, prompts) absolute against ``base`` (the YAML's folder's parent project)."""

        def fix(p: str | None) -> str | None:
            if p is None or os.path.isabs(p):
                return p
            return str((base / p).resolve())

        m = self.model
        update = {
            "model": m.model_copy(
                update={k: fix(getattr(m, k)) for k in ("actor", "reference", "critic", "reward_model")}
            ),
            "data": self.data.model_copy(update={"prompts": fix(self.data.prompts)}),
            "eval": self.eval.model_copy(update={"prompts": fix(self.eval.prompts)}),
        }
        a = self.algorithm
        if a.recipe in OFFLINE_RECIPES:
            files = {k: fix(getattr(a, k)) for k in ("train_file", "eval_file")}
            if a.recipe == "rm":
                files["init"] = fix(a.init)
            update["algorithm"] = a.model_copy(update=files)
        return self.model_copy(update=update)


# --------------------------------------------------------------------------------------------- loading


def format_validation_error(err: ValidationError, source: str) -> str:
    """pydantic's errors as the user wrote the config: one line per field (its dotted path, the reason
    and the value given), under a head naming ``source``. Every config loader raises it as ConfigError."""
    lines = []
    for e in err.errors():
        loc = list(e["loc"])
        if loc[:1] == ["algorithm"] and len(loc) > 1 and loc[1] in ("ppo", *OFFLINE_RECIPES):
            del loc[1]  # the union's tag: the user wrote algorithm.x, not algorithm.ppo.x
        path = ".".join(str(p) for p in loc) or "<root>"
        msg = e["msg"]
        if e["type"] == "union_tag_invalid":  # the discriminator names its own field
            path, msg = (
                f"{path}.recipe",
                f"unknown recipe {e['ctx']['tag']!r}; choose from {e['ctx']['expected_tags']}",
            )
            lines.append(f"{path}: {msg}")
            continue
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        got = e.get("input")
        shown = (
            "" if e["type"] in ("extra_forbidden", "missing") or isinstance(got, dict) else f" (got {got!r})"
        )
        if not e["loc"]:  # a cross-field check: its message starts with the field it names
            lines.append(msg.removeprefix("Value error, "))
            continue
        lines.append(f"{path}: {msg}{shown}")
    return f"invalid config {source}:\n  " + "\n  ".join(lines)


def _parse_scalar(text: str) -> Any:
    """An override value is parsed as YAML so `x=3`, `x=0.5`, `x=true`, `x=null`, `x=[a,b]` all work."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` overrides to a raw config dict (before validation)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key.sub=value")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override {item!r}: empty key segment")
        node = raw
        for i, p in enumerate(parts[:-1]):
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r}: {'.'.join(parts[: i + 1])} is not a section")
            node = nxt
        node[parts[-1]] = _parse_scalar(value)
    return raw


def load_config(
    path: str | os.PathLike[str] | None,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    raw: dict[str, Any] | None = None,
) -> Config:
    """Load, override and validate a config. Raises ConfigError naming the field and reason.

    Relative paths in ``model`` and ``data`` are resolved against the current directory (where launch.py
    runs), so the shipped configs work from the repo root.
    """
    source = str(path) if path is not None else "<dict>"
    if raw is None:
        if path is None:
            raise ConfigError("no config file given")
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {source}: not found")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {source}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {source}: top level must be a mapping of sections")
    raw = apply_overrides(_deepcopy(raw), list(overrides))
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source)) from None
    return cfg.resolve_paths(Path.cwd())


def _deepcopy(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _deepcopy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deepcopy(v) for v in d]
    return d


# user:password@ (or :password@) in any URL, e.g. redis://:secret@host:6379/0.
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^:@/\s]*):[^@/\s]+@")
REDACTED = "***"


def redact(text: str) -> str:
    """``text`` with the password of every URL in it replaced, for logs and error messages."""
    return _URL_CREDENTIALS.sub(rf"\g<scheme>\g<user>:{REDACTED}@", text)


def public_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain data with every secret (URL passwords, API keys) redacted: what wandb records."""
    data = cfg.model_dump(mode="json")
    if data["redis"]["url"] is not None:
        data["redis"]["url"] = redact(data["redis"]["url"])
    for section in (data["rollout"]["http"], data["rollout"]["vllm"], data["rollout"]["sglang"]):
        if section.get("api_key") is not None:
            section["api_key"] = REDACTED
    return data


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML (written into the run directory and passed to child processes)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` for its owner only (mode 0600 from creation on: it holds a secret, a
    Redis password), atomically: a reader sees the old file or the whole new one, never half a secret."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)  # O_EXCL below: a leftover must not lend its mode
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(text)
    os.replace(tmp, path)


def describe_fields(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(path, default, description) for every field; the README's config table is generated from this."""
    rows: list[tuple[str, str, str]] = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, Section):
            rows.extend(describe_fields(ann, path + "."))
            continue
        if get_origin(ann) is Union and all(_is_section(a) for a in get_args(ann)):
            rows.extend(_describe_union([_section_of(a) for a in get_args(ann)], path + "."))
            continue
        default = "required" if field.is_required() else repr(field.get_default(call_default_factory=True))
        rows.append((path, default, field.description or ""))
    return rows


def _section_of(ann: Any) -> Any:
    return get_args(ann)[0] if get_origin(ann) is Annotated else ann


def _is_section(ann: Any) -> bool:
    cls = _section_of(ann)
    return isinstance(cls, type) and issubclass(cls, Section)


def _describe_union(members: list[type[BaseModel]], prefix: str) -> list[tuple[str, str, str]]:
    """A discriminated union's fields, each once, each description prefixed by the recipes that read it."""
    seen: dict[str, dict[tuple[str, str], list[str]]] = {}
    for member in members:
        recipe = get_args(member.model_fields["recipe"].annotation)[0]
        for path, default, desc in describe_fields(member, prefix):
            if path.endswith(".recipe"):
                default, desc = "'ppo'", "Training recipe: ppo (default), sft, rm or dpo (docs/stages.md)."
            seen.setdefault(path, {}).setdefault((default, desc), []).append(recipe)
    rows = []
    for path, variants in seen.items():
        if len(variants) == 1 and len(next(iter(variants.values()))) == len(members):
            (default, desc), _ = next(iter(variants.items()))
            rows.append((path, default, desc))
            continue
        defaults = " / ".join(dict.fromkeys(d for d, _ in variants))
        desc = " ".join(f"[{', '.join(r)}] {d}" for (_, d), r in variants.items())
        rows.append((path, defaults, desc))
    return rows
