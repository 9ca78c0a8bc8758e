"""The offline recipes (sft, rm, dpo) on real DeepSpeed engines and the tiny real checkpoints.

Losses are checked against hand-worked values, datasets against their documented schemas, and each trainer
by what it must achieve on the echo task's generated data: lower held-out loss (sft), held-out pairwise
accuracy (rm), a higher held-out implied-reward accuracy (dpo). Resume is checked bit for bit against an
uninterrupted run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from learner.dpo import DPOTrainer, dpo_loss
from learner.examples import ExampleError, load_demonstrations, load_pairs
from learner.rm import RewardModelTrainer, bradley_terry_loss
from learner.sft import SFTTrainer
from tandem.config import ConfigError, load_config
from toy.tasks import write_demonstrations, write_preferences

REPO = Path(__file__).resolve().parents[1]


def stage_config(tiny_ckpt, recipe: str, train: Path, held_out: Path, **learner) -> dict:
    return {
        "run": {"name": f"{recipe}-test", "device": "cpu", "seed": 0},
        "model": {"actor": str(tiny_ckpt["actor"])},
        "data": {"prompts": str(REPO / "pyproject.toml")},  # required by the schema, unused offline
        "algorithm": {
            "recipe": recipe, "train_file": str(train), "eval_file": str(held_out), "batch_size": 16,
            "eval_interval": 5,
        },
        "learner": {"total_steps": 10, "actor_lr": 3e-3, "micro_batch_size": 8, "checkpoint_interval": 0, **learner},
        "logging": {"wandb_mode": "disabled"},
    }  # fmt: skip


@pytest.fixture(scope="module")
def echo_data(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("echo-data")
    return {
        "sft": write_demonstrations("echo", d / "sft.jsonl", 320, seed=1),
        "sft_eval": write_demonstrations("echo", d / "sft-eval.jsonl", 48, seed=2),
        "prefs": write_preferences("echo", d / "prefs.jsonl", 480, seed=1),
        "prefs_eval": write_preferences("echo", d / "prefs-eval.jsonl", 64, seed=2),
    }


# ------------------------------------------------------------------------------------------------- math


def assert_grad_norms(run_dir: Path, role: str) -> None:
    """Every logged training step of an offline run has ``<role>/grad_norm`` (at fp32 ZeRO stage 0, the
    norm DeepSpeed clipped by), positive and finite."""
    rows = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    trained = [r for r in rows if any(k.startswith("loss/") for k in r)]
    assert trained and all(f"{role}/grad_norm" in r for r in trained), trained[:1]
    assert all(0 < r[f"{role}/grad_norm"] < math.inf for r in trained)


def test_bradley_terry_hand_values() -> None:
    chosen, rejected = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([0.0, 0.0, 1.0])
    loss, m = bradley_terry_loss(chosen, rejected)
    # -log σ(2) - log σ(0) - log σ(-2) = 0.126928 + 0.693147 + 2.126928
    assert loss.item() == pytest.approx(2.947003, abs=1e-5)
    assert m["accuracy"].item() == 1.0  # a tie is not a win
    assert m["margin"].item() == pytest.approx(0.0)


def test_dpo_loss_hand_values_and_label_smoothing() -> None:
    logp_c, logp_r = torch.tensor([-1.0, -4.0]), torch.tensor([-3.0, -2.0])
    ref_c, ref_r = torch.tensor([-2.0, -3.0]), torch.tensor([-2.0, -3.0])
    loss, m = dpo_loss(logp_c, logp_r, ref_c, ref_r, beta=0.5)
    # implied rewards: chosen 0.5·1 = 0.5 and 0.5·(-1) = -0.5; rejected -0.5 and 0.5; margins 1 and -1
    want = -math.log(1 / (1 + math.exp(-1))) - math.log(1 / (1 + math.exp(1)))
    assert loss.item() == pytest.approx(want, abs=1e-5)
    assert m["reward_accuracy"].item() == 1.0 and m["margin"].item() == pytest.approx(0.0)
    assert m["logp_accuracy"].item() == 1.0  # -1 > -3 only
    smooth, _ = dpo_loss(logp_c, logp_r, ref_c, ref_r, beta=0.5, label_smoothing=0.1)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    want_s = sum(-0.9 * math.log(sig(x)) - 0.1 * math.log(sig(-x)) for x in (1.0, -1.0))
    assert smooth.item() == pytest.approx(want_s, abs=1e-5)


# ---------------------------------------------------------------------------------------------- datasets


def test_demonstrations_put_loss_only_on_the_response(tiny_ckpt, tmp_path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_ckpt["actor"])
    path = tmp_path / "d.jsonl"
    chat = [{"role": "user", "content": "say a:"}, {"role": "assistant", "content": "aaaa"}]
    path.write_text(
        json.dumps({"prompt": "say b:", "response": "bb"}) + "\n" + json.dumps({"messages": chat}) + "\n"
    )
    plain, messages = load_demonstrations(path, tok, max_tokens=64)
    assert tok.decode(plain.prompt) == "say b:" and plain.response == [
        *tok("bb")["input_ids"],
        tok.eos_token_id,
    ]
    assert tok.decode(messages.prompt) == "user: say a:\nassistant: "  # the chat template's generation prompt
    assert tok.decode(messages.response[:-1]) == "aaaa" and messages.response[-1] == tok.eos_token_id


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ({"prompt": "p", "chosen": "a"}, r"bad\.jsonl:2: field 'rejected' must be a non-empty string"),
        ({"prompt": 3, "chosen": "a", "rejected": "b"}, r"bad\.jsonl:2: field 'prompt' must be"),
        ({"prompt": "p" * 70, "chosen": "a", "rejected": "b"}, r"bad\.jsonl:2: 72 tokens, more than algorithm\.max_tokens=64"),
    ],
)  # fmt: skip
def test_bad_pairs_name_the_line_and_field(tiny_ckpt, tmp_path, line: dict, error: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_ckpt["actor"])
    path = tmp_path / "bad.jsonl"
    path.write_text(
        json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}) + "\n" + json.dumps(line) + "\n"
    )
    with pytest.raises(ExampleError, match=error):
        load_pairs(path, tok, max_tokens=64)


def test_recipe_sections_are_typed_per_recipe(tiny_ckpt, echo_data) -> None:
    raw = stage_config(tiny_ckpt, "dpo", echo_data["prefs"], echo_data["prefs_eval"])
    assert load_config(None, raw=raw).algorithm.beta == 0.1
    raw["algorithm"]["ppo_epochs"] = 2  # a ppo field in a dpo section
    with pytest.raises(ConfigError, match=r"algorithm\.ppo_epochs: unknown key"):
        load_config(None, raw=raw)
    del raw["algorithm"]["ppo_epochs"], raw["algorithm"]["train_file"]
    with pytest.raises(ConfigError, match=r"algorithm\.train_file: Field required"):
        load_config(None, raw=raw)


# ---------------------------------------------------------------------------------------------- trainers


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return dict(AutoModelForCausalLM.from_pretrained(run_dir / "final").named_parameters())


@pytest.mark.slow
def test_sft_lowers_held_out_loss_and_resumes_exactly(tiny_ckpt, echo_data, tmp_path) -> None:
    raw = stage_config(tiny_ckpt, "sft", echo_data["sft"], echo_data["sft_eval"], total_steps=6)
    SFTTrainer(load_config(None, raw=raw), tmp_path / "whole").run()
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert summary["steps"] == 6
    assert summary["after"]["eval/loss"] < summary["before"]["eval/loss"] - 1.0, summary
    assert_grad_norms(tmp_path / "whole", "actor")

    # Interrupted after 3 steps (its final checkpoint), then resumed to 6: the same weights bit for bit.
    raw["learner"]["total_steps"] = 3
    SFTTrainer(load_config(None, raw=raw), tmp_path / "split").run()
    raw["learner"]["total_steps"] = 6
    resumed = SFTTrainer(load_config(None, raw=raw), tmp_path / "split", resume=True)
    resumed.run()
    assert json.loads((tmp_path / "split" / "summary.json").read_text())["steps"] == 6
    whole, split = final_weights(tmp_path / "whole"), final_weights(tmp_path / "split")
    for name, p in whole.items():
        torch.testing.assert_close(split[name], p, rtol=0, atol=0, msg=name)
    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_ckpt["actor"]).named_parameters())
    assert not torch.equal(whole["model.norm.weight"], initial["model.norm.weight"])  # it did train


@pytest.mark.slow
def test_reward_model_learns_pairs_and_scores_as_the_server_does(tiny_ckpt, echo_data, tmp_path) -> None:
    raw = stage_config(tiny_ckpt, "rm", echo_data["prefs"], echo_data["prefs_eval"], total_steps=40)
    trainer = RewardModelTrainer(load_config(None, raw=raw), tmp_path / "rm")
    trainer.run()
    summary = json.loads((tmp_path / "rm" / "summary.json").read_text())
    assert summary["before"]["eval/accuracy"] == 0.0  # a zero head ties every pair
    assert summary["after"]["eval/accuracy"] >= 0.85, summary
    assert_grad_norms(tmp_path / "rm", "reward_model")

    from rollout.reward_model import RewardModel

    served = RewardModel(str(tmp_path / "rm" / "final"), device="cpu", dtype="float32")
    pairs = [json.loads(line) for line in echo_data["prefs_eval"].read_text().splitlines()[:8]]
    texts = [p["prompt"] + p[k] for p in pairs for k in ("chosen", "rejected")]
    scores = served.score(texts)
    examples = trainer.load_examples(str(echo_data["prefs_eval"]))[:8]
    from learner.rm import pair_batch

    batch = pair_batch(examples)
    with torch.no_grad():
        (mb,) = trainer.pair_micro(batch)
        chosen, rejected = trainer.scores(mb, len(examples))
    torch.testing.assert_close(torch.tensor(scores[0::2]), chosen, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.tensor(scores[1::2]), rejected, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_dpo_raises_held_out_preference_accuracy(tiny_ckpt, echo_data, tmp_path) -> None:
    raw = stage_config(tiny_ckpt, "dpo", echo_data["prefs"], echo_data["prefs_eval"], actor_lr=1e-3)
    trainer = DPOTrainer(load_config(None, raw=raw), tmp_path / "dpo")
    trainer.run()
    summary = json.loads((tmp_path / "dpo" / "summary.json").read_text())
    before, after = summary["before"], summary["after"]
    assert before["eval/loss"] == pytest.approx(math.log(2), abs=1e-5)  # policy = reference at step 0
    assert after["eval/reward_accuracy"] >= 0.9 and after["eval/loss"] < before["eval/loss"] - 0.2, summary
    assert_grad_norms(tmp_path / "dpo", "actor")

    # The reference log-probabilities computed once equal a plain forward of the initial model.
    ref = AutoModelForCausalLM.from_pretrained(tiny_ckpt["actor"])
    pair, ref_c, ref_r = trainer.eval_examples[0]
    for response, want in ((pair.chosen, ref_c), (pair.rejected, ref_r)):
        ids = torch.tensor([pair.prompt + response])
        with torch.no_grad():
            logp = torch.log_softmax(ref(ids).logits[0, len(pair.prompt) - 1 : -1], -1)
        got = logp.gather(-1, torch.tensor(response)[:, None]).sum().item()
        assert want == pytest.approx(got, abs=1e-4)
