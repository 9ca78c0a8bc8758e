"""The checks across sections, run in order by :class:`~tandem.config.root.Config`'s validator once every
section is valid. Each is a small pure function of the whole config that raises ``ValueError`` naming the
fields at fault; the first to fail is the one reported. A check that reads one section only is that
section's own validator instead. :func:`checks_for` gives the list for a recipe: the placement and
token-budget checks for all, then the online ones for ppo or the offline one for sft, rm and dpo.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from tandem.config.algorithm import OFFLINE_RECIPES, SFTConfig
from tandem.vision import is_vision_checkpoint

if TYPE_CHECKING:
    from tandem.config.root import Config

Check = Callable[["Config"], None]


# --------------------------------------------------------------------------------------------- placement


def colocate_needs_sync(cfg: Config) -> None:
    if cfg.placement.mode == "colocate" and cfg.run.mode != "sync":
        raise ValueError(
            "placement.mode=colocate takes turns on the same devices, which needs run.mode=sync "
            "(max_staleness 0: the servers generate one batch per version, never while the learner trains)"
        )


def own_reference_is_not_colocated(cfg: Config) -> None:
    if cfg.reference_scorer == "own" and cfg.placement_mode == "colocate":
        raise ValueError(
            "placement.reference=own gives the reference devices of its own, beside generation and "
            "learning; colocated (run.mode=sync or placement.mode=colocate) every device is shared: use "
            "placement.reference=learner or server there"
        )


def own_critic_is_runnable(cfg: Config) -> None:
    if cfg.placement.critic != "own":
        return
    if cfg.recipe != "ppo" or cfg.algorithm.advantage != "gae":  # offline recipes train no critic
        raise ValueError("placement.critic=own needs a critic: algorithm.advantage=gae")
    if cfg.placement_mode == "colocate":
        raise ValueError(
            "placement.critic=own gives the critic threads of its own, beside the actor's; colocated "
            "(run.mode=sync or placement.mode=colocate) every device is shared: use "
            "placement.critic=learner there"
        )
    if cfg.run.device == "cuda" or cfg.learner.num_ranks > 1:
        raise ValueError(
            "placement.critic=own trains the critic beside the actor on CPU threads of its own in "
            "the learner's process: it needs run.device=cpu and learner.num_ranks=1 (on devices, "
            "critic ranks of their own are predicted by `launch.py plan` but not yet run)"
        )


def own_reward_model_is_runnable(cfg: Config) -> None:
    if cfg.placement.reward_model != "own":
        return
    if cfg.model.reward_model is None:
        raise ValueError(
            "placement.reward_model=own needs model.reward_model (the checkpoint it scores with)"
        )
    if cfg.placement_mode == "colocate":
        raise ValueError(
            "placement.reward_model=own gives the reward model devices of its own, beside generation "
            "and learning; colocated (run.mode=sync or placement.mode=colocate) every device is "
            "shared: use placement.reward_model=server there"
        )
    if cfg.algorithm.dynamic_sampling:
        raise ValueError(
            "algorithm.dynamic_sampling drops groups of equal rewards on the rollout servers, before "
            "an own reward model's score exists: use placement.reward_model=server with it"
        )


def split_scoring_is_on_one_cpu_rank(cfg: Config) -> None:
    if cfg.placement.scoring == "split" and (cfg.run.device == "cuda" or cfg.learner.num_ranks > 1):
        raise ValueError(
            "placement.scoring=split runs the learner's scoring forwards at once on shares of its CPU "
            "threads: it needs run.device=cpu and learner.num_ranks=1 (on devices, disjoint device groups "
            "are the own placements, which `launch.py plan` predicts but runs do not yet use)"
        )


# ------------------------------------------------------------------------------------------ token budget


def _longest_sequence(cfg: Config) -> tuple[int, str]:
    """The longest sequence the run can produce, and where that length comes from."""
    a = cfg.algorithm
    if a.recipe in ("rm", "dpo"):  # both sequences of a pair share a forward pass
        pair = f"2 x algorithm.max_tokens ({a.max_tokens}; a pair's two sequences share a pass)"
        return 2 * a.max_tokens, pair
    if a.recipe == "sft":
        return a.max_tokens, "algorithm.max_tokens"
    if cfg.env.path is not None:
        e, p = cfg.env.max_total_tokens, cfg.data.max_prompt_tokens
        if e >= p:
            return e, "env.max_total_tokens"
        return p, "data.max_prompt_tokens (above env.max_total_tokens)"
    p, n = cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens
    return p + n, f"data.max_prompt_tokens ({p}) + rollout.max_new_tokens ({n})"


def token_budget_holds_the_longest_sequence(cfg: Config) -> None:
    """A token budget below the longest sequence the run can produce would leave that sequence out of
    training (docs/design.md §4.8): refuse it here, naming where the length comes from. Agent sessions
    have no token cap; one over the budget is masked out at run time and counted."""
    budget = cfg.learner.max_tokens_per_micro_batch
    if budget is None or (cfg.algorithm.recipe == "ppo" and cfg.agent.path is not None):
        return
    longest, source = _longest_sequence(cfg)
    if budget < longest:
        raise ValueError(
            f"learner.max_tokens_per_micro_batch ({budget}) is below the longest sequence this run can "
            f"produce, {source} = {longest}: a longer one would not fit a forward pass; raise the budget or "
            "lower that limit"
        )


# --------------------------------------------------------------------------------------------- offline


def micro_batches_divide_the_batch(cfg: Config) -> None:
    a, micro = cfg.algorithm, cfg.learner.micro_batch_size
    if a.batch_size % min(micro, a.batch_size):
        raise ValueError(
            f"algorithm.batch_size ({a.batch_size}) must be a multiple of learner.micro_batch_size ({micro})"
        )


# ---------------------------------------------------------------------------------------------- online


def groups_stay_whole(cfg: Config) -> None:
    a, n = cfg.algorithm, cfg.rollout.n_samples
    if a.batch_size % n:
        raise ValueError(
            f"algorithm.batch_size ({a.batch_size}) must be a multiple of rollout.n_samples ({n}) so groups stay whole"
        )


def minibatches_divide_the_batch(cfg: Config) -> None:
    # Read from the algorithm section alone, yet checked here, after groups_stay_whole: a batch_size that
    # splits groups is reported as that, whatever its minibatch_size.
    a = cfg.algorithm
    if a.batch_size % a.minibatch_size:
        raise ValueError(
            f"algorithm.batch_size ({a.batch_size}) must be a multiple of algorithm.minibatch_size ({a.minibatch_size})"
        )


def group_estimators_have_groups(cfg: Config) -> None:
    a, n = cfg.algorithm, cfg.rollout.n_samples
    if a.advantage in ("grpo", "rloo") and n < 2:
        raise ValueError(f"algorithm.advantage={a.advantage} needs rollout.n_samples >= 2 (got {n})")


def env_or_agent(cfg: Config) -> None:
    if cfg.env.path is not None and cfg.agent.path is not None:
        raise ValueError("env.path and agent.path are exclusive: an episode is either one or the other")


def some_reward_source(cfg: Config) -> None:
    if (
        not cfg.reward.functions
        and not cfg.reward.group_functions
        and cfg.model.reward_model is None
        and cfg.env.path is None
        and cfg.agent.path is None
        and (cfg.algorithm.distill is None or cfg.algorithm.distill.as_ != "reward")
    ):
        raise ValueError(
            "reward: give at least one reward.functions or reward.group_functions entry, a "
            "model.reward_model, an env.path, an agent.path or an algorithm.distill with as: reward"
        )


def distill_has_a_teacher(cfg: Config) -> None:
    distill = cfg.distill
    if distill is not None and cfg.model.teacher is None:
        raise ValueError(
            "algorithm.distill needs model.teacher: the checkpoint the actor is distilled toward"
        )
    if distill is None and cfg.model.teacher is not None:
        raise ValueError(
            f"model.teacher ({cfg.model.teacher}) is read only by algorithm.distill (recipe ppo): set "
            "algorithm.distill, or model.teacher to null"
        )


def overlong_buffer_fits_the_response(cfg: Config) -> None:
    buffer, longest = cfg.algorithm.overlong_buffer, cfg.rollout.max_new_tokens
    if buffer is not None and buffer > longest:
        raise ValueError(
            f"algorithm.overlong_buffer ({buffer}) must be <= rollout.max_new_tokens ({longest})"
        )


def token_sum_norm_bounds_the_response(cfg: Config) -> None:
    """Dr. GRPO's constant divides each sequence's token sum; rollout.max_new_tokens stands in for it only
    when it bounds a response, which a multi-turn episode's (model turns and environment turns) it does not."""
    a = cfg.algorithm
    if a.loss_agg != "seq-mean-token-sum-norm" or a.loss_agg_norm is not None:
        return
    if cfg.env.path is not None or cfg.agent.path is not None:
        source = "env.path" if cfg.env.path is not None else "agent.path"
        raise ValueError(
            f"algorithm.loss_agg=seq-mean-token-sum-norm divides each sequence's token sum by a constant, "
            f"rollout.max_new_tokens when algorithm.loss_agg_norm is null; with {source} a response holds "
            "several turns and is not bounded by it: set algorithm.loss_agg_norm"
        )


