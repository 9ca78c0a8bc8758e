"""The learner's models: actor and critic as DeepSpeed engines, a frozen reference, and their forward passes.

What this module owns and why it looks the way it does:

- **Distributed setup.** One process per rank (torchrun, or a plain ``python -m`` for one rank, for which
  the usual ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/... variables get single-process defaults). gloo on
  CPU, nccl on GPU. A second, always-gloo group carries control messages (the batch bytes, the stop flag)
  so they never need device tensors.
- **Engines.** Actor and critic are ``deepspeed.initialize`` engines with ZeRO stage 0–3, optional
  optimizer offload and gradient checkpointing from the config; ``learner.deepspeed`` is merged over the
  generated DeepSpeed config. The optimizer is torch's fused ``AdamW``, so no DeepSpeed op is compiled. ``managed_gradient_accumulation: false`` lets the step run a variable number of
  micro-batches per optimizer step: ``backward`` accumulates, ``step`` is the boundary. A lone rank keeps
  DeepSpeed's gradient allreduce: turning it off measured no faster (bench/learner.py).
- **Critic.** A scalar-head model (``*ForSequenceClassification`` with one label) used per token:
  ``score(trunk(x).last_hidden_state)``, wrapped in :class:`ValueModel` so DeepSpeed sees one module.
  Initialised from ``model.critic``, else from the reward model or the actor's trunk (``critic_init``);
  from the actor the fresh head starts at zero, so the first values are 0 rather than noise. Only built
  for ``algorithm.advantage == "gae"``.
- **LoRA.** With ``learner.lora.rank > 0`` the actor (of ppo, sft, dpo) is wrapped in peft adapters and
  only they train (``learner/lora.py``); the reference stays the plain base model.
- **Reference.** A frozen plain module (no optimizer state, nothing to partition), loaded only when
  ``kl_coef > 0``; with ``placement.reference: learner_cpu`` it lives on CPU and visits the device for its forward pass.
  With ``placement.reference: server`` or ``own`` it is not loaded here at all: the rollout servers score it
  next to generation (``rollout/reference.py``), or the reference worker as trajectories arrive
  (``rollout/own_scorer.py``), and each trajectory carries its ``ref_logp``.
  The reward model itself is scored on the rollout servers, not here; the learner only reads it as a
  critic initialisation.
- **Teacher.** With ``algorithm.distill`` the teacher (``model.teacher``) is a second frozen module loaded
  and placed as the reference is (``algorithm.distill.placement``: learner, or learner_cpu visiting the
  device for each pass), after a check that its tokenizer is the actor's (``tandem/tokenizer_match.py``).
- **Vision-language actors.** A checkpoint with a vision tower (Qwen2-VL) loads through
  ``AutoModelForImageTextToText``. With ``model.freeze_vision`` (the default) the tower's parameters take
  no gradient and no optimizer state; the weights published to the engines still include them.
- **dtype.** ``model.dtype: auto`` is bfloat16 on GPU and float32 on CPU. Logits are upcast to float32
  before log-probabilities and divided by the sampling temperature, to be comparable to ``behav_logp``.
- **Sequence parallelism.** With ``learner.sequence_parallel`` > 1 the engines get DeepSpeed's
  sequence-parallel groups (``mpu``) and the forwards read sharded micro-batches: :func:`response_head`
  runs the head on this rank's response tokens only and sums the group's pieces
  (``learner/sequence_parallel.py``, docs/design.md §4.12).
- **Chunked head.** :func:`policy_logprobs` gives the same log-probabilities and entropies from the last
  hidden states without the ``(tokens, V)`` logits (``learner/lm_head.py``, docs/design.md §4.8);
  :func:`output_head` says whether a model's head allows it.

Known limit: under ZeRO-3 the weights are loaded whole on every rank and partitioned by
``deepspeed.initialize`` (no ``zero.Init`` loading), which is fine until one model no longer fits in host RAM.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.utils import clip_grad_norm_
from torch import Tensor, nn
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSequenceClassification,
    AutoTokenizer,
)

from learner import moe
from learner.batch import MicroBatch, response_columns
from learner.lm_head import chunk_tokens, chunked_logprobs_entropy
from learner.sequence_parallel import assemble, mpu
from tandem.config import Config
from tandem.logprobs import plain_output_head, temper
from tandem.net import free_port
from tandem.prebuild import prepare_extensions
from tandem.tokenizer_match import check_same_tokenizer
from tandem.vision import SUPPRESSED_LOGIT, is_vision_checkpoint

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --------------------------------------------------------------------------------------------- distributed


def resolve_device(cfg: Config) -> torch.device:
    want = cfg.run.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def resolve_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    if cfg.model.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[cfg.model.dtype]


def init_distributed(device: torch.device) -> dist.ProcessGroup:
    """Join (or, alone, create) the process group; returns a gloo group for control messages."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "RANK" not in os.environ:  # a single process started without torchrun
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))  # DeepSpeed checks it is set; never bound
        if not dist.is_initialized():
            # An in-memory store: a TCP rendezvous on a port picked in advance can lose a race with
            # another process taking the same port between the pick and the bind.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if not dist.is_initialized() or deepspeed.comm.cdb is None:
        if device.type == "cpu":
            prepare_extensions()  # DeepSpeed loads its CPU collective op here (tandem/prebuild.py)
        deepspeed.init_distributed(dist_backend=backend)  # wraps a group that exists, or joins torchrun's
    log.info(
        "rank %d of %d on %s, %d torch threads",
        dist.get_rank(),
        dist.get_world_size(),
        device,
        torch.get_num_threads(),
    )
    return dist.new_group(backend="gloo") if device.type == "cuda" else dist.group.WORLD


