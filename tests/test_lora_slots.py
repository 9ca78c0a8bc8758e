"""Adapter-only sync into vLLM without vLLM: which adapter versions stay loaded, which version a request
uses, the peft directory the publisher writes, the server flags, and the config checks."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from rollout.engines.lora_slots import AdapterSlots, lora_name
from tandem.config import Config, load_config
from weightsync.adapters import peft_adapter, write_peft_adapter


def test_version_zero_is_the_base_model() -> None:
    assert lora_name(0) is None and lora_name(7) == "v7"
    assert lora_name(0, "echo") is None and lora_name(7, "echo") == "echo-v7"  # one of several adapters' runs
    slots = AdapterSlots(keep=2)
    assert slots.acquire() == 0 and slots.release(0) == []


def test_the_newest_keep_versions_stay_and_older_ones_go_once_unused() -> None:
    slots = AdapterSlots(keep=2)
    assert slots.loaded_as(1) == []
    held = slots.acquire()  # a request sent under v1
    assert held == 1
    assert slots.loaded_as(2) == []
    assert slots.acquire() == 2 and slots.release(2) == []
    assert slots.loaded_as(3) == []  # v1 is beyond keep but in flight
    assert slots.loaded == [1, 2, 3]
    assert slots.release(1) == [1]  # its last request returned
    assert slots.loaded == [2, 3]
    assert slots.loaded_as(4) == [2]
    with pytest.raises(ValueError, match="not newer"):
        slots.loaded_as(4)


def test_racing_releases_hand_out_a_version_once() -> None:
    slots = AdapterSlots(keep=1)
    slots.loaded_as(1)
    n = 64
    for _ in range(n):
        slots.acquire()
    slots.loaded_as(2)
    freed: list[list[int]] = []
    threads = [threading.Thread(target=lambda: freed.append(slots.release(1))) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(v for f in freed for v in f) == [1] and slots.loaded == [2]


def adapter_update(rank: int = 4, scaling: float = 2.0) -> dict[str, torch.Tensor]:
    out = {}
    for layer in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        out[f"{layer}.lora_A.weight"] = torch.randn(rank, 16)
        out[f"{layer}.lora_B.weight"] = torch.randn(24, rank)
        out[f"{layer}.lora_scaling"] = torch.tensor(scaling)
    return out


def test_the_peft_form_of_an_update() -> None:
    tensors = adapter_update()
    config, state = peft_adapter(tensors, "/base")
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8.0, ["down_proj", "q_proj"])
    assert set(state) == {f"base_model.model.{n}" for n in tensors if not n.endswith("lora_scaling")}
    with pytest.raises(ValueError, match="whole modules"):
        peft_adapter({**tensors, "model.norm.weight": torch.ones(16)})
    mixed = {**tensors, "model.layers.1.mlp.down_proj.lora_scaling": torch.tensor(1.0)}
    with pytest.raises(ValueError, match="alpha"):
        peft_adapter(mixed)


def test_a_written_adapter_loads_in_peft_as_the_learner_applies_it(tmp_path: Path) -> None:
    """The directory ``PeftModel.from_pretrained`` reads gives the same logits as W0 + scaling · B @ A."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from learner import lora
    from tandem.config import LoRAConfig
    from toy.tiny import make_tiny

    actor = make_tiny(tmp_path / "tiny", seed=0)["actor"]
    model = lora.wrap(
        AutoModelForCausalLM.from_pretrained(actor, dtype=torch.float32),
        LoRAConfig(rank=4, alpha=8.0, target_modules=["q_proj", "up_proj"]),
    ).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.normal_(std=0.3)
    write_peft_adapter(dict(lora.adapter_tensors(model, model.named_parameters())), tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(actor, dtype=torch.float32), tmp_path / "adapter"
    ).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, loaded(ids).logits, atol=1e-5)


LORA = {"rank": 12, "target_modules": ["q_proj"]}


def cfg_for(engine: str, lora: dict | None = None, transport: str = "shm") -> Config:
    raw = {
        "model": {"actor": "/unused"},
        "data": {"prompts": "/unused.jsonl"},
        "reward": {"functions": [{"path": "toy.tasks.echo:reward"}]},
        "algorithm": {"max_staleness": 2},
        "learner": {"lora": LORA if lora is None else lora},
        "rollout": {"engine": engine},
        "weightsync": {"transport": transport},
    }
    return load_config(None, raw=raw)


def test_vllm_takes_adapter_sync_over_shm_with_lora_flags() -> None:
    from rollout.engines.vllm import adapter_versions, serve_argv

    cfg = cfg_for("vllm")
    assert adapter_versions(cfg) == 3
    argv = serve_argv(cfg, "/m", "127.0.0.1", 8000, cpu=True)
    flags = argv[argv.index("--enable-lora") :][:7]
    assert flags == ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "3", "--max-cpu-loras", "6"]
    assert "--enable-lora" not in serve_argv(cfg_for("vllm", lora={}), "/m", "h", 1, cpu=True)


@pytest.mark.parametrize(
    ("engine", "transport", "match"),
    [
        ("sglang", "shm", "not built for rollout.engine=sglang"),
        ("vllm", "dist", "needs weightsync.transport=shm"),
    ],
)
def test_adapter_sync_refusals_name_the_field(engine: str, transport: str, match: str) -> None:
    with pytest.raises(ValueError, match=match) as e:
        cfg_for(engine, transport=transport)
    assert "learner.lora.sync" in str(e.value)


def test_vllm_adapter_sync_refuses_modules_trained_in_full() -> None:
    with pytest.raises(ValueError, match=r"learner\.lora\.modules_to_save"):
        cfg_for("vllm", lora={**LORA, "modules_to_save": ["norm"]})
