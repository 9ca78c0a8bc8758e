"""launch.py's command line and its checks before anything starts (no process is started here)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

import launch
from launcher.feeder import PromptSet
from tandem.config import ConfigError, load_config
from tandem.data import write_prompts

ROOT = Path(__file__).resolve().parent.parent


def tiny_args(tiny_ckpt: dict[str, Path], prompts: Path, *extra: str) -> list[str]:
    return [
        str(ROOT / "configs/tiny.yaml"),
        f"model.actor={tiny_ckpt['actor']}",
        f"model.critic={tiny_ckpt['critic']}",
        f"data.prompts={prompts}",
        *extra,
    ]


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    return write_prompts(tmp_path / "p.jsonl", [{"prompt": "say b:"}, {"prompt": "say c:"}])


def test_chat_template_prompts_are_token_ids_of_the_templated_text(tiny_ckpt, prompts: Path) -> None:
    args = tiny_args(tiny_ckpt, prompts, "data.chat_template=true")
    cfg = load_config(args[0], args[1:])
    tok = AutoTokenizer.from_pretrained(tiny_ckpt["actor"])
    expected = tok("user: say b:\nassistant: ", add_special_tokens=False).input_ids  # the template by hand
    got = PromptSet.load(cfg)
    assert got.tokens[0] == expected
    assert all(isinstance(t, int) for t in got.tokens[1])


def test_plain_prompts_are_tokenised_as_they_are(tiny_ckpt, prompts: Path) -> None:
    args = tiny_args(tiny_ckpt, prompts)
    got = PromptSet.load(load_config(args[0], args[1:]))
    tok = AutoTokenizer.from_pretrained(tiny_ckpt["actor"])
    assert got.tokens == [tok("say b:").input_ids, tok("say c:").input_ids]


def test_overrides_are_accepted_after_flags(tiny_ckpt, prompts: Path, capsys) -> None:
    args = tiny_args(tiny_ckpt, prompts)
    code = launch.main([args[0], "--dry-run", *args[1:], "--no-console", "rollout.max_new_tokens=5"])
    assert code == 0
    out = capsys.readouterr().out
    assert "max_new_tokens: 5" in out and str(prompts) in out


def test_prompt_problems_are_one_error_line_naming_the_field(tiny_ckpt, prompts: Path, capsys) -> None:
    code = launch.main([*tiny_args(tiny_ckpt, prompts), "data.max_prompt_tokens=3"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: data.max_prompt_tokens:") and "Traceback" not in err

    broken = prompts.with_name("broken.jsonl")
    broken.write_text('{"prompt": "ok"}\nnot json\n')
    assert launch.main(tiny_args(tiny_ckpt, broken)) == 2
    assert capsys.readouterr().err.startswith(f"error: data.prompts: {broken}:2: not valid JSON")


def test_a_chat_template_the_tokenizer_lacks_is_refused(tiny_ckpt, prompts: Path, tmp_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_ckpt["actor"])
    tok.chat_template = None
    tok.save_pretrained(tmp_path / "actor")
    for f in Path(tiny_ckpt["actor"]).iterdir():  # the weights and config, as they are
        if not (tmp_path / "actor" / f.name).exists():
            (tmp_path / "actor" / f.name).symlink_to(f)
    (tmp_path / "actor" / "chat_template.jinja").unlink(missing_ok=True)
    args = tiny_args(tiny_ckpt, prompts, f"model.actor={tmp_path / 'actor'}", "data.chat_template=true")
    with pytest.raises(ConfigError, match=r"data\.chat_template: the tokenizer"):
        PromptSet.load(load_config(args[0], args[1:]))


def test_overrides_after_resume_are_overrides_and_a_config_file_is_refused(tmp_path: Path, capsys) -> None:
    """The run directory holds a resumed run's config: every positional is an override (the first one was
    once read as the config's path and dropped)."""
    args = launch.parse_args(["--resume", str(tmp_path), "learner.total_steps=40", "run.seed=3"])
    assert args.config is None and args.overrides == ["learner.total_steps=40", "run.seed=3"]
    with pytest.raises(SystemExit):
        launch.parse_args(["configs/tiny.yaml", "--resume", str(tmp_path)])
    assert "configs/tiny.yaml is not a key=value override" in capsys.readouterr().err


def test_help_lists_the_pipeline_and_plan_commands(capsys) -> None:
    with pytest.raises(SystemExit):
        launch.main(["--help"])
    out = capsys.readouterr().out
    assert "launch.py pipeline CONFIG" in out and "--dry-run" in out and "launch.py plan CONFIG" in out
    assert "--fresh" in out


def test_pipeline_takes_run_overrides_dry_run_and_no_console(tmp_path: Path, capsys) -> None:
    pipeline = str(ROOT / "configs/pipeline-tiny.yaml")
    args = [pipeline, f"run.output_dir={tmp_path}", "run.name=p1", "run.seed=7", "--no-console"]
    assert launch.main(["pipeline", *args, "--dry-run"]) == 0
    out = capsys.readouterr().out
    for stage in ("sft", "rm", "ppo"):
        assert f"# {stage}: " in out and str(tmp_path / "p1" / stage) in out
    assert out.count("seed: 7") == 3  # run.* other than the pipeline's place: every stage's run section
    assert not (tmp_path / "p1").exists()  # nothing started, nothing written
    assert launch.main(["pipeline", pipeline, f"output_dir={tmp_path}", "--dry-run"]) == 0  # the old form
    assert str(tmp_path / "pipeline-tiny" / "sft") in capsys.readouterr().out
    assert launch.main(["pipeline", pipeline, "run.dir=x", "--dry-run"]) == 2
    assert "run.dir" in capsys.readouterr().err


def test_a_fixed_run_dir_is_resumed_by_the_same_command_unless_fresh(tiny_ckpt, prompts, tmp_path, capsys):
    run_dir = tmp_path / "exp"
    args = [*tiny_args(tiny_ckpt, prompts, f"run.dir={run_dir}"), "--dry-run"]
    assert launch.main(args) == 0
    out = capsys.readouterr().out
    assert f"--run-dir {run_dir}" in out and "--resume" not in out  # nothing there yet: a new run
    run_dir.mkdir()
    (run_dir / "config.public.yaml").write_text("")  # a run was started there
    assert launch.main(args) == 0
    assert "--resume" in capsys.readouterr().out
    assert launch.main([*args, "--fresh"]) == 0
    assert "--resume" not in capsys.readouterr().out
    assert launch.main([*tiny_args(tiny_ckpt, prompts, "run.dir=a/b c")]) == 2
    assert "run.dir" in capsys.readouterr().err
    assert launch.main(["--resume", str(run_dir), "--fresh"]) == 2