def several_adapters_are_runnable(cfg: Config) -> None:
    """``learner.lora.adapters``: adapter-only updates into the engine's served adapters, whose rows share
    the running batch (hf: rollout/engines/hf_lora.py; vllm: one LoRA per adapter and version), from one
    learner rank running a ppo learner per adapter (learner/adapter_runs.py). What is not built with it is
    refused here, by name."""
    lora = cfg.learner.lora
    if not lora.adapters:
        return
    given = "learner.lora.adapters"
    if cfg.algorithm.recipe != "ppo":
        raise ValueError(f"{given} trains with algorithm.recipe=ppo only (got {cfg.algorithm.recipe})")
    needs = {
        "learner.lora.rank > 0": lora.rank > 0,
        "learner.lora.sync=adapter": lora.sync == "adapter",
        "learner.lora.modules_to_save=[] (whole modules would be shared by every adapter's rows)": not lora.modules_to_save,
        "rollout.engine=hf or vllm": cfg.rollout.engine in ("hf", "vllm"),
        "learner.num_ranks=1": cfg.learner.num_ranks == 1,
        "placement.mode=separate": cfg.placement_mode == "separate" and cfg.placement.mode != "auto",
        "no critic (a group advantage: grpo, rloo, ...)": cfg.model.critic is None,
        "no reference (algorithm.kl_coef=0)": cfg.algorithm.kl_coef == 0,
        "no reward model": cfg.model.reward_model is None,
        "no env.path or agent.path": cfg.env.path is None and cfg.agent.path is None,
        "eval.prompts=null": cfg.eval.prompts is None,
        "algorithm.distill off": cfg.distill is None,
    }
    if missing := [what for what, holds in needs.items() if not holds]:
        raise ValueError(f"{given} needs {'; '.join(missing)}")


