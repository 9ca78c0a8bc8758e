"""Black-box agents trained in a run (docs/environments.md §10.9): agent functions on the official openai client,
run n per prompt by the runner through its own API on the real hf engine, the tiny model and, for the
loop, a real Redis. Agents that raise, hang, block, leave their session open or return garbage end only
their own episode."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoModelForCausalLM

import rollout.agents.runner as runner_module
from buffer.schema import decode_trajectory, encode_trajectory
from rollout.agents.runner import AgentEpisode, AgentRunner, check_reward
from rollout.engines.base import SamplingParams
from rollout.engines.hf import HFEngine
from rollout.metrics import ServerMetrics
from tandem.config import Config, load_config
from tests.test_env_episode import learner_logp

N = 3
TIMEOUT_S = 5.0  # the good agents must finish well within it on a loaded machine


async def talk_agent(client, record, *, model: str, turns: int = 2, max_tokens: int = 6) -> dict[str, float]:
    """Two chat turns with a user reply in between; knows nothing of tandem."""
    messages = [{"role": "user", "content": record["prompt"]}]
    said = ""
    for _ in range(turns):
        r = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, stop=["\n"]
        )
        said = r.choices[0].message.content or ""
        messages += [{"role": "assistant", "content": said}, {"role": "user", "content": "go on"}]
    return {"length": len(said) / 10, "bonus": 0.5}


async def misbehaving_agent(client, record, *, model: str) -> float:
    """Behaves (one call, reward 1) except on the record marked ``bad``, where it does ``record["bad"]``."""
    how = record.get("bad")

    def call():
        return client.completions.create(model=model, prompt=record["prompt"], max_tokens=4)

    if how == "raise":
        await call()
        raise RuntimeError("the tool broke")
    if how == "hang":
        await asyncio.sleep(3600)
    if how == "block":
        time.sleep(TIMEOUT_S + 3)  # blocks its own event loop: cannot be cancelled, only given up on
    if how == "open":
        asyncio.get_running_loop().create_task(call())  # returns while its call is still running
        await asyncio.sleep(0.2)
        return 1.0
    if how == "none":
        return 1.0
    await call()
    return {"nan": float("nan")} if how == "garbage" else 1.0


async def retrying_agent(client, record, *, model: str) -> float:
    """Retries a failed call every half second, up to 40 times, as an agent with its own retry loop does."""
    for _ in range(40):
        try:
            await client.completions.create(model=model, prompt=record["prompt"], max_tokens=4)
            return 1.0
        except Exception:
            await asyncio.sleep(0.5)
    return 0.0


def agent_cfg(tiny_ckpt: dict[str, Path], tmp: Path, path: str, **over: object) -> Config:
    raw = {
        "run": {"name": "agents", "device": "cpu"},
        "model": {"actor": str(tiny_ckpt["actor"])},
        "data": {"prompts": str(tmp / "prompts.jsonl")},
        "rollout": {"n_samples": N, "prompts_per_batch": 2, "max_new_tokens": 8, "http": {"enabled": False}},
        "agent": {"path": path, "timeout_s": TIMEOUT_S},
        "algorithm": {"batch_size": 2 * N, "minibatch_size": 2 * N, "max_staleness": 0},
        "learner": {"micro_batch_size": 2 * N},
        "logging": {"wandb_mode": "disabled"},
    }
    return load_config(None, [f"{k}={json.dumps(v)}" for k, v in over.items()], raw=raw)


@pytest.fixture(scope="module")
def engine(tiny_ckpt) -> HFEngine:
    return HFEngine(str(tiny_ckpt["actor"]), device="cpu", seed=3)


def make_runner(cfg: Config, engine) -> AgentRunner:
    return AgentRunner(cfg, engine, engine.tokenizer, metrics=ServerMetrics(engine))


def episodes(engine: HFEngine, records: list[dict], n: int = N) -> list[AgentEpisode]:
    return [AgentEpisode(r, engine.tokenizer(r["prompt"]).input_ids) for r in records for _ in range(n)]


def test_agents_run_n_per_prompt_batched_and_token_exact(engine, tiny_ckpt, tmp_path) -> None:
    cfg = agent_cfg(tiny_ckpt, tmp_path, "tests.test_agent_run:talk_agent", **{"agent.timeout_s": 60})
    runner = make_runner(cfg, engine)
    rows: list[int] = []  # rows of every forward the engine ran
    forward = engine._forward
    engine._forward = lambda ids, *a: rows.append(ids.shape[0]) or forward(ids, *a)
    try:
        eps = runner.run(episodes(engine, [{"id": "a", "prompt": "12+30="}, {"id": "b", "prompt": "7+5="}]))
        calls = runner.engine.calls
    finally:
        runner.close()
        del engine._forward
    assert [e.end_reason for e in eps] == ["done"] * 2 * N
    assert calls == 2 * 2 * N  # two chat calls per episode, each one row
    assert max(rows) > 1, f"{calls} calls, every forward of one row: the engine did not batch them"
    trajs = [decode_trajectory(encode_trajectory(e.trajectories("p", "g", "server-0")[0])) for e in eps]
    tok = engine.tokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt["actor"]).eval()
    ref = learner_logp(model, trajs)
    for e, t, r in zip(eps, trajs, ref, strict=True):
        assert [k for k, _, _ in t.segments()] == ["model", "env", "model"]
        assert tok.decode(t.prompt_tokens.tolist()) == f"user: {e.record['prompt']}\nassistant: "
        _, s, end = t.segments()[1]
        assert tok.decode(t.response_tokens[s:end].tolist()).endswith("\nuser: go on\nassistant: ")
        gen = np.flatnonzero(t.generated)
        np.testing.assert_allclose(t.behav_logp[gen], r[gen].numpy(), atol=2e-4)
        assert t.reward == pytest.approx(sum(e.parts.values())) and e.parts["bonus"] == 0.5
        assert t.finish_reason == "stop" and t.meta["calls"] == 2
    assert eps[0].metrics()["agent/calls"] == 2.0 and eps[0].metrics()["agent/aborted"] == 0.0


def test_an_engine_that_batches_concurrent_calls_gets_each_call_at_once(tiny_ckpt, tmp_path) -> None:
    """The front hands every call straight to an engine whose running batch takes in concurrent calls (hf,
    vLLM and SGLang), with the run's sampling, instead of queueing it behind the batch in flight."""
    engine = HFEngine(str(tiny_ckpt["actor"]), device="cpu", seed=3)
    assert engine.continuous_batching
    seen: list[SamplingParams] = []
    real = engine.generate

    def spy(prompts, sampling, **kw):
        seen.append(sampling)
        return real(prompts, sampling, **kw)

    engine.generate = spy
    cfg = agent_cfg(tiny_ckpt, tmp_path, "tests.test_agent_run:talk_agent", **{"agent.timeout_s": 60})
    runner = make_runner(cfg, engine)
    try:
        eps = runner.run(episodes(engine, [{"id": "a", "prompt": "12+30="}], n=3))
        batches, calls = runner.engine.batches, runner.engine.calls
    finally:
        runner.close()
    assert [e.end_reason for e in eps] == ["done"] * 3
    assert batches == calls == len(seen) == 2 * 3  # one engine call per agent call: nothing queued
    assert {s.temperature for s in seen} == {cfg.rollout.temperature}
    assert max(s.max_new_tokens for s in seen) <= cfg.rollout.max_new_tokens