# -------------------------------------------------------------------------------------------------- engines


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def deepspeed_config(cfg: Config, dtype: torch.dtype) -> dict[str, Any]:
    """The generated DeepSpeed config with ``learner.deepspeed`` merged over it."""
    lc = cfg.learner
    zero: dict[str, Any] = {"stage": lc.zero_stage}
    if lc.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if lc.sequence_parallel > 1 and lc.zero_stage == 3:
        # ZeRO-3's reduce-scatter averages a sequence-parallel group's gradients where the others sum
        # them, halving the update on 2 ranks (docs/design.md §4.12): the all-reduce path sums.
        zero["reduce_scatter"] = False
    generated = {
        "train_micro_batch_size_per_gpu": lc.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": lc.grad_clip,
        "zero_optimization": zero,
        # A torch AdamW under offload runs on the CPU copy of the fp32 weights; no compiled op needed.
        "zero_force_ds_cpu_optimizer": False,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    return _merge(generated, lc.deepspeed)


def make_engine(model: nn.Module, cfg: Config, dtype: torch.dtype, lr: float) -> deepspeed.DeepSpeedEngine:
    params = [p for p in model.parameters() if p.requires_grad]
    # torch's fused AdamW (also TRL's default): one kernel per parameter instead of a dozen small ops; an
    # optimizer step of the tiny demo model on one CPU thread goes from 1.6 to 0.3 ms, a 3.6M model's 13 to 3.8.
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=cfg.learner.weight_decay, fused=fused or None)
    if cfg.learner.zero_stage == 3:
        # Ranks route tokens to different experts: a MoE block is gathered whole, as one leaf (learner/moe.py).
        moe.set_leaf_modules(model)
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        config=deepspeed_config(cfg, dtype),
        model_parameters=params,
        # learner.sequence_parallel: gradients summed over a group's shards (learner/sequence_parallel.py)
        mpu=mpu() if cfg.learner.sequence_parallel > 1 else None,
    )
    if not (engine.fp16_enabled() or engine.bfloat16_enabled() or engine.zero_optimization()):
        keep_clip_norm(engine)
    return engine


