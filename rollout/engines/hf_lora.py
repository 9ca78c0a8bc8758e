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
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from torch import nn

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


def load_adapters(model: nn.Module, adapters: Mapping[str, str | Path]) -> nn.Module:
    """The peft model serving ``adapters`` (name -> directory) beside ``model``'s own weights.

    The base weights stay the same tensors (peft keeps each adapted ``Linear`` as its ``base_layer``), so
    the engine's name -> tensor map of the base model, built before, still writes into the live weights.
    """
    from peft import PeftModel

    if not adapters:
        raise ValueError("load_adapters: no adapter given")
    bad = [name for name in adapters if not name or name == BASE or "/" in name]
    if bad:
        raise ValueError(f"LoRA adapter names {bad}: give each a plain name, not {BASE!r}, without '/'")
    for name, path in adapters.items():
        check_adapter_dir(name, path)
    (first, first_dir), *rest = adapters.items()
    peft_model = PeftModel.from_pretrained(model, str(first_dir), adapter_name=first, is_trainable=False)
    for name, path in rest:
        peft_model.load_adapter(str(path), adapter_name=name, is_trainable=False)
    return peft_model.eval()


def row_adapters(adapters: Sequence[str | None]) -> list[str]:
    """peft's ``adapter_names`` for rows that take ``adapters`` (None: the base model)."""
    return [BASE if a is None else a for a in adapters]


def prefix_seed(adapter: str | None, served: Sequence[str]) -> int:
    """The first prefix hash of a row of ``adapter`` (0 for the base model): distinct per served adapter, so
    the prefix cache never hands one adapter's KV to another's row."""
    return 0 if adapter is None else 1 + list(served).index(adapter)