def test_a_longer_max_tokens_is_cut_to_the_runs(engine, tiny_ckpt, tmp_path) -> None:
    cfg = agent_cfg(tiny_ckpt, tmp_path, "tests.test_agent_run:talk_agent",
                    **{"agent.timeout_s": 60, "agent.kwargs": {"max_tokens": 400}, "rollout.max_new_tokens": 3})  # fmt: skip
    runner = make_runner(cfg, engine)
    try:
        (e,) = runner.run(episodes(engine, [{"id": "a", "prompt": "12+30="}], n=1))
    finally:
        runner.close()
    assert e.end_reason == "done"
    (t,) = e.trajectories("p", "g", "s")
    lengths = [end - s for k, s, end in t.segments() if k == "model"]
    assert len(lengths) == 2 and max(lengths) <= 3, lengths  # the random model rarely ends a line by then


@pytest.mark.parametrize(
    ("how", "reason"),
    [
        ("raise", "agent_error: RuntimeError: the tool broke"),
        ("hang", "agent_timeout: the agent ran past agent.timeout_s=5s"),
        ("block", "agent_timeout: still running after"),
        ("open", "session_left_open: the agent returned with 1 call(s) still running"),
        ("garbage", "agent_garbage: reward part 'nan' nan is not a finite number"),
        ("none", "no_calls: the agent made no model call on its session"),
    ],
)
def test_a_misbehaving_agent_ends_only_its_episode(engine, tiny_ckpt, tmp_path, monkeypatch, how, reason):
    monkeypatch.setattr(runner_module, "JOIN_SLACK_S", 1.0)
    # The runaway call must still be running when its agent returns 0.2 s later: the idle engine waits 1 s
    # for the calls of that moment before its first step (agent.gather_ms, applied by make_engine).
    if how == "open":
        monkeypatch.setattr(engine, "gather_s", 1.0)
    cfg = agent_cfg(tiny_ckpt, tmp_path, "tests.test_agent_run:misbehaving_agent")
    runner = make_runner(cfg, engine)
    try:
        records = [{"id": "good", "prompt": "1+2="}, {"id": "bad", "prompt": "3+4=", "bad": how}]
        eps = runner.run(episodes(engine, records))
        assert [e.end_reason for e in eps[:N]] == ["done"] * N
        for e in eps[N:]:
            assert e.end_reason.startswith(reason), e.end_reason
            t = decode_trajectory(encode_trajectory(e.trajectories("p", "g", "server-0")[0]))
            assert t.finish_reason == "abort" and t.reward == 0.0  # masked out by the learner
        assert all(e.trajectories("p", "g", "s")[0].reward == 1.0 for e in eps[:N])
        assert runner.sessions.sessions == {}  # every session closed, the runaway call's included
        again = runner.run(episodes(engine, [{"id": "next", "prompt": "5+6="}]))  # the server still serves
        assert [e.end_reason for e in again] == ["done"] * N
    finally:
        runner.close()