def adapter_sync_engine(cfg: Config) -> None:
    """Adapter-only updates reach the hf engine (any transport) and vLLM (a LoRA loaded from the shm
    version's peft directory, so neither the dist push nor modules trained in full, which vLLM's LoRA does
    not take); SGLang's path is not built."""
    lora, engine = cfg.learner.lora, cfg.rollout.engine
    if not lora.rank or lora.sync != "adapter" or engine == "hf":
        return
    if engine != "vllm":
        raise ValueError(
            f"learner.lora.sync=adapter is not built for rollout.engine={engine} (only hf and vllm load "
            "adapter-only updates); use learner.lora.sync=merged"
        )
    if cfg.weight_path != "shm":
        raise ValueError(
            "learner.lora.sync=adapter with rollout.engine=vllm needs weightsync.transport=shm (vLLM loads "
            f"the adapter from the version's directory; got {cfg.weightsync.transport}); or use "
            "learner.lora.sync=merged"
        )
    if lora.modules_to_save:
        raise ValueError(
            f"learner.lora.modules_to_save={list(lora.modules_to_save)} with learner.lora.sync=adapter and "
            "rollout.engine=vllm: vLLM's LoRA takes only lora_A/lora_B, not modules trained in full; "
            "set modules_to_save to [] or use learner.lora.sync=merged"
        )


def routing_replay_is_recorded(cfg: Config) -> None:
    if cfg.algorithm.routing_replay == "off":
        return
    if cfg.rollout.engine not in ("hf", "vllm"):
        raise ValueError(
            f"algorithm.routing_replay=rollout needs rollout.engine hf or vllm (got {cfg.rollout.engine}): "
            "they record the experts their routers chose; recording in SGLang is not built"
        )
    if cfg.env.path is not None or cfg.agent.path is not None:
        raise ValueError(
            "algorithm.routing_replay=rollout records single-turn trajectories only: a multi-turn episode's "
            "earlier turns are routed by other forward passes than its last; unset env.path / agent.path "
            "or set algorithm.routing_replay=off"
        )


def vision_actor_has_no_critic(cfg: Config) -> None:
    if cfg.algorithm.advantage == "gae" and is_vision_checkpoint(cfg.model.actor):
        raise ValueError(
            f"algorithm.advantage=gae trains a critic, and {cfg.model.actor} is a vision-language model, "
            "for which transformers has no scalar-head (sequence-classification) class: use a group "
            "estimator (algorithm.advantage: grpo, rloo, ...)"
        )


