"""Agent sessions on a chat template that rewrites history (docs/environments.md §10.6, segments): a thinking
model's template drops earlier turns' ``<think>...</think>``, so the next prompt does not extend what the model
sampled. Under ``rollout.http.session.on_rewrite: split`` the call starts a new segment of the same episode,
each a token-exact trajectory carrying the episode's reward; under ``refuse`` it is answered 400.

The segmenting is tested as the pure function it is, then through the real app, HTTP server, openai client,
byte-level tokenizer and the thinking template (toy/think_chat_template.jinja). The engine is the test double
of tests/test_tool_calls.py (:class:`ScriptedEngine`): a random tiny model cannot be made to think or call a
tool, so it "samples" what a warm-started one would.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch

from buffer.admission import extra_segments
from buffer.schema import Trajectory, decode_trajectory, encode_trajectory
from rollout.engines.base import Completion
from rollout.http.sessions import SessionError, SessionStore, continuation
from tests.scripted_engine import ScriptedEngine, serve
from toy.tasks.calc_agent import TOOLS
from toy.tasks.calc_think import TEMPLATE
from toy.tiny import build_byte_tokenizer

KEY = "segment-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CALL = '<tool_call>{"name": "add", "arguments": {"a": 37, "b": 48}}</tool_call>'
FIRST, SECOND = f"<think>tool</think>{CALL}", "<think>copy</think>85"


def think_tokenizer():
    tok = build_byte_tokenizer()
    tok.chat_template = TEMPLATE.read_text()
    return tok


# ---------------------------------------------------------------------------------------- the pure function


def test_continuation_is_the_added_text_or_none_on_a_rewrite() -> None:
    transcripts = ("q: a<think>x</think>b\n", "q: a<think>x</think>b")  # in full, and as returned
    assert continuation(transcripts, "q: a<think>x</think>b\ntool: 1\n") == "tool: 1\n"
    assert continuation(transcripts, "q: a<think>x</think>b, more") == ", more"
    assert continuation(transcripts, "q: a<think>x</think>b") == ""
    assert continuation(transcripts, "q: ab\ntool: 1\n") is None  # the reasoning was dropped
    assert continuation((), "anything") is None


def completion(tok, text: str, version: int = 3) -> Completion:
    ids = tok(text, add_special_tokens=False).input_ids
    return Completion(ids, [-0.5] * len(ids), "stop", [version] * len(ids))


def test_a_rewrite_starts_a_segment_from_the_prompt_as_it_is() -> None:
    tok = build_byte_tokenizer()
    store = SessionStore(tok)
    store.open("s")
    enc = store.encode
    c1, c2, c3 = completion(tok, "<think>a</think>x"), completion(tok, "y"), completion(tok, "z")
    assert store.context("s", "q: ") == enc("q: ")
    store.record("s", "q: ", c1, "<think>a</think>x")
    extended = "q: <think>a</think>x\nt: 1\n"
    assert store.context("s", extended) == enc("q: ") + c1.token_ids + enc("\nt: 1\n")
    store.record("s", extended, c2, "y")
    rewritten = "q: x\nt: 1\ny\nt: 2\n"  # the template dropped the reasoning
    assert store.context("s", rewritten) == enc(rewritten)
    store.record("s", rewritten, c3, "z")
    s = store.sessions["s"]
    assert (s.calls, s.rewrites) == (3, 1)
    first, second = s.segments()
    assert first.prompt == enc("q: ") and first.calls == 2
    assert first.turns.tokens == c1.token_ids + enc("\nt: 1\n") + c2.token_ids
    assert first.turns.mask == [1] * len(c1.token_ids) + [0] * 6 + [1]
    assert second.prompt == enc(rewritten) and second.calls == 1
    assert (second.turns.tokens, second.turns.mask) == (c3.token_ids, [1])
    # the next call extends the new segment's transcript
    assert store.context("s", rewritten + "z!") == enc(rewritten) + c3.token_ids + enc("!")


def test_under_refuse_a_rewrite_is_an_error_and_changes_nothing() -> None:
    tok = build_byte_tokenizer()
    store = SessionStore(tok, on_rewrite="refuse")
    store.open("s")
    store.record("s", "q: ", completion(tok, "<think>a</think>x"), "<think>a</think>x")
    with pytest.raises(SessionError, match=r"does not extend.*on_rewrite=split"):
        store.context("s", "q: x\n")
    store.record("s", "q: x\n", completion(tok, "y"), "y")  # a late completion of such a call is dropped
    s = store.sessions["s"]
    assert (s.calls, s.rewrites, len(s.segments())) == (1, 0, 1)


def test_a_completion_generated_from_a_stale_context_is_dropped() -> None:
    """Two calls at once: the second was generated from the session as it was; once the first is recorded
    the same prompt would start a segment, tokenised anew, without the EOS the engine was given."""
    tok = build_byte_tokenizer()
    store = SessionStore(tok)
    store.open("s")
    x = completion(tok, "x")
    x.token_ids.append(tok.eos_token_id)
    x.logprobs.append(-0.1)
    x.versions.append(3)
    store.record("s", "q: ", x, "x")
    stale = store.context("s", "q: x!")
    store.record("s", "q: x!", completion(tok, "y"), "y", context=stale)
    store.record("s", "q: x!", completion(tok, "z"), "z", context=stale)  # now a rewrite: dropped
    s = store.sessions["s"]
    assert (s.calls, s.rewrites) == (2, 0)


# ------------------------------------------------------------------------------------------ through the API


def think_reply(prompt: str) -> str:
    """The 'model': a brief plan and the tool call, then, once the prompt holds the result, the answer."""
    return SECOND if prompt.endswith("tool: 85\nassistant: ") else FIRST


@pytest.fixture
def engine() -> ScriptedEngine:
    engine = ScriptedEngine(think_tokenizer())
    engine.reply = think_reply
    return engine


def play(url: str) -> list[str]:
    """The calculator agent's loop on the chat API, in one session; returns the replies' contents."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=30, max_retries=0)
    sid = httpx.post(f"{url}/v1/sessions", headers=AUTH, timeout=30).json()["id"]
    head = {"X-Session-Id": sid}
    messages = [{"role": "user", "content": "37+48="}]
    r = client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, max_tokens=200, extra_headers=head
    )
    (call,) = r.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"a": 37, "b": 48}
    messages += [
        r.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "85"},
    ]
    r = client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, max_tokens=200, extra_headers=head
    )
    return [sid, r.choices[0].message.content]


