"""The rollout loop against a real Redis, the real shm weight transport, tiny models and a fake learner.

The fake learner does what the real one does at the boundary: take a batch, publish new weights for
version v, then set the Redis version to v, then acknowledge.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

import rollout.weights
from buffer.admission import Admission
from buffer.schema import PromptRecord, Trajectory
from buffer.streams import ClaimHeartbeat, ReplayBuffer
from rollout.engines.base import SamplingParams
from rollout.engines.hf import HFEngine
from rollout.loop import RolloutLoop
from tandem.config import Config, load_config
from tandem.procs import alive
from tandem.rewards import RewardFunctions
from tandem.telemetry import Telemetry, ready_key, stop_key
from toy.tasks import make_records
from weightsync import make_publisher, make_subscriber
from weightsync.base import Subscriber, Update, WeightSyncError

TIMEOUT = 60.0


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The 'trained' actor a fake learner publishes: same architecture, other weights."""
    from toy.tiny import make_tiny

    path = make_tiny(tmp_path_factory.mktemp("tiny-v1"), seed=7)["actor"]
    model = AutoModelForCausalLM.from_pretrained(path)
    return {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}


@pytest.fixture(scope="module")
def engine(tiny_ckpt: dict[str, Path]) -> HFEngine:
    return HFEngine(str(tiny_ckpt["actor"]), device="cpu", seed=0)


def make_cfg(run_id: str, redis_url: str, tiny_ckpt: dict[str, Path], tmp: Path, **over: object) -> Config:
    raw = {
        "run": {"name": run_id, "device": "cpu"},
        "redis": {"url": redis_url},
        "model": {"actor": str(tiny_ckpt["actor"])},
        "data": {"prompts": str(tmp / "prompts.jsonl")},
        "rollout": {"n_samples": 2, "prompts_per_batch": 2, "max_new_tokens": 6, "http": {"enabled": False}},
        "reward": {"functions": [{"path": "toy.tasks.echo:reward"}]},
        "algorithm": {"batch_size": 4, "minibatch_size": 4, "max_staleness": 0},
        "learner": {"micro_batch_size": 4},
        "weightsync": {"shm_dir": str(tmp / "shm"), "timeout_s": 30},
        "logging": {"wandb_mode": "disabled"},
    }
    return load_config(None, [f"{k}={json.dumps(v)}" for k, v in over.items()], raw=raw)


def queue_prompts(buffer: ReplayBuffer, engine: HFEngine, n: int) -> list[PromptRecord]:
    prompts = [
        PromptRecord(r["id"], r["prompt"], engine.tokenizer(r["prompt"]).input_ids, r)
        for r in make_records("echo", n, seed=1)
    ]
    buffer.put_prompts(prompts)
    return prompts


class Learner:
    """Takes batches and publishes weights like the real learner, without training."""

    def __init__(self, cfg: Config, client, engine_weights: dict[str, torch.Tensor]) -> None:
        self.cfg = cfg
        self.buffer = ReplayBuffer.from_config(client, cfg, consumer="learner-0")
        self.admission = Admission.from_config(client, cfg, consumer="learner-0")
        self.publisher = make_publisher(cfg, client)
        self.version = 0
        self.publisher.publish(engine_weights.items(), 0)  # version-0 weights first, as the learner does
        self.admission.set_version(0)

    def take(self, n: int) -> list[Trajectory]:
        got = self.buffer.take(n, timeout_s=TIMEOUT)
        assert len(got) == n, f"took {len(got)} of {n} trajectories within {TIMEOUT}s"
        self.buffer.ack([t.id for t in got])
        return [t.traj for t in got]

    def step(self, weights: dict[str, torch.Tensor]) -> None:
        self.version += 1
        self.publisher.publish(weights.items(), self.version)  # publish v before announcing v
        self.admission.set_version(self.version)


