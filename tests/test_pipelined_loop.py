"""Several batches in flight (``rollout.max_inflight_batches``): the engine generates the next batch while the
last is scored and appended, with the guarantees of the one-batch loop (docs/design.md §1.3).

The engine is the tiny ``hf`` one behind a wrapper that makes every call last a while and counts the calls
running at once, so the overlap is certain rather than a matter of timing.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from buffer.admission import Admission
from buffer.streams import ReplayBuffer
from rollout.engines.base import EngineExited
from rollout.engines.hf import HFEngine
from rollout.envs.base import Action, Env, StepResult, Task
from rollout.loop import RolloutLoop, inflight_window
from tandem.rewards import RewardFunctions
from tandem.telemetry import Telemetry, history_key
from tests.test_rollout_loop import TIMEOUT, Harness, Learner, make_cfg, queue_prompts
from weightsync import make_subscriber
from weightsync.base import Update

DELAY_S = 0.3


class SlowEngine:
    """The hf engine, every call at least ``DELAY_S`` long; ``peak`` is the most calls ever running at once.
    ``fail_on``: that call (1-based) raises ``error`` instead."""

    continuous_batching = False

    def __init__(
        self, inner: HFEngine, fail_on: int | None = None, error: type[Exception] = RuntimeError
    ) -> None:
        self.inner, self.tokenizer, self.fail_on, self.error = inner, inner.tokenizer, fail_on, error
        self.lock = threading.Lock()
        self.running = self.peak = self.calls = 0

    @property
    def version(self) -> int:
        return self.inner.version

    def generate(self, prompts, sampling, **kw):
        with self.lock:
            self.calls += 1
            call = self.calls
            self.running += 1
            self.peak = max(self.peak, self.running)
        try:
            time.sleep(DELAY_S)
            if call == self.fail_on:
                raise self.error("engine died")
            return self.inner.generate(prompts, sampling, **kw)
        finally:
            with self.lock:
                self.running -= 1

    def update_weights(self, update: Update) -> None:
        self.inner.update_weights(update)


class HeldEngine:
    """The hf engine behind a server that answers each call's first prompt at once and the others only when
    ``release`` is set (or after ``hold_s``), as vLLM does when one request of a batch finishes early. It
    reports only that first prompt through ``on_prompt``; the loop takes the others from the call's result."""

    continuous_batching = True

    def __init__(self, inner: HFEngine, hold_s: float = TIMEOUT) -> None:
        self.inner, self.tokenizer, self.hold_s = inner, inner.tokenizer, hold_s
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.open = 0  # calls not yet returned

    @property
    def version(self) -> int:
        return self.inner.version

    def generate(self, prompts, sampling, *, on_prompt=None, **kw):
        out = self.inner.generate(prompts, sampling, **kw)
        with self.lock:
            self.open += 1
        try:
            if on_prompt is not None:
                on_prompt(0, out[0])
            self.release.wait(self.hold_s)
            return out
        finally:
            with self.lock:
                self.open -= 1

    def update_weights(self, update: Update) -> None:
        self.inner.update_weights(update)


@pytest.fixture(scope="module")
def hf(tiny_ckpt: dict[str, Path]) -> HFEngine:
    return HFEngine(str(tiny_ckpt["actor"]), device="cpu", seed=0)


def server_loop(cfg, client, engine) -> RolloutLoop:
    """Server 0's rollout loop, run by the test itself (to see how ``run`` ends)."""
    return RolloutLoop(
        cfg, engine, engine.tokenizer, ReplayBuffer.from_config(client, cfg, consumer="server-0"),
        make_subscriber(cfg, client, "server-0"), Telemetry(cfg, "server-0", client), server_index=0,
        rewards=RewardFunctions(cfg.reward),
    )  # fmt: skip


def weights(engine: HFEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.model.state_dict().items() if k != "lm_head.weight"}


