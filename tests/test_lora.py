"""LoRA actors (peft): adapter-only weight sync into the hf engine, merged exports, LoRA sft and ppo learners.

Real peft adapters on the tiny real checkpoint, a real ``HFEngine``, real DeepSpeed engines, real Redis and
the real shm transport. Every merged weight is compared against ``W0 + scaling · B @ A`` computed here.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from buffer.streams import ReplayBuffer
from learner import lora
from learner.ppo import PPOLearner
from learner.sft import SFTTrainer
from rollout.engines.hf import HFEngine
from tandem.config import ConfigError, LoRAConfig, load_config
from tests.test_learner import group, history, raw_config
from toy.tasks import write_demonstrations
from weightsync.base import Update, WeightSyncError


def lora_model(tiny_ckpt, *, seed: int, rank: int = 4) -> torch.nn.Module:
    model = lora.wrap(
        AutoModelForCausalLM.from_pretrained(tiny_ckpt["actor"]), LoRAConfig(rank=rank, alpha=8)
    )
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at 0 (a no-op adapter): make the update visible
            p.data = torch.randn(p.shape, generator=gen) * 0.05
    return model


def by_hand(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """W0 + (α/r) · B @ A for every adapted layer, the base weight elsewhere, under HF names."""
    out = {}
    for name, m in model.named_modules():
        if hasattr(m, "lora_A") and "default" in m.lora_A:
            hf = name.removeprefix("base_model.model.")
            w0 = m.base_layer.weight.detach()
            out[hf + ".weight"] = (
                w0 + m.scaling["default"] * m.lora_B["default"].weight @ m.lora_A["default"].weight
            )
    return out


def as_update(named, version: int) -> Update:
    items = list(named)
    return Update(version=version, manifest=[], _iter=lambda: iter(items))


def test_adapter_update_sets_base_plus_low_rank_product_on_the_hf_engine(tiny_ckpt) -> None:
    engine = HFEngine(str(tiny_ckpt["actor"]), device="cpu", dtype="float32")
    base = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    for version, seed in ((1, 0), (2, 1)):  # the second update replaces the first, it does not add to it
        model = lora_model(tiny_ckpt, seed=seed)
        params = [(n, p.detach()) for n, p in model.named_parameters()]
        adapter = list(lora.adapter_tensors(model, params))
        assert all(n.endswith((".lora_A.weight", ".lora_B.weight", ".lora_scaling")) for n, _ in adapter)
        engine.update_weights(as_update(adapter, version))
        want = by_hand(model)
        live = dict(engine.model.named_parameters())
        assert len(want) == 14  # 7 linear layers x 2 blocks
        for name, p in live.items():
            torch.testing.assert_close(p, want.get(name, base[name]), atol=1e-6, rtol=1e-5, msg=name)
        merged = dict(lora.merged_tensors(model, params))
        for name, w in want.items():
            torch.testing.assert_close(merged[name], w, atol=1e-6, rtol=1e-5)
    assert engine.version == 2
    bad = [("model.layers.0.self_attn.q_proj.lora_A.weight", torch.zeros(4, 3)),
           ("model.layers.0.self_attn.q_proj.lora_B.weight", torch.zeros(64, 4)),
           ("model.layers.0.self_attn.q_proj.lora_scaling", torch.tensor(2.0))]  # fmt: skip
    with pytest.raises(
        WeightSyncError, match=r"update v3: adapter update for 'model\.layers\.0\.self_attn\.q_proj'"
    ):
        engine.update_weights(as_update(bad, 3))


def test_adapter_sync_needs_the_hf_or_vllm_engine() -> None:
    raw = {"model": {"actor": "x"}, "data": {"prompts": "y"}, "reward": {"functions": [{"path": "a:b"}]},
           "rollout": {"engine": "sglang"}, "learner": {"lora": {"rank": 4}}}  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"learner\.lora\.sync=adapter is not built for rollout\.engine=sglang"
    ):
        load_config(None, raw=raw)
    raw["learner"]["lora"]["sync"] = "merged"
    assert load_config(None, raw=raw).learner.lora.sync == "merged"
    raw["rollout"]["engine"], raw["learner"]["lora"]["sync"] = "vllm", "adapter"
    assert load_config(None, raw=raw).learner.lora.sync == "adapter"


@pytest.mark.slow
def test_lora_sft_trains_only_adapters_and_exports_merged_or_adapter(tiny_ckpt, tmp_path) -> None:
    data = write_demonstrations("echo", tmp_path / "sft.jsonl", 64, seed=1)
    raw = {
        "run": {"name": "lora-sft", "device": "cpu"}, "model": {"actor": str(tiny_ckpt["actor"])},
        "data": {"prompts": str(data)},
        "algorithm": {"recipe": "sft", "train_file": str(data), "eval_file": str(data), "batch_size": 16, "eval_interval": 4},
        "learner": {"total_steps": 4, "actor_lr": 1e-2, "micro_batch_size": 16, "checkpoint_interval": 0,
                    "lora": {"rank": 4, "alpha": 8}},
        "logging": {"wandb_mode": "disabled"},
    }  # fmt: skip
    trainer = SFTTrainer(load_config(None, raw=raw), tmp_path / "merged")
    trainer.run()
    summary = json.loads((tmp_path / "merged" / "summary.json").read_text())
    assert summary["after"]["eval/loss"] < summary["before"]["eval/loss"]
    module = trainer.actor.module
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_ckpt["actor"]).named_parameters())
    final = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "merged" / "final").named_parameters())
    want = by_hand(module)
    for name, p in final.items():
        torch.testing.assert_close(p, want.get(name, initial[name]), atol=1e-6, rtol=1e-5, msg=name)
    assert not torch.equal(
        final["model.layers.0.self_attn.q_proj.weight"], initial["model.layers.0.self_attn.q_proj.weight"]
    )

    # merge_final: false writes the adapter alone; merging it on request gives the same model.
    raw["learner"]["lora"]["merge_final"] = False
    SFTTrainer(load_config(None, raw=raw), tmp_path / "adapter").run()
    assert (tmp_path / "adapter" / "final" / "adapter_model.safetensors").exists()
    assert not (tmp_path / "adapter" / "final" / "model.safetensors").exists()
    out = lora.merge(tiny_ckpt["actor"], tmp_path / "adapter" / "final", tmp_path / "on-request")
    again = dict(AutoModelForCausalLM.from_pretrained(out).named_parameters())
    for name, p in final.items():  # the same seed and data: the same training
        torch.testing.assert_close(again[name], p, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.slow
def test_lora_ppo_publishes_only_adapter_tensors(
    tiny_ckpt, redis_server, redis_client, run_id, tmp_path
) -> None:
    steps = 4
    raw = raw_config(
        tiny_ckpt, redis_server.url, run_id, tmp_path,
        learner={"total_steps": steps, "actor_lr": 3e-2, "lora": {"rank": 2, "alpha": 16}, "save_hf_final": False},
    )  # fmt: skip
    cfg = load_config(None, raw=raw)
    buffer = ReplayBuffer.from_config(redis_client, cfg, "test-producer")
    for _ in range(steps):
        for g in range(2):
            buffer.put(group(g, 4))
    learner = PPOLearner(cfg, tmp_path / "run")
    learner.run()
    rows = history(redis_client, run_id)
    assert [r["learner/version"] for r in rows] == list(range(1, steps + 1))
    policy = [r["loss/policy"] for r in rows]
    assert policy[-1] < policy[0], policy
    module = learner.models.actor.module
    full_bytes = sum(p.numel() * p.element_size() for n, p in module.named_parameters() if "lora_" not in n)
    published = load_file(tmp_path / "weights" / f"v{steps:08d}" / "model.safetensors")
    assert published and all(
        n.endswith((".lora_A.weight", ".lora_B.weight", ".lora_scaling")) for n in published
    )
    nbytes = sum(t.numel() * t.element_size() for t in published.values())
    assert all(r["weightsync/bytes"] == nbytes for r in rows)
    assert nbytes < 0.1 * full_bytes, (nbytes, full_bytes)
