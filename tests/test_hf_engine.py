"""The hf engine against a fresh forward pass of the same weights (fp32, 1e-4), plus its controls."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rollout.engines.base import Completion, SamplingParams
from rollout.engines.hf import HFEngine
from rollout.engines.sampling import truncate_logits
from weightsync.base import TensorMeta, Update, WeightSyncError

TOL = 1e-4


@pytest.fixture(scope="module")
def engine(tiny_ckpt: dict[str, Path]) -> HFEngine:
    return HFEngine(str(tiny_ckpt["actor"]), device="cpu", seed=0)


@pytest.fixture(scope="module")
def other_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture, different weights: the 'new version' a learner would publish."""
    from toy.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny-v1"), seed=7)["actor"]


@pytest.fixture
def prompts(engine: HFEngine) -> list[list[int]]:
    # Different lengths, so the batch is left-padded.
    return [engine.tokenizer(t).input_ids for t in ("say a:", "say bcd, then 12:", "x")]


def as_update(model: torch.nn.Module, version: int, *, drop: tuple[str, ...] = ("lm_head.weight",)) -> Update:
    items = [(k, v.detach().clone()) for k, v in model.state_dict().items() if k not in drop]
    manifest = [TensorMeta(k, str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in items]
    return Update(version=version, manifest=manifest, _iter=lambda: iter(items))


def forward_logprobs(engine: HFEngine, prompt: list[int], c: Completion) -> torch.Tensor:
    """log_softmax of one unpadded full forward pass at the response positions. Shape: (R, V)."""
    ids = torch.tensor([prompt + c.token_ids])  # (1, P + R)
    with torch.no_grad():
        logits = engine.model(ids).logits[0].float()  # (P + R, V)
    return logits[len(prompt) - 1 : -1]


def picked(logits: torch.Tensor, c: Completion) -> torch.Tensor:
    return logits.log_softmax(-1).gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)


@pytest.mark.parametrize("lengths", ["mixed", "one"])
def test_logprobs_match_a_fresh_forward_pass(
    engine: HFEngine, prompts: list[list[int]], lengths: str
) -> None:
    """Left-padded prompts (an attention mask) and prompts of one length (none: plain causal attention)."""
    if lengths == "one":
        prompts = [prompts[1], prompts[1][::-1], prompts[1][1:] + prompts[1][:1]]
    out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=12, temperature=1.0, seed=3))
    assert [len(g) for g in out] == [2, 2, 2]
    for prompt, group in zip(prompts, out, strict=True):
        for c in group:
            assert len(c.token_ids) == len(c.logprobs) == len(c.versions) > 0
            ref = picked(forward_logprobs(engine, prompt, c), c)
            torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=TOL, rtol=0)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.9, 8, 0.9)]
)
def test_logprobs_are_of_the_truncated_renormalised_distribution(
    engine: HFEngine, prompts: list[list[int]], temperature: float, top_k: int, top_p: float
) -> None:
    sampling = SamplingParams(
        n=2, max_new_tokens=10, temperature=temperature, top_k=top_k, top_p=top_p, seed=5
    )
    for prompt, group in zip(prompts, engine.generate(prompts, sampling), strict=True):
        for c in group:
            scores = truncate_logits(forward_logprobs(engine, prompt, c) / temperature, top_k, top_p)
            ref = picked(scores, c)
            assert torch.isfinite(ref).all(), "a sampled token lies outside the truncated support"
            torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=TOL, rtol=0)


def test_truncation_by_hand() -> None:
    scores = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(truncate_logits(scores, 2, 1.0)).tolist() == [[False, False, True, True]]
    # 0.5 < 0.7, 0.5 + 0.3 reaches it: keep the first two (the crossing token included).
    assert torch.isinf(truncate_logits(scores, 0, 0.7)).tolist() == [[False, False, True, True]]
    assert torch.isinf(truncate_logits(scores, 0, 0.5)).tolist() == [[False, True, True, True]]


