"""Adapter-only weight updates: the wire form of a LoRA actor's update and how a server applies it.

A LoRA-trained actor (``learner/lora.py``) publishes, per adapted linear layer ``<m>``, three tensors
under Hugging Face names: ``<m>.lora_A.weight`` (r, in), ``<m>.lora_B.weight`` (out, r) and
``<m>.lora_scaling`` (0-d, α/r). Every update carries the whole adapter, so a receiver that keeps each
layer's original weight ``W0`` sets ``W = W0 + scaling · B @ A`` (docs/stages.md §5): any transport
(``shm``, ``dist``) moves these tensors like any others, ``r·(in + out)`` numbers per layer instead of
``in·out``. Applied by the ``hf`` engine (``rollout/engines/hf.py``).
"""

from __future__ import annotations

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
