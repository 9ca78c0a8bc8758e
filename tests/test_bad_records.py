"""Bad records are named or set aside, never a crash: a prompt file's record that cannot be tokenised or is
too long (refused with its line, or skipped into rejected_prompts.jsonl), and a prompt record in Redis that
the model cannot take (dead-lettered by the server that takes it, which keeps serving)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import redis

import launch
from buffer.schema import PromptRecord
from buffer.streams import ReplayBuffer
from launcher.driver import check_inputs, count_rejected
from launcher.feeder import PromptSet
from rollout.loop import RolloutLoop
from tandem.config import ConfigError, load_config
from tandem.data import prompt_screen, write_prompts
from tandem.timing import Timers
from tests.test_launch import launch_cmd, run_dir_of
from toy.tasks import make_records

ROOT = Path(__file__).resolve().parent.parent
LONG = "a b c d e f g h " * 20  # far more than 16 tokens


def tiny_args(tiny_ckpt: dict[str, Path], prompts: Path, *extra: str) -> list[str]:
    return [
        str(ROOT / "configs/tiny.yaml"),
        f"model.actor={tiny_ckpt['actor']}",
        f"model.critic={tiny_ckpt['critic']}",
        f"data.prompts={prompts}",
        *extra,
    ]


@pytest.fixture
def bad_file(tmp_path: Path) -> Path:
    """Line 1 good, 2 a lone surrogate (a JSON escape), 3 not JSON, 4 too long, 5 bytes that are not UTF-8."""
    p = tmp_path / "prompts.jsonl"
    p.write_bytes(
        b'{"prompt": "say b:"}\n'
        b'{"prompt": "x \\ud800 y"}\n'
        b"not json\n" + json.dumps({"prompt": LONG}).encode() + b"\n"
        b'{"prompt": "\xff\xfe"}\n'
    )
    return p


def test_a_lone_surrogate_is_an_error_naming_the_line(tiny_ckpt, bad_file: Path, capsys) -> None:
    bad_file.write_text('{"prompt": "ok"}\n{"prompt": "x \\ud800 y"}\n')
    assert launch.main(tiny_args(tiny_ckpt, bad_file)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: data.prompts: {bad_file}:2: ") and "surrogate" in err
    assert "Traceback" not in err


def test_whatever_the_tokenizer_raises_on_names_the_line(tiny_ckpt, tmp_path: Path, monkeypatch) -> None:
    import tandem.data

    real = tandem.data.prompt_token_ids

    def picky(tokenizer, text, *, chat_template):
        if text == "boom":
            raise TypeError("TextEncodeInput must be Union[...]")
        return real(tokenizer, text, chat_template=chat_template)

    monkeypatch.setattr(tandem.data, "prompt_token_ids", picky)
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "ok"}\n\n{"prompt": "boom"}\n')
    args = tiny_args(tiny_ckpt, p)
    with pytest.raises(ConfigError, match=rf"^data.prompts: {p}:3: cannot be tokenised: TypeError"):
        PromptSet.load(load_config(args[0], args[1:]))


def test_skip_sets_bad_records_aside_and_the_summary_counts_them(
    tiny_ckpt, bad_file: Path, tmp_path: Path
) -> None:
    args = tiny_args(tiny_ckpt, bad_file, "data.max_prompt_tokens=16")
    with pytest.raises(ConfigError, match=r"data.prompts: .*:2: field 'prompt' is not valid text"):
        PromptSet.load(load_config(args[0], args[1:]))  # refuse, the default: the first bad line
    prompts = PromptSet.load(load_config(args[0], [*args[1:], "data.on_bad_record=skip"]))
    assert [r["prompt"] for r in prompts.records] == ["say b:"] and len(prompts.tokens) == 1

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rejected = [json.loads(line) for line in prompts.write_rejected(run_dir).read_text().splitlines()]
    assert [r["line"] for r in rejected] == [2, 3, 4, 5]
    reasons = [r["reason"] for r in rejected]
    assert "lone surrogate" in reasons[0] and "not valid JSON" in reasons[1]
    assert "> 16" in reasons[2] and "not valid UTF-8" in reasons[3]
    assert (
        rejected[0]["raw"] == '{"prompt": "x \\ud800 y"}' and rejected[3]["raw"] == '{"prompt": "\\xff\\xfe"}'
    )
    count_rejected(run_dir)
    assert json.loads((run_dir / "summary.json").read_text())["data/rejected"] == 4


def test_prompt_and_response_must_fit_the_model_context(tiny_ckpt, tmp_path: Path) -> None:
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "ok"}\n')
    args = tiny_args(tiny_ckpt, p, "data.max_prompt_tokens=500", "rollout.max_new_tokens=32")
    with pytest.raises(ConfigError, match=r"data.max_prompt_tokens \(500\) \+ rollout.max_new_tokens \(32\)"):
        check_inputs(load_config(args[0], args[1:]))  # the tiny model's context is 512 tokens
    check_inputs(load_config(args[0], [*args[1:], "rollout.max_new_tokens=12"]))  # 512: fits


# ------------------------------------------------------------------------------------- prompts in Redis


class Credits:
    """The admission a server holds, as the loop's take path uses it."""

    def __init__(self, credits: int) -> None:
        self.credits = credits

    def spend(self, n: int) -> None:
        self.credits -= n


