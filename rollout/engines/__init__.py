"""Inference engines behind one Protocol (docs/design.md §8); :func:`make_engine` picks one from the config."""

from __future__ import annotations

import importlib
from typing import Any

from rollout.engines.base import Completion, Engine, SamplingParams
from tandem.config import Config

# The GPU engines import vllm / sglang, which live in their own environments: load them only when chosen.
_ENGINES = {
    "hf": "rollout.engines.hf:HFEngine",
    "vllm": "rollout.engines.vllm:VLLMEngine",
    "sglang": "rollout.engines.sglang:SGLangEngine",
}


def make_engine(cfg: Config, model_path: str, *, server_index: int = 0, device: str | None = None) -> Engine:
    """The engine named by ``cfg.rollout.engine``, loaded from ``model_path`` onto ``device``.

    ``device`` None follows ``cfg.run.device`` (auto: cuda when available).
    """
    module_name, _, cls_name = _ENGINES[cfg.rollout.engine].partition(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    device = device or cfg.run.device
    if cfg.rollout.engine == "hf":
        # Only turns that extend an earlier call's sequence hit the prefix cache: a single-turn run never
        # does, and would pay for storing every finished row.
        multi_turn = cfg.env.path is not None or cfg.agent.path is not None
        # Turns and agents' calls that arrive at an idle engine together start one batch (§8.1).
        independent = cfg.env.path is not None and cfg.episode_progression == "independent"
        gather_ms = cfg.env.gather_ms if independent else cfg.agent.gather_ms if cfg.agent.path else 0.0
        return cls(
            model_path,
            device=device,
            dtype=cfg.model.dtype,
            trust_remote_code=cfg.model.trust_remote_code,
            seed=cfg.run.seed + server_index,
            prefix_cache_mb=cfg.rollout.hf_prefix_cache_mb if multi_turn else 0.0,
            gather_s=gather_ms / 1000,
            # Colocated and releasing memory, the shm version's pages are the engine's weights (§11.1).
            zero_copy=cfg.releases_memory,
            record_routing=cfg.algorithm.routing_replay == "rollout",
            loras=served_adapters(cfg) or None,
        )
    return cls(cfg, model_path, server_index=server_index, device=device)


def served_adapters(cfg: Config) -> dict[str, Any]:
    """Each of ``learner.lora.adapters`` as the hf engine serves it (rollout/server.py): a peft
    ``LoraConfig`` of the learner's rank, α and target modules, empty (B = 0: the base model) until its
    run's version 0 arrives."""
    lora = cfg.learner.lora
    if not lora.adapters:
        return {}
    from peft import LoraConfig

    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.target_modules))
    return {a.name: config for a in lora.adapters}


__all__ = ["Completion", "Engine", "SamplingParams", "make_engine"]