def test_the_window_is_one_batch_unless_the_engine_runs_apart_and_staleness_allows(
    tiny_ckpt, tmp_path
) -> None:
    def window(**over: object) -> int:
        return inflight_window(make_cfg("w", "redis://unused", tiny_ckpt, tmp_path, **over))

    async_ = {"algorithm.max_staleness": 2}
    assert window(**async_) == 1  # hf: in-process, today's serial loop
    assert window(**async_, **{"rollout.engine": "vllm"}) == 3
    assert window(**async_, **{"rollout.engine": "sglang"}) == 3
    assert window(**async_, **{"rollout.max_inflight_batches": 2}) == 2
    assert window(**{"rollout.engine": "vllm", "rollout.max_inflight_batches": 4}) == 1  # s = 0: sync
    assert window(**async_, **{"rollout.engine": "vllm", "rollout.inflight_updates": False}) == 1
    assert window(**async_, **{"rollout.engine": "vllm", "rollout.vllm.pause_mode": "abort"}) == 1


def test_batches_overlap_and_every_prompt_is_answered_once_within_the_staleness_bound(
    redis_server, redis_client, run_id, tiny_ckpt, tmp_path, hf
) -> None:
    s = 2
    cfg = make_cfg(
        run_id, redis_server.url, tiny_ckpt, tmp_path,
        **{"algorithm.max_staleness": s, "rollout.max_inflight_batches": 3},
    )  # fmt: skip
    v0 = weights(hf)
    learner = Learner(cfg, redis_client, v0)
    prompts = queue_prompts(learner.buffer, hf, 16)
    engine = SlowEngine(hf)
    with Harness(cfg, redis_client, engine, make_subscriber(cfg, redis_client, "server-0")) as h:
        assert h.loop.window == 3
        trajs = []
        for _ in range(8):  # 16 prompts × 2 samples = 8 learner batches of 4
            trajs += (batch := learner.take(4))
            assert all(learner.version - min(t.token_versions) <= s for t in batch)
            learner.step(v0)  # a new version (same tensors): updates land while batches are in flight
    assert engine.peak >= 2, "the loop never had two batches in the engine"
    assert engine.peak <= 3
    assert Counter(t.prompt_id for t in trajs) == {p.prompt_id: 2 for p in prompts}  # each once, n = 2
    for i in range(0, len(trajs), 2):  # groups contiguous
        assert trajs[i].group_id == trajs[i + 1].group_id and trajs[i].prompt_id == trajs[i + 1].prompt_id
    assert any(max(t.token_versions) > 0 for t in trajs)
    assert learner.buffer.prompts_pending() == 0
    assert int(redis_client.get(f"{run_id}:admitted")) == 32
    stats = redis_client.hgetall(f"{run_id}:stats:server-0")
    assert 0.0 < float(stats[b"rollout/engine_busy"]) <= 1.0 + 1e-6
    assert b"time/score" in stats and b"time/put" in stats
    # The engine's rate is over its busy time, not over each batch's own generation time, which counts the
    # other batches' overlapping time too (the console sums this over servers).
    rows = [json.loads(r) for r in redis_client.lrange(history_key(run_id, "server-0"), 0, -1)]
    assert sum(r["rollout/tokens"] for r in rows) == sum(int(t.loss_mask.sum()) for t in trajs)
    per_batch = sum(r["rollout/tokens"] for r in rows) / sum(r.get("time/generate", 0.0) for r in rows)
    rates = [r["rollout/tokens_per_s"] for r in rows]
    assert max(rates) > 1.5 * per_batch  # three batches generated at once
    assert max(rates) < 4 * per_batch  # and no batch harvested beside another read as a sliver of time


