"""Tiny checkpoints, toy tasks, reward plug-ins and the prompt dataset."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from tandem.config import RewardConfig, RewardFunction
from tandem.data import DatasetError, load_prompts, write_prompts
from tandem.rewards import RewardFunctions, load_callable
from toy.tasks import echo, make_records, reverse


def test_tiny_checkpoint_reloads_by_path_offline(tiny_ckpt: dict[str, Path]) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_ckpt["actor"], local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt["actor"], local_files_only=True)
    ids = tok("rev 1 2\n=")["input_ids"]
    assert tok.decode(ids) == "rev 1 2\n="  # one token per character, spaces and newlines kept
    assert tok.eos_token_id is not None and tok.pad_token_id is not None
    logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size)
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "user: hi\nassistant: "


def test_tiny_critic_has_scalar_head(tiny_ckpt: dict[str, Path]) -> None:
    critic = AutoModelForSequenceClassification.from_pretrained(tiny_ckpt["critic"], local_files_only=True)
    tok = AutoTokenizer.from_pretrained(tiny_ckpt["critic"], local_files_only=True)
    out = critic(torch.tensor([tok("say a:")["input_ids"]]))
    assert out.logits.shape == (1, 1)


def test_tiny_is_deterministic_in_seed(tmp_path: Path) -> None:
    from toy.tiny import make_tiny

    a = AutoModelForCausalLM.from_pretrained(make_tiny(tmp_path / "a", seed=3)["actor"])
    b = AutoModelForCausalLM.from_pretrained(make_tiny(tmp_path / "b", seed=3)["actor"])
    c = AutoModelForCausalLM.from_pretrained(make_tiny(tmp_path / "c", seed=4)["actor"])
    wa, wb, wc = (m.model.embed_tokens.weight for m in (a, b, c))
    assert torch.equal(wa, wb)
    assert not torch.equal(wa, wc)


def test_echo_reward_by_hand() -> None:
    rec = {"letter": "b"}
    assert echo.reward("say b:", "bbbbbbbb", rec) == 1.0
    assert echo.reward("say b:", "bbbbxxxx", rec) == 0.5  # 4 of 8
    assert echo.reward("say b:", "bb", rec) == 0.25  # short: 2 of 8
    assert echo.reward("say b:", "bbbbbbbbbbbb", rec) == 1.0  # only the first 8 count


@pytest.mark.parametrize("completion", ["", None, 123, "\x00\xff", "b" * 10_000])
@pytest.mark.parametrize("record", [{}, {"letter": 5}, {"letter": "bb"}, None, {"answer": None}])
def test_rewards_never_raise_on_malformed_input(completion, record) -> None:
    assert echo.reward("p", completion, record) == 0.0
    out = reverse.reward("p", completion, record)
    assert set(out) == {"exact", "digits", "format"}
    assert all(v == 0.0 for v in out.values())


def test_reverse_reward_by_hand() -> None:
    rec = {"answer": "1704"}
    assert reverse.reward("rev 4071=", "1704", rec) == {"exact": 1.0, "digits": 1.0, "format": 1.0}
    assert reverse.reward("rev 4071=", "1700", rec) == {"exact": 0.0, "digits": 0.75, "format": 1.0}
    assert reverse.reward("rev 4071=", "17", rec) == {"exact": 0.0, "digits": 0.5, "format": 0.0}


def test_task_records_are_deterministic_and_consistent() -> None:
    a, b = make_records("reverse", 50, seed=1), make_records("reverse", 50, seed=1)
    assert a == b
    for r in a:
        digits = r["prompt"][len("rev ") : -1]
        assert r["answer"] == digits[::-1]
    for r in make_records("echo", 20, seed=2):
        assert r["prompt"] == f"say {r['letter']}:" and r["answer"] == r["letter"] * echo.TARGET_LEN


def test_random_policy_scores_near_the_floor_on_echo(tiny_ckpt: dict[str, Path]) -> None:
    """The demo claims the reward rises from near its floor: check the floor with the real tokenizer."""
    tok = AutoTokenizer.from_pretrained(tiny_ckpt["actor"])
    rng = random.Random(0)
    vocab = [tok.decode([i]) for i in range(len(tok)) if i not in tok.all_special_ids]
    scores = [
        echo.reward("", "".join(rng.choice(vocab) for _ in range(8)), {"letter": "a"}) for _ in range(2000)
    ]
    assert sum(scores) / len(scores) < 0.05


def test_reward_functions_weight_name_and_isolate_failures() -> None:
    cfg = RewardConfig(
        functions=[
            RewardFunction(path="toy.tasks.echo:reward", weight=2.0),
            RewardFunction(path="toy.tasks.reverse:reward", weight=1.0),
            RewardFunction(path="json:loads", weight=1.0),  # raises TypeError on these args: scored 0
            RewardFunction(path="toy.tasks.echo:reward", weight=0.0, name="echo_again"),
        ]
    )
    rf = RewardFunctions(cfg)
    total, parts = rf.score("say a:", "aaaa", {"letter": "a", "answer": "aaaa"})
    assert parts["echo"] == 0.5
    assert parts["reverse/exact"] == 1.0 and parts["reverse/digits"] == 1.0 and parts["reverse/format"] == 0.0
    assert parts["json"] == 0.0
    assert parts["echo_again"] == 0.5  # named in the config; weight 0 keeps it out of the total
    assert total == pytest.approx(2.0 * 0.5 + 1.0 + 1.0 + 0.0)
    assert rf.errors == 1


def test_load_callable_errors_name_the_path() -> None:
    with pytest.raises(ValueError, match="cannot import module 'no_such_mod'"):
        load_callable("no_such_mod:f")
    with pytest.raises(ValueError, match="has no callable 'nope'"):
        load_callable("toy.tasks.echo:nope")


def test_prompt_dataset_round_trip_and_errors(tmp_path: Path) -> None:
    recs = make_records("echo", 5)
    p = write_prompts(tmp_path / "p.jsonl", recs)
    assert [r["prompt"] for r in load_prompts(p)] == [r["prompt"] for r in recs]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n{not json\n")
    with pytest.raises(DatasetError, match=r"bad\.jsonl:2: not valid JSON"):
        load_prompts(bad)
    bad.write_text(json.dumps({"text": "no prompt field"}) + "\n")
    with pytest.raises(DatasetError, match=r"bad\.jsonl:1: field 'prompt'"):
        load_prompts(bad)
    with pytest.raises(DatasetError, match="not found"):
        load_prompts(tmp_path / "missing.jsonl")


def test_warmstart_teaches_the_reverse_format(tiny_ckpt: dict[str, Path], tmp_path: Path) -> None:
    """A short supervised warm-start moves the tiny model from noise toward well-formed digit answers."""
    from toy.warmstart import warmstart

    def mean_nll(path: Path) -> float:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path)
        total = 0.0
        demos = make_records("reverse", 20, seed=99)
        for r in demos:
            p, a = tok(r["prompt"])["input_ids"], tok(r["answer"])["input_ids"] + [tok.eos_token_id]
            ids = torch.tensor([p + a])
            logp = torch.log_softmax(model(ids).logits[0, :-1], -1)
            total += -logp[len(p) - 1 :, :].gather(-1, ids[0, len(p) :, None]).mean().item()
        return total / len(demos)

    before = mean_nll(tiny_ckpt["actor"])
    out = warmstart("reverse", str(tiny_ckpt["actor"]), str(tmp_path / "warm"), steps=40, batch_size=16)
    after = mean_nll(out)
    assert after < before - 1.0, (before, after)  # nats per answer token


def test_demo_assets_are_built_when_missing(tmp_path: Path) -> None:
    from toy.tiny import ensure_demo_assets

    ensure_demo_assets(tmp_path)
    assert (tmp_path / "assets/tiny/actor/config.json").is_file()
    assert (tmp_path / "assets/tiny/critic/config.json").is_file()
    assert len((tmp_path / "assets/echo.jsonl").read_text().splitlines()) == 2000
    before = (tmp_path / "assets/echo.jsonl").stat().st_mtime_ns
    ensure_demo_assets(tmp_path)  # present: left as they are
    assert (tmp_path / "assets/echo.jsonl").stat().st_mtime_ns == before


def test_a_lock_file_left_by_a_killed_loader_is_removed_and_a_live_loader_is_waited_for(
    tmp_path: Path, monkeypatch
) -> None:
    import subprocess
    import sys

    from tandem.prebuild import ExtensionLockTimeout, prepare_extensions

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    # torch's lock files, their holders killed: where TORCH_EXTENSIONS_DIR puts them, and where its default does
    left, default = tmp_path / "deepspeed_shm_comm/lock", tmp_path / "py311_cpu/deepspeed_shm_comm/lock"
    for lock in (left, default):
        lock.parent.mkdir(parents=True)
        lock.touch()  # seconds old: no age rule could tell it from a live one
    assert prepare_extensions(load=False) == tmp_path
    assert not left.exists() and not default.exists()

    # A live loader holds the kernel lock: its lock file stays and the wait ends in a named error.
    left.touch()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl,sys,time; f=open(sys.argv[1],'a'); fcntl.flock(f, fcntl.LOCK_EX); "
         "print('held', flush=True); time.sleep(60)", str(tmp_path / "tandem-load.lock")],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ExtensionLockTimeout, match="building or loading DeepSpeed's CPU ops"):
            prepare_extensions(load=False, timeout_s=0.5)
        assert left.exists()
    finally:
        holder.kill()
        holder.wait()
    assert prepare_extensions(load=False) == tmp_path  # the kernel released the killed holder's lock
    assert not left.exists()


def test_extensions_build_in_this_environment_by_default(monkeypatch) -> None:
    import sys

    from tandem.prebuild import prepare_extensions

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert prepare_extensions(load=False) == Path(sys.prefix) / "torch_extensions"