def vision_actor_is_not_packed(cfg: Config) -> None:
    packed = isinstance(cfg.algorithm, SFTConfig) and cfg.algorithm.packing  # only sft has the field
    if packed and is_vision_checkpoint(cfg.model.actor):
        raise ValueError(
            f"algorithm.packing: {cfg.model.actor} is a vision-language model, whose 3-D positions are "
            "computed per padded row; packed rows are not supported: set algorithm.packing: false"
        )


def sequence_parallel_is_wired(cfg: Config) -> None:
    sp = cfg.learner.sequence_parallel
    if sp == 1:
        return
    why = None
    if cfg.recipe != "ppo":
        why = f"the {cfg.recipe} recipe deals its rows whole; only ppo shards them"
    elif cfg.learner.lora.rank:
        why = "learner.lora.rank > 0: LoRA under Ulysses attention is not checked yet"
    elif cfg.algorithm.routing_replay != "off":
        why = "algorithm.routing_replay: recorded routing is laid out for whole rows"
    elif is_vision_checkpoint(cfg.model.actor):
        why = f"{cfg.model.actor} is a vision-language model, whose image tokens are not sharded"
    if why:
        raise ValueError(f"learner.sequence_parallel={sp}: {why} (docs/design.md §4.12); set it to 1")


# The checks that read the actor's config.json: at load, where the checkpoint exists already, and again by
# the launcher once the run's prepare steps have made it (launcher/driver.py check_inputs).
VISION_CHECKS: tuple[Check, ...] = (
    vision_actor_has_no_critic,
    vision_actor_is_not_packed,
    sequence_parallel_is_wired,
)


def sync_interval_within_staleness(cfg: Config) -> None:
    interval, bound = cfg.algorithm.sync_interval, cfg.max_staleness
    if cfg.auto_staleness:  # admission may hold the bound at its lowest
        bound = cfg.algorithm.staleness_min
    if interval > bound + 1:
        why = "run.mode=sync trains on-policy (max_staleness 0)" if cfg.run.mode == "sync" else ""
        raise ValueError(
            f"algorithm.sync_interval ({interval}) must be <= max_staleness + 1 "
            f"({bound + 1}{'; ' + why if why else ''}): weights published every "
            f"{interval} steps make data up to {interval - 1} versions stale, which the "
            "servers' freshness check and the learner's staleness filter refuse"
        )


def micro_batches_divide_the_minibatch(cfg: Config) -> None:
    a, micro = cfg.algorithm, cfg.learner.micro_batch_size
    if a.minibatch_size % min(micro, a.minibatch_size):
        raise ValueError(
            f"algorithm.minibatch_size ({a.minibatch_size}) must be a multiple of learner.micro_batch_size ({micro})"
        )


COMMON_CHECKS: tuple[Check, ...] = (
    colocate_needs_sync,
    own_reference_is_not_colocated,
    own_critic_is_runnable,
    own_reward_model_is_runnable,
    split_scoring_is_on_one_cpu_rank,
    token_budget_holds_the_longest_sequence,
    distill_has_a_teacher,
    vision_actor_is_not_packed,
    sequence_parallel_is_wired,
)
OFFLINE_CHECKS: tuple[Check, ...] = (micro_batches_divide_the_batch,)
ONLINE_CHECKS: tuple[Check, ...] = (
    groups_stay_whole,
    minibatches_divide_the_batch,
    group_estimators_have_groups,
    env_or_agent,
    some_reward_source,
    overlong_buffer_fits_the_response,
    token_sum_norm_bounds_the_response,
    adapter_sync_engine,
    several_adapters_are_runnable,
    routing_replay_is_recorded,
    vision_actor_has_no_critic,
    sync_interval_within_staleness,
    micro_batches_divide_the_minibatch,
)


def checks_for(recipe: str) -> tuple[Check, ...]:
    """The checks a config of ``recipe`` must pass, in the order they run."""
    return COMMON_CHECKS + (OFFLINE_CHECKS if recipe in OFFLINE_RECIPES else ONLINE_CHECKS)


def vision_checks_for(recipe: str) -> tuple[Check, ...]:
    """The vision-actor checks among :func:`checks_for`'s, which the launcher runs again once the prepare
    steps have made the actor."""
    return tuple(check for check in checks_for(recipe) if check in VISION_CHECKS)
