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
