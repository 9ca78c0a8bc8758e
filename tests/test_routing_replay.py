"""Routing replay (R3): forced router weights, recording in the hf engine, the trajectory's wire form and the
learner's forward forced to the engine's routing (learner/routing_replay.py, docs/design.md §4.11)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from buffer.schema import SchemaError, Trajectory, decode_trajectory, encode_trajectory, routed_dtype
from learner import moe
from learner.batch import MicroBatch, make_batch, micro_batches, response_view, trajectory_problem
from learner.losses import logprobs_from_logits
from learner.models import policy_logits
from learner.routing_replay import RoutingReplay, flipped, forced_routing
from rollout.engines.base import SamplingParams
from rollout.engines.hf import HFEngine
from tandem.config import ConfigError, load_config


def router(norm: bool, *, experts: int = 4, k: int = 2, hidden: int = 8) -> Qwen3MoeTopKRouter:
    cfg = Qwen3MoeConfig(hidden_size=hidden, num_experts=experts, num_experts_per_tok=k, norm_topk_prob=norm)
    r = Qwen3MoeTopKRouter(cfg)
    torch.nn.init.normal_(r.weight, generator=torch.Generator().manual_seed(0))
    return r


def test_forced_routing_by_hand() -> None:
    # softmax([0, ln 2, ln 3, ln 4]) = [1, 2, 3, 4] / 10; recorded {0, 2}: weights 1/10, 3/10, renormalised 1/4, 3/4
    logits = torch.log(torch.tensor([[1.0, 2, 3, 4]]))
    scores, idx = forced_routing(logits, torch.tensor([[0, 2]]), norm_topk_prob=False)
    torch.testing.assert_close(scores, torch.tensor([[0.1, 0.3]]))
    scores, idx = forced_routing(logits, torch.tensor([[0, 2]]))
    torch.testing.assert_close(scores, torch.tensor([[0.25, 0.75]]))
    assert idx.tolist() == [[0, 2]] and idx.dtype == torch.long
    # GPT-OSS: softmax over the recorded logits themselves, the same renormalisation
    scores, _ = forced_routing(logits, torch.tensor([[0, 2]]), style="topk_softmax")
    torch.testing.assert_close(scores, torch.tensor([[0.25, 0.75]]))


def test_forced_routing_equals_the_router_on_its_own_choice() -> None:
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    for norm in (True, False):
        r = router(norm)
        logits, scores, indices = r(x)
        forced, idx = forced_routing(logits, indices, norm_topk_prob=norm)
        assert torch.equal(forced, scores) and torch.equal(idx, indices)  # bit-identical
    r16 = router(True).to(torch.bfloat16)
    logits, scores, indices = r16(x.to(torch.bfloat16))
    forced, _ = forced_routing(logits, indices)
    assert forced.dtype == torch.bfloat16 and torch.equal(forced, scores)


def test_forced_routing_passes_the_gradient_to_the_router() -> None:
    r = router(True)
    logits, _, _ = r(torch.randn(5, 8))
    scores, _ = forced_routing(logits, torch.tensor([[3, 1]] * 5))
    scores[:, 0].sum().backward()
    assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0


def test_flipped_ignores_order() -> None:
    own = torch.tensor([[0, 1], [2, 3], [1, 0]])
    assert flipped(own, torch.tensor([[1, 0], [2, 1], [0, 1]])).tolist() == [False, True, False]


# -------------------------------------------------------------------- the engine records, the learner replays


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from toy.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny-moe-r3"), arch="qwen3-moe")


@pytest.fixture(scope="module")
def rolled(tiny_moe: dict[str, Path]) -> list[Trajectory]:
    """Two prompts x 2 samples from the hf engine recording its routing, through the wire and back."""
    engine = HFEngine(str(tiny_moe["actor"]), device="cpu", seed=0, record_routing=True)
    try:
        assert engine.prefix_cache is None  # a cached prefix would never be routed again
        prompts = [[1, 5, 9, 12, 7, 3, 20, 4], [1, 30, 31]]
        out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=12, temperature=1.0, seed=3))
    finally:
        engine.close()
    trajs = []
    for i, (p, group) in enumerate(zip(prompts, out, strict=True)):
        for j, c in enumerate(group):
            r = c.routed_experts
            assert r is not None and r.dtype == np.uint8
            assert r.shape == (len(p) + len(c.token_ids) - 1, 2, 2)  # every fed position, 2 layers, top-2
            t = Trajectory(
                traj_id=f"{i}-{j}",
                group_id=str(i),
                prompt_id=str(i),
                prompt_tokens=p,
                response_tokens=c.token_ids,
                behav_logp=c.logprobs,
                token_versions=c.versions,
                reward=0.0,
                routed_experts=r,
            )
            trajs.append(decode_trajectory(encode_trajectory(t)))
    return trajs


def captured(model: torch.nn.Module) -> list[list[Tensor]]:
    """The indices each router returns (after any replay hook), per forward pass, in layer order."""
    out: list[list[Tensor]] = []

    def hook(module: torch.nn.Module, args: object, output: tuple[Tensor, ...]) -> None:
        if not out or len(out[-1]) == len(rs):
            out.append([])
        out[-1].append(output[2])

    rs = moe.routers(model)
    for r in rs:
        r.register_forward_hook(hook)
    return out


def forward(model: torch.nn.Module, replay: RoutingReplay, mb: MicroBatch, force: bool) -> Tensor:
    """Response log-probabilities (b, R) of ``mb``, with or without the recorded routing."""
    with torch.no_grad(), replay.replaying(mb.routed if force else None):
        logits = response_view(policy_logits(model, mb, 1.0), mb)
    return logprobs_from_logits(logits, mb.targets)


def load(path: Path, *, perturb: float = 0.0) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # the trainer's numerics differing from the engine's, in the routers only
        for r in moe.routers(model):
            r.weight.add_(perturb * r.weight.std() * torch.randn(r.weight.shape, generator=g))
    return model


def test_the_wire_carries_routed_experts(rolled: list[Trajectory]) -> None:
    t = rolled[0]
    assert t.routed_experts is not None and t.routed_experts.shape[1:] == (2, 2)
    plain = dataclasses.replace(t, routed_experts=None)
    back = decode_trajectory(encode_trajectory(plain))
    assert back.routed_experts is None and encode_trajectory(back) == encode_trajectory(plain)
    wide = dataclasses.replace(t, routed_experts=t.routed_experts.astype(routed_dtype(300)))
    assert np.array_equal(decode_trajectory(encode_trajectory(wide)).routed_experts, t.routed_experts)
    short = dataclasses.replace(t, routed_experts=t.routed_experts[:-1])
    with pytest.raises(SchemaError, match="routed_experts"):
        decode_trajectory(encode_trajectory(short))
    assert "routed_experts" in (trajectory_problem(t, 10_000, (3, 2, 8)) or "")
    assert "outside the model's 1" in (trajectory_problem(t, 10_000, (2, 2, 1)) or "")
    assert trajectory_problem(t, 10_000, (2, 2, 8)) is None


@pytest.mark.parametrize("layout", ["pad", "pack"])
def test_replay_routes_as_the_engine_did(
    rolled: list[Trajectory], tiny_moe: dict[str, Path], layout: str
) -> None:
    batch = make_batch(rolled, 0)
    (mb,) = micro_batches(batch, torch.arange(len(batch)), len(batch), layout, torch.device("cpu"))
    assert mb.routed is not None and mb.routed.shape == (mb.input_ids.numel(), 2, 2)
    recorded = mb.routed
    valid = recorded[:, 0, 0] >= 0
    assert int(valid.sum()) == sum(len(t.routed_experts) for t in rolled)
    mask = batch.mask[mb.rows].bool()

    # The engine's own weights: its routing is the learner's, and replay changes nothing, bit for bit.
    same = load(tiny_moe["actor"])
    replay, seen = RoutingReplay(same), captured(same)
    plain = forward(same, replay, mb, force=False)
    assert torch.equal(torch.stack(seen[-1], 1)[valid], recorded[valid])
    assert torch.equal(forward(same, replay, mb, force=True), plain)
    assert replay.take_flips()[0] == 0

    # Perturbed routers flip some tokens' experts in every layer, and the log-probabilities move.
    moved = load(tiny_moe["actor"], perturb=0.3)
    replay, seen = RoutingReplay(moved), captured(moved)
    plain = forward(moved, replay, mb, force=False)
    own = torch.stack(seen[-1], 1)  # (T, layers, k)
    per_layer = [int(flipped(own[valid, i], recorded[valid, i]).sum()) for i in range(2)]
    assert all(n > 0 for n in per_layer), per_layer
    print(f"flipped slots per layer {per_layer} of {int(valid.sum())} tokens")
    replayed = forward(moved, replay, mb, force=True)
    flips, slots = replay.take_flips()
    assert int(flips) == sum(per_layer) and int(slots) == 2 * int(valid.sum())
    assert not torch.allclose(plain[mask], replayed[mask], atol=1e-4)
    # With replay every router chose exactly the recorded experts, for every recorded token and layer.
    assert torch.equal(torch.stack(seen[-1], 1)[valid], recorded[valid])
    # ... and its weights are the learner's own softmax over them, so the router still gets a gradient.
    with replay.replaying(mb.routed):
        logits = response_view(policy_logits(moved, mb, 1.0), mb)
    logprobs_from_logits(logits, mb.targets)[mask].sum().backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in moe.routers(moved))


def test_routing_replay_is_refused_where_nothing_records_it(tiny_ckpt: dict[str, Path]) -> None:
    raw = {"model": {"actor": "x"}, "data": {"prompts": "y"}, "reward": {"functions": [{"path": "a:b"}]},
           "rollout": {"engine": "sglang"}, "algorithm": {"routing_replay": "rollout"}}  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"algorithm\.routing_replay=rollout needs rollout\.engine hf or vllm"
    ):
        load_config(None, raw=raw)
    for engine in ("hf", "vllm"):  # vLLM records with --enable-return-routed-experts (tests/test_vllm_moe.py)
        raw["rollout"]["engine"] = engine
        assert load_config(None, raw=raw).algorithm.routing_replay == "rollout"
    with pytest.raises(ValueError, match="recording routing needs a mixture-of-experts model"):
        HFEngine(str(tiny_ckpt["actor"]), device="cpu", record_routing=True)  # a dense model
    assert RoutingReplay.of(load(tiny_ckpt["actor"])) is None


def test_the_learner_replays_and_counts_flips(
    rolled: list[Trajectory], tiny_moe: dict[str, Path], tiny_ckpt: dict[str, Path], tmp_path: Path
) -> None:
    """PPOLearner with routing_replay=rollout: its proximal pass routes through the recorded experts, its
    training step logs moe/routing_flips; a dense actor is refused naming the field."""
    from learner.ppo import PPOLearner
    from tests.test_learner import raw_config

    sizes = {"batch_size": 4, "minibatch_size": 4, "routing_replay": "rollout"}
    raw = raw_config(tiny_moe, "redis://unused", "r3", tmp_path, algorithm=sizes, rollout={"n_samples": 2})
    learner = PPOLearner(load_config(None, raw=raw), tmp_path)
    learner.models = learner.load_models()
    assert learner.routing_shape == (2, 2, 8)
    module = learner.models.actor.module
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for r in moe.routers(module):
            r.weight.add_(0.3 * r.weight.std() * torch.randn(r.weight.shape, generator=g))
    batch = make_batch(rolled, 0)
    bare = make_batch([dataclasses.replace(t, routed_experts=None) for t in rolled], 0)
    replayed, plain = learner.score(batch)[0], learner.score(bare)[0]
    mask = batch.mask.bool()
    assert not torch.allclose(replayed[mask], plain[mask], atol=1e-4)
    flips = learner.train(batch)["moe/routing_flips"]
    assert 0 < flips < 1
    assert "moe/routing_flips" not in learner.train(bare)  # nothing recorded: no metric

    raw = raw_config(
        tiny_ckpt, "redis://unused", "r3d", tmp_path / "d", algorithm=sizes, rollout={"n_samples": 2}
    )
    dense = PPOLearner(load_config(None, raw=raw), tmp_path / "d")
    with pytest.raises(
        ValueError, match=r"algorithm\.routing_replay=rollout needs a mixture-of-experts actor"
    ):
        dense.load_models()


def test_the_mismatch_bench_shows_replay_lowering_the_kl() -> None:
    """``bench/moe_mismatch.py`` at small size: an engine in bfloat16 against a float32 learner flips some
    routing slots, and replaying the recorded experts lowers the mismatch KL (docs/benchmarks.md)."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, str(root / "bench/moe_mismatch.py"), "--prompts", "8", "--tokens", "32", "--hidden", "64",
         "--layers", "2"],
        cwd=root, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["replay"]["routing_flip_frac"] > 0, result
    assert result["replay"]["kl_k3"] < result["own"]["kl_k3"], result