class Harness:
    """A rollout loop running in a thread of the test, stopped (and checked to stop) at the end."""

    def __init__(self, cfg: Config, client, engine: HFEngine, subscriber: Subscriber, evaluator=None) -> None:
        self.buffer = ReplayBuffer.from_config(client, cfg, consumer="server-0")
        self.telemetry = Telemetry(cfg, "server-0", client)
        self.loop = RolloutLoop(
            cfg,
            engine,
            engine.tokenizer,
            self.buffer,
            subscriber,
            self.telemetry,
            server_index=0,
            rewards=RewardFunctions(cfg.reward),
            evaluator=evaluator,
        )
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.loop.run()
        except BaseException as e:
            self.errors.append(e)

    def __enter__(self) -> Harness:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.stop_event.set()
        self.thread.join(TIMEOUT)
        assert not self.thread.is_alive(), "the rollout loop did not stop within the timeout"
        assert not self.errors, self.errors


@pytest.fixture
def restore(engine: HFEngine) -> Iterator[None]:
    """Tests swap the shared engine's weights; put the originals back."""
    original = {k: v.clone() for k, v in engine.model.state_dict().items() if k != "lm_head.weight"}
    yield
    engine.update_weights(Update(0, [], lambda: iter(original.items())))


def behaviour_logp(weights: dict[str, torch.Tensor], tiny_ckpt: dict[str, Path], t: Trajectory) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt["actor"])
    model.load_state_dict(weights, strict=False)
    ids = torch.tensor(np.concatenate([t.prompt_tokens, t.response_tokens]), dtype=torch.long)[None]
    with torch.no_grad():
        logp = model(ids).logits[0, len(t.prompt_tokens) - 1 : -1].log_softmax(-1)
    return logp.gather(-1, torch.tensor(t.response_tokens, dtype=torch.long)[:, None]).squeeze(-1).numpy()


def test_staleness_zero_is_synchronous(
    redis_server, redis_client, run_id, tiny_ckpt, tmp_path, engine, new_weights, restore
) -> None:
    """Admission holds the server while the learner's version stands still; after v1 is published every
    token carries version 1 and its behaviour logprob is that of the v1 weights."""
    cfg = make_cfg(run_id, redis_server.url, tiny_ckpt, tmp_path)
    v0 = {k: v.clone() for k, v in engine.model.state_dict().items() if k != "lm_head.weight"}
    learner = Learner(cfg, redis_client, v0)
    queue_prompts(learner.buffer, engine, 8)
    with Harness(cfg, redis_client, engine, make_subscriber(cfg, redis_client, "server-0")):
        first = learner.take(4)
        time.sleep(2.0)  # the server would produce more now if admission let it
        assert learner.buffer.trajectories_pending() == 0, "admission let the server run ahead of the learner"
        assert int(redis_client.get(f"{run_id}:admitted")) == 4
        learner.step(new_weights)
        second = learner.take(4)
    assert all(set(t.token_versions.tolist()) == {0} for t in first)
    assert all(set(t.token_versions.tolist()) == {1} for t in second)
    np.testing.assert_allclose(
        second[0].behav_logp, behaviour_logp(new_weights, tiny_ckpt, second[0]), atol=1e-4
    )
    # Groups: n samples share a group id and a prompt, and arrive contiguously.
    for batch in (first, second):
        assert batch[0].group_id == batch[1].group_id != batch[2].group_id == batch[3].group_id
        assert batch[0].prompt_id == batch[1].prompt_id
    t = second[0]
    assert len(t.response_tokens) == len(t.behav_logp) == len(t.token_versions) >= 1
    assert t.server_id == "server-0" and t.finish_reason in ("stop", "length") and len(t.traj_id) == 32
    assert 0.0 <= t.reward <= 1.0 and set(t.reward_parts) == {"echo"}
    assert learner.buffer.prompts_pending() == 4  # four answered and acknowledged, four left
    stats = redis_client.hgetall(f"{run_id}:stats:server-0")
    assert float(stats[b"rollout/groups"]) >= 2 and b"time/generate" in stats