def test_greedy_matches_transformers_generate(engine: HFEngine, prompts: list[list[int]]) -> None:
    out = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0))
    for prompt, (c,) in zip(prompts, out, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = engine.model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10, pad_token_id=0
            )[0, len(prompt) :]
        assert c.token_ids == ref.tolist()
        # Greedy reports the untempered log_softmax at the argmax.
        torch.testing.assert_close(
            torch.tensor(c.logprobs), picked(forward_logprobs(engine, prompt, c), c), atol=TOL, rtol=0
        )


def test_seeds_reproduce_and_differ(engine: HFEngine, prompts: list[list[int]]) -> None:
    def run(seed: int) -> list[list[int]]:
        out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=8, seed=seed))
        return [c.token_ids for g in out for c in g]

    assert run(11) == run(11)
    assert run(11) != run(12)


def test_stop_tokens_stop_strings_and_length(engine: HFEngine, prompts: list[list[int]]) -> None:
    greedy = SamplingParams(max_new_tokens=12, temperature=0)
    (base,) = engine.generate(prompts[:1], greedy)[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 12
    # A stop token: the first occurrence of the 4th greedy token ends the sequence, included.
    stop_id = base.token_ids[3]
    (c,) = engine.generate(
        prompts[:1], SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=[stop_id])
    )[0]
    cut = base.token_ids.index(stop_id) + 1
    assert (c.finish_reason, c.token_ids) == ("stop", base.token_ids[:cut])
    # A stop string: generation ends with the token that completes it.
    text = engine.tokenizer.decode(base.token_ids, skip_special_tokens=True)
    stop = text[4:6]
    assert stop
    (c,) = engine.generate(prompts[:1], SamplingParams(max_new_tokens=12, temperature=0, stop=[stop]))[0]
    assert c.finish_reason == "stop"
    assert stop in engine.tokenizer.decode(c.token_ids, skip_special_tokens=True)
    assert stop not in engine.tokenizer.decode(c.token_ids[:-1], skip_special_tokens=True)
    assert c.token_ids == base.token_ids[: len(c.token_ids)]


def test_eos_always_stops(engine: HFEngine) -> None:
    eos = engine.tokenizer.eos_token_id
    prompt = engine.tokenizer("say a:").input_ids

    def favour_eos(module: torch.nn.Module, inputs: object, logits: torch.Tensor) -> torch.Tensor:
        return logits + 100.0 * torch.nn.functional.one_hot(torch.tensor(eos), logits.shape[-1])

    hook = engine.model.lm_head.register_forward_hook(favour_eos)
    try:
        (c,) = engine.generate([prompt], SamplingParams(max_new_tokens=8, temperature=0))[0]
    finally:
        hook.remove()
    assert (c.token_ids, c.finish_reason) == ([eos], "stop")


def test_update_weights_swaps_the_model_in_place(
    engine: HFEngine, other_ckpt: Path, prompts: list[list[int]]
) -> None:
    fresh = HFEngine(str(other_ckpt), device="cpu")
    original = as_update(engine.model, 0)
    greedy = SamplingParams(max_new_tokens=8, temperature=0)
    try:
        engine.update_weights(as_update(fresh.model, 3))
        assert engine.version == 3
        got = engine.generate(prompts, greedy)
        want = fresh.generate(prompts, greedy)
        assert [g[0].token_ids for g in got] == [g[0].token_ids for g in want]
        assert all(v == 3 for g in got for v in g[0].versions)
    finally:
        engine.update_weights(original)
    assert engine.version == 0

    with pytest.raises(WeightSyncError, match="no tensor named"):
        engine.update_weights(Update(1, [], lambda: iter([("nope.weight", torch.zeros(1))])))
    with pytest.raises(WeightSyncError, match="parameters missing"):
        engine.update_weights(as_update(engine.model, 1, drop=("lm_head.weight", "model.norm.weight")))
    engine.update_weights(original)


