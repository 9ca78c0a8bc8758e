"""Asynchronous checkpoints (learner/checkpoint_async.py) on real DeepSpeed engines, one gloo rank in-process:
the snapshot is the state at snapshot time, the commit comes only after the files are durable, one write
at a time, and the wait for it is counted. The kill -9 audit is in tests/test_learner.py."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import OrderedDict

import deepspeed
import pytest
import torch
from torch import nn

from buffer.streams import ReplayBuffer
from learner import checkpoint, checkpoint_async
from learner.checkpoint import LearnerState
from learner.checkpoint_async import AsyncCheckpointer, to_host
from learner.models import init_distributed
from learner.ppo import PPOLearner as Learner
from tandem.config import load_config
from tests.test_learner import (
    REPO,
    group,
    history,
    learner_env,
    lineage,
    raw_config,
    run_two_learner_ranks,
    wait_for_version,
    write_config,
)


@pytest.fixture(scope="module", autouse=True)
def one_rank() -> None:
    init_distributed(torch.device("cpu"))


def engine(zero_stage: int, seed: int = 0) -> deepspeed.DeepSpeedEngine:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": zero_stage},
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 30,
    }
    out, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return out


def train_step(e: deepspeed.DeepSpeedEngine, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    loss = e(torch.randn(4, 8, generator=g)).square().mean()
    e.backward(loss)
    e.step()


def params(e: deepspeed.DeepSpeedEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in e.module.state_dict().items()}


def optimizer_tensors(e: deepspeed.DeepSpeedEngine) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    to_host(e.optimizer.state_dict(), (), out)
    return out


def test_to_host_copies_tensors_and_keeps_containers() -> None:
    t = torch.ones(3)
    state = OrderedDict(w=t, nested={"xs": [t, 2], "pair": (t, "a")}, step=7)
    copied = to_host(state)
    t.add_(1.0)  # training changes the live tensor in place after the snapshot
    assert type(copied) is OrderedDict and copied["step"] == 7 and copied["nested"]["pair"][1] == "a"
    for got in (copied["w"], copied["nested"]["xs"][0], copied["nested"]["pair"][0]):
        assert torch.equal(got, torch.ones(3))
    assert copied["nested"]["xs"][1] == 2


def test_to_host_copies_into_the_previous_snapshots_tensors_where_they_fit() -> None:
    w, b = torch.ones(2, 3), torch.zeros(4)
    first: list[torch.Tensor] = []
    to_host({"w": w, "b": b}, (), first)
    w.fill_(5.0)
    second: list[torch.Tensor] = []
    copied = to_host({"w": w, "b": torch.zeros(5)}, first, second)  # b changed shape
    assert copied["w"] is first[0] and torch.equal(copied["w"], torch.full((2, 3), 5.0))
    assert copied["b"] is not first[1] and copied["b"].shape == (5,)
    assert second == [copied["w"], copied["b"]]


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_snapshot_is_the_state_at_snapshot_time(tmp_path, zero_stage: int) -> None:
    e = engine(zero_stage)
    train_step(e, 1)
    at_snapshot = params(e)
    writer = AsyncCheckpointer(tmp_path, timeout_s=60)
    writer.write_delay_s = 0.3
    writer.snapshot({"actor": e}, LearnerState(1, ["1-0"]))
    train_step(e, 2)  # trains on while the writer writes
    train_step(e, 3)
    after = params(e)
    assert any(not torch.equal(after[k], at_snapshot[k]) for k in after)
    state, _ = writer.wait()
    assert state.version == 1
    at_snapshot = params(e)  # the second snapshot copies into the first one's host tensors
    optimizer_at_snapshot = optimizer_tensors(e)
    writer.snapshot({"actor": e}, LearnerState(3, ["3-0"]))
    train_step(e, 4)
    assert writer.wait()[0].version == 3

    fresh = engine(zero_stage, seed=1)  # other initial weights: the load must overwrite them
    loaded = checkpoint.load(tmp_path, {"actor": fresh})
    assert loaded.version == 3 and loaded.trained_ids == ["3-0"]
    for k, v in params(fresh).items():
        torch.testing.assert_close(v, at_snapshot[k], rtol=0, atol=0)
    # The optimizer state (Adam's moments; a ZeRO partition's fp32 weights) came back too.
    restored = optimizer_tensors(fresh)
    assert len(restored) == len(optimizer_at_snapshot) > 0
    for got, want in zip(restored, optimizer_at_snapshot, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_commit_only_after_the_files_are_durable(tmp_path, monkeypatch) -> None:
    events: list[str] = []
    real_durable, real_commit = checkpoint.make_durable, checkpoint.commit
    monkeypatch.setattr(
        checkpoint, "make_durable", lambda *a: (real_durable(*a), events.append("durable"))[0]
    )
    monkeypatch.setattr(
        checkpoint, "commit", lambda *a, **k: (events.append("commit"), real_commit(*a, **k))[1]
    )
    e = engine(0)
    checkpoint.save(tmp_path, {"actor": e}, LearnerState(1, []))
    writer = AsyncCheckpointer(tmp_path, timeout_s=60)
    writer.write_delay_s = 0.5
    writer.snapshot({"actor": e}, LearnerState(2, ["2-0"]))
    assert writer.poll() is None  # still writing: nothing committed, latest.json names the previous one
    assert json.loads((tmp_path / "latest.json").read_text())["version"] == 1
    while writer.in_flight.thread.is_alive():
        time.sleep(0.05)
    committed = writer.poll()
    assert committed is not None and committed.trained_ids == ["2-0"]
    assert json.loads((tmp_path / "latest.json").read_text())["version"] == 2
    assert (tmp_path / "actor" / "latest").read_text() == "v00000002"
    assert events == ["durable", "commit", "durable", "commit"]
    assert writer.poll() is None  # nothing in flight


def test_old_checkpoints_are_pruned_off_the_training_thread_and_never_the_committed_one(tmp_path) -> None:
    """keep=1: after each commit only the committed folder is left (the prune runs on its own thread), and
    a write in flight is never counted among those kept, so pruning cannot remove the committed one."""
    e = engine(0)
    writer = AsyncCheckpointer(tmp_path, timeout_s=60, keep=1)
    for version in (1, 2, 3):
        writer.snapshot({"actor": e}, LearnerState(version, []))
        writer.wait()
        deadline = time.monotonic() + 10
        while len(list((tmp_path / "state").iterdir())) > 1:
            assert time.monotonic() < deadline, sorted(p.name for p in (tmp_path / "state").iterdir())
            time.sleep(0.02)
        assert sorted(p.name for p in (tmp_path / "actor").iterdir() if p.is_dir()) == [f"v{version:08d}"]
    writer.write_delay_s = 1.0
    writer.snapshot({"actor": e}, LearnerState(4, []))  # v4 is being written; v3 is the committed one
    (tmp_path / "state" / "v00000004").mkdir(exist_ok=True)  # as its writer makes it, any moment now
    checkpoint.prune(tmp_path, ["actor"], 3, keep=1)
    assert (tmp_path / "state" / "v00000003").is_dir() and (tmp_path / "actor" / "v00000003").is_dir()
    writer.wait()


def test_one_write_in_flight_and_the_wait_is_counted(tmp_path) -> None:
    e = engine(0)
    writer = AsyncCheckpointer(tmp_path, timeout_s=60)
    writer.write_delay_s = 0.4
    writer.snapshot({"actor": e}, LearnerState(1, []))
    with pytest.raises(RuntimeError, match="still in flight"):
        writer.snapshot({"actor": e}, LearnerState(2, []))
    state, waited = writer.wait()
    assert state.version == 1 and 0.3 <= waited < 5
    assert writer.wait() == (None, 0.0)


def test_a_hung_write_stops_the_wait_with_the_folder_named(tmp_path) -> None:
    e = engine(0)
    checkpoint.save(tmp_path, {"actor": e}, LearnerState(1, []))
    writer = AsyncCheckpointer(tmp_path, timeout_s=0.2)
    writer.write_delay_s = 1.0  # a write that outlasts the timeout, as a dead network mount would
    writer.snapshot({"actor": e}, LearnerState(2, ["2-0"]))
    with pytest.raises(TimeoutError, match=f"checkpoint v2: still writing to {tmp_path}"):
        writer.wait()
    assert json.loads((tmp_path / "latest.json").read_text())["version"] == 1


def test_the_learner_stops_on_a_write_past_its_configured_timeout(
    tiny_ckpt, redis_server, redis_client, run_id, tmp_path, monkeypatch
) -> None:
    """``learner.checkpoint_timeout_s`` reaches the writer: a write held 3 s against a timeout of 0.3 s stops
    the learner at the next checkpoint with the folder named, and nothing is committed."""
    monkeypatch.setenv(checkpoint_async.WRITE_DELAY_ENV, "3.0")
    learner = {"total_steps": 3, "checkpoint_interval": 1, "checkpoint_async": True, "save_hf_final": False}
    learner["checkpoint_timeout_s"] = 0.3
    cfg = load_config(None, raw=raw_config(tiny_ckpt, redis_server.url, run_id, tmp_path, learner=learner))
    buffer = ReplayBuffer.from_config(redis_client, cfg, "test-producer")
    for g in range(6):
        buffer.put(group(g, 4))
    run_dir = tmp_path / "run"
    with pytest.raises(TimeoutError, match=f"checkpoint v1: still writing to {run_dir / 'checkpoints'}"):
        Learner(cfg, run_dir).run()
    assert not (run_dir / "checkpoints" / "latest.json").exists()


def test_a_failed_write_is_never_committed(tmp_path, monkeypatch) -> None:
    e = engine(0)
    checkpoint.save(tmp_path, {"actor": e}, LearnerState(1, []))
    writer = AsyncCheckpointer(tmp_path, timeout_s=60)

    def full_disk(*_a, **_k) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_async.checkpoint, "write_state", full_disk)
    writer.snapshot({"actor": e}, LearnerState(2, ["2-0"]))
    with pytest.raises(RuntimeError, match="checkpoint v2 could not be written"):
        writer.wait()
    assert json.loads((tmp_path / "latest.json").read_text())["version"] == 1


@pytest.mark.slow
@pytest.mark.faults
def test_sigkill_during_a_slow_write_trains_every_trajectory_once(
    tiny_ckpt, redis_server, redis_client, run_id, tmp_path
) -> None:
    """Checkpoints every step, each write held 1 s: a checkpoint due while the previous one writes waits
    (counted), and a kill -9 right after step 3 lands in the middle of checkpoint 3's write. Resume falls
    back to checkpoint 2; the records show every trajectory trained into the surviving model once."""

    steps = 4
    learner = {
        "total_steps": steps,
        "checkpoint_interval": 1,
        "checkpoint_async": True,
        "save_hf_final": False,
    }
    raw = raw_config(tiny_ckpt, redis_server.url, run_id, tmp_path, learner=learner)
    cfg_path = write_config(raw, tmp_path / "learner.yaml")
    buffer = ReplayBuffer.from_config(redis_client, load_config(cfg_path), "test-producer")
    ids = [i for g in range(2 * steps) for i in buffer.put(group(g, 4))]
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "learner.train", "--config", str(cfg_path), "--run-dir", str(run_dir)]

    log_path = tmp_path / "first.log"
    slow = {**learner_env(), checkpoint_async.WRITE_DELAY_ENV: "1.0"}
    with open(log_path, "wb") as log_file:
        first = subprocess.Popen(cmd, cwd=REPO, env=slow, stderr=log_file)
    try:
        wait_for_version(redis_client, run_id, 3, first, timeout_s=120, log=log_path)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    done_before = max(lineage(run_dir))
    committed = json.loads((run_dir / "checkpoints" / "latest.json").read_text())["version"]
    assert committed < done_before  # killed while the newest checkpoint was still writing
    rows = history(redis_client, run_id)
    # A step shorter than the write waits for it when its own checkpoint is due (a longer one finds it done).
    assert max(r["checkpoint/wait_s"] for r in rows) > 0.3
    assert all(r["checkpoint/stall_s"] >= r["checkpoint/wait_s"] for r in rows)

    env = {**learner_env(), checkpoint_async.WRITE_DELAY_ENV: "0.2"}
    second = subprocess.run([*cmd, "--resume"], cwd=REPO, env=env, capture_output=True, timeout=180)
    assert second.returncode == 0, second.stderr.decode()[-3000:]
    assert f"resumed at version {committed} " in second.stderr.decode()
    trained = lineage(run_dir)
    assert sorted(trained) == list(range(1, steps + 1))
    flat = [i for v in sorted(trained) for i in trained[v]]
    assert len(flat) == len(set(flat))  # none twice
    assert sorted(flat) == sorted(ids)  # none lost
    assert buffer.trajectories_pending() == 0
    assert json.loads((run_dir / "checkpoints" / "latest.json").read_text())["version"] == steps


@pytest.mark.slow
@pytest.mark.faults  # a minute of torchrun: beside the other exactly-once audits (make test-faults)
def test_two_ranks_under_zero_2_commit_together(
    tiny_ckpt, redis_server, redis_client, run_id, tmp_path
) -> None:
    """Two torchrun ranks, ZeRO-2 (each rank writes its own optimizer partition), a checkpoint every step
    whose writes are held 0.5 s: every checkpoint commits once both ranks' files are written, the run ends
    with the last one committed and every trajectory acked, and both partitions of it load."""
    steps = 3
    learner = {
        "total_steps": steps,
        "checkpoint_interval": 1,
        "checkpoint_async": True,
        "zero_stage": 2,
        "micro_batch_size": 2,
        "num_ranks": 2,
        "save_hf_final": False,
    }
    algorithm = {"advantage": "grpo", "minibatch_size": 4}
    raw = raw_config(tiny_ckpt, redis_server.url, run_id, tmp_path, learner=learner, algorithm=algorithm)
    cfg_path = write_config(raw, tmp_path / "learner.yaml")
    buffer = ReplayBuffer.from_config(redis_client, load_config(cfg_path), "test-producer")
    ids = [i for g in range(2 * steps) for i in buffer.put(group(g, 4))]
    run_dir = tmp_path / "run"
    run_two_learner_ranks(cfg_path, run_dir, env={checkpoint_async.WRITE_DELAY_ENV: "0.5"})
    assert sorted(i for v in lineage(run_dir).values() for i in v) == sorted(ids)
    assert buffer.trajectories_pending() == 0
    ckpt = run_dir / "checkpoints"
    assert json.loads((ckpt / "latest.json").read_text())["version"] == steps
    tag = ckpt / "actor" / f"v{steps:08d}"
    assert sorted(p.name for p in tag.glob("*optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    for rank in (0, 1):
        assert (ckpt / "state" / f"v{steps:08d}" / f"rng_rank{rank}.json").exists()
    assert [r["learner/version"] for r in history(redis_client, run_id)] == [1, 2, 3]