def test_a_template_that_drops_reasoning_makes_two_segments_with_the_reward(engine) -> None:
    sunk: list[Trajectory] = []
    server = serve(engine, sink=sunk.append, api_key=KEY)
    try:
        url = f"http://127.0.0.1:{server.port}"
        sid, answer = play(url)
        r = httpx.post(f"{url}/v1/sessions/{sid}/finish", json={"reward": 1.0, "group_id": "g"}, headers=AUTH)
    finally:
        server.stop()
    assert answer == SECOND and r.status_code == 200, r.text
    body = r.json()
    assert body["calls"] == 2 and [s["calls"] for s in body["segments"]] == [1, 1]
    # the second prompt as the template rendered it: the call without its plan
    assert "<think>" not in engine.prompts[1] and engine.prompts[1].endswith(f"{CALL}\ntool: 85\nassistant: ")
    tok = engine.tokenizer
    first, second = [decode_trajectory(encode_trajectory(t)) for t in sunk]
    for t, prompt, c in zip((first, second), engine.prompts, engine.completions, strict=True):
        assert tok.decode(t.prompt_tokens.tolist()) == prompt  # each segment's own prompt, token-exact
        assert t.response_tokens.tolist() == c.token_ids  # exactly what the engine sampled, all trained
        assert t.loss_mask.tolist() == [1] * len(c.token_ids)
        np.testing.assert_allclose(t.behav_logp, c.logprobs)
        assert t.reward == 1.0 and t.group_id == "g" and t.prompt_id == sid
    assert tok.decode(first.response_tokens.tolist()).startswith(FIRST)
    assert tok.decode(second.response_tokens.tolist()).startswith(SECOND)
    assert [(t.meta["segment"], t.meta["segments"]) for t in (first, second)] == [(0, 2), (1, 2)]
    assert extra_segments([first, second]) == 1  # charged to admission beyond the group's one episode


def test_the_same_under_refuse_is_answered_400(engine) -> None:
    server = serve(engine, api_key=KEY, session={"on_rewrite": "refuse"})
    try:
        with pytest.raises(openai.BadRequestError, match="does not extend"):
            play(f"http://127.0.0.1:{server.port}")
    finally:
        server.stop()
    assert len(engine.prompts) == 1  # the refused call never reached the engine


# ------------------------------------------------------------------------------------------ what the learner sees


def test_group_statistics_count_an_episode_once_however_many_segments() -> None:
    """Three episodes of scores 1, 0 and 0.5, the first in two segments: worked by hand over the episodes,
    GRPO's mean is 0.5 and its (n-1) std 0.5, so 1, -1, 0; RLOO's leave-one-out baselines are 0.25, 0.75
    and 0.5, so 0.75, -0.75, 0. Each segment gets its episode's advantage."""
    from learner.advantages import grpo_advantages, rloo_advantages
    from learner.batch import make_batch

    def row(reward: float, segment: int, segments: int) -> Trajectory:
        return Trajectory(traj_id=f"t{reward}{segment}", group_id="g", prompt_id="p", prompt_tokens=[5],
                          response_tokens=[6], behav_logp=[-1.0], token_versions=[0], loss_mask=[1],
                          reward=reward, meta={"segment": segment, "segments": segments})  # fmt: skip

    batch = make_batch([row(1.0, 0, 2), row(1.0, 1, 2), row(0.0, 0, 1), row(0.5, 0, 1)], 0)
    assert batch.episode_weight.tolist() == [0.5, 0.5, 1.0, 1.0]
    grpo = grpo_advantages(batch.rewards, batch.group_index, eps=0.0, weight=batch.episode_weight)
    torch.testing.assert_close(grpo, torch.tensor([1.0, 1.0, -1.0, 0.0]))
    rloo = rloo_advantages(batch.rewards, batch.group_index, batch.episode_weight)
    torch.testing.assert_close(rloo, torch.tensor([0.75, 0.75, -0.75, 0.0]))


