"""What a config's placement means for a run, and the planner's first guess before anything is measured.

- :func:`roles_of`: the models a config has besides the actor;
- :func:`configured_plan`: the config's placement as a :class:`~placement.plans.Plan` on ``devices``;
- :func:`thread_split`, :func:`aux_threads`, :func:`critic_threads`: on CPU a device is a thread, so a plan
  is a thread budget per process (and per role within the learner's);
- :func:`prior_model`: per-phase laws from the checkpoints' sizes and a device's nominal speed, so
  ``launch.py plan`` can rank plans before a run has profiled anything. Measured laws replace it
  (``placement/cost.py``); its figures are orders of magnitude, and ``launch.py plan`` says so.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from placement.cost import CostModel, Law
from placement.plans import Plan, Roles
from tandem.config import Config

# Nominal sustained speeds: dense bf16 matmuls at realistic utilisation, and memory bandwidth.
CUDA_FLOPS, CUDA_BANDWIDTH = 300e12, 2.0e12  # an H100-class device
CPU_FLOPS, CPU_BANDWIDTH = 20e9, 10e9  # one core of a server CPU (fp32)
# Bytes moved per second: between devices or to the host (PCIe / NVLink), and a copy within a device.
CUDA_LINK, CUDA_COPY = 25e9, 1e12
CPU_LINK, CPU_COPY = 2e9, 10e9


def roles_of(cfg: Config) -> Roles:
    return Roles(
        reference=cfg.algorithm.kl_coef > 0,
        critic=cfg.algorithm.advantage == "gae",
        reward_model=cfg.model.reward_model is not None,
        proximal=cfg.algorithm.proximal_pass,
    )


def configured_plan(cfg: Config, devices: int) -> Plan:
    """The config's placement on ``devices`` (separate: the servers' share, at least one each side, and
    the own worker's, at least one, when a model is placed own)."""
    p = cfg.placement
    if cfg.placement_mode == "colocate":
        return Plan("colocate", devices, devices, 0, p.reference, p.critic, p.reward_model, p.scoring)
    servers, own = cfg.rollout.num_servers, bool(own_roles(cfg))
    aux = max(1, min(devices - 2, round(aux_share(cfg) * devices))) if own else 0
    share = p.generation_share if p.generation_share is not None else servers / (servers + 1 + own)
    generation = max(0, min(devices - 1 - aux, max(1, round(share * devices))))
    return Plan(
        "separate",
        generation,
        devices - generation - aux,
        aux,
        p.reference,
        p.critic,
        p.reward_model,
        p.scoring,
    )


def aux_share(cfg: Config) -> float:
    """The own group's share of the devices, for all its workers: ``placement.aux_share``, else an equal
    share per process."""
    if cfg.placement.aux_share is not None:
        return cfg.placement.aux_share
    return 1 / (cfg.rollout.num_servers + 2)


def own_roles(cfg: Config) -> list[str]:
    """The roles placed ``own``: the scoring workers' (processes of their own) and the critic (threads of
    its own in the learner's process)."""
    return cfg.own_scorers + (["critic"] if cfg.critic_own else [])


