"""The hf engine's prefix cache: a turn's KV reused by the next turn gives a full prefill's logprobs
(fp32, 1e-4), only suffixes are fed, weight updates clear it, and the byte budget holds."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from rollout.engines.base import SamplingParams
from rollout.engines.hf import HFEngine
from rollout.engines.hf_prefix import PrefixCache, kv_nbytes, left_padded_kv, prefix_hashes
from weightsync.base import TensorMeta, Update

TOL = 1e-4
GREEDY = SamplingParams(max_new_tokens=6, temperature=0)


@pytest.fixture
def cached(tiny_ckpt: dict[str, Path]) -> HFEngine:
    return HFEngine(str(tiny_ckpt["actor"]), device="cpu", seed=0)


@pytest.fixture(scope="module")
def plain(tiny_ckpt: dict[str, Path]) -> HFEngine:
    return HFEngine(str(tiny_ckpt["actor"]), device="cpu", seed=0, prefix_cache_mb=0)


def same_weights(engine: HFEngine, version: int) -> Update:
    items = [(k, v.detach().clone()) for k, v in engine.model.state_dict().items() if k != "lm_head.weight"]
    manifest = [TensorMeta(k, str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in items]
    return Update(version=version, manifest=manifest, _iter=lambda: iter(items))


def full_forward_logprobs(engine: HFEngine, row: list[int], tokens: list[int]) -> torch.Tensor:
    """A naive reference: one unpadded forward of the whole sequence, logprobs of ``tokens``."""
    ids = torch.tensor([row + tokens])
    with torch.no_grad():
        logits = engine.model(ids).logits[0, len(row) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def first_turn(engine: HFEngine) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts of different lengths and their (sampled) first turns."""
    prompts = [engine.tokenizer(t).input_ids for t in ("say a:", "say bcd, then 12:", "x", "7+8=")]
    sampling = SamplingParams(max_new_tokens=5, temperature=1.0, seed=3)
    turns = [c.token_ids for (c,) in engine.generate(prompts, sampling)]
    return prompts, turns


def second_turn_rows(engine: HFEngine, prompts, turns) -> list[list[int]]:
    """Three rows extend a first turn with observations of different lengths (cached lengths differ, and
    so do suffixes); two are fresh prompts (misses)."""
    obs = [engine.tokenizer(t, add_special_tokens=False).input_ids for t in (" ok", " no, again:", " fine")]
    rows = [prompts[i] + turns[i] + obs[k] for k, i in enumerate((0, 1, 3))]
    return [*rows, engine.tokenizer("hello there").input_ids, engine.tokenizer("q").input_ids]


def test_second_turn_reuses_the_first_and_matches_a_full_prefill(cached: HFEngine, plain: HFEngine) -> None:
    prompts, turns = first_turn(cached)
    assert len(cached.prefix_cache) == 4
    rows = second_turn_rows(cached, prompts, turns)
    fed_before = cached.prefilled_tokens
    got = [c for (c,) in cached.generate(rows, GREEDY)]
    want = [c for (c,) in plain.generate(rows, GREEDY)]
    for row, g, w in zip(rows, got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=TOL)
        ref = full_forward_logprobs(plain, row, g.token_ids)
        assert torch.allclose(torch.tensor(g.logprobs), ref, atol=TOL)
    # Three hits, each reusing its prompt and all but the last sampled token; only the rest was fed.
    stats = cached.prefix_stats()
    reused = [len(prompts[i]) + len(turns[i]) - 1 for i in (0, 1, 3)]
    assert (stats.lookups, stats.hits, stats.reused_tokens) == (4 + 5, 3, sum(reused))
    assert cached.prefilled_tokens - fed_before == sum(map(len, rows)) - sum(reused)


def test_rows_of_one_call_hitting_alike_need_no_mask(cached: HFEngine, plain: HFEngine) -> None:
    """Equal cached and suffix lengths: no padding anywhere, plain causal attention over the cache."""
    prompts = [cached.tokenizer(t).input_ids for t in ("ab", "cd")]
    turns = [
        c.token_ids for (c,) in cached.generate(prompts, SamplingParams(max_new_tokens=4, temperature=0))
    ]
    rows = [p + t + [5, 6] for p, t in zip(prompts, turns, strict=True)]
    got = [c for (c,) in cached.generate(rows, GREEDY)]
    assert cached.prefix_stats().hits == 2
    for row, c in zip(rows, got, strict=True):
        assert torch.allclose(
            torch.tensor(c.logprobs), full_forward_logprobs(plain, row, c.token_ids), atol=TOL
        )


