"""Routing replay (R3): forced router weights, recording in the hf engine, the trajectory's wire form and the
learner's forward forced to the engine's routing (learner/routing_replay.py, docs/design.md §4.11)."""

from __future__ import annotations

import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from learner.routing_replay import flipped, forced_routing


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