class TriggerSubscriber:
    """The real shm subscriber; its ``at``-th poll first has the learner publish (a deterministic 'during')."""

    def __init__(self, inner: Subscriber, at: int, publish) -> None:
        self.inner, self.at, self.publish, self.calls = inner, at, publish, 0
        self.server_id = inner.server_id

    @property
    def version(self) -> int:
        return self.inner.version

    def latest_version(self) -> int:
        return self.inner.latest_version()

    def poll(self, timeout: float = 0.0) -> Update | None:
        self.calls += 1
        if self.calls == self.at:
            self.publish()
        return self.inner.poll(timeout)

    def applied(self) -> None:
        self.inner.applied()

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("inflight", [True, False])
def test_weight_update_during_generation(
    redis_server,
    redis_client,
    run_id,
    tiny_ckpt,
    tmp_path,
    engine,
    new_weights,
    restore,
    monkeypatch,
    inflight,
) -> None:
    """Poll 1 is before the first batch, poll 2 the first in-flight one (after one token of every row):
    in flight, the switch shows inside sequences; otherwise the whole next batch has the new version."""
    monkeypatch.setattr(rollout.weights, "INFLIGHT_POLL_S", 0.0)
    cfg = make_cfg(
        run_id,
        redis_server.url,
        tiny_ckpt,
        tmp_path,
        **{"algorithm.max_staleness": 2, "rollout.inflight_updates": inflight, "rollout.max_new_tokens": 12},
    )
    v0 = {k: v.clone() for k, v in engine.model.state_dict().items() if k != "lm_head.weight"}
    learner = Learner(cfg, redis_client, v0)
    queue_prompts(learner.buffer, engine, 8)
    sub = TriggerSubscriber(
        make_subscriber(cfg, redis_client, "server-0"), 2, lambda: learner.step(new_weights)
    )
    with Harness(cfg, redis_client, engine, sub):
        first, second = learner.take(4), learner.take(4)
    if inflight:
        for t in first:
            assert t.token_versions.tolist() == [0] + [1] * (len(t.token_versions) - 1)
        assert any(len(t.token_versions) > 1 for t in first)
    else:
        assert all(set(t.token_versions.tolist()) == {0} for t in first)
    assert all(set(t.token_versions.tolist()) == {1} for t in second)


def test_stop_leaves_unanswered_prompts_pending(
    redis_server, redis_client, run_id, tiny_ckpt, tmp_path, engine
) -> None:
    """A stopped server appends nothing partial; admission it will not use goes back to the counter."""
    cfg = make_cfg(run_id, redis_server.url, tiny_ckpt, tmp_path)
    v0 = {k: v.clone() for k, v in engine.model.state_dict().items() if k != "lm_head.weight"}
    learner = Learner(cfg, redis_client, v0)
    with Harness(cfg, redis_client, engine, make_subscriber(cfg, redis_client, "server-0")) as h:
        # No prompts yet: the loop holds admission for a batch and waits for prompts.
        deadline = time.monotonic() + TIMEOUT
        while h.loop.admission.credits < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert int(redis_client.get(f"{run_id}:admitted")) == 4
    assert int(redis_client.get(f"{run_id}:admitted")) == 0
    assert learner.buffer.trajectories_pending() == 0