@pytest.mark.parametrize("agent", ["talk_agent", "retrying_agent"])
def test_an_engine_whose_process_died_ends_the_batch_of_agents(engine, tiny_ckpt, tmp_path, agent) -> None:
    """A failed engine call is one episode's failure; an engine whose process died is every later one's, so
    the runner raises it (the rollout server exits and is restarted), with every session closed. It does so
    at once, not when an agent that keeps retrying gives up or agent.timeout_s (60 s) runs out."""
    from rollout.engines.base import EngineExited

    def dead(*args, **kwargs):
        raise EngineExited("vllm serve (server 0) exited with code -9")

    cfg = agent_cfg(tiny_ckpt, tmp_path, f"tests.test_agent_run:{agent}", **{"agent.timeout_s": 60})
    runner = make_runner(cfg, engine)
    engine.generate = dead
    try:
        start = time.monotonic()
        with pytest.raises(EngineExited, match="code -9"):
            runner.run(episodes(engine, [{"id": "a", "prompt": "1+2="}]))
        assert time.monotonic() - start < 15  # the retrying agents alone would hold it 20 s
        assert runner.sessions.sessions == {}
    finally:
        del engine.generate
        runner.close()


def test_a_closed_session_refuses_calls(engine, tiny_ckpt, tmp_path) -> None:
    import openai

    cfg = agent_cfg(tiny_ckpt, tmp_path, "tests.test_agent_run:misbehaving_agent")
    runner = make_runner(cfg, engine)
    try:
        client = openai.OpenAI(base_url=runner.url, api_key=runner.api_key, max_retries=0, timeout=30)
        with pytest.raises(openai.BadRequestError, match="not open on this server"):
            client.completions.create(model=runner.model_name, prompt="1+1=", max_tokens=2,
                                      extra_headers={"X-Session-Id": "made-up"})  # fmt: skip
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=runner.url, api_key="wrong", max_retries=0).models.list()
    finally:
        runner.close()


def test_rewards_are_checked() -> None:
    assert check_reward(1) == (1.0, {})
    assert check_reward({"a": 0.5, "b": 1}) == (1.5, {"a": 0.5, "b": 1.0})
    for bad in (True, None, "1", float("inf"), {}, {"a": "x"}):
        with pytest.raises(ValueError):
            check_reward(bad)


def test_agent_and_env_are_exclusive(tiny_ckpt, tmp_path) -> None:
    from tandem.config import ConfigError

    with pytest.raises(ConfigError, match="exclusive"):
        agent_cfg(tiny_ckpt, tmp_path, "tests.test_agent_run:talk_agent",
                  **{"env.path": "toy.calculator:CalculatorEnv"})  # fmt: skip