def test_calls_decoding_at_once_share_the_cache(cached: HFEngine, plain: HFEngine) -> None:
    """Two threads' calls interleave their decode steps (and cache lookups and inserts) on one engine."""
    prompts, turns = first_turn(cached)
    rows = second_turn_rows(cached, prompts, turns)
    out: dict[int, list] = {}
    threads = [
        threading.Thread(target=lambda i=i, part=part: out.setdefault(i, cached.generate(part, GREEDY)))
        for i, part in enumerate((rows[:3], rows[3:]))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    got = [c for i in (0, 1) for (c,) in out[i]]
    for row, c in zip(rows, got, strict=True):
        assert torch.allclose(
            torch.tensor(c.logprobs), full_forward_logprobs(plain, row, c.token_ids), atol=TOL
        )
    assert cached.prefix_stats().hits == 3
    assert len(cached.prefix_cache) == 4 - 3 + 5  # the hit entries superseded by their rows' new turns


def test_an_episode_keeps_one_entry_its_latest_turn(cached: HFEngine) -> None:
    row = cached.tokenizer("count:").input_ids
    for _ in range(3):
        (c,) = cached.generate([row], GREEDY)[0]
        row = row + c.token_ids + [7]
    assert len(cached.prefix_cache) == 1
    assert cached.prefix_stats().hits == 2


def test_a_weight_update_or_sleep_clears_it(cached: HFEngine) -> None:
    prompts, turns = first_turn(cached)
    rows = second_turn_rows(cached, prompts, turns)
    cached.update_weights(same_weights(cached, 1))
    assert len(cached.prefix_cache) == 0 and cached.prefix_cache.nbytes == 0
    cached.generate(rows, GREEDY)
    assert cached.prefix_stats().hits == 0
    assert len(cached.prefix_cache) == len(rows)
    cached.sleep()
    assert len(cached.prefix_cache) == 0


def test_an_update_between_decode_steps_stores_nothing(cached: HFEngine) -> None:
    """The rows' KV mixes two versions of the weights: never reused."""
    prompts = [cached.tokenizer(t).input_ids for t in ("ab", "abcdef")]
    update = same_weights(cached, 1)
    steps = iter(range(100))
    cached.generate(prompts, GREEDY, between_steps=lambda: next(steps) == 1 and cached.update_weights(update))
    assert cached.version == 1
    assert len(cached.prefix_cache) == 0


def test_zero_megabytes_turns_it_off(plain: HFEngine) -> None:
    assert plain.prefix_cache is None and plain.prefix_stats() is None
    with pytest.raises(ValueError, match="hf_prefix_cache_mb"):
        HFEngine(str(Path(plain.model.name_or_path)), device="cpu", prefix_cache_mb=-1)


# ------------------------------------------------------------------------------- the cache on its own


def kv_of(n: int, layers: int = 2, fill: float = 0.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full((2, n, 4), fill), torch.full((2, n, 4), fill + 0.5)) for _ in range(layers)]


def test_eviction_keeps_the_byte_budget_least_recently_used_first() -> None:
    per = kv_nbytes(kv_of(10))  # 2 layers x (keys + values) x 2 heads x 10 x 4 x 4 bytes = 1280
    assert per == 2 * 2 * 2 * 10 * 4 * 4
    cache = PrefixCache(3 * per)
    seqs = [[i] * 10 for i in range(1, 5)]
    for s in seqs[:3]:
        assert cache.insert(s, kv_of(10), cache.epoch)
    assert cache.longest(seqs[0] + [9]) is not None  # touched: now the most recently used
    assert cache.insert(seqs[3], kv_of(10), cache.epoch)
    assert cache.nbytes == 3 * per <= cache.max_bytes and cache.stats.evicted == 1
    assert cache.longest(seqs[1] + [9]) is None  # the least recently used went
    assert all(cache.longest([*s, 9]) is not None for s in (seqs[0], seqs[2], seqs[3]))
    assert not cache.insert([5] * 40, kv_of(40), cache.epoch)  # alone over the budget
    assert cache.nbytes == 3 * per


