"""The learner's side of training whatever the recipe: steps, optimizer, DeepSpeed and checkpoints, its
LoRA adapters, and how the actor's weights reach the rollout servers (weight sync).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from tandem.config.base import Section, SectionCheckError
from tandem.config.rollout import RewardFunction


class AdapterRun(Section):
    """One of several LoRA adapters trained at once on one base model (``learner.lora.adapters``): a run of
    its own on the shared servers and learner process (docs/stages.md §5.1)."""

    name: str = Field(
        ...,
        pattern=r"^[A-Za-z0-9_-]+$",
        description="The adapter's name: its run is <run.name>.<name> (Redis keys, wandb run), its directory <run dir>/adapters/<name>.",
    )
    prompts: str | None = Field(
        None, min_length=1, description="Its prompt dataset (JSONL); null: data.prompts."
    )
    reward: list[RewardFunction] | None = Field(
        None, min_length=1, description="Its reward functions; null: reward.functions."
    )
    actor_lr: float | None = Field(None, gt=0, description="Its learning rate; null: learner.actor_lr.")
    seed: int | None = Field(
        None, ge=0, description="Its random seed (its adapter's initial A); null: run.seed."
    )


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
        description="ppo: publish only the adapter tensors (hf applies W0 + B·A·α/r; vllm loads a LoRA per version, shm only) or the merged full weights (any engine).",
    )
    merge_final: bool = Field(
        True,
        description="Write the final model with adapters merged (a plain HF directory); false writes the adapter alone.",
    )
    adapters: list[AdapterRun] = Field(
        default_factory=list,
        description="ppo on the hf engine: several adapters trained at once, each its own run (prompts, rewards, stream, admission, weight sync, checkpoints, wandb run) on the shared servers, whose batches mix their rows; [] trains one (docs/stages.md §5.1).",
    )

    @field_validator("adapters")
    @classmethod
    def _distinct_names(cls, adapters: list[AdapterRun]) -> list[AdapterRun]:
        names = [a.name for a in adapters]
        if twice := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"adapter names must differ; given more than once: {twice}")
        return adapters


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
    moe_aux_loss_coef: float = Field(
        0.0,
        ge=0,
        description="Mixture-of-experts actor: weight of the router's load-balancing loss (transformers' load_balancing_loss_func) added to the policy loss; 0 leaves routing to the RL loss alone (docs/design.md §4.11).",
    )
    offload_optimizer: bool = Field(
        False,
        description="Keep optimizer state and step on CPU (ZeRO-Offload, zero_stage >= 1): pays on GPU when Adam state does not fit (docs/stages.md §6).",
    )
    num_ranks: int = Field(1, ge=1, description="Learner ranks (processes); >1 launches through torchrun.")
    sequence_parallel: int = Field(
        1,
        ge=1,
        description="Ranks that split each sequence's positions between them (DeepSpeed's Ulysses attention over heads; the num_ranks / this data-parallel groups split a batch's rows). Must divide num_ranks and the actor's attention heads. The ppo recipe, the pad layout, no LoRA, no mixture-of-experts or vision-language actor (docs/design.md §4.12).",
    )
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
    checkpoint_async: bool = Field(
        False,
        description="Online learner: copy the checkpoint to host memory and write it on a thread while training goes on; acks wait until it is durable. Off by default: the copy holds a second full training state (weights and optimizer) in host memory per rank (docs/design.md §6.2).",
    )
    checkpoint_timeout_s: float = Field(
        6 * 3600.0,
        gt=0,
        description="learner.checkpoint_async: a write still going after this many seconds is taken as hung (a dead network mount); the learner stops with an error naming the folder, and the previous committed checkpoint stays the one to resume from.",
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

    @model_validator(mode="after")
    def _offload_needs_zero(self) -> LearnerConfig:
        if self.offload_optimizer and self.zero_stage == 0:
            raise SectionCheckError(
                "learner.offload_optimizer needs learner.zero_stage >= 1 (ZeRO-Offload; DeepSpeed ignores it at stage 0)"
            )
        return self

    @model_validator(mode="after")
    def _sequence_parallel_divides_the_ranks(self) -> LearnerConfig:
        sp = self.sequence_parallel
        if sp > 1 and self.num_ranks % sp:
            raise SectionCheckError(
                f"learner.sequence_parallel ({sp}) must divide learner.num_ranks ({self.num_ranks}): each "
                "sequence-parallel group is that many ranks"
            )
        return self


class WeightSyncConfig(Section):
    transport: Literal["shm", "dist"] = Field(
        "shm", description="shm: safetensors in a shared directory; dist: torch.distributed broadcast."
    )
    shm_dir: str | None = Field(
        None,
        description="Directory of the shm transport; null makes /dev/shm/tandem-<run>-<random> (mode 0700; falls back to the run dir).",
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
