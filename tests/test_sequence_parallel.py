"""Ulysses sequence parallelism (docs/design.md §4.12): DeepSpeed's attention over 2 gloo ranks, each holding
half of every sequence, gives the log-probabilities and gradient one rank gives on the whole sequence; and
``learner.sequence_parallel``, not yet wired into the learner, is refused naming the field."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tandem.config import ConfigError, load_config
from tandem.net import free_port

REPO = Path(__file__).resolve().parents[1]
DIST_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def run_worker(model: Path, out: Path, *flags: str) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
        "-m", "tests.ulysses_worker", str(model), str(out), *flags,
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=REPO, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr.decode()[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.presets  # two torchrun ranks: about 15-35 s on 2 cores
def test_ulysses_on_two_ranks_matches_one_rank(tiny_ckpt: dict[str, Path], tmp_path: Path) -> None:
    # The tiny Qwen2 has 4 query and 2 KV heads: each of the 2 ranks attends with half of each over the
    # whole gathered sequence of 16 positions, 8 of them its own.
    got = run_worker(tiny_ckpt["actor"], tmp_path / "sp.json")
    assert got["shard_len"] == 8
    assert got["grad_keys_equal"]
    assert got["logp_max_abs_diff"] <= 1e-5, got
    assert got["grad_max_abs_diff"] <= 1e-5, got
    # A forward without position ids passes DeepSpeed's check but is wrong: the learner must pass them.
    assert got["no_position_ids_logp_max_abs_diff"] > 1e-4, got
    # An engine given the sequence-parallel groups applies the summed gradient, except ZeRO-3 with its
    # default reduce-scatter, which averages over the group without DeepSpeed's sequence-parallel factor
    # (docs/design.md §4.12): if that 1/2 changes, DeepSpeed has, and the design notes must follow.
    ratio = got["engine_update_ratio"]
    assert ratio["zero0"] == pytest.approx(1.0, abs=1e-4), ratio
    assert ratio["zero3_no_reduce_scatter"] == pytest.approx(1.0, abs=1e-4), ratio
    assert ratio["zero3"] == pytest.approx(0.5, abs=1e-4), ratio


@pytest.mark.slow
@pytest.mark.presets  # two torchrun ranks and one in-process learner: about 20 s each on 2 cores
@pytest.mark.parametrize(
    ("zero_stage", "learner"),
    [
        (3, {"chunked_head": "on", "max_tokens_per_micro_batch": 40}),  # the long-response path
        (2, {"chunked_head": "off", "micro_batch_size": 2}),  # plain logits, rows by count
    ],
)
def test_learner_on_a_sequence_parallel_pair_matches_one_rank(
    tiny_ckpt, redis_server, redis_client, run_id, tmp_path, zero_stage: int, learner: dict
) -> None:
    """PPO with a critic and a reference, two steps of two minibatches each, trained by 2 ranks that split
    every sequence between them (one sequence-parallel group), and by 1 rank on the same batches: the
    losses, entropies and the gradient norms before clipping agree step by step. A gradient counted twice
    (the group's all-reduce backward) or once per shard only (no sum over the group) moves the norms."""
    from buffer.streams import ReplayBuffer
    from learner.ppo import PPOLearner
    from tests.test_learner import group, history, raw_config, run_two_learner_ranks, write_config

    steps = 2
    raw = raw_config(
        tiny_ckpt,
        redis_server.url,
        run_id,
        tmp_path,
        algorithm={"advantage": "gae", "kl_coef": 0.05, "minibatch_size": 4},
        data={"max_prompt_tokens": 8},  # the groups' prompts are 2-6 tokens, their responses 1-8
        rollout={"n_samples": 4, "temperature": 1.0, "max_new_tokens": 8},
        learner={"total_steps": steps, "zero_stage": zero_stage, "num_ranks": 2, "sequence_parallel": 2}
        | learner,
    )
    cfg_path = write_config(raw, tmp_path / "learner.yaml")
    buffer = ReplayBuffer.from_config(redis_client, load_config(cfg_path), "test-producer")
    for g in range(2 * steps):
        buffer.put(group(g, 4))
    run_two_learner_ranks(cfg_path, tmp_path / "run")
    split = history(redis_client, run_id)
    assert [r["learner/version"] for r in split] == [1, 2]

    single = {**raw, "run": {**raw["run"], "name": f"{run_id}-one"}}
    single["learner"] = {**raw["learner"], "num_ranks": 1, "sequence_parallel": 1}
    single_cfg = load_config(None, raw=single)
    buffer = ReplayBuffer.from_config(redis_client, single_cfg, "test-producer")
    for g in range(2 * steps):
        buffer.put(group(g, 4))
    PPOLearner(single_cfg, tmp_path / "one").run()
    one = history(redis_client, f"{run_id}-one")
    keys = ["loss/policy", "loss/value", "loss/kl", "policy/entropy", "actor/grad_norm", "critic/grad_norm"]
    for key in keys:
        np.testing.assert_allclose(
            [r[key] for r in split], [r[key] for r in one], rtol=1e-5, atol=1e-7, err_msg=key
        )


def test_sequence_parallel_refusals_name_the_field() -> None:
    tiny = REPO / "configs/tiny.yaml"
    with pytest.raises(
        ConfigError, match=r"learner\.sequence_parallel \(3\) must divide learner\.num_ranks \(2\)"
    ):
        load_config(tiny, ["learner.num_ranks=2", "learner.sequence_parallel=3"])
    with pytest.raises(ConfigError, match=r"learner\.sequence_parallel=2: learner\.lora\.rank > 0"):
        load_config(tiny, ["learner.num_ranks=2", "learner.sequence_parallel=2", "learner.lora.rank=4"])
    with pytest.raises(ConfigError, match=r"learner\.sequence_parallel=2: the sft recipe"):
        load_config(REPO / "configs/sft-echo.yaml", ["learner.num_ranks=2", "learner.sequence_parallel=2"])
    cfg = load_config(tiny, ["learner.num_ranks=2", "learner.sequence_parallel=2"])
    assert (cfg.learner.num_ranks, cfg.learner.sequence_parallel) == (2, 2)
