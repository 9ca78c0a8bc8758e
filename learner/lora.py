"""LoRA on the actor (peft): wrap, publish adapter-only updates, merge into a plain Hugging Face model.

``learner.lora.rank > 0`` wraps the actor of ``sft``, ``dpo`` and ``ppo`` in peft's ``LoraConfig``
adapters: the base weights are frozen, only ``lora_A``/``lora_B`` train (docs/stages.md §5). Three views of
such a model, each a stream of ``(name, tensor)`` under Hugging Face names (``model.layers.0...``):

- :func:`adapter_tensors`: per adapted linear layer ``<module>.lora_A.weight`` (r, in),
  ``<module>.lora_B.weight`` (out, r) and ``<module>.lora_scaling`` (a 0-d tensor, α/r). This is the
  adapter-only weight sync (``weightsync/adapters.py``): a rollout server holding the base weights ``W0``
  applies ``W = W0 + scaling · B @ A``, so a sync moves ``r·(in + out)`` numbers per layer, not ``in·out``.
  Modules trained in full (``lora.modules_to_save``, e.g. the RMSNorms: a frozen final norm and tied
  embeddings cap the logits' scale, so LoRA alone cannot sharpen a near-uniform random model) are sent
  whole under their own names.
- :func:`merged_tensors`: every weight with the adapters merged in, as a full checkpoint names them; what
  ``lora.sync: merged`` publishes (any engine) and what the final HF directory holds.
- ``save_pretrained`` of the peft model (``lora.merge_final: false``): the adapter alone, which
  ``python -m learner.lora merge BASE ADAPTER OUT`` turns into a full model on request.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

from learner import moe
from tandem.config import LoRAConfig
from weightsync.adapters import SCALING

PEFT_PREFIX = "base_model.model."
ADAPTER = "default"


def wrap(model: nn.Module, lora: LoRAConfig) -> nn.Module:
    """``model`` with LoRA adapters on ``lora.target_modules``; only the adapters train."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        modules_to_save=list(lora.modules_to_save) or None,
        bias="none",
        task_type="CAUSAL_LM",
    )
    blocks = tuple(moe.moe_block_classes(model))
    experts = [name for name, m in model.named_modules() if blocks and isinstance(m, blocks)]
    model = get_peft_model(model, config)
    # peft maps gate/up/down_proj onto a MoE block's fused 3-d expert tensors; the adapter sync and the
    # merge here handle Linear layers only, so a MoE model takes adapters on its attention.
    adapted = [n for n, p in model.named_parameters() if p.requires_grad and ".lora_" in n]
    inside = [n for n in adapted if any(f".{e}." in n for e in experts)]
    if inside:
        raise ValueError(
            f"learner.lora.target_modules {list(lora.target_modules)} adapt the experts of a "
            f"mixture-of-experts model ({inside[0]}), which is not supported: set target_modules to the "
            "attention projections, [q_proj, k_proj, v_proj, o_proj]"
        )
    return model


def is_lora(module: nn.Module) -> bool:
    return hasattr(module, "peft_config")


SAVED, ORIGINAL = f".modules_to_save.{ADAPTER}.", ".original_module."


def _hf_name(peft_name: str) -> str:
    """``base_model.model.model.layers.0.q_proj.base_layer.weight`` -> ``model.layers.0.q_proj.weight``
    (and a ``modules_to_save`` copy's name to its module's)."""
    name = peft_name.removeprefix(PEFT_PREFIX)
    return name.replace(".base_layer.", ".").replace(SAVED, ".")


def _scalings(module: nn.Module) -> dict[str, float]:
    """α/r of every adapted layer, by its Hugging Face module name."""
    return {
        _hf_name(name): float(m.scaling[ADAPTER])
        for name, m in module.named_modules()
        if hasattr(m, "lora_A") and ADAPTER in getattr(m, "scaling", {})
    }


def adapter_tensors(module: nn.Module, named: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """The adapter-only update from the peft model's ``named`` parameters (full tensors, e.g. gathered)."""
    scalings = _scalings(module)
    for name, t in named:
        if SAVED in name:  # a module trained in full (modules_to_save): sent whole, under its own name
            yield _hf_name(name), t
        for part in ("lora_A", "lora_B"):
            tag = f".{part}.{ADAPTER}.weight"
            if name.endswith(tag):
                layer = _hf_name(name[: -len(tag)])
                yield f"{layer}.{part}.weight", t
                if part == "lora_B":
                    yield layer + SCALING, torch.tensor(scalings[layer], dtype=torch.float32)


def merged_tensors(module: nn.Module, named: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """Every base weight under its Hugging Face name, adapters merged (``W0 + scaling · B @ A``)."""
    scalings, lora, base = _scalings(module), {}, []
    for name, t in named:
        if f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name:
            lora[name.replace(f".{ADAPTER}.", ".")] = t
        else:
            base.append((name, t))
    for name, t in base:
        if ORIGINAL in name:  # superseded by its trained modules_to_save copy
            continue
        hf = _hf_name(name)
        layer = hf.removesuffix(".weight")
        if name.endswith(".base_layer.weight") and layer in scalings:
            peft_layer = name.removesuffix(".base_layer.weight")
            a, b = lora[f"{peft_layer}.lora_A.weight"], lora[f"{peft_layer}.lora_B.weight"]
            t = (t.float() + scalings[layer] * (b.float() @ a.float())).to(t.dtype)
        yield hf, t


def merge(base_dir: str | Path, adapter_dir: str | Path, out: str | Path) -> Path:
    """A saved adapter merged into its base model, written as a plain Hugging Face directory."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base_dir)
    merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    merged.save_pretrained(out)
    AutoTokenizer.from_pretrained(
        adapter_dir if (Path(adapter_dir) / "tokenizer.json").exists() else base_dir
    ).save_pretrained(out)
    return Path(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m learner.lora", description="LoRA checkpoint tools")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("merge", help="merge a saved adapter into its base model (a plain HF directory)")
    p.add_argument("base")
    p.add_argument("adapter")
    p.add_argument("out")
    args = ap.parse_args(argv)
    print(merge(args.base, args.adapter, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