def test_a_group_is_appended_as_soon_as_its_samples_are_back_while_its_batch_still_generates(
    redis_server, redis_client, run_id, tiny_ckpt, tmp_path, hf
) -> None:
    cfg = make_cfg(
        run_id, redis_server.url, tiny_ckpt, tmp_path,
        **{"algorithm.max_staleness": 2, "rollout.max_inflight_batches": 2},
    )  # fmt: skip
    learner = Learner(cfg, redis_client, weights(hf))
    prompts = queue_prompts(learner.buffer, hf, 4)  # two batches of 2 prompts × 2 samples
    engine = HeldEngine(hf)
    try:
        with Harness(cfg, redis_client, engine, make_subscriber(cfg, redis_client, "server-0")):
            early = learner.buffer.take(2, timeout_s=20)
            assert len(early) == 2, "no group was appended while its batch was still generating"
            assert engine.open >= 1 and not engine.release.is_set()
            learner.buffer.ack([t.id for t in early])
            engine.release.set()
            rest = learner.take(6)
    finally:
        engine.release.set()
    first = [t.traj for t in early]
    assert first[0].group_id == first[1].group_id
    assert first[0].prompt_id in {prompts[0].prompt_id, prompts[2].prompt_id}  # a batch's first prompt
    trajs = first + rest
    assert Counter(t.prompt_id for t in trajs) == {p.prompt_id: 2 for p in prompts}  # each once, n = 2
    assert learner.buffer.prompts_pending() == 0


def test_sync_mode_holds_one_batch_whatever_the_window_says(
    redis_server, redis_client, run_id, tiny_ckpt, tmp_path, hf
) -> None:
    cfg = make_cfg(
        run_id, redis_server.url, tiny_ckpt, tmp_path,
        **{"rollout.max_inflight_batches": 4, "algorithm.batch_size": 8, "algorithm.minibatch_size": 8},
    )  # fmt: skip
    v0 = weights(hf)
    learner = Learner(cfg, redis_client, v0)
    queue_prompts(learner.buffer, hf, 8)
    engine = SlowEngine(hf)
    with Harness(cfg, redis_client, engine, make_subscriber(cfg, redis_client, "server-0")) as h:
        assert h.loop.window == 1
        first = learner.take(8)  # two batches of 2 groups within one version's window
        learner.step(v0)
        second = learner.take(8)
    assert engine.peak == 1
    assert all(set(t.token_versions.tolist()) == {0} for t in first)
    assert all(set(t.token_versions.tolist()) == {1} for t in second)


def test_a_clean_stop_appends_the_batches_in_flight_and_gives_everything_else_back(
    redis_server, redis_client, run_id, tiny_ckpt, tmp_path, hf
) -> None:
    cfg = make_cfg(
        run_id, redis_server.url, tiny_ckpt, tmp_path,
        **{"algorithm.max_staleness": 3, "rollout.max_inflight_batches": 3},
    )  # fmt: skip
    learner = Learner(cfg, redis_client, weights(hf))
    queue_prompts(learner.buffer, hf, 40)
    engine = SlowEngine(hf)
    with Harness(cfg, redis_client, engine, make_subscriber(cfg, redis_client, "server-0")) as h:
        deadline = time.monotonic() + TIMEOUT
        while len(h.loop.inflight) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(h.loop.inflight) >= 2
    # Stopped: every batch it held was appended, nothing else is held, admission counts what was appended.
    appended = learner.buffer.trajectories_pending()
    assert appended >= 4 and appended % 2 == 0
    assert int(redis_client.get(f"{run_id}:admitted")) == appended
    assert Admission.from_config(redis_client, cfg, consumer="server-0").held_credits() == 0
    assert learner.buffer.prompts_pending() == 40 - appended // 2
    other = ReplayBuffer.from_config(redis_client, cfg, consumer="server-1")
    assert other.reclaim_prompts(40) == []  # none left claimed by server-0
    h.telemetry.close()