def test_agent_groups_go_through_admission_and_the_append(
    redis_server, redis_client, run_id, tiny_ckpt, tmp_path, engine
) -> None:
    """In the rollout loop: n sessions of one prompt become one contiguous group, admitted, appended with
    its prompt's acknowledgement, at the version admission allowed (max_staleness 0)."""
    from tests.test_rollout_loop import Harness, Learner, make_cfg, queue_prompts
    from weightsync import make_subscriber

    cfg = make_cfg(run_id, redis_server.url, tiny_ckpt, tmp_path, **{
        "agent.path": "tests.test_agent_run:talk_agent", "agent.timeout_s": 60, "reward.functions": [],
    })  # fmt: skip
    v0 = {k: v.clone() for k, v in engine.model.state_dict().items() if k != "lm_head.weight"}
    learner = Learner(cfg, redis_client, v0)
    queue_prompts(learner.buffer, engine, 6)
    with Harness(cfg, redis_client, engine, make_subscriber(cfg, redis_client, "server-0")):
        batch = learner.take(4)
        time.sleep(1.0)
        assert learner.buffer.trajectories_pending() == 0, "admission let the agents run ahead"
    assert batch[0].group_id == batch[1].group_id != batch[2].group_id == batch[3].group_id
    assert batch[0].prompt_id == batch[1].prompt_id != batch[2].prompt_id
    for t in batch:
        assert t.finish_reason == "stop" and set(t.token_versions[t.generated].tolist()) == {0}
        assert set(t.reward_parts) == {"agent", "agent/length", "agent/bonus"}
        assert t.meta["end_reason"] == "done" and t.meta["calls"] == 2
    assert learner.buffer.prompts_pending() == 4  # two answered and acknowledged, exactly once
    stats = redis_client.hgetall(f"{run_id}:stats:server-0")
    assert float(stats[b"agent/calls"]) == 2.0 and float(stats[b"agent/aborted"]) == 0.0


def test_agent_batches_play_at_once_within_the_servers_request_limit(
    redis_server, redis_client, run_id, tiny_ckpt, tmp_path, engine
) -> None:
    """With batches in flight (max_staleness 2), the next batch's agents play while the last one finishes:
    the runner's API admits every episode of every batch in flight, and each prompt is answered once."""
    from collections import Counter

    from tests.test_rollout_loop import Harness, Learner, make_cfg, queue_prompts
    from weightsync import make_subscriber

    cfg = make_cfg(run_id, redis_server.url, tiny_ckpt, tmp_path, **{
        "agent.path": "tests.test_agent_run:talk_agent", "agent.timeout_s": 60, "reward.functions": [],
        "algorithm.max_staleness": 2, "rollout.max_inflight_batches": 2, "rollout.n_samples": 3,
        "rollout.prompts_per_batch": 3, "algorithm.batch_size": 9, "algorithm.minibatch_size": 9, "learner.micro_batch_size": 9,
    })  # fmt: skip
    v0 = {k: v.clone() for k, v in engine.model.state_dict().items() if k != "lm_head.weight"}
    learner = Learner(cfg, redis_client, v0)
    prompts = queue_prompts(learner.buffer, engine, 6)
    with Harness(cfg, redis_client, engine, make_subscriber(cfg, redis_client, "server-0")) as h:
        assert h.loop.window == 2
        episodes_in_flight = 2 * cfg.rollout.prompts_per_batch * cfg.rollout.n_samples
        assert h.loop.agents.http.max_concurrent_requests >= 2 * episodes_in_flight
        trajs = learner.take(18)
    assert Counter(t.prompt_id for t in trajs) == {p.prompt_id: 3 for p in prompts}
    assert all(t.meta["end_reason"] == "done" and t.meta["calls"] == 2 for t in trajs)


@pytest.fixture(scope="module")
def tools_ckpt(tmp_path_factory) -> Path:
    from toy.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny-tools"), tokenizer="bytes")["actor"]


