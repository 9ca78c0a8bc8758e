"""The run itself: its identity and mode, the Redis it talks through, the checkpoints and prompts it
loads, its logging, how launch.py supervises its processes, and the steps that make its inputs first.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tandem.config.base import Section


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
    teacher: str | None = Field(
        None,
        description="Path of the teacher of algorithm.distill (same tokenizer as the actor); null without distillation.",
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
    freeze_vision: bool = Field(
        True,
        description="A vision-language actor: keep its vision tower's weights fixed (only the language model "
        "trains); false trains the tower too. No effect on a text model.",
    )


class DataConfig(Section):
    prompts: str = Field(
        ..., min_length=1, description="JSONL file of prompt records ({'prompt': ..., 'answer': ..., ...})."
    )
    prompt_field: str = Field("prompt", min_length=1, description="Record field holding the prompt text.")
    max_prompt_tokens: int = Field(
        512,
        ge=1,
        description="Prompts longer than this (in tokens) are bad records (data.on_bad_record), named by "
        "their line at load; with rollout.max_new_tokens it must fit the model's context.",
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
    on_bad_record: Literal["refuse", "skip"] = Field(
        "refuse",
        description="A prompt record that cannot be used (not tokenisable, longer than max_prompt_tokens): "
        "refuse stops launch.py naming its file and line; skip sets it aside in "
        "<run dir>/rejected_prompts.jsonl with its reason, counted as data/rejected in summary.json.",
    )


class LoggingConfig(Section):
    wandb_mode: Literal["online", "offline", "disabled"] = Field(
        "offline", description="wandb mode; offline needs no account."
    )
    wandb_project: str = Field("tandem", min_length=1, description="wandb project.")
    log_interval: int = Field(1, ge=1, description="Log learner metrics every this many steps.")
    samples_interval: int = Field(
        0,
        ge=0,
        description="Every this many learner steps, samples_count trained prompts, completions and rewards go to <run dir>/samples.jsonl and a wandb table (samples); 0 disables.",
    )
    samples_count: int = Field(
        4, ge=1, description="Trajectories drawn from the batch each samples_interval."
    )
    console: bool = Field(True, description="Show the live progress view in launch.py.")
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="Python log level of every process."
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
