"""Real vLLM / SGLang engines on a tiny checkpoint: generate, update weights, and check the logprobs.

Runs only where a CUDA GPU and the engine package are present (``.venv-vllm`` / ``.venv-sglang``, see
``scripts/engines-env.sh``); skipped with the reason elsewhere. After each update, the behaviour logprobs the
engine reports must match a float32 forward pass of the *new* weights (temperature 1, no truncation), and every
token must carry the new version. The dist test needs two GPUs: NCCL cannot put the learner and the engine
on one device.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout.engines.base import Completion, SamplingParams
from tandem.config import Config, load_config
from weightsync.base import Update

pytestmark = [pytest.mark.gpu, pytest.mark.engines, pytest.mark.slow]

ENGINES = ["vllm", "sglang"]


def need(engine: str, gpus: int = 1) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < gpus:
        pytest.skip(
            f"needs {gpus} CUDA GPU(s); found {torch.cuda.device_count() if torch.cuda.is_available() else 0}"
        )
    if importlib.util.find_spec(engine) is None:
        pytest.skip(f"{engine} is not installed in this environment (scripts/engines-env.sh {engine})")


def make_cfg(tmp_path: Path, engine: str, actor: Path) -> Config:
    raw = {
        "run": {"output_dir": str(tmp_path), "device": "cuda"},
        "model": {"actor": str(actor), "dtype": "float32"},
        "data": {"prompts": "/unused.jsonl"},
        "reward": {"functions": [{"path": "toy.tasks.echo:reward"}]},
        "rollout": {
            "engine": engine,
            "vllm": {"gpu_memory_utilization": 0.2, "startup_timeout_s": 600},
            "sglang": {"mem_fraction_static": 0.2, "startup_timeout_s": 600},
        },
        "weightsync": {"transport": "dist", "backend": "nccl", "timeout_s": 120},
    }
    return load_config(None, raw=raw)


def start(engine: str, cfg: Config, actor: Path):
    if engine == "vllm":
        from rollout.engines.vllm import VLLMEngine

        return VLLMEngine(cfg, str(actor), server_index=0, device="cuda:0")
    from rollout.engines.sglang import SGLangEngine

    return SGLangEngine(cfg, str(actor), server_index=0, device="cuda:0")


def perturbed(actor: Path, out: Path, scale: float) -> dict[str, torch.Tensor]:
    """New weights: the checkpoint with every matrix scaled, saved HF-loadable to ``out``."""
    model = AutoModelForCausalLM.from_pretrained(actor, torch_dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    model.save_pretrained(out)
    for f in actor.glob("*token*"):
        (out / f.name).write_bytes(f.read_bytes())
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_logprobs_match(
    weights_dir: Path, prompts: list[list[int]], outs: list[list[Completion]], version: int
):
    model = AutoModelForCausalLM.from_pretrained(weights_dir, torch_dtype=torch.float32).eval()
    for prompt, comps in zip(prompts, outs, strict=True):
        for c in comps:
            assert c.versions == [version] * len(c.token_ids)
            ids = torch.tensor([prompt + c.token_ids])
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1 : -1]  # (R, V)
            ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=2e-3, rtol=0)


@pytest.mark.parametrize("engine", ENGINES)
def test_generate_then_reload_from_disk(engine, tmp_path, request):
    need(engine)  # before building the tiny checkpoint, so a skip costs nothing
    actor = request.getfixturevalue("tiny_ckpt")["actor"]
    cfg = make_cfg(tmp_path, engine, actor)
    eng = start(engine, cfg, actor)
    try:
        prompts = [[1, 2, 3], [4, 5]]
        sampling = SamplingParams(n=2, max_new_tokens=8, temperature=1.0, seed=0)
        assert_logprobs_match(actor, prompts, eng.generate(prompts, sampling), 0)
        new_dir = tmp_path / "v1"
        perturbed(actor, new_dir, 1.5)
        eng.update_weights(Update(version=1, manifest=[], _iter=lambda: iter(()), path=str(new_dir)))
        assert eng.version == 1
        assert_logprobs_match(new_dir, prompts, eng.generate(prompts, sampling), 1)
    finally:
        eng.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_nccl_push_from_the_learner(engine, tmp_path, request, run_id):
    need(engine, gpus=2)
    from weightsync.engine_push import (
        EngineEndpoint,
        EnginePublisher,
        EngineVersionSubscriber,
        register_engine,
    )

    actor = request.getfixturevalue("tiny_ckpt")["actor"]
    redis_client = request.getfixturevalue("redis_client")
    cfg = make_cfg(tmp_path, engine, actor)
    eng = start(engine, cfg, actor)
    torch.cuda.set_device(1)  # the learner's end of the group; the engine holds cuda:0
    pub = EnginePublisher(cfg, redis_client, run_id, master_address="127.0.0.1")
    try:
        register_engine(redis_client, run_id, EngineEndpoint(0, engine, eng.url, eng.world_size()))
        new = perturbed(actor, tmp_path / "v1", 0.5)
        pub.publish(iter(new.items()), 1)
        update = EngineVersionSubscriber(redis_client, run_id, server_id="0").poll(timeout=5)
        assert update is not None
        eng.update_weights(update)
        prompts = [[7, 8, 9]]
        outs = eng.generate(prompts, SamplingParams(n=2, max_new_tokens=8, seed=1))
        assert_logprobs_match(tmp_path / "v1", prompts, outs, 1)
    finally:
        pub.close()
        eng.close()