def test_a_batch_that_fails_in_flight_is_counted_and_its_prompts_are_generated_again(
    redis_server, redis_client, run_id, tiny_ckpt, tmp_path, hf
) -> None:
    """An engine call that raises does not end the loop (docs/design.md §6.4): it is counted in
    ``rollout/engine_errors``, the prompts it did not report are handed back at once with the admission they
    carry (claim_idle_ms is far longer than the test), a later call claims them, and every prompt is answered
    exactly once, with admission counting exactly what was appended."""
    cfg = make_cfg(
        run_id, redis_server.url, tiny_ckpt, tmp_path,
        **{"algorithm.max_staleness": 3, "rollout.max_inflight_batches": 2, "redis.claim_idle_ms": 600_000},
    )  # fmt: skip
    learner = Learner(cfg, redis_client, weights(hf))
    prompts = queue_prompts(learner.buffer, hf, 6)  # 12 trajectories: within admission at version 0
    engine = SlowEngine(hf, fail_on=3)
    with Harness(cfg, redis_client, engine, make_subscriber(cfg, redis_client, "server-0")) as h:
        deadline = time.monotonic() + TIMEOUT
        while learner.buffer.trajectories_pending() < 12 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert h.loop.engine_errors == 1 and engine.calls >= 4
    got = learner.buffer.take(12, timeout_s=5)
    per_prompt = Counter(t.traj.prompt_id for t in got)
    assert per_prompt == {p.prompt_id: 2 for p in prompts}  # each prompt's group once, none lost
    assert learner.buffer.trajectories_pending() == 12 and learner.buffer.prompts_pending() == 0
    assert int(redis_client.get(f"{run_id}:admitted")) == 12
    assert h.loop.admission.held_credits() == 0
    h.telemetry.close()


def run_until_it_raises(loop: RolloutLoop, error: type[Exception], went_on: str) -> Exception:
    """Run ``loop`` on a thread; it must end within the test's timeout (else fail with ``went_on``) by
    raising ``error``, which is returned."""
    raised: list[Exception] = []

    def run() -> None:
        try:
            loop.run()
        except error as e:
            raised.append(e)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(TIMEOUT)
    assert not runner.is_alive(), went_on
    assert raised, f"the loop ended without raising {error.__name__}"
    return raised[0]


def test_an_engine_whose_process_died_ends_the_loop_and_hands_back_its_prompts(
    redis_server, redis_client, run_id, tiny_ckpt, tmp_path, hf
) -> None:
    """Unlike a failed call, an engine whose process is gone cannot answer a retry: the loop ends (the server
    exits, and its supervisor starts a fresh engine) rather than retrying forever, and every prompt it held
    goes back to the buffer."""
    cfg = make_cfg(
        run_id, redis_server.url, tiny_ckpt, tmp_path,
        **{"algorithm.max_staleness": 3, "rollout.max_inflight_batches": 2, "redis.claim_idle_ms": 600_000},
    )  # fmt: skip
    learner = Learner(cfg, redis_client, weights(hf))
    queue_prompts(learner.buffer, hf, 6)
    loop = server_loop(cfg, redis_client, SlowEngine(hf, fail_on=2, error=EngineExited))
    run_until_it_raises(loop, EngineExited, "the loop retried an engine whose process had died")
    assert loop.engine_errors == 0
    loop.telemetry.close()
    answered = learner.buffer.trajectories_pending() // 2
    assert learner.buffer.prompts_pending() == 6 - answered  # none lost, none still held
    assert loop.admission.held_credits() == 0


def test_a_group_that_fails_to_score_in_the_scoring_thread_ends_the_loop(
    redis_server, redis_client, run_id, tiny_ckpt, tmp_path, hf
) -> None:
    cfg = make_cfg(
        run_id, redis_server.url, tiny_ckpt, tmp_path,
        **{"algorithm.max_staleness": 3, "rollout.max_inflight_batches": 2},
    )  # fmt: skip
    learner = Learner(cfg, redis_client, weights(hf))
    queue_prompts(learner.buffer, hf, 8)
    loop = server_loop(cfg, redis_client, hf)

    def broken(prompts, completions):
        raise ValueError("reward function failed")

    loop.scoring.score = broken  # type: ignore[method-assign]
    error = run_until_it_raises(loop, ValueError, "the loop went on after its scoring thread failed")
    assert "reward function failed" in str(error)
    loop.telemetry.close()
    assert learner.buffer.trajectories_pending() == 0
    assert learner.buffer.prompts_pending() == 8  # every prompt handed back, none answered
    assert loop.admission.held_credits() == 0