def keep_clip_norm(engine: deepspeed.DeepSpeedEngine) -> None:
    """fp32 at ZeRO stage 0, DeepSpeed's ``step`` clips by the gradient's norm (``clip_fp32_gradients``, after
    the ranks' all-reduce) but drops the norm, so ``get_global_grad_norm`` stays None. The same call, with the
    norm kept where the other stages' optimizers leave theirs."""

    def clip_and_keep() -> None:
        norm = clip_grad_norm_(engine.module.parameters(), engine.gradient_clipping(), mpu=engine.mpu)
        engine._global_grad_norm = float(norm)

    engine.clip_fp32_gradients = clip_and_keep


class ValueModel(nn.Module):
    """Per-token values from a sequence-classification model: ``score(trunk(x).last_hidden_state)``."""

    def __init__(self, seq_cls: nn.Module) -> None:
        super().__init__()
        self.seq_cls = seq_cls

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None) -> Tensor:
        hidden = self.seq_cls.base_model(
            input_ids=input_ids, position_ids=position_ids, use_cache=False
        ).last_hidden_state  # (rows, N, H)
        return self.seq_cls.score(hidden).squeeze(-1).float()  # (rows, N)


def load_critic(cfg: Config, dtype: torch.dtype) -> ValueModel:
    m = cfg.model
    source = m.critic or (m.reward_model if m.critic_init == "reward_model" else m.actor)
    if source is None:
        raise ValueError("model.critic_init=reward_model needs model.reward_model (or set model.critic)")
    seq_cls = AutoModelForSequenceClassification.from_pretrained(
        source, num_labels=1, dtype=dtype, trust_remote_code=m.trust_remote_code
    )
    if m.critic is None and m.critic_init == "actor":
        nn.init.zeros_(seq_cls.score.weight)
    return ValueModel(seq_cls)


def _causal_lm(path: str, cfg: Config, dtype: torch.dtype) -> nn.Module:
    # A vision-language checkpoint (Qwen2-VL) is no AutoModelForCausalLM: its class holds the vision tower.
    auto = AutoModelForImageTextToText if is_vision_checkpoint(path) else AutoModelForCausalLM
    return auto.from_pretrained(path, dtype=dtype, trust_remote_code=cfg.model.trust_remote_code)


def vision_tower(model: nn.Module) -> nn.Module | None:
    """A vision-language model's vision encoder (Qwen2-VL's ``model.visual``), None for a text model."""
    inner = getattr(model, "model", None)
    for owner in (model, inner):
        tower = getattr(owner, "visual", None) if owner is not None else None
        if isinstance(tower, nn.Module):
            return tower
    return None


def load_policy(cfg: Config, path: str, dtype: torch.dtype) -> nn.Module:
    """A trainable causal LM (the actor of any recipe), with gradient checkpointing when configured."""
    model = _causal_lm(path, cfg, dtype)
    tower = vision_tower(model)
    if tower is not None and cfg.model.freeze_vision:  # only the language model trains (the default)
        tower.requires_grad_(False)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.learner.lora.rank:
        from learner import lora

        model = lora.wrap(model, cfg.learner.lora)
    return model