@pytest.mark.parametrize(
    "path",
    ["toy.tasks.calc_agent:agent", "toy.tasks.calc_agent_sdk:agent"],
    ids=["plain-openai-sdk", "openai-agents-sdk"],
)
def test_the_calculator_agent_calls_its_tool_inside_a_run(tools_ckpt, tmp_path, path) -> None:
    """configs/tiny-agent.yaml's agent (toy/tasks/calc_agent.py, plain openai SDK) and the same agent on the
    OpenAI Agents SDK's own loop (toy/tasks/calc_agent_sdk.py, configs/tiny-agent-sdk.yaml) inside the
    runner: a tool call, its result, the final answer, one session each, token-exact. The engine is the
    labelled test double of tests/test_tool_calls.py (a random model writes no calls): it writes the call a
    warm-started model would, and answers with the tool's result once the prompt holds it."""
    import re

    from tests.scripted_engine import ScriptedEngine
    from toy.tasks.calc_tools import chat_prompt
    from toy.tiny import build_byte_tokenizer

    def reply(prompt: str) -> str:
        if m := re.search(r"tool: (\S+)\nassistant: $", prompt):
            return m.group(1)
        a, b = re.search(r"user: (\d+)\+(\d+)=", prompt).groups()
        return f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {int(b) + (a == "11")}}}}}</tool_call>'

    engine = ScriptedEngine(build_byte_tokenizer())
    engine.reply = reply
    cfg = agent_cfg({"actor": tools_ckpt}, tmp_path, path,
                    **{"agent.timeout_s": 60, "rollout.max_new_tokens": 80})  # fmt: skip
    runner = make_runner(cfg, engine)
    try:
        records = [
            {"id": "a", "prompt": "37+48=", "result": 85},
            {"id": "b", "prompt": "11+20=", "result": 31},
        ]
        eps = runner.run(episodes(engine, records))
    finally:
        runner.close()
    assert [e.end_reason for e in eps] == ["done"] * 2 * N
    assert [e.reward for e in eps] == [1.0] * N + [0.0] * N  # the second prompt's call adds 11+21
    tok, sums = engine.tokenizer, {"37+48=": 85, "11+20=": 32}
    for e in eps:
        (t,) = e.trajectories("p", "g", "s")
        assert e.metrics()["agent/tool_used"] == 1.0 and t.meta["calls"] == 2
        assert t.meta["env/tool_used"] == 1.0 and t.meta["env/aborted"] == 0.0  # the learner logs them
        assert tok.decode(t.prompt_tokens.tolist()) == chat_prompt(
            e.record["prompt"]
        )  # as the warm start saw
        assert [k for k, _, _ in t.segments()] == ["model", "env", "model"]
        _, s, end = t.segments()[1]
        assert (
            tok.decode(t.response_tokens[s:end].tolist())
            == f"\ntool: {sums[e.record['prompt']]}\nassistant: "
        )
        assert set(t.reward_parts) == {"agent", "agent/correct"}


def test_a_weight_update_between_batches_reaches_the_next_calls(engine, tiny_ckpt, tmp_path) -> None:
    """The runner's between_batches hook (the loop's EngineWeights.poll) runs before each call; it applies
    v1 once the first call has ended, so before any session's second call. Every second call of a session is generated, and
    prefilled, by v1, and its behaviour logprobs are v1's over the whole session, as the learner computes
    them; the first call that finished first was v0's alone."""
    from toy.tiny import make_tiny
    from weightsync.base import Update

    path = make_tiny(tmp_path / "v1", seed=7)["actor"]
    v1 = {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(path).state_dict().items()
          if k != "lm_head.weight"}  # fmt: skip
    v0 = {k: v.clone() for k, v in engine.model.state_dict().items() if k != "lm_head.weight"}
    cfg = agent_cfg(tiny_ckpt, tmp_path, "tests.test_agent_run:talk_agent", **{"agent.timeout_s": 60})

    done: list[int] = []  # engine calls that have returned
    generate = engine.generate

    def counted(*args, **kwargs):
        out = generate(*args, **kwargs)
        done.append(1)
        return out

    engine.generate = counted

    def between_batches() -> None:
        if done and engine.version == 0:  # a first call has ended: its session's second call is next
            engine.update_weights(Update(1, [], lambda: iter(v1.items())))

    runner = AgentRunner(cfg, engine, engine.tokenizer, metrics=ServerMetrics(engine),
                         between_batches=between_batches)  # fmt: skip
    try:
        eps = runner.run(episodes(engine, [{"id": "a", "prompt": "12+30="}, {"id": "b", "prompt": "7+5="}]))
    finally:
        runner.close()
        del engine.generate
        engine.update_weights(Update(0, [], lambda: iter(v0.items())))
    assert [e.end_reason for e in eps] == ["done"] * 2 * N
    trajs = [t for e in eps for t in e.trajectories("p", "g", "s")]
    firsts, seconds = [], []
    for t in trajs:
        (_, a, b), _, (_, c, d) = t.segments()
        firsts.append(set(t.token_versions[a:b].tolist()))
        seconds.append(set(t.token_versions[c:d].tolist()))
    assert {0} in firsts and all(s == {1} for s in seconds), (firsts, seconds)
    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt["actor"]).eval()
    model.load_state_dict(v1, strict=False)
    ref = learner_logp(model, trajs)
    for t, r in zip(trajs, ref, strict=True):
        _, _, (_, c, d) = t.segments()
        np.testing.assert_allclose(t.behav_logp[c:d], r[c:d].numpy(), atol=2e-4)