GATE = (
    threading.Event()
)  # held shut: the episodes of the prompts in HELD wait on it in their environment step
HELD: set[str] = set()


class GatedEnv(Env):
    """One environment step, then done; a held prompt's step waits for ``GATE`` (a slow tool call)."""

    def step(self, action: Action) -> StepResult:
        if self.task_id in HELD:
            GATE.wait(TIMEOUT)
        return StepResult("", 1.0, True)

    def reset(self, task: Task) -> None:
        self.task_id = str(task.record["id"])


def test_independent_episodes_of_the_next_batches_run_while_a_batch_waits_on_its_slowest(
    redis_server, redis_client, run_id, tiny_ckpt, tmp_path, hf
) -> None:
    cfg = make_cfg(
        run_id, redis_server.url, tiny_ckpt, tmp_path,
        **{"algorithm.max_staleness": 4, "rollout.max_inflight_batches": 3, "algorithm.batch_size": 4,
           "env.path": "tests.test_pipelined_loop:GatedEnv", "env.progression": "independent"},
    )  # fmt: skip
    assert inflight_window(cfg) == 3
    rounds = cfg.model_copy(update={"env": cfg.env.model_copy(update={"progression": "rounds"})})
    assert inflight_window(rounds) == 1  # a round is one engine call for its batch
    learner = Learner(cfg, redis_client, weights(hf))
    prompts = queue_prompts(learner.buffer, hf, 6)
    HELD.clear()
    HELD.add(str(prompts[0].record["id"]))  # the first batch's first prompt: its episodes hang
    GATE.clear()
    try:
        with Harness(cfg, redis_client, hf, make_subscriber(cfg, redis_client, "server-0")):
            later = learner.take(4)  # the second batch, and not the first, while the first one hangs
            assert prompts[0].prompt_id not in {t.prompt_id for t in later}
            GATE.set()
            rest = learner.take(8)
    finally:
        GATE.set()
    trajs = later + rest
    assert Counter(t.prompt_id for t in trajs) == {p.prompt_id: 2 for p in prompts}  # each once, n = 2
    assert all(t.reward == 1.0 for t in trajs)


@pytest.mark.parametrize("window", [1, 2])
def test_a_group_waits_for_the_rest_of_its_batch_only_when_groups_are_not_streamed(
    window, redis_server, redis_client, run_id, tiny_ckpt, tmp_path, hf
) -> None:
    """``rollout/group_wait_s``: a group's time from its last sample to its append. The engine reports the
    batch's first prompt and holds the call open ``hold_s`` longer: one batch in flight appends that group
    with the rest of its batch, after the hold; two stream it at once."""
    hold_s = 1.0
    cfg = make_cfg(
        run_id, redis_server.url, tiny_ckpt, tmp_path,
        **{"algorithm.max_staleness": 2, "rollout.max_inflight_batches": window},
    )  # fmt: skip
    learner = Learner(cfg, redis_client, weights(hf))
    queue_prompts(learner.buffer, hf, 2)  # one batch of 2 prompts × 2 samples
    with Harness(
        cfg, redis_client, HeldEngine(hf, hold_s), make_subscriber(cfg, redis_client, "server-0")
    ) as h:
        assert h.loop.window == window
        assert len(learner.take(4)) == 4
    (row,) = [json.loads(r) for r in redis_client.lrange(history_key(run_id, "server-0"), 0, -1)]
    longest, mean = row["rollout/group_wait_max_s"], row["rollout/group_wait_s"]
    if window == 1:  # the first group waited out the hold; the other was back when the call returned
        assert longest >= hold_s and hold_s / 2 <= mean < longest
    else:
        assert longest < hold_s / 2
    assert h.loop.group_waits.count == 2