@pytest.mark.slow
def test_server_process_end_to_end(
    redis_server, redis_client, run_id, tiny_ckpt, tmp_path, engine, new_weights
) -> None:
    """``python -m rollout.server --config ... --server-id 0 --run-dir ...``: ready with an HTTP port,
    trajectories flow, a published version reaches them, the stop key ends the process cleanly."""
    import httpx

    cfg = make_cfg(run_id, redis_server.url, tiny_ckpt, tmp_path, **{"rollout.http": {"enabled": True}})
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    v0 = {k: v.clone() for k, v in engine.model.state_dict().items() if k != "lm_head.weight"}
    learner = Learner(cfg, redis_client, v0)
    queue_prompts(learner.buffer, engine, 8)
    cmd = [
        sys.executable,
        "-m",
        "rollout.server",
        "--config",
        str(config_path),
        "--server-id",
        "0",
        "--run-dir",
        str(tmp_path),
    ]
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
    try:
        deadline = time.monotonic() + 120
        while (ready := redis_client.get(ready_key(run_id, "server-0"))) is None:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "server not ready within 120 s"
            time.sleep(0.2)
        port = json.loads(ready)["http_port"]
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "actor", "prompt": "say a:", "max_tokens": 3},
            timeout=30,
        )
        assert r.status_code == 200
        first = learner.take(4)
        learner.step(new_weights)
        second = learner.take(4)
        assert {v for t in first for v in t.token_versions.tolist()} == {0}
        assert {v for t in second for v in t.token_versions.tolist()} == {1}
        redis_client.set(stop_key(run_id), 1)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


ROOT = Path(__file__).resolve().parent.parent

# SGLang cannot run here: this stand-in for ``python -m sglang.launch_server`` notes its pid and never
# answers /health, as a real server loading a large model does for minutes.
SLOW_SGLANG = """
import os, sys, time
with open(os.environ["SLOW_ENGINE_PID"], "w") as f:
    f.write(str(os.getpid()))
time.sleep(600)
"""


