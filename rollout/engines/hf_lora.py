"""Several LoRA adapters served at once by the ``hf`` engine, each row of the running batch with its own.

``python -m rollout.server --standalone --model DIR --lora NAME=ADAPTER_DIR ...`` (as vLLM's
``--lora-modules``) serves each adapter under its ``NAME``: a request whose ``model`` is ``NAME`` generates
with that adapter, one naming the base model generates without any. peft loads every adapter beside the
others into the one base model (``PeftModel.load_adapter``), and a forward given ``adapter_names`` (peft's
mixed-batch inference) applies to each row its own adapter's ``scaling · B @ A`` on top of the shared base
weights. So rows of different adapters decode in the same step of the running batch, as multi-LoRA
batching does in vLLM (Punica, S-LoRA): one base model in memory, one forward per step.

A row's cached KV depends on its adapter, so each adapter's rows hash their prefixes from a seed of their
own (:func:`prefix_seed`) and never reuse another adapter's cache.

An adapter may also start empty, from a ``LoraConfig`` (peft's initial B = 0: the base model), and take
adapter-only updates of a LoRA actor (weightsync/adapters.py) later, as each adapter's run does when several
train at once (``learner.lora.adapters``, rollout/server.py): :func:`write_adapter` writes an update's
``lora_A``/``lora_B``/``lora_scaling`` into the adapter's own layers, leaving the base and the others as they
are. Each adapter's run drives the engine through its view of it (rollout/engines/adapter_view.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from weightsync.adapters import SCALING, A, B

if TYPE_CHECKING:
    from peft import LoraConfig


BASE = "__base__"  # peft's adapter_names entry for a row that takes no adapter


def check_adapter_dir(name: str, path: str | Path) -> dict[str, object]:
    """The adapter's ``adapter_config.json``, or a ValueError naming ``NAME=DIR`` and what is wrong."""
    where = f"LoRA adapter {name}={path}"
    config_file = Path(path) / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"{where}: no adapter_config.json there (a directory peft's save_pretrained wrote)")
    config = json.loads(config_file.read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{where}: peft_type {config.get('peft_type')!r}, not 'LORA'")
    if config.get("use_dora"):
        raise ValueError(f"{where}: a DoRA adapter (use_dora) cannot share a batch with others (peft)")
    if config.get("modules_to_save"):
        raise ValueError(
            f"{where}: modules_to_save {config['modules_to_save']} replace whole modules, which rows of other "
            "adapters share; serve its merged model instead (python -m learner.lora merge)"
        )
    return config


def load_adapters(model: nn.Module, adapters: Mapping[str, str | Path | LoraConfig]) -> nn.Module:
    """The peft model serving ``adapters`` (name -> a peft directory, or a ``LoraConfig`` for an adapter
    that starts empty) beside ``model``'s own weights.

    The base weights stay the same tensors (peft keeps each adapted ``Linear`` as its ``base_layer``), so
    the engine's name -> tensor map of the base model, built before, still writes into the live weights.
    """
    from peft import LoraConfig, PeftModel, get_peft_model  # (imported by engines that serve adapters only)

    if not adapters:
        raise ValueError("load_adapters: no adapter given")
    bad = [name for name in adapters if not name or name == BASE or "/" in name]
    if bad:
        raise ValueError(f"LoRA adapter names {bad}: give each a plain name, not {BASE!r}, without '/'")
    for name, given in adapters.items():
        if not isinstance(given, LoraConfig):
            check_adapter_dir(name, given)
    peft_model = None
    for name, given in adapters.items():
        if isinstance(given, LoraConfig):
            if peft_model is None:
                peft_model = get_peft_model(model, given, adapter_name=name)
            else:
                peft_model.add_adapter(name, given)
        elif peft_model is None:
            peft_model = PeftModel.from_pretrained(model, str(given), adapter_name=name, is_trainable=False)
        else:
            peft_model.load_adapter(str(given), adapter_name=name, is_trainable=False)
    assert peft_model is not None
    return peft_model.eval().requires_grad_(False)


@torch.no_grad()
def write_adapter(model: nn.Module, name: str, tensors: Mapping[str, Tensor]) -> list[str]:
    """Write an adapter-only update (per layer ``<m>.lora_A.weight``, ``<m>.lora_B.weight``,
    ``<m>.lora_scaling``, Hugging Face names) into adapter ``name`` of the peft-wrapped ``model`` (the
    plain model peft injected into); returns the layers written. A layer the adapter does not have, a
    shape of another rank, or a tensor other than these is refused before anything is written."""
    layers = sorted(n.removesuffix(SCALING) for n in tensors if n.endswith(SCALING))
    if other := [n for n in tensors if not n.endswith((A, B, SCALING))]:
        raise ValueError(f"adapter {name!r}: {other[:3]} are not adapter tensors (modules trained in full?)")
    targets = []
    for layer in layers:
        try:
            module = model.get_submodule(layer)
        except AttributeError:
            module = None
        if module is None or name not in getattr(module, "lora_A", {}):
            raise ValueError(f"adapter {name!r} has no layer {layer!r}")
        a, b = module.lora_A[name].weight, module.lora_B[name].weight
        if tuple(tensors[layer + A].shape) != tuple(a.shape) or tuple(tensors[layer + B].shape) != tuple(
            b.shape
        ):
            raise ValueError(
                f"adapter {name!r}, {layer}: the update's A {tuple(tensors[layer + A].shape)} and B "
                f"{tuple(tensors[layer + B].shape)}, the adapter's {tuple(a.shape)} and {tuple(b.shape)}"
            )
        targets.append((layer, module, a, b))
    for layer, module, a, b in targets:
        a.copy_(tensors[layer + A])
        b.copy_(tensors[layer + B])
        module.scaling[name] = float(tensors[layer + SCALING])
    return layers


def row_adapters(adapters: Sequence[str | None]) -> list[str]:
    """peft's ``adapter_names`` for rows that take ``adapters`` (None: the base model)."""
    return [BASE if a is None else a for a in adapters]


def prefix_seed(adapter: str | None, served: Sequence[str]) -> int:
    """The first prefix hash of a row of ``adapter`` (0 for the base model): distinct per served adapter, so
    the prefix cache never hands one adapter's KV to another's row."""
    return 0 if adapter is None else 1 + list(served).index(adapter)