# ------------------------------------------------------------------------------------------ in a run


@pytest.fixture(scope="module")
def tools_ckpt(tmp_path_factory) -> Path:
    """The byte-level tiny model (the runner reads its config; the engine is the test double)."""
    from toy.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny-tools"), tokenizer="bytes")["actor"]


def test_the_calculator_agent_on_a_thinking_template_plays_two_segments(tools_ckpt, tmp_path) -> None:
    """configs/tiny-agent-think.yaml's agent in the runner: each episode that calls the tool is two
    trajectories with the episode's reward; its metrics ride on the last one only."""
    from tests.test_agent_run import N, agent_cfg, episodes, make_runner

    engine = ScriptedEngine(think_tokenizer())
    engine.reply = think_reply
    cfg = agent_cfg({"actor": tools_ckpt}, tmp_path, "toy.tasks.calc_agent:agent",
                    **{"agent.timeout_s": 60, "rollout.max_new_tokens": 100, "agent.kwargs": {"max_tokens": 100, "tool_bonus": 0.25}})  # fmt: skip
    runner = make_runner(cfg, engine)
    try:
        eps = runner.run(episodes(engine, [{"id": "a", "prompt": "37+48=", "result": 85}]))
    finally:
        runner.close()
    # the plan is not the answer; the tool's bonus is a reward part of its own
    assert [(e.end_reason, e.reward, e.parts) for e in eps] == [
        ("done", 1.25, {"correct": 1.0, "tool": 0.25})
    ] * N
    for e in eps:
        m = e.metrics()
        assert (m["agent/segments"], m["agent/rewrites"], m["agent/tool_used"]) == (2.0, 1.0, 1.0)
        first, last = e.trajectories("p", "g", "s")
        assert first.reward == last.reward == 1.25 and first.meta["calls"] == last.meta["calls"] == 1
        assert not any(k.startswith("env/") for k in first.meta)
        assert (last.meta["env/segments"], last.meta["env/reward"], last.meta["env/reward/correct"]) == (
            2.0,
            1.25,
            1.0,
        )
        assert extra_segments([first, last]) == 1
        tok = engine.tokenizer
        assert tok.decode(last.prompt_tokens.tolist()).endswith(f"{CALL}\ntool: 85\nassistant: ")


async def rewriting_agent(client, record, *, model: str) -> float:
    """Two calls, the second's prompt not extending the first's transcript (as a template that rewrote it)."""
    await client.completions.create(model=model, prompt=record["prompt"], max_tokens=4)
    await client.completions.create(model=model, prompt=f"re {record['prompt']}", max_tokens=4)
    return 1.0


def test_segments_are_appended_as_one_group_and_take_admission(
    redis_server, redis_client, run_id, tiny_ckpt, tmp_path
) -> None:
    """In the rollout loop, real hf engine: the 2 x 2 segments of a prompt's n=2 episodes are one contiguous
    group; admission was given for the n episodes and the later segments are charged as they are appended,
    so the counter equals the trajectories appended (8, for the 2 groups a bound of 4 admits)."""
    from rollout.engines.hf import HFEngine
    from tests.test_rollout_loop import Harness, Learner, make_cfg, queue_prompts
    from weightsync import make_subscriber

    engine = HFEngine(str(tiny_ckpt["actor"]), device="cpu", seed=3)
    cfg = make_cfg(run_id, redis_server.url, tiny_ckpt, tmp_path, **{
        "agent.path": "tests.test_agent_segments:rewriting_agent", "agent.timeout_s": 60, "reward.functions": [],
    })  # fmt: skip
    v0 = {k: v.clone() for k, v in engine.model.state_dict().items() if k != "lm_head.weight"}
    learner = Learner(cfg, redis_client, v0)
    queue_prompts(learner.buffer, engine, 4)
    with Harness(cfg, redis_client, engine, make_subscriber(cfg, redis_client, "server-0")):
        batch = learner.take(4)
        deadline = time.monotonic() + 60
        while learner.buffer.trajectories_pending() < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
    assert len({t.group_id for t in batch}) == 1 and [t.meta["segment"] for t in batch] == [0, 1, 0, 1]
    assert all(t.reward == 1.0 and t.meta["segments"] == 2 for t in batch)
    first, second = batch[:2]
    assert engine.tokenizer.decode(second.prompt_tokens.tolist()) == "re " + engine.tokenizer.decode(
        first.prompt_tokens.tolist()
    )
    assert learner.buffer.trajectories_pending() == 4  # the second group; admission holds the rest back
    assert learner.admission.admitted() == 8
