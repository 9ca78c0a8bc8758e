"""The training recipes: the ``algorithm`` section is a discriminated union on ``recipe``, one section
class per recipe (online ``ppo``; offline ``sft``, ``rm``, ``dpo``), all listed once in :data:`RECIPES`,
from which the union's tags and :data:`OFFLINE_RECIPES` are derived.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from tandem.config.base import Section, SectionCheckError


class ImportanceConfig(Section):
    """The off-policy correction between the behaviour policy (what the rollout engine sampled from) and
    the proximal policy (the actor at the start of the learner step): ``learner/importance.py``."""

    level: Literal["token", "sequence"] = Field(
        "token",
        description="Ratio exp(prox_logp - behav_logp) per token, or per sequence as the geometric mean of its token ratios (GSPO's length-normalised ratio), the same for all its tokens.",
    )
    treatment: Literal["truncate", "mask"] = Field(
        "truncate",
        description="truncate: weight min(ratio, algorithm.is_cap) (TIS); mask: weight the ratio inside [mask_low, mask_high] and 0 outside it (MIS; IcePop at level token).",
    )
    mask_low: float = Field(
        0.5, gt=0, description="treatment mask: tokens (or sequences) whose ratio is below this get weight 0."
    )
    mask_high: float = Field(
        5.0, gt=0, description="treatment mask: tokens (or sequences) whose ratio is above this get weight 0."
    )

    @model_validator(mode="after")
    def _mask_bounds_hold_one(self) -> ImportanceConfig:
        if not self.mask_low < 1.0 < self.mask_high:
            raise SectionCheckError(
                f"algorithm.importance.mask_low ({self.mask_low}) and algorithm.importance.mask_high "
                f"({self.mask_high}) must satisfy mask_low < 1 < mask_high: on-policy data (ratio 1) is never "
                "masked"
            )
        return self


class DistillConfig(Section):
    """On-policy distillation toward ``model.teacher``: the per-token reverse KL log π − log π_teacher on the
    student's own samples (Agarwal et al. 2024, GKD), as the reward or as a loss term (``learner/losses.py``)."""

    # `as` is a Python keyword: the field is `as_`, read and written as `as`.
    model_config = ConfigDict(
        extra="forbid",
        validate_assignment=True,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
    )

    as_: Literal["reward", "loss"] = Field(
        "reward",
        alias="as",
        description="reward: every response token is rewarded -coef·(log π_behav − log π_teacher) and the advantage estimator applies (grpo, rloo: a sequence scores its summed negative KL); loss: coef times the token-mean ½(log π − log π_teacher)², whose gradient is the reverse KL's on the student's samples.",
    )
    coef: float = Field(
        1.0, gt=0, description="Weight of the reverse KL to the teacher, in the reward or the loss."
    )
    placement: Literal["learner", "learner_cpu", "server", "own"] = Field(
        "learner",
        description="Where the teacher scores, as placement.reference: learner (resident on the learner's devices) or learner_cpu (on its CPU, moved to its devices for each pass); server and own are not built for the teacher.",
    )

    @model_validator(mode="after")
    def _placement_is_built(self) -> DistillConfig:
        if self.placement in ("server", "own"):
            raise SectionCheckError(
                f"algorithm.distill.placement={self.placement}: the teacher scores only in the learner so "
                "far; use learner or learner_cpu"
            )
        return self


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
        5.0,
        gt=0,
        description="Truncation c of the importance weight exp(prox_logp - behav_logp) (importance.treatment truncate).",
    )
    importance: ImportanceConfig = Field(
        default_factory=ImportanceConfig,
        description="Off-policy correction from the behaviour to the proximal policy (docs/design.md §4.9).",
    )
    loss: Literal["ppo", "gspo", "cispo"] = Field(
        "ppo",
        description="Policy loss: ppo (token ratio, clipped surrogate), gspo (sequence ratio, GSPO's clip range) or cispo (clipped, detached token ratio on a REINFORCE term; eps_clip_low/high).",
    )
    gspo_clip_low: float = Field(
        3e-4, gt=0, lt=1, description="loss gspo: sequence-ratio lower bound 1-gspo_clip_low (GSPO's 3e-4)."
    )
    gspo_clip_high: float = Field(
        4e-4, gt=0, description="loss gspo: sequence-ratio upper bound 1+gspo_clip_high (GSPO's 4e-4)."
    )
    loss_agg: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = Field(
        "token-mean",
        description="How per-token losses become one: token-mean over the minibatch (DAPO), or a mean over its sequences of each one's token sum, token mean, or token sum / loss_agg_norm (Dr. GRPO).",
    )
    loss_agg_norm: int | None = Field(
        None,
        gt=0,
        description="seq-mean-token-sum-norm: the constant a sequence's token sum is divided by; null is rollout.max_new_tokens.",
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
    distill: DistillConfig | None = Field(
        None,
        description="On-policy distillation toward model.teacher (docs/design.md §4.10); null is off.",
    )
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus weight.")
    vf_coef: float = Field(0.5, ge=0, description="Value-loss weight (gae only).")
    value_clip: float | None = Field(0.2, gt=0, description="Clip range of the value update; null disables.")
    max_staleness: int | Literal["auto"] = Field(
        2,
        description="Largest learner version minus the oldest token version that may be trained on; 0 is on-policy. auto: admission's bound moves within [staleness_min, staleness_max] with the importance weights' effective sample size (docs/design.md §3.7); staleness_max is the hard limit.",
    )
    staleness_min: int = Field(0, ge=0, description="max_staleness auto: the lowest bound.")
    staleness_start: int | None = Field(
        None,
        ge=0,
        description="max_staleness auto: the first bound, within [staleness_min, staleness_max]; null starts at 1 (asynchronous from the first step), clamped into the range.",
    )
    staleness_max: int = Field(
        4, ge=0, description="max_staleness auto: the highest bound; no trained token is staler."
    )
    staleness_ess_target: float = Field(
        0.9,
        gt=0,
        le=1,
        description="max_staleness auto: a step whose policy/ess (normalised effective sample size of the importance weights) is below this lowers the bound by one.",
    )
    staleness_patience: int = Field(
        10,
        ge=1,
        description="max_staleness auto: this many steps in a row at or above staleness_ess_target raise the bound by one.",
    )
    batch_size: int = Field(
        16, ge=1, description="Trajectories per learner step (a multiple of rollout.n_samples)."
    )
    minibatch_size: int = Field(16, ge=1, description="Trajectories per optimizer step within a PPO epoch.")
    ppo_epochs: int = Field(1, ge=1, description="Passes over each batch.")
    stop_kl: float | None = Field(
        None,
        gt=0,
        description="Early stopping of a step's update (the target_kl of Spinning Up and Stable-Baselines3, "
        "there 1.5 x target_kl): before each actor minibatch after the step's first, a no-grad forward "
        "measures KL(proximal || current) (k3, the minibatch's token mean); above this, the step's remaining "
        "actor minibatches are skipped (policy/kl_skipped_frac). One forward more per minibatch; null "
        "runs them all. Needs more than one optimizer step per batch.",
    )
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
    routing_replay: Literal["off", "rollout"] = Field(
        "off",
        description="Routing replay (R3) for a mixture-of-experts actor: rollout has the hf engine record "
        "the experts each router chose for every token and the learner's forward route through exactly "
        "those (weights still from its own router logits), so a routing flip between engine and trainer "
        "cannot change the experts a token is scored by. hf engine, single-turn runs only.",
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
        auto = self.prox_forward == "auto"
        return not (auto and self.one_optimizer_step and not (self.kl_in_reward and self.kl_coef > 0))

    @property
    def one_optimizer_step(self) -> bool:
        """Whether a learner step makes a single optimizer step of the actor: one epoch of one minibatch."""
        return self.ppo_epochs == 1 and self.minibatch_size == self.batch_size

    @field_validator("max_staleness", mode="before")
    @classmethod
    def _staleness_or_auto(cls, value: Any) -> Any:
        # One message for the two members of the union, not one per member.
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"Input should be a non-negative integer or 'auto', not {value!r}")
        if value < 0:
            raise ValueError("Input should be greater than or equal to 0, or 'auto'")
        return value

    @model_validator(mode="after")
    def _auto_staleness_range(self) -> AlgorithmConfig:
        if self.max_staleness != "auto":
            return self
        if self.staleness_min > self.staleness_max:
            raise SectionCheckError(
                f"algorithm.staleness_min ({self.staleness_min}) must be <= algorithm.staleness_max "
                f"({self.staleness_max}) with max_staleness auto"
            )
        start = self.staleness_start
        if start is not None and not self.staleness_min <= start <= self.staleness_max:
            raise SectionCheckError(
                f"algorithm.staleness_start ({start}) must lie in [staleness_min, staleness_max] "
                f"([{self.staleness_min}, {self.staleness_max}]) with max_staleness auto"
            )
        return self

    @property
    def first_staleness_bound(self) -> int:
        """``max_staleness: auto``'s bound at the first step: ``staleness_start``, else 1 clamped into
        ``[staleness_min, staleness_max]``. Not 0 by default: a synchronous start costs the overlap of
        its first ``staleness_patience`` steps and tells the controller nothing it would not learn at 1."""
        if self.staleness_start is not None:
            return self.staleness_start
        return min(max(1, self.staleness_min), self.staleness_max)

    @model_validator(mode="after")
    def _turn_credit_needs_a_per_token_estimator(self) -> AlgorithmConfig:
        if self.credit == "turn" and self.advantage not in ("gae", "reinforce_pp"):
            raise SectionCheckError(
                f"algorithm.credit=turn places rewards on tokens, which only the per-token estimators read "
                f"(gae, reinforce_pp); algorithm.advantage={self.advantage} scores whole sequences"
            )
        return self

    @model_validator(mode="after")
    def _loss_variants_fit_together(self) -> AlgorithmConfig:
        if self.dual_clip is not None and self.loss != "ppo":
            raise SectionCheckError(
                f"algorithm.dual_clip bounds the clipped surrogate of algorithm.loss=ppo; algorithm.loss="
                f"{self.loss} has no such term: set algorithm.dual_clip=null"
            )
        if self.loss == "gspo" and self.importance.level == "token":
            raise SectionCheckError(
                "algorithm.loss=gspo weighs whole sequences, but algorithm.importance.level=token would weigh "
                "its tokens one by one: set algorithm.importance.level=sequence"
            )
        if self.stop_kl is not None and self.one_optimizer_step:
            raise SectionCheckError(
                "algorithm.stop_kl skips the minibatches after the first of a step, but with "
                f"algorithm.ppo_epochs=1 and algorithm.minibatch_size=batch_size ({self.batch_size}) a step has "
                "only one: raise ppo_epochs or lower minibatch_size, or set stop_kl=null"
            )
        if self.loss_agg_norm is not None and self.loss_agg != "seq-mean-token-sum-norm":
            raise SectionCheckError(
                f"algorithm.loss_agg_norm is read only by algorithm.loss_agg=seq-mean-token-sum-norm "
                f"(got algorithm.loss_agg={self.loss_agg}): set it to null"
            )
        return self


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


RECIPES: dict[str, type[Section]] = {
    "ppo": AlgorithmConfig,
    "sft": SFTConfig,
    "rm": RMConfig,
    "dpo": DPOConfig,
}  # algorithm.recipe -> its section; the key is the class's `recipe` literal and the union's tag

Algorithm = Annotated[
    Union[tuple(Annotated[cls, Tag(recipe)] for recipe, cls in RECIPES.items())],  # noqa: UP007 (built from a list)
    Discriminator(_recipe_tag),
]  # one member per recipe, tagged by it, in RECIPES' order (the order config-doc shows them in)
OFFLINE_RECIPES = tuple(recipe for recipe, cls in RECIPES.items() if issubclass(cls, OfflineConfig))