def server(client: redis.Redis, run: str, actor: Path, credits: int) -> SimpleNamespace:
    """What ``RolloutLoop.take_prompts`` / ``reclaim_prompts`` read of a server: its buffer, admission,
    timers and prompt screen (vocabulary and limits of the tiny actor)."""
    buffer = ReplayBuffer(client, run, consumer="server-0")
    cfg = SimpleNamespace(rollout=SimpleNamespace(prompts_per_batch=4))
    return SimpleNamespace(
        buffer=buffer, admission=Credits(credits), timers=Timers(), screen=prompt_screen(actor, 16), cfg=cfg
    )


def prompt(pid: str, tokens: list[int]) -> PromptRecord:
    return PromptRecord(prompt_id=pid, text="t", tokens=np.array(tokens))


def test_a_bad_prompt_in_redis_is_dead_lettered_and_the_server_keeps_serving(
    redis_client: redis.Redis, run_id: str, tiny_ckpt
) -> None:
    s = server(redis_client, run_id, tiny_ckpt["actor"], credits=1)
    s.buffer.put_prompts(
        [prompt("neg", [-5, 3]), prompt("huge", [10**6]), prompt("long", [3] * 17), prompt("ok", [3, 4])]
    )
    taken = RolloutLoop.take_prompts(s)
    assert [t.prompt.prompt_id for t in taken] == ["ok"] and s.admission.credits == 0
    dead = redis_client.xrange(f"{run_id}:prompts:dead")
    reasons = [e[1][b"reason"].decode() for e in dead]
    assert (
        len(dead) == 3 and "outside the vocabulary" in reasons[0] and "outside the vocabulary" in reasons[1]
    )
    assert "17 prompt tokens > 16" in reasons[2]
    assert s.buffer.metrics()["buffer/prompts_dead"] == 3  # the learner logs it
    assert s.buffer.prompts_claimed() == 1  # the bad ones are acknowledged: nobody takes them again

    s.buffer.put_prompts([prompt("next", [5])])
    s.admission.credits = 1
    assert [t.prompt.prompt_id for t in RolloutLoop.take_prompts(s)] == ["next"]  # still serving


def test_a_restarted_server_dead_letters_the_bad_prompt_it_held(
    redis_client: redis.Redis, run_id: str, tiny_ckpt
) -> None:
    """The crash loop: a server took a bad prompt and died; its next life re-reads its own pending prompts
    first. That prompt is now dead-lettered instead of crashing it again."""
    before = ReplayBuffer(redis_client, run_id, consumer="server-0")
    before.put_prompts([prompt("huge", [10**6]), prompt("ok", [3])])
    assert len(before.take_prompts(2, timeout_s=1.0)) == 2  # no screen: both held, then the crash
    again = server(redis_client, run_id, tiny_ckpt["actor"], credits=0)
    assert [t.prompt.prompt_id for t in RolloutLoop.reclaim_prompts(again)] == ["ok"]
    assert redis_client.xlen(f"{run_id}:prompts:dead") == 1


@pytest.mark.slow
def test_a_run_with_skip_finishes_and_counts_the_records_it_set_aside(tiny_ckpt, tmp_path: Path) -> None:
    """``data.on_bad_record=skip`` through launch.py: the run trains on the good records, the bad ones are in
    ``rejected_prompts.jsonl`` with their lines, ``summary.json`` counts them, and the run directory, which
    holds the run's secrets, is owner-only."""
    prompts = write_prompts(tmp_path / "echo.jsonl", make_records("echo", 40))
    with prompts.open("a") as f:  # two bad records after 40 good ones: lines 41 and 42
        f.write('{"prompt": "x \\ud800 y"}\n{"prompt": 3}\n')
    out = tmp_path / "runs"
    cmd = launch_cmd(tiny_ckpt, prompts, out, "learner.total_steps=2", "data.on_bad_record=skip")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = run_dir_of(out)
    rejected = [json.loads(line) for line in (run_dir / "rejected_prompts.jsonl").read_text().splitlines()]
    assert [r["line"] for r in rejected] == [41, 42]
    assert json.loads((run_dir / "summary.json").read_text())["data/rejected"] == 2
    assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