def test_a_signal_while_the_engine_starts_ends_the_server_and_its_engine(
    redis_server, run_id, tiny_ckpt, tmp_path
) -> None:
    """SIGTERM to a rollout server whose managed engine has not yet answered /health: the server exits 0 at
    once and takes the engine server down, instead of waiting out rollout.sglang.startup_timeout_s."""
    fake = tmp_path / "fake" / "sglang"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "launch_server.py").write_text(SLOW_SGLANG)
    cfg = make_cfg(
        run_id, redis_server.url, tiny_ckpt, tmp_path,
        **{"rollout.engine": "sglang", "rollout.sglang": {"startup_timeout_s": 300}},
        **{"run.output_dir": str(tmp_path / "out")},
    )  # fmt: skip
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    pid_file = tmp_path / "engine.pid"
    env = {**os.environ, "PYTHONPATH": f"{fake.parent}:{ROOT}", "SLOW_ENGINE_PID": str(pid_file)}
    cmd = [sys.executable, "-m", "rollout.server", "--config", str(config_path), "--server-id", "0"]
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not pid_file.is_file() or not pid_file.read_text():
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the engine server never started"
            time.sleep(0.1)
        engine_pid = int(pid_file.read_text())
        time.sleep(1.0)  # well inside the health wait
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log_path.read_text()[-3000:]
        assert "stopped by SIGTERM while the engine was starting" in log_path.read_text()
        assert not alive(engine_pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_reward_model_scores_padded_batches_like_single_texts(tiny_ckpt) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rollout.reward_model import RewardModel

    rm = RewardModel(str(tiny_ckpt["critic"]), device="cpu")
    texts = ["say a:aaaa", "x", "say bcd:dd"]
    model = AutoModelForSequenceClassification.from_pretrained(tiny_ckpt["critic"])
    tok = AutoTokenizer.from_pretrained(tiny_ckpt["critic"])
    with torch.no_grad():
        want = [model(**tok(t, return_tensors="pt")).logits[0, 0].item() for t in texts]
    assert rm.score(texts) == pytest.approx(want, abs=1e-4)


def test_make_engine_builds_the_configured_engine(redis_server, run_id, tiny_ckpt, tmp_path) -> None:
    from rollout.engines import make_engine

    cfg = make_cfg(run_id, redis_server.url, tiny_ckpt, tmp_path, **{"run.seed": 5})
    engine = make_engine(cfg, str(tiny_ckpt["actor"]), server_index=2)
    assert isinstance(engine, HFEngine) and engine.device.type == "cpu" and engine.version == 0
    # Seeded from run.seed + server_index: two engines built alike sample alike.
    again = HFEngine(str(tiny_ckpt["actor"]), device="cpu", seed=7)
    prompt = [[5, 6, 7]]
    assert engine.generate(prompt, SamplingParams(max_new_tokens=8))[0][0].token_ids == (
        again.generate(prompt, SamplingParams(max_new_tokens=8))[0][0].token_ids
    )


def test_missing_weights_fail_with_a_clear_error_and_prompts_stay_claimable(
    redis_server, redis_client, run_id, tiny_ckpt, tmp_path, engine
) -> None:
    """The learner says v3 but never publishes it: the server fails after weightsync.timeout_s naming both
    versions, and the prompts it took are claimed by another server once idle (the crash-safety path)."""
    cfg = make_cfg(
        run_id,
        redis_server.url,
        tiny_ckpt,
        tmp_path,
        **{"weightsync.timeout_s": 1.0, "redis.claim_idle_ms": 100},
    )
    v0 = {k: v.clone() for k, v in engine.model.state_dict().items() if k != "lm_head.weight"}
    learner = Learner(cfg, redis_client, v0)
    queue_prompts(learner.buffer, engine, 2)
    learner.admission.set_version(3)
    h = Harness(cfg, redis_client, engine, make_subscriber(cfg, redis_client, "server-0"))
    with pytest.raises(WeightSyncError, match=r"holds weights v0 but needs >= v3"):
        h.loop.step()
    assert learner.buffer.trajectories_pending() == 0
    other = ReplayBuffer.from_config(redis_client, cfg, consumer="server-1")
    time.sleep(0.2)
    claimed = other.take_prompts(2, timeout_s=5)
    assert len(claimed) == 2 and all(p.redelivered for p in claimed)


def test_groups_of_a_dead_server_that_fill_the_window_are_still_answered(
    redis_server, redis_client, run_id, tiny_ckpt, tmp_path, engine
) -> None:
    """A server killed holding the whole admission window's prompts (one batch at s = 0): the survivor gains
    no admission, yet it takes and answers those prompts, which carry the dead server's admission. Waiting
    for admission first was a deadlock: the learner waited for them, and admission for the learner."""
    cfg = make_cfg(run_id, redis_server.url, tiny_ckpt, tmp_path, **{"redis.claim_idle_ms": 100})
    v0 = {k: v.clone() for k, v in engine.model.state_dict().items() if k != "lm_head.weight"}
    learner = Learner(cfg, redis_client, v0)
    queue_prompts(learner.buffer, engine, 4)
    dead = ReplayBuffer.from_config(redis_client, cfg, consumer="server-1")
    assert Admission.from_config(redis_client, cfg, "server-1").try_admit(2) == 2  # the window is full
    held = [p.prompt.prompt_id for p in dead.take_prompts(2, timeout_s=1)]  # ... and then it is killed
    time.sleep(0.2)
    h = Harness(cfg, redis_client, engine, make_subscriber(cfg, redis_client, "server-0"))
    assert h.loop.step() == 2
    trajs = learner.take(4)
    assert sorted({t.prompt_id for t in trajs}) == sorted(held)
    assert int(redis_client.get(f"{run_id}:admitted")) == 4  # the dead server's, used once
    assert learner.buffer.prompts_pending() == 2  # the two new prompts still wait for admission
    h.telemetry.close()


def test_a_restarted_server_adopts_the_admission_its_killed_life_had_not_spent(
    redis_server, redis_client, run_id, tiny_ckpt, tmp_path, engine
) -> None:
    """server-0 is killed right after it was admitted for the whole window (one batch at s = 0), before it
    took a prompt. Its next life adopts those credits and answers new prompts; without them the window
    would stay closed until a learner restart recounted it."""
    cfg = make_cfg(run_id, redis_server.url, tiny_ckpt, tmp_path)
    v0 = {k: v.clone() for k, v in engine.model.state_dict().items() if k != "lm_head.weight"}
    learner = Learner(cfg, redis_client, v0)
    queue_prompts(learner.buffer, engine, 4)
    first_life = Admission.from_config(redis_client, cfg, consumer="server-0")
    assert first_life.try_admit(2) == 2  # ... and then it is killed
    with Harness(cfg, redis_client, engine, make_subscriber(cfg, redis_client, "server-0")):
        trajs = learner.take(4)
    assert len({t.prompt_id for t in trajs}) == 2
    assert int(redis_client.get(f"{run_id}:admitted")) == 4  # adopted, not admitted again
    assert first_life.held_credits() == 0


def test_claim_heartbeat_keeps_prompts_through_a_long_generation(redis_client, run_id) -> None:
    def buf(consumer: str) -> ReplayBuffer:
        return ReplayBuffer(redis_client, run_id, consumer=consumer, claim_idle_ms=300)

    buf("launch").put_prompts([PromptRecord("p0", "q", [1])])
    server = buf("server-0")
    held = server.take_prompts(1, timeout_s=1)
    with ClaimHeartbeat(server, [p.id for p in held]):
        time.sleep(1.0)  # over three times claim_idle_ms
        assert buf("server-1").take_prompts(1, timeout_s=0.2) == []
    time.sleep(0.4)  # the heartbeat stopped: now the prompt looks abandoned, and is claimed
    assert [p.prompt.prompt_id for p in buf("server-1").take_prompts(1, timeout_s=1)] == ["p0"]


def constant_reward(prompt: str, completion: str, record: dict) -> float:
    """Every sample scores the same: every group is uninformative (a reward plug-in for the tests below)."""
    return 0.5


def test_dynamic_sampling_drops_uniform_groups_and_gives_back_admission(
    redis_server, redis_client, run_id, tiny_ckpt, tmp_path, engine
) -> None:
    cfg = make_cfg(
        run_id, redis_server.url, tiny_ckpt, tmp_path,
        reward={"functions": [{"path": "tests.test_rollout_loop:constant_reward"}]},
        algorithm={"batch_size": 4, "minibatch_size": 4, "max_staleness": 0, "dynamic_sampling": True},
    )  # fmt: skip
    v0 = {k: v.clone() for k, v in engine.model.state_dict().items() if k != "lm_head.weight"}
    learner = Learner(cfg, redis_client, v0)
    queue_prompts(learner.buffer, engine, 6)
    with Harness(cfg, redis_client, engine, make_subscriber(cfg, redis_client, "server-0")) as h:
        deadline = time.monotonic() + TIMEOUT
        while learner.buffer.prompts_pending() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.3)
        # Every prompt was answered, none appended: the admission window (one batch at s = 0) refilled
        # three times over, which only giving slots back allows.
        assert learner.buffer.prompts_pending() == 0
        assert learner.buffer.trajectories_pending() == 0
        assert h.loop.uniform_dropped == 6
    assert int(redis_client.get(f"{run_id}:admitted")) == 0