def aux_threads(cfg: Config, cores: int | None = None) -> int:
    """CPU threads of each role placed own (a scoring worker, the critic): the own group's share, split
    between them; 0 without one."""
    if not (n := len(own_roles(cfg))):
        return 0
    cores = cores or os.cpu_count() or 1
    return max(1, round(aux_share(cfg) * cores) // n)


def critic_threads(cfg: Config, cores: int | None = None) -> int:
    """The critic's threads in the learner's process under ``placement.critic: own``; else 0."""
    return aux_threads(cfg, cores) if cfg.critic_own else 0


def thread_split(cfg: Config, cores: int | None = None) -> tuple[int, int]:
    """CPU threads for each server and for the learner.

    colocate (run.mode sync): the phases take turns, so each has every core: the servers share them
    while generating, then the learner has them all (the colocated baseline TRL, verl and AReaL compare
    against; on the generation-heavy workload of ``bench/vs_trl.py`` it measured 1.6 -> 1.1 s/step against
    the split). separate: generation and training run at once, so they split the cores: the servers'
    ``placement.generation_share`` (or ``rollout.threads`` each, or an equal share per process), each
    scoring worker its :func:`aux_threads` (a model placed ``own``), the learner what is left (with the
    critic's own threads when it is placed ``own``). ``rollout.threads`` and ``learner.threads`` override either share (on a busy
    machine, 1 avoids OpenMP barrier stalls).
    """
    cores = cores or os.cpu_count() or 1
    servers, learner = cfg.rollout.num_servers, cfg.learner.threads
    if cfg.placement_mode == "colocate":
        return cfg.rollout.threads or max(1, cores // servers), learner or cores
    # The critic's own threads are the learner process's: only the scoring workers' are left out.
    share, aux = cfg.placement.generation_share, aux_threads(cfg, cores) * len(cfg.own_scorers)
    if cfg.rollout.threads:
        per_server = cfg.rollout.threads
    elif share is not None:
        per_server = max(1, round(share * cores) // servers)
    else:
        per_server = max(1, cores // (servers + 1 + bool(own_roles(cfg))))
    return per_server, learner or max(1, cores - per_server * servers - aux)


def checkpoint_params(path: str | None) -> tuple[float, float, float]:
    """(total parameters, parameters active per token, KV bytes per token) of a checkpoint from its
    config.json; zeros when unreadable. A mixture of experts (``num_experts`` or ``num_local_experts``)
    holds every expert but runs ``num_experts_per_tok`` of them (plus its router and any shared expert)
    per token: memory scales with the total, compute with the active count. Dense: the two are equal."""
    if path is None:
        return 0.0, 0.0, 0.0
    try:
        c = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return 0.0, 0.0, 0.0
    h, layers, vocab = c.get("hidden_size", 0), c.get("num_hidden_layers", 0), c.get("vocab_size", 0)
    inter = c.get("intermediate_size", 4 * h)
    kv_heads = c.get("num_key_value_heads", c.get("num_attention_heads", 1))
    head_dim = c.get("head_dim") or h // max(1, c.get("num_attention_heads", 1))
    experts = c.get("num_experts") or c.get("num_local_experts") or 0
    if experts:
        expert = 3 * h * (c.get("moe_intermediate_size") or inter)
        shared = 3 * h * c.get("shared_expert_intermediate_size", 0) + h * experts  # + the router
        mlp, active_mlp = experts * expert + shared, c.get("num_experts_per_tok", 1) * expert + shared
    else:
        mlp = active_mlp = 3 * h * inter
    attention, ends = 4 * h * h, 2 * vocab * h
    total, active = layers * (attention + mlp) + ends, layers * (attention + active_mlp) + ends
    return float(total), float(active), float(2 * layers * kv_heads * head_dim * 2)  # K and V, 2 bytes each


def prior_model(cfg: Config, *, cuda: bool) -> CostModel:
    """Laws from FLOPs and bytes: ~2N FLOPs a token forward, ~6N to train, decode bound by reading the
    weights once per step of a batch of ``prompts_per_batch * n_samples`` sequences. For a mixture of
    experts N is the actor's active parameters in FLOPs, its total in bytes (:func:`checkpoint_params`)."""
    flops, bandwidth = (CUDA_FLOPS, CUDA_BANDWIDTH) if cuda else (CPU_FLOPS, CPU_BANDWIDTH)
    link, copy = (CUDA_LINK, CUDA_COPY) if cuda else (CPU_LINK, CPU_COPY)
    n_actor, active, kv = checkpoint_params(cfg.model.actor)
    n_ref, active_ref, _ = checkpoint_params(cfg.model.reference or cfg.model.actor)
    n_critic, active_critic, _ = checkpoint_params(cfg.model.critic or cfg.model.actor)
    n_rm, active_rm, _ = checkpoint_params(cfg.model.reward_model)
    r = cfg.rollout
    decode_batch = r.prompts_per_batch * r.n_samples
    call = 2e-4 if cuda else 2e-3  # a forward call's fixed cost (launch, Python)
    fwd = lambda n: Law(call, 2 * n / flops)  # noqa: E731
    epochs = cfg.algorithm.ppo_epochs if cfg.recipe == "ppo" else 1
    weight_bytes = 2 * n_actor
    return CostModel(
        time={
            "generate": Law(call, max(2 * active / flops, weight_bytes / bandwidth / decode_batch)),
            "actor_logp": fwd(active),
            "reference": fwd(active_ref),
            "critic_values": fwd(active_critic),
            "reward_model": fwd(active_rm),
            "actor_train": Law(3 * call, epochs * 6 * active / flops),
            "critic_train": Law(3 * call, epochs * 6 * active_critic / flops),
            "sync": Law(weight_bytes / link, 0.0),  # across devices (NVLink / shm copy)
            "sync_local": Law(weight_bytes / copy, 0.0),  # within a device
            "switch": Law(2 * weight_bytes / (link if cuda else copy), 0.0),  # sleep/wake + offload/reload
            "reference_reload": Law(2 * n_ref * 2 / (link if cuda else copy), 0.0),
        },
        memory={
            "engine": Law(weight_bytes, kv),
            "actor": Law(16 * n_actor, 2 * n_actor / 1e3),  # bf16 weights, fp32 master, grads, Adam
            "reference": Law(2 * n_ref, 0.0),
            "critic": Law(16 * n_critic, 2 * n_critic / 1e3),
            "reward_model": Law(2 * n_rm, 0.0),
        },
    )