def test_inflight_update_switches_version_mid_sequence(
    engine: HFEngine, other_ckpt: Path, prompts: list[list[int]]
) -> None:
    original = as_update(engine.model, 0)
    new = as_update(HFEngine(str(other_ckpt), device="cpu").model, 1)
    calls = 0

    def between_steps() -> None:
        nonlocal calls
        calls += 1
        if calls == 3:  # after three tokens of every row
            engine.update_weights(new)

    greedy = SamplingParams(n=1, max_new_tokens=8, temperature=0, stop_token_ids=[])
    before = engine.generate(prompts, greedy)
    try:
        during = engine.generate(prompts, greedy, between_steps=between_steps)
    finally:
        engine.update_weights(original)
    for (b,), (d,) in zip(before, during, strict=True):
        n = len(d.token_ids)
        assert d.versions == ([0, 0, 0] + [1] * (n - 3))[:n]
        assert d.token_ids[:3] == b.token_ids[:3] and d.logprobs[:3] == b.logprobs[:3]
        if n > 3:  # the fourth token came from other weights (on the stale KV cache)
            assert abs(d.logprobs[3] - b.logprobs[3]) > 1e-3 or d.token_ids[3] != b.token_ids[3]


def test_on_token_streams_every_token_in_order(engine: HFEngine, prompts: list[list[int]]) -> None:
    seen: dict[int, list[tuple[int, float]]] = {}
    out = engine.generate(
        prompts,
        SamplingParams(n=2, max_new_tokens=6, seed=1),
        on_token=lambda r, t, lp: seen.setdefault(r, []).append((t, lp)),
    )
    flat = [c for g in out for c in g]
    assert sorted(seen) == list(range(len(flat)))
    for row, c in enumerate(flat):
        assert seen[row] == list(zip(c.token_ids, c.logprobs, strict=True))


def test_a_prompt_is_reported_when_its_rows_finish_while_the_others_still_decode(
    engine: HFEngine, prompts: list[list[int]]
) -> None:
    """``on_prompt``: prompt 0's rows are made to stop at their second token (stop ids that prompt 1 does
    not sample); prompt 0 is reported with its ``n`` completions while prompt 1's rows still decode."""
    n, sampling = 2, SamplingParams(n=2, max_new_tokens=10, temperature=1.0, seed=3)
    free = engine.generate(prompts[:2], sampling)
    stop = {c.token_ids[1] for c in free[0]}
    assert not stop & {c.token_ids[0] for c in free[0]}  # the premise: no row of prompt 0 stops sooner,
    assert not stop & {t for c in free[1] for t in c.token_ids[:2]}  # nor prompt 1 with it
    decoded = [0, 0]  # tokens sampled per prompt so far

    def on_token(row: int, token: int, logp: float) -> None:
        decoded[row // n] += 1

    reported: list[tuple[int, list[list[int]], list[int]]] = []
    out = engine.generate(
        prompts[:2],
        replace(sampling, stop_token_ids=sorted(stop)),
        on_token=on_token,
        on_prompt=lambda i, group: reported.append((i, [c.token_ids for c in group], list(decoded))),
    )
    assert [i for i, _, _ in reported] == [0, 1]  # once each, in the order they finished
    for i, tokens, _ in reported:
        assert tokens == [c.token_ids for c in out[i]]
    assert [c.token_ids for c in out[0]] == [c.token_ids[:2] for c in free[0]]
    assert reported[0][2] == [2 * n, 2 * n]  # prompt 1's rows had sampled 2 tokens each, not finished
    assert all(len(c.token_ids) > 2 for c in out[1])
    assert reported[1][2] == [2 * n, sum(len(c.token_ids) for c in out[1])]


def test_pause_holds_generation_until_resume(engine: HFEngine, prompts: list[list[int]]) -> None:
    tokens: list[int] = []
    result: list[list[list[Completion]]] = []
    engine.pause()
    worker = threading.Thread(
        target=lambda: result.append(
            engine.generate(
                prompts[:1], SamplingParams(max_new_tokens=4), on_token=lambda r, t, lp: tokens.append(t)
            )
        )
    )
    worker.start()
    time.sleep(0.3)
    assert worker.is_alive() and tokens == []
    engine.resume()
    worker.join(timeout=30)
    assert not worker.is_alive() and len(tokens) == len(result[0][0][0].token_ids) > 0


def test_bad_requests_raise_value_error(engine: HFEngine) -> None:
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="context"):
        engine.generate([[5] * 500], SamplingParams(max_new_tokens=20))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.generate([[10**6]], SamplingParams())