def test_longest_prefix_exact_and_shorter_than_the_row() -> None:
    cache = PrefixCache(1 << 20)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    cache.insert(tokens, kv_of(9, fill=1.0), cache.epoch)
    cache.insert([*tokens[:4], 8, 8], kv_of(6), cache.epoch)
    n, kv = cache.longest([*tokens, 3, 5])
    assert n == 9 and kv[0][0].shape == (2, 9, 4) and kv[0][0].eq(1).all()
    assert cache.longest(tokens) is None  # the row itself: at least one token must be fed
    assert cache.longest([3, 1, 4, 1, 5, 0, 0]) is None  # shares a part only
    assert cache.longest([7, 1, 4, 1, 5, 9, 2, 6, 5, 1]) is None
    assert cache.longest([3, 1, 4, 1, 8, 8, 0])[0] == 6
    cache.clear()
    assert cache.longest([*tokens, 3]) is None
    assert not cache.insert(tokens, kv_of(9), cache.epoch - 1)  # computed under the old weights


def test_a_newer_entry_supersedes_its_prefixes() -> None:
    cache = PrefixCache(1 << 20)
    cache.insert([1, 2, 3], kv_of(3), cache.epoch)
    cache.insert([1, 2, 3, 4, 5], kv_of(5, fill=2.0), cache.epoch)
    assert len(cache) == 1 and cache.nbytes == kv_nbytes(kv_of(5))
    n, kv = cache.longest([1, 2, 3, 7])  # still found at the old entry's length, in the new one's KV
    assert n == 3 and float(kv[0][0][0, 0, 0]) == 2.0


def test_left_padded_kv_places_each_row_at_the_right() -> None:
    kv, lengths = left_padded_kv([(2, kv_of(2, fill=1.0)), None, (3, kv_of(3, fill=3.0))])
    assert lengths == [2, 0, 3]
    keys = kv[1][0]
    assert keys.shape == (3, 2, 3, 4)
    assert keys[0, :, 0].eq(0).all() and keys[0, :, 1:].eq(1).all()
    assert keys[1].eq(0).all() and keys[2].eq(3).all()
    kv, lengths = left_padded_kv([(2, kv_of(2, fill=1.0)), (2, kv_of(2, fill=3.0))])  # alike: stacked
    assert lengths == [2, 2] and kv[0][0].shape == (2, 2, 2, 4)
    assert kv[0][0][0].eq(1).all() and kv[0][1][1].eq(3.5).all()


def test_prefix_hashes_tell_prefixes_apart() -> None:
    h = prefix_hashes([1, 2, 3])
    assert h[0] == 0 and len(set(h)) == 4
    assert prefix_hashes([1, 2])[:3] == h[:3] and prefix_hashes([0, 2, 3])[3] != h[3]
    assert prefix_hashes([1, 2, 3, 4], known=prefix_hashes([1, 2])) == prefix_hashes([1, 2, 3, 4])


@pytest.mark.parametrize(
    ("mb", "env", "max_bytes"),
    [
        (0, "toy.calculator:CalculatorEnv", None),
        (1.5, "toy.calculator:CalculatorEnv", 3 << 19),
        (1.5, None, None),
    ],
)
def test_the_budget_comes_from_the_config_for_runs_with_several_turns(
    tiny_ckpt: dict[str, Path], mb: float, env: str | None, max_bytes: int | None
) -> None:
    """A single-turn run (no env, no agent) never extends a finished row: its engine keeps no cache."""
    from rollout.engines import make_engine
    from tandem.config import load_config

    raw = {
        "run": {"name": "prefix", "device": "cpu"},
        "model": {"actor": str(tiny_ckpt["actor"])},
        "data": {"prompts": "unused.jsonl"},
        "rollout": {"hf_prefix_cache_mb": mb},
        "env": {"path": env},
        "reward": {"functions": [{"path": "toy.tasks.echo:reward"}]},
    }
    engine = make_engine(load_config(None, raw=raw), str(tiny_ckpt["actor"]))
    assert (engine.prefix_cache.max_bytes if engine.prefix_cache is not None else None) == max_bytes