def load_frozen(cfg: Config, path: str, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A frozen causal LM (a reference policy): eval mode, no gradients, no optimizer state."""
    return _causal_lm(path, cfg, dtype).eval().requires_grad_(False).to(device)


def load_scalar_head(cfg: Config, path: str, dtype: torch.dtype, *, zero_head: bool) -> ValueModel:
    """A scalar-head model on ``path``'s architecture (a critic or reward model), read per position.

    From a causal LM the head is new: ``zero_head`` starts it at 0, so first scores are 0, not noise.
    """
    seq_cls = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, dtype=dtype, trust_remote_code=cfg.model.trust_remote_code
    )
    if zero_head:
        nn.init.zeros_(seq_cls.score.weight)
    if cfg.model.gradient_checkpointing:
        seq_cls.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return ValueModel(seq_cls)


@dataclass
class Models:
    actor: deepspeed.DeepSpeedEngine
    critic: deepspeed.DeepSpeedEngine | None  # gae only
    reference: nn.Module | None  # when the learner scores the reference (Config.reference_scorer)
    tokenizer: Any
    device: torch.device
    temperature: float  # rollout sampling temperature (behav_logp is of the tempered distribution)
    reference_on_cpu: bool
    teacher: nn.Module | None = None  # algorithm.distill's teacher, frozen, placed as the reference is
    teacher_on_cpu: bool = False

    @property
    def vocab_size(self) -> int:
        """Rows of the actor's embedding: every token id a trajectory carries must be below it."""
        return self.actor.module.get_input_embeddings().num_embeddings


def load_models(cfg: Config, device: torch.device) -> Models:
    dtype = resolve_dtype(cfg, device)
    actor = load_policy(cfg, cfg.model.actor, dtype)
    critic = None
    if cfg.algorithm.advantage == "gae":
        critic = load_critic(cfg, dtype)
        if cfg.model.gradient_checkpointing:
            critic.seq_cls.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
    reference = None
    # placement.reference server or own: scored elsewhere; each trajectory brings its ref_logp.
    if cfg.reference_scorer == "learner":
        reference = (
            _causal_lm(cfg.model.reference or cfg.model.actor, cfg, dtype).eval().requires_grad_(False)
        )
        reference.to("cpu" if cfg.placement.reference == "learner_cpu" else device)
    distill = cfg.distill
    teacher = None
    if distill is not None:
        check_same_tokenizer(
            cfg.model.actor, cfg.model.teacher, trust_remote_code=cfg.model.trust_remote_code
        )
        teacher = load_frozen(cfg, cfg.model.teacher, dtype, torch.device("cpu"))
        teacher.to("cpu" if distill.placement == "learner_cpu" else device)
    return Models(
        actor=make_engine(actor, cfg, dtype, cfg.learner.actor_lr),
        critic=None if critic is None else make_engine(critic, cfg, dtype, cfg.learner.critic_lr),
        reference=reference,
        tokenizer=AutoTokenizer.from_pretrained(
            cfg.model.actor, trust_remote_code=cfg.model.trust_remote_code
        ),
        device=device,
        temperature=cfg.rollout.temperature,
        reference_on_cpu=cfg.placement.reference == "learner_cpu",
        teacher=teacher,
        teacher_on_cpu=distill is not None and distill.placement == "learner_cpu",
    )


# ---------------------------------------------------------------------------------------------- forwards


def policy_logits(model: nn.Module, mb: MicroBatch, temperature: float) -> Tensor:
    """float32 logits of the tempered policy at every position. Shape: (rows, N, V)."""
    logits = model(
        input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False, **(mb.vision or {})
    ).logits
    if mb.suppress is not None:  # a vision-language policy's placeholders, as its engine samples
        logits = logits.index_fill(-1, mb.suppress, SUPPRESSED_LOGIT)
    return temper(logits, temperature)  # as the rollout servers' reference does (rollout/reference.py)


def output_head(model: nn.Module) -> nn.Linear | None:
    """The causal LM's output layer when the chunked head (``learner/lm_head.py``) can stand in for its
    logits, else None (:func:`tandem.logprobs.plain_output_head` says when). A LoRA actor whose head is
    frozen (the default) qualifies: its trunk runs with the adapters, the head is the plain base layer.
    """
    module = model.module if isinstance(model, deepspeed.DeepSpeedEngine) else model
    if hasattr(module, "peft_config"):  # peft: the adapters are injected into the base model in place
        module = module.get_base_model()
    return plain_output_head(module)


def policy_logprobs(
    model: nn.Module,
    mb: MicroBatch,
    temperature: float,
    mask: Tensor,
    head: nn.Linear,
    *,
    chunk_logits: int,
    with_entropy: bool,
) -> tuple[Tensor, Tensor]:
    """Log-probabilities of ``mb.targets`` and entropies of the tempered policy, without its logits.

    The same numbers as ``logprobs_from_logits`` / ``entropy_from_logits`` of :func:`policy_logits`, from
    the last hidden states and ``head`` a chunk of tokens at a time (docs/design.md §4.8), through
    :func:`response_head`. Only ``mask``-ed tokens are computed; the rest are 0. Without ``with_entropy``
    the entropy is zeros.

    Shape: mask (b, R) -> logp (b, R), entropy (b, R), float32.
    """
    chunk = chunk_tokens(head.out_features, chunk_logits)
    bias = head.bias
    if mb.suppress is not None:  # a vision-language policy's placeholders, as in policy_logits
        base = bias if bias is not None else head.weight.new_zeros(head.out_features)
        bias = base.index_fill(0, mb.suppress, SUPPRESSED_LOGIT)

    def forward(h: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        return chunked_logprobs_entropy(
            h,
            head.weight,
            labels,
            bias=bias,
            temperature=temperature,
            chunk=chunk,
            with_entropy=with_entropy,
        )

    logp, entropy = response_head(model, mb, mask, head, forward)
    return logp, entropy


def response_head(
    model: nn.Module,
    mb: MicroBatch,
    mask: Tensor,
    head: nn.Linear,
    fn: Callable[[Tensor, Tensor], tuple[Tensor, ...]],
) -> tuple[Tensor, ...]:
    """``fn(hidden, labels)`` on the last hidden states of ``mask``-ed response tokens, run as ``head``'s
    own call; each per-token output scattered back to ``(b, R)`` (0 off the mask).

    The model is called through its own forward (a DeepSpeed engine hooks its outputs for backward) with
    ``logits_to_keep=1``: the head then runs on one position only. Shape: mask (b, R) -> (b, R) each.
    """
    out = model(
        input_ids=mb.input_ids,
        position_ids=mb.position_ids,
        use_cache=False,
        output_hidden_states=True,
        logits_to_keep=1,
        **(mb.vision or {}),  # a vision-language row's images (learner/batch.py with_vision)
    )
    # The last hidden states (after the final norm) of the masked response tokens, and of a sharded
    # micro-batch this rank's only: the group's pieces are summed below (learner/sequence_parallel.py).
    last = out.hidden_states[-1]
    cols, mine = response_columns(mb, last.shape[1])
    valid = mask.bool() if mine is None else mask.bool() & mine
    row, j = valid.nonzero(as_tuple=True)  # row-major, the order masked_scatter fills
    hidden = last[mb.logit_row[row], cols[row, j]]  # (n, H)
    # Run as the head module's own call, so its hooks see it: ZeRO-3 gathers the partitioned weight
    # before this forward and again before its backward, once per micro-batch rather than per chunk, and
    # reduce-scatters the weight's gradient as for any module (tests/test_lm_head.py checks this on one CPU
    # rank with nothing kept gathered; several GPU ranks are untested).
    head.forward = fn  # an instance attribute: shadows nn.Linear.forward for this call only
    try:
        outputs = head(hidden, mb.targets[row, j])
    finally:
        del head.forward
    zeros = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    scattered = (zeros.masked_scatter(valid, x.float()) for x in outputs)
    return tuple(scattered if mine is None else (assemble(x, mb.shard) for x in scattered))


def values(critic: nn.Module, mb: MicroBatch) -> Tensor:
    """Per-position values. Shape: (rows, N)."""
    return critic(input_ids=mb.input_ids, position_ids=mb.position_ids)


@contextlib.contextmanager
def visiting(model: nn.Module, device: torch.device, offloaded: bool) -> Iterator[nn.Module]:
    """The reference model on ``device`` for the duration of a pass, back on CPU afterwards if offloaded."""
    if offloaded and device.type != "cpu":
        model.to(device)
        try:
            yield model
        finally:
            model.to("cpu")
    else:
        yield model