def test_vllm_routing_is_asked_for_and_decoded() -> None:
    """The vLLM adapter's side, without a server (the server's side: tests/test_vllm_moe.py): replay adds
    ``--enable-return-routed-experts``, and a choice's ``routed_experts``, base64 of ``.npy`` bytes as vLLM's
    ``numpy2base64`` writes them, decodes to the completion's (P + R - 1, layers, k) array in a wire dtype."""
    import base64
    import io

    from rollout.engines.vllm import parse_generate, serve_argv

    raw = {"model": {"actor": "x"}, "data": {"prompts": "y"}, "reward": {"functions": [{"path": "a:b"}]},
           "rollout": {"engine": "vllm"}}  # fmt: skip
    assert "--enable-return-routed-experts" not in serve_argv(
        load_config(None, raw=raw), "/m", "h", 1, cpu=True
    )
    raw["algorithm"] = {"routing_replay": "rollout"}
    assert "--enable-return-routed-experts" in serve_argv(load_config(None, raw=raw), "/m", "h", 1, cpu=True)

    def npy(a: np.ndarray) -> str:
        buffer = io.BytesIO()
        np.save(buffer, a, allow_pickle=False)
        return base64.b64encode(buffer.getvalue()).decode("ascii")

    rng = np.random.default_rng(0)
    routed = [
        rng.integers(0, 8, (4 + 3 - 1, 2, 2)).astype(np.uint8),
        rng.integers(0, 300, (5, 2, 2)).astype(np.uint16),
    ]
    body = {
        "choices": [
            {"index": i, "token_ids": [5] * n, "finish_reason": "length", "routed_experts": npy(r),
             "logprobs": {"content": [{"token_id": 5, "logprob": -1.0}] * n},
             "weight_versions": [{"start": 0, "end": n, "version": "0"}]}
            for i, (n, r) in enumerate(zip((3, 2), routed, strict=True))
        ]
    }  # fmt: skip
    out = parse_generate(body, 2, "test")
    assert out[0].routed_experts.dtype == np.uint8 and np.array_equal(out[0].routed_experts, routed[0])
    assert out[1].routed_experts.dtype == np.int32 and np.array_equal(out[1].routed_experts, routed[1])
    del body["choices"][0]["routed_experts"]
    assert parse_generate(body, 2, "test")[0].routed_experts is None