def test_overlong_shaping_adds_the_penalty_part(
    redis_server, redis_client, run_id, tiny_ckpt, tmp_path, engine
):
    from rollout.shaping import overlong_penalty

    cfg = make_cfg(
        run_id, redis_server.url, tiny_ckpt, tmp_path,
        reward={"functions": [{"path": "tests.test_rollout_loop:constant_reward"}]},
        algorithm={"batch_size": 4, "minibatch_size": 4, "max_staleness": 0, "overlong_buffer": 3},
    )  # fmt: skip
    v0 = {k: v.clone() for k, v in engine.model.state_dict().items() if k != "lm_head.weight"}
    learner = Learner(cfg, redis_client, v0)
    queue_prompts(learner.buffer, engine, 4)
    with Harness(cfg, redis_client, engine, make_subscriber(cfg, redis_client, "server-0")):
        trajs = learner.take(4)
    assert any(len(t.response_tokens) > 3 for t in trajs)  # some entered the buffer zone (6 - 3 tokens)
    for t in trajs:
        expected = overlong_penalty(len(t.response_tokens), 6, 3)
        assert t.reward_parts["overlong"] == pytest.approx(expected)
        assert t.reward == pytest.approx(0.5 + expected)


def test_pass_at_k_matches_counting_subsets() -> None:
    import itertools

    from rollout.evaluate import pass_at_k

    assert pass_at_k(4, 1, 1) == 0.25 and pass_at_k(4, 1, 2) == 0.5  # 1 - C(3,2)/C(4,2) by hand
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    for n, c, k in [(5, 2, 3), (6, 1, 2), (7, 3, 1), (6, 3, 4)]:
        samples = [True] * c + [False] * (n - c)
        subsets = list(itertools.combinations(samples, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_servers_evaluate_held_out_prompts_at_known_versions_without_training_on_them(
    redis_server, redis_client, run_id, tiny_ckpt, tmp_path, engine, new_weights, restore
) -> None:
    from rollout.evaluate import Evaluator
    from tandem.data import write_prompts

    held_out = write_prompts(tmp_path / "eval.jsonl", make_records("echo", 3, seed=99))
    cfg = make_cfg(
        run_id, redis_server.url, tiny_ckpt, tmp_path,
        eval={"prompts": str(held_out), "interval": 1, "n_samples": 2, "temperature": 0.0, "pass_threshold": 0.5},
    )  # fmt: skip
    records = make_records("echo", 3, seed=99)
    rewards = RewardFunctions(cfg.reward)
    # The naive reference at version 0: greedy completions of each held-out prompt, scored one by one.
    ref = engine.generate(
        [engine.tokenizer(r["prompt"]).input_ids for r in records],
        SamplingParams(n=2, max_new_tokens=6, temperature=0),
    )
    scores = [
        rewards.score(r["prompt"], engine.tokenizer.decode(c.token_ids, skip_special_tokens=True), r)[0]
        for r, g in zip(records, ref, strict=True)
        for c in g
    ]
    v0 = {k: v.clone() for k, v in engine.model.state_dict().items() if k != "lm_head.weight"}
    learner = Learner(cfg, redis_client, v0)
    queue_prompts(learner.buffer, engine, 8)
    evaluator = Evaluator(
        cfg, engine, engine.tokenizer, rewards, redis_client, Telemetry(cfg, "eval-server-0", redis_client)
    )
    with Harness(cfg, redis_client, engine, make_subscriber(cfg, redis_client, "server-0"), evaluator):
        learner.take(4)
        learner.step(new_weights)
        learner.take(4)
        deadline = time.monotonic() + TIMEOUT  # v1 is evaluated before the server's next batch
        while redis_client.llen(f"{run_id}:history:eval-server-0") < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
    rows = [json.loads(r) for r in redis_client.lrange(f"{run_id}:history:eval-server-0", 0, -1)]
    assert [r["eval/version"] for r in rows][:2] == [0, 1]
    assert rows[0]["eval/reward_mean"] == pytest.approx(sum(scores) / len(scores))
    passed = [sum(s >= 0.5 for s in scores[i : i + 2]) for i in (0, 2, 4)]
    assert rows[0]["eval/pass@1"] == pytest.approx(sum(p / 2 for p in passed) / 3)
    assert rows[0]["eval/pass@2"] == pytest.approx(sum(p > 0 for p in passed) / 3)
    # Never trained on, never admitted: the stream and the admission counter saw only the 8 training prompts.
    assert int(redis_client.get(f"{run_id}:admitted")) == 8
    assert learner.buffer.trajectories_pending() == 0
