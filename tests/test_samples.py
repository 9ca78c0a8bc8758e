"""Sampled completions (learner/samples.py): every ``logging.samples_interval`` steps, ``samples_count``
trajectories of the batch as text in ``<run dir>/samples.jsonl``, decoded with the actor's real tokenizer."""

from __future__ import annotations

import json
import random

import numpy as np
from transformers import AutoTokenizer

from buffer.schema import Trajectory
from learner.samples import SAMPLES_FILE, CompletionSamples, sample_rows
from tandem.config import load_config
from tandem.telemetry import Telemetry


def trajectory(tok, i: int, prompt: str, completion: str) -> Trajectory:
    p, r = tok(prompt)["input_ids"], tok(completion)["input_ids"]
    return Trajectory(
        traj_id=f"t{i}",
        group_id="g",
        prompt_id=f"p{i}",
        prompt_tokens=np.array(p),
        response_tokens=np.array(r),
        behav_logp=np.zeros(len(r)),
        token_versions=np.zeros(len(r)),
        reward=i / 10,
        reward_parts={"echo": i / 10},
    )


def test_samples_are_written_every_k_steps_as_text(tiny_ckpt, tmp_path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_ckpt["actor"])
    raw = {
        "run": {"name": "samples", "device": "cpu", "seed": 3},
        "model": {"actor": str(tiny_ckpt["actor"])},
        "data": {"prompts": "unused.jsonl"},
        "reward": {"functions": [{"path": "toy.tasks.echo:reward"}]},
        "logging": {"wandb_mode": "disabled", "samples_interval": 3, "samples_count": 2},
    }
    cfg = load_config(None, raw=raw)
    texts = [(f"say {c}:", c * (i + 1)) for i, c in enumerate("abcda")]
    trajs = [trajectory(tok, i, p, c) for i, (p, c) in enumerate(texts)]
    samples = CompletionSamples(cfg, tok, Telemetry(cfg, "learner"), tmp_path)
    logged = {step: samples.log(step, trajs) for step in range(1, 8)}
    assert [s for s, rows in logged.items() if rows] == [3, 6]
    lines = [json.loads(line) for line in (tmp_path / SAMPLES_FILE).read_text().splitlines()]
    assert [r["step"] for r in lines] == [3, 3, 6, 6]
    by_id = {f"p{i}": (p, c, i / 10) for i, (p, c) in enumerate(texts)}
    for row in lines:
        prompt, completion, reward = by_id[row["prompt_id"]]
        assert tok.decode(tok(prompt)["input_ids"]) == row["prompt"]
        assert row["completion"] == tok.decode(tok(completion)["input_ids"], skip_special_tokens=True)
        assert row["completion"].replace(" ", "") == completion  # the text, not token ids
        assert row["reward"] == reward and row["reward_parts"] == {"echo": reward}
    assert len({r["prompt_id"] for r in lines[:2]}) == 2  # drawn without replacement


def test_sample_rows_draws_all_when_fewer_and_off_by_default() -> None:
    trajs = [Trajectory("t", "g", "p", np.array([1]), np.array([2, 3]), np.zeros(2), np.zeros(2), reward=1.0)]
    rows = sample_rows(trajs, lambda ids, skip: ",".join(map(str, ids)), 5, 7, random.Random(0))
    assert [(r["prompt"], r["completion"], r["step"]) for r in rows] == [("1", "2,3", 7)]
    cfg = load_config(
        None,
        raw={
            "run": {"name": "x"},
            "model": {"actor": "a"},
            "data": {"prompts": "p"},
            "reward": {"functions": [{"path": "toy.tasks.echo:reward"}]},
        },
    )
    assert cfg.logging.samples_interval == 0  # off unless asked for
