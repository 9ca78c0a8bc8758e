"""The offline recipes (sft, dpo, rm) with the chunked output head and token-budget micro-batches.

sft and dpo compute their log-probabilities with the chunked head (``learner/lm_head.py``) under
``learner.chunked_head``; their loss, gradients and evaluation metrics must equal the plain logits path's
within 1e-5 relative, tied head or not, on real DeepSpeed engines over random tiny Qwen2 checkpoints. A
token budget must give the same gradients as row-count micro-batches (the loss is exact whatever the
split) with no pass above it, pairs kept whole. The rm recipe has a scalar head (no vocabulary logits):
only its micro-batching changes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import learner.offline_runtime as offline
from learner.batch import budget_sizes, make_batch, pair_micro_batches
from learner.dpo import DPOTrainer
from learner.examples import Demonstration, as_trajectory
from learner.rm import RewardModelTrainer
from learner.sft import SFTTrainer
from tandem.config import load_config
from tests.test_lm_head import RTOL, VOCAB, assert_close, random_lm
from toy.tiny import build_tokenizer

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["add 1 2", "echo abc", "say hi", "what is 7", "spell cat", "count to 3", "x", "repeat zz"]
ANSWERS = ["3", "abc", "hi there", "seven", "c a t", "1 2 3", "y", "zz zz zz zz"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[bool, Path]:
    """Random tiny Qwen2 causal LMs (head tied to the embedding, and not) with the tiny tokenizer."""
    out = {}
    for tied in (True, False):
        d = tmp_path_factory.mktemp(f"lm-tied-{tied}")
        random_lm(tied=tied).save_pretrained(d)
        build_tokenizer().save_pretrained(d)
        out[tied] = d
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("offline-data")
    demos = [{"prompt": p, "response": a} for p, a in zip(PROMPTS, ANSWERS, strict=True)]
    # rejected answers of varied length, so pairs differ in length
    pairs = [
        {"prompt": p, "chosen": a, "rejected": a[::-1] + "!" * i}
        for i, (p, a) in enumerate(zip(PROMPTS, ANSWERS, strict=True))
    ]
    paths = {"sft": d / "sft.jsonl", "prefs": d / "prefs.jsonl"}
    paths["sft"].write_text("".join(json.dumps(r) + "\n" for r in demos))
    paths["prefs"].write_text("".join(json.dumps(r) + "\n" for r in pairs))
    return paths


def offline_config(ckpt: Path, recipe: str, train: Path, **learner) -> dict:
    return {
        "run": {"name": f"{recipe}-head", "device": "cpu", "seed": 0},
        "model": {"actor": str(ckpt)},
        "data": {"prompts": str(REPO / "pyproject.toml")},  # required by the schema, unused offline
        "algorithm": {"recipe": recipe, "train_file": str(train), "batch_size": 8, "max_tokens": 32},
        "learner": {"micro_batch_size": 4, "checkpoint_interval": 0, "chunked_head_chunk": VOCAB * 3, **learner},
        "logging": {"wandb_mode": "disabled"},
    }  # fmt: skip


def one_step(trainer, monkeypatch, examples) -> tuple[dict, dict[str, torch.Tensor], list[int]]:
    """``train_step`` with the optimizer step replaced by a copy of every gradient: (stats, gradients,
    one entry per chunked-head call: its micro-batch's rows)."""
    engine = next(iter(trainer.engines().values()))
    grads: dict[str, torch.Tensor] = {}

    def keep_grads() -> None:
        grads.update({n: p.grad.detach().clone() for n, p in engine.module.named_parameters()})

    calls: list[int] = []
    real = offline.response_head
    monkeypatch.setattr(
        offline, "response_head", lambda m, mb, *a: calls.append(len(mb.rows)) or real(m, mb, *a)
    )
    real_lp = offline.policy_logprobs
    monkeypatch.setattr(
        offline,
        "policy_logprobs",
        lambda m, mb, *a, **k: calls.append(len(mb.rows)) or real_lp(m, mb, *a, **k),
    )
    monkeypatch.setattr(engine, "step", keep_grads)
    stats = trainer.train_step(examples)
    return stats, grads, calls


def assert_same(got: tuple[dict, dict], want: tuple[dict, dict], keys: tuple[str, ...]) -> None:
    (s_got, g_got), (s_want, g_want) = got, want
    for key in keys:
        assert s_got[key] == pytest.approx(s_want[key], rel=RTOL, abs=1e-7), key
    assert g_got.keys() == g_want.keys() and g_want
    for name, want_grad in g_want.items():
        assert_close(g_got[name], want_grad, f"grad {name}")
    assert any(float(g.abs().max()) > 0 for g in g_want.values())


# ------------------------------------------------------------------------------------- the chunked head


@pytest.mark.parametrize("tied", [True, False])
def test_sft_step_and_evaluation_match_the_plain_logits(ckpts, data, tmp_path, monkeypatch, tied) -> None:
    results = {}
    for mode in ("off", "on"):
        raw = offline_config(ckpts[tied], "sft", data["sft"], chunked_head=mode)
        trainer = SFTTrainer(load_config(None, raw=raw), tmp_path / mode)
        trainer.load_models()
        examples = trainer.load_examples(str(data["sft"]))
        stats, grads, calls = one_step(trainer, monkeypatch, examples)
        assert bool(calls) == (mode == "on")  # the chunked head ran, and only when asked
        evals = trainer.evaluate(examples)
        results[mode] = (stats, grads, evals)
        monkeypatch.undo()
    assert_same(results["on"][:2], results["off"][:2], ("loss/sft",))
    on, off = results["on"][2], results["off"][2]
    assert on["eval/loss"] == pytest.approx(off["eval/loss"], rel=RTOL)
    assert on["eval/token_accuracy"] == off["eval/token_accuracy"]  # the same argmax, token by token


@pytest.mark.parametrize("tied", [True, False])
def test_dpo_step_and_reference_match_the_plain_logits(ckpts, data, tmp_path, monkeypatch, tied) -> None:
    results = {}
    for mode in ("off", "on"):
        raw = offline_config(ckpts[tied], "dpo", data["prefs"], chunked_head=mode, actor_lr=1e-2)
        trainer = DPOTrainer(load_config(None, raw=raw), tmp_path / mode)
        trainer.load_models()
        examples = trainer.load_examples(str(data["prefs"]))  # reference log-probabilities, once
        # Move the policy off the reference, so the implied rewards (and the loss's gradient) are not 0.
        with torch.no_grad():
            for p in trainer.actor.module.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        stats, grads, calls = one_step(trainer, monkeypatch, examples)
        assert bool(calls) == (mode == "on")
        results[mode] = (stats, grads, [(c, r) for _, c, r in examples])
        monkeypatch.undo()
    ref_on, ref_off = torch.tensor(results["on"][2]), torch.tensor(results["off"][2])
    assert_close(ref_on, ref_off, "reference log-probabilities")
    assert_same(results["on"][:2], results["off"][:2], ("loss/dpo", "dpo/reward_accuracy"))
    # The margin is β x a difference of sequence log-probabilities: digits cancel, so it agrees to 1e-5 of
    # the log-probabilities it is made of, not of itself.
    (on, _, _), (off, _, _) = results["on"], results["off"]
    scale = 0.1 * 2 * float(ref_off.abs().mean())
    assert on["dpo/margin"] == pytest.approx(off["dpo/margin"], abs=RTOL * scale) and off["dpo/margin"] != 0


def test_auto_keeps_the_plain_path_below_the_threshold(ckpts, data, tmp_path, monkeypatch) -> None:
    """auto decides by the nominal micro-batch (micro_batch_size rows x the batch's width, pairs x 2)."""
    raw = offline_config(ckpts[True], "sft", data["sft"])  # default threshold 2^26: far above
    trainer = SFTTrainer(load_config(None, raw=raw), tmp_path)
    trainer.load_models()
    examples = trainer.load_examples(str(data["sft"]))
    _, _, calls = one_step(trainer, monkeypatch, examples)
    assert calls == []
    monkeypatch.undo()
    width = make_batch([as_trajectory(d.prompt, d.response, "x") for d in examples], 0).mask.shape[1]
    raw["learner"]["chunked_head_threshold"] = VOCAB * 4 * width - 1  # just below 4 rows x width
    trainer = SFTTrainer(load_config(None, raw=raw), tmp_path / "auto")
    trainer.load_models()
    _, _, calls = one_step(trainer, monkeypatch, examples)
    assert calls == [4, 4]


# --------------------------------------------------------------------------------- token-budget passes


def test_sft_token_budget_gives_the_same_gradients(ckpts, data, tmp_path, monkeypatch) -> None:
    budget = 32  # algorithm.max_tokens: the longest demonstration fits
    seen: list[tuple[int, int]] = []
    results = {}
    for name, extra in (("rows", {}), ("tokens", {"max_tokens_per_micro_batch": budget})):
        raw = offline_config(ckpts[False], "sft", data["sft"], chunked_head="off", **extra)
        trainer = SFTTrainer(load_config(None, raw=raw), tmp_path / name)
        trainer.load_models()
        examples = trainer.load_examples(str(data["sft"]))
        real_micro = trainer.micro
        passes: list[tuple[int, int]] = []

        def spy(batch, rows, real_micro=real_micro, passes=passes):
            out = real_micro(batch, rows)
            passes.extend((mb.input_ids.numel(), len(mb.rows)) for mb in out)
            return out

        monkeypatch.setattr(trainer, "micro", spy)
        stats, grads, _ = one_step(trainer, monkeypatch, examples)
        results[name] = (stats, grads)
        seen.append(passes)
        monkeypatch.undo()
    rows, tokens = seen
    assert all(n <= budget for n, _ in tokens), tokens
    assert len(tokens) > len(rows)  # the budget did split differently
    assert_same(results["tokens"], results["rows"], ("loss/sft",))


@pytest.mark.parametrize("recipe", ["dpo", "rm"])
def test_pair_token_budget_gives_the_same_gradients(ckpts, data, tmp_path, monkeypatch, recipe) -> None:
    """Pairs stay whole in a pass (both sequences, padded to the longer: 2 x longest tokens)."""
    trainer_cls = DPOTrainer if recipe == "dpo" else RewardModelTrainer
    budget = 64  # 2 x algorithm.max_tokens
    results, passes = {}, {}
    for name, extra in (("rows", {}), ("tokens", {"max_tokens_per_micro_batch": budget})):
        raw = offline_config(ckpts[True], recipe, data["prefs"], chunked_head="off", **extra)
        trainer = trainer_cls(load_config(None, raw=raw), tmp_path / name)
        trainer.load_models()
        examples = trainer.load_examples(str(data["prefs"]))
        real = trainer.pair_micro
        seen: list = []
        monkeypatch.setattr(
            trainer, "pair_micro", lambda b, real=real, seen=seen: seen.extend(out := real(b)) or out
        )
        stats, grads, _ = one_step(trainer, monkeypatch, examples)
        results[name], passes[name] = (stats, grads), [(mb.input_ids.numel(), mb.rows) for mb in seen]
        monkeypatch.undo()
    b = len(examples)
    for n, rows in passes["tokens"]:
        assert n <= budget
        firsts = {r for r in rows.tolist() if r < b}
        assert {r - b for r in rows.tolist() if r >= b} == firsts  # whole pairs
    assert len(passes["tokens"]) != len(passes["rows"])
    keys = ("loss/dpo", "dpo/margin") if recipe == "dpo" else ("loss/rm", "rm/margin")
    assert_same(results["tokens"], results["rows"], keys)


def test_pair_budget_counts_both_sequences() -> None:
    """Padded, a pass of k pairs reads 2k x their longest sequence; packed, their total."""
    assert budget_sizes([10, 9, 5, 5], 40, "pad", rows_per_unit=2) == [2, 2]
    assert budget_sizes([10, 9, 5, 5], 39, "pad", rows_per_unit=2) == [1, 2, 1]  # 2 x 3 x 9 > 39
    assert budget_sizes([20, 18, 10, 10], 40, "pack") == [2, 2]
    trajs = [as_trajectory([1] * 3, [2] * n, str(i)) for i, n in enumerate([7, 2, 2, 1, 3, 1, 1, 1])]
    batch = make_batch(trajs, 0)  # pairs (0, 4), (1, 5), (2, 6), (3, 7): longest 10, 5, 5, 4
    mbs = pair_micro_batches(batch, 0, 1, "pad", torch.device("cpu"), size=4, budget=20)
    assert [sorted(mb.rows.tolist()) for mb in mbs] == [[0, 4], [1, 2, 5, 6], [3, 7]]
    assert all(mb.input_ids.numel() <= 20 for mb in mbs)
    # Two ranks: the same number of passes each, shares disjoint and whole.
    shares = [pair_micro_batches(batch, r, 2, "pad", torch.device("cpu"), size=4, budget=20) for r in (0, 1)]
    assert len(shares[0]) == len(shares[1])
    assert sorted(i for s in shares for mb in s for i in mb.rows.tolist()) == list(range(8))


def test_an_example_over_the_budget_fails_the_load(ckpts, data, tmp_path) -> None:
    raw = offline_config(ckpts[True], "sft", data["sft"], max_tokens_per_micro_batch=32)
    trainer = SFTTrainer(load_config(None, raw=raw), tmp_path)
    trainer.train_examples = [Demonstration([5] * 10, [6] * 23)]
    with pytest.raises(
        ValueError,
        match=r"learner.max_tokens_per_micro_batch \(32\) is below the 33 tokens.*algorithm.train_file",
    ):
        trainer.check_budget()
    trainer.train_examples = [Demonstration([5] * 10, [6] * 22)]
    trainer.check_budget()
