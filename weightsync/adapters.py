"""Adapter-only weight updates: the wire form of a LoRA actor's update and how a server applies it.

A LoRA-trained actor (``learner/lora.py``) publishes, per adapted linear layer ``<m>``, three tensors
under Hugging Face names: ``<m>.lora_A.weight`` (r, in), ``<m>.lora_B.weight`` (out, r) and
``<m>.lora_scaling`` (0-d, α/r). Every update carries the whole adapter, so a receiver that keeps each
layer's original weight ``W0`` sets ``W = W0 + scaling · B @ A`` (docs/stages.md §5): any transport
(``shm``, ``dist``) moves these tensors like any others, ``r·(in + out)`` numbers per layer instead of
``in·out``. Applied by the ``hf`` engine (``rollout/engines/hf.py``); for vLLM the shm publisher also writes
the update as a peft adapter directory (:func:`write_peft_adapter`), which the server loads as a LoRA.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

A, B, SCALING = ".lora_A.weight", ".lora_B.weight", ".lora_scaling"


def is_adapter_tensor(name: str) -> bool:
    return name.endswith((A, B, SCALING))


@torch.no_grad()
def apply_adapter(
    tensors: dict[str, Tensor], params: dict[str, Tensor], base: dict[str, Tensor]
) -> list[str]:
    """Set each adapted weight to ``W0 + scaling · B @ A`` in place; returns the layers updated.

    ``params`` are the model's live weights by name; ``base`` keeps each adapted layer's original ``W0``
    (filled on first use), since an update is the whole adapter, not a delta from the previous one.
    """
    layers = [n.removesuffix(SCALING) for n in tensors if n.endswith(SCALING)]
    missing = [
        n for n in tensors if n.removesuffix(A).removesuffix(B) not in layers and not n.endswith(SCALING)
    ]
    if missing:
        raise KeyError(f"adapter update: {missing[:3]} come without their {SCALING} tensor")
    for layer in layers:
        target = params.get(layer + ".weight")
        if target is None:
            raise KeyError(f"adapter update for {layer!r}: the model has no weight {layer}.weight")
        a, b, scaling = tensors[layer + A], tensors[layer + B], float(tensors[layer + SCALING])
        if (b.shape[0], a.shape[1]) != tuple(target.shape):
            raise ValueError(
                f"adapter update for {layer!r}: B @ A is {(b.shape[0], a.shape[1])}, the weight {tuple(target.shape)}"
            )
        w0 = base.setdefault(layer, target.detach().clone())
        target.copy_(w0)
        target.addmm_(b.to(target), a.to(target), alpha=scaling)  # fused: no (out, in) temporaries
    return layers


PEFT_PREFIX = "base_model.model."
PEFT_DIR = "adapter"  # inside a shm version directory: the adapter as peft saves it (vLLM loads it)


def peft_adapter(
    tensors: dict[str, Tensor], base_model: str | None = None
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """An adapter-only update as peft's ``adapter_config.json`` and ``adapter_model.safetensors`` contents.

    ``scaling`` is α/r, so α = scaling · r; peft (and vLLM) take one α and one r for every layer, so an
    update whose layers disagree is refused rather than written with the wrong scale.
    """
    layers = sorted(n.removesuffix(SCALING) for n in tensors if n.endswith(SCALING))
    if not layers:
        raise ValueError("peft adapter: the update has no adapted layer (no *.lora_scaling tensor)")
    extra = [n for n in tensors if not is_adapter_tensor(n)]
    if (
        extra
    ):  # vLLM's LoRA takes no modules trained in full (learner.lora.modules_to_save) beside the adapter
        raise ValueError(f"peft adapter: {extra[:3]} are whole modules, not adapter tensors")
    ranks = {tensors[layer + A].shape[0] for layer in layers}
    alphas = {round(float(tensors[layer + SCALING]) * tensors[layer + A].shape[0], 6) for layer in layers}
    if len(ranks) != 1 or len(alphas) != 1:
        raise ValueError(f"peft adapter: layers differ in rank {sorted(ranks)} or alpha {sorted(alphas)}")
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": ranks.pop(),
        "lora_alpha": alphas.pop(),
        "lora_dropout": 0.0,
        "target_modules": sorted({layer.rsplit(".", 1)[-1] for layer in layers}),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "modules_to_save": None,
    }
    state = {
        PEFT_PREFIX + layer + part: tensors[layer + part].contiguous() for layer in layers for part in (A, B)
    }
    return config, state


def write_peft_adapter(tensors: dict[str, Tensor], out: Path, base_model: str | None = None) -> Path:
    """Write :func:`peft_adapter` of ``tensors`` as a directory ``PeftModel.from_pretrained`` and vLLM's
    ``load_lora_adapter`` read."""
    from safetensors.torch import save_file

    config, state = peft_adapter(tensors, base_model)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return out
