"""Ulysses sequence parallelism (docs/design.md §4.12): DeepSpeed's attention over 2 gloo ranks, each holding
half of every sequence, gives the log-probabilities and gradient one rank gives on the whole sequence; and
``learner.sequence_parallel``, not yet wired into the learner, is refused naming the field."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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


def test_sequence_parallel_is_refused_naming_the_field() -> None:
    tiny = REPO / "configs/tiny.yaml"
    with pytest.raises(
        ConfigError, match=r"learner\.sequence_parallel \(3\) must divide learner\.num_ranks \(2\)"
    ):
        load_config(tiny, ["learner.num_ranks=2", "learner.sequence_parallel=3"])
    with pytest.raises(ConfigError, match=r"learner\.sequence_parallel=2 is not yet wired"):
        load_config(tiny, ["learner.num_ranks=2", "learner.sequence_parallel=2"])
    assert load_config(tiny, ["learner.sequence_parallel=1"]).learner.sequence_parallel == 1
