"""The reasoning-gym arithmetic demo (configs/sft-arith.yaml, configs/tiny-arith.yaml; docs/stages.md §4.1).

Its reward is reasoning-gym's own verifier on the entry a prompt record names, its SFT data are the dataset's
own answers, and its held-out prompts come from another seed. The learning test (marker ``stages``) runs
the two stages at a reduced size and asserts that held-out accuracy rises during RL.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollout.envs import reasoning_gym as rg
from tandem.telemetry import read_history

ROOT = Path(__file__).resolve().parent.parent
SMALL = dict(
    min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=["+", "-"],
    allow_parentheses=False, allow_negation=False,
)  # fmt: skip


def expression_value(prompt: str) -> int:
    """The answer worked out from the question text alone (``calculate 4 - 1.`` -> 3), independent of
    reasoning-gym's own answer field."""
    expr = prompt.strip().removeprefix("calculate ").removesuffix(".")
    a, op, b = expr.split()
    return int(a) + int(b) if op == "+" else int(a) - int(b)


def test_reward_is_the_datasets_verifier_on_the_named_entry() -> None:
    recs = rg.make_records("basic_arithmetic", 20, seed=0, lowercase=True, **SMALL)
    for r in recs:
        right = str(expression_value(r["prompt"]))
        assert rg.reward(r["prompt"], right, r) == 1.0
        assert rg.reward(r["prompt"], f" {right}\n", r) == 1.0  # surrounding whitespace is not the answer
        assert rg.reward(r["prompt"], str(int(right) + 1), r) == 0.0
        assert rg.reward(r["prompt"], "", r) == 0.0
        # reasoning-gym's partial credit: the answer inside a longer completion, len(answer)/len(completion)
        assert rg.reward(r["prompt"], right + "x", r) == pytest.approx(len(right) / (len(right) + 1))


def test_reward_names_what_a_foreign_record_lacks() -> None:
    with pytest.raises(KeyError, match="rg_dataset"):
        rg.reward("say a:", "aaaa", {"id": "echo-0", "prompt": "say a:"})


def test_demonstrations_are_the_datasets_answers_and_the_seeds_differ() -> None:
    demos = rg.demonstration_records("basic_arithmetic", 50, seed=1, lowercase=True, **SMALL)
    assert all(set(d) == {"prompt", "response"} for d in demos)
    assert all(d["response"] == str(expression_value(d["prompt"])) for d in demos)
    other = rg.demonstration_records("basic_arithmetic", 50, seed=2, lowercase=True, **SMALL)
    assert [d["prompt"] for d in demos] != [d["prompt"] for d in other]


def test_cli_writes_prompts_and_sft_records(tmp_path: Path) -> None:
    cfg = json.dumps(SMALL)
    for kind in ("prompts", "sft"):
        out = tmp_path / f"{kind}.jsonl"
        cmd = [sys.executable, "-m", "rollout.envs.reasoning_gym", "basic_arithmetic", str(out), "--n", "8"]
        cmd += ["--lowercase", "--config", cfg, "--kind", kind]
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=120)
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(rows) == 8
        if kind == "prompts":
            assert all(rg.reward(r["prompt"], str(expression_value(r["prompt"])), r) == 1.0 for r in rows)
        else:
            assert all(r["response"] == str(expression_value(r["prompt"])) for r in rows)


def test_solved_gives_no_partial_credit_for_a_padded_guess() -> None:
    (r,) = rg.make_records("basic_arithmetic", 1, seed=0, lowercase=True, **SMALL)
    right = str(expression_value(r["prompt"]))
    padded = right + "00"  # contains the answer: reasoning-gym scores it len(answer)/len(padded)
    assert rg.reward(r["prompt"], padded, r) == pytest.approx(len(right) / len(padded))
    assert rg.solved(r["prompt"], padded, r) == 0.0
    assert rg.solved(r["prompt"], f"{right}\n", r) == 1.0


@pytest.mark.stages  # ~8 minutes on 2 cores: its own tier (make test-stages), not make test
@pytest.mark.timeout(1500)
def test_sft_then_grpo_raises_held_out_accuracy(tmp_path: Path) -> None:
    """The demo at a reduced RL length: a 200-step SFT warm-start (partial: held-out accuracy ~0.08), then
    GRPO whose held-out pass@1, after the first evaluation, averages at least 0.03 above the SFT model's.
    A policy that collapses (lr 1e-3 here) or farms reasoning-gym's partial credit (reward ``reward``
    instead of ``solved``) ends below where it started and fails this."""
    from tandem.data import write_prompts
    from toy.tiny import make_tiny

    model = make_tiny(tmp_path / "tiny", hidden=128)["actor"]
    cfg = SMALL
    data = tmp_path / "arith"
    write_prompts(data / "prompts.jsonl", rg.make_records("basic_arithmetic", 2000, 0, lowercase=True, **cfg))
    write_prompts(data / "eval.jsonl", rg.make_records("basic_arithmetic", 128, 2, lowercase=True, **cfg))
    write_prompts(
        data / "sft.jsonl", rg.demonstration_records("basic_arithmetic", 2000, 1, lowercase=True, **cfg)
    )
    write_prompts(
        data / "sft-eval.jsonl", rg.demonstration_records("basic_arithmetic", 200, 3, lowercase=True, **cfg)
    )
    sft = tmp_path / "sft"
    cmd = [
        sys.executable, "-m", "learner.train", "--config", str(ROOT / "configs/sft-arith.yaml"),
        "--run-dir", str(sft), f"model.actor={model}", f"data.prompts={data / 'prompts.jsonl'}",
        f"algorithm.train_file={data / 'sft.jsonl'}", f"algorithm.eval_file={data / 'sft-eval.jsonl'}",
        "logging.wandb_mode=disabled",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = tmp_path / "runs"
    cmd = [
        sys.executable, str(ROOT / "launch.py"), str(ROOT / "configs/tiny-arith.yaml"), "--no-console",
        f"model.actor={sft / 'final'}", f"data.prompts={data / 'prompts.jsonl'}",
        f"eval.prompts={data / 'eval.jsonl'}", f"run.output_dir={runs}", "learner.total_steps=250",
        "learner.checkpoint_interval=0", "logging.wandb_mode=disabled",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = runs.iterdir()
    evals = read_history(run_dir, "eval")
    versions = [int(r["eval/version"]) for r in evals]  # a server may skip a superseded version
    assert versions[0] == 0 and len(versions) >= 4 and all(v % 50 == 0 for v in versions), versions
    start, later = evals[0]["eval/pass@1"], [r["eval/pass@1"] for r in evals[1:]]
    # The gain of the later evaluations' mean over the start measured 0.049-0.066 in seven runs
    # (2026-11-26, start 0.077): a threshold at it failed one run in several. +0.03 is still about twice
    # the evaluation's own noise (128 prompts x 8 samples, a pass rate near 0.12) above no gain.
    assert sum(later) / len(later) >= start + 0.03, f"held-out pass@1 {start:.3f} -> {later}"
