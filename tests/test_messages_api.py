"""Anthropic's Messages API on the rollout server (docs/environments.md §10.10), driven by the official
``anthropic`` client: a tool call, its result and the answer, plain and streamed; tool_choice; stop reasons;
errors in Anthropic's shape; and a session that records the same trajectory as the chat API.

The engine is the test double of tests/test_tool_calls.py (:class:`ScriptedEngine`): a random tiny model
cannot be made to write a tool call, so a scripted reply to what the server rendered stands in for it. The
tokenizer, its chat template, the app, uvicorn and the clients are real.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import anthropic
import httpx
import numpy as np
import openai
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from rollout.engines.hf import HFEngine
from rollout.http.app import create_app
from rollout.http.messages_api import events, message
from rollout.http.serve import HTTPServer
from rollout.metrics import ServerMetrics
from tandem.config import HTTPConfig
from tests.scripted_engine import (
    ANSWER,
    CALL,
    MODEL,
    RESULT,
    ScriptedEngine,
    Served,
    byte_tokenizer,
    serve,
    serving,
    weather_agent_reply,
)
from toy.tasks import calc_agent_anthropic

KEY = "messages-test-key"
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TIME = {"name": "get_time", "input_schema": {"type": "object"}}
TIME_CALL = '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>'


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serving(KEY) as served:
        yield served


@pytest.fixture
def engine(served: Served) -> ScriptedEngine:
    return served.engine.reset(weather_agent_reply)


@pytest.fixture
def client(served) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served.url, api_key=KEY, timeout=30, max_retries=0)


def post(served, body: dict, **headers: str) -> httpx.Response:
    headers = {"x-api-key": KEY, **headers}
    return httpx.post(f"{served.url}/v1/messages", json=body, headers=headers, timeout=30)


def test_tool_use_then_result_then_answer(client: anthropic.Anthropic, engine: ScriptedEngine) -> None:
    messages = [{"role": "user", "content": "weather in paris?"}]
    r = client.messages.create(
        model=MODEL, max_tokens=200, system="be brief", messages=messages, tools=[WEATHER]
    )
    assert r.stop_reason == "tool_use" and r.role == "assistant" and r.type == "message"
    (call,) = r.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.input == {"city": "Paris"}
    (sampled,) = engine.completions
    assert r.usage.output_tokens == len(sampled.token_ids)
    prompt = engine.prompts[0]
    assert r.usage.input_tokens == len(engine.tokenizer(prompt, add_special_tokens=False).input_ids)
    assert prompt.startswith("system: be brief\n\n# Tools")
    as_chat = {"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                                "parameters": WEATHER["input_schema"]}}  # fmt: skip
    assert f"<tools>\n{json.dumps(as_chat)}\n</tools>" in prompt  # the chat API's prompt, to the byte

    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "21"}]}]},
    ]  # fmt: skip
    r = client.messages.create(
        model=MODEL, max_tokens=200, system="be brief", messages=messages, tools=[WEATHER]
    )
    assert r.stop_reason == "end_turn" and [(b.type, b.text) for b in r.content] == [("text", ANSWER)]
    assert f"assistant: {CALL}\ntool: {RESULT}\nassistant: " in engine.prompts[1]


def test_tool_use_streamed_in_anthropics_events(client: anthropic.Anthropic, engine: ScriptedEngine) -> None:
    engine.reply = lambda p: ANSWER if RESULT in p else "Checking. " + CALL
    messages = [{"role": "user", "content": "weather in paris?"}]
    with client.messages.stream(model=MODEL, max_tokens=200, messages=messages, tools=[WEATHER]) as stream:
        seen = [e for e in stream]
        final = stream.get_final_message()
    kinds = [e.type for e in seen if e.type not in ("text", "input_json")]  # the helper's own events
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e.content_block.type for e in seen if e.type == "content_block_start"]
    assert starts == ["text", "tool_use"]
    assert kinds.count("content_block_stop") == 2
    deltas = [e.delta for e in seen if e.type == "content_block_delta"]
    text = "".join(d.text for d in deltas if d.type == "text_delta")
    assert text == "Checking." and "<" not in text  # no tag leaks in; the space before the call goes
    assert json.loads("".join(d.partial_json for d in deltas if d.type == "input_json_delta")) == {
        "city": "Paris"
    }
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["text", "tool_use"] and final.content[1].input == {
        "city": "Paris"
    }
    (sampled,) = engine.completions
    assert final.usage.output_tokens == len(sampled.token_ids)

    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": final.content[1].id, "content": "21"}]},
    ]  # fmt: skip
    with client.messages.stream(model=MODEL, max_tokens=200, messages=messages, tools=[WEATHER]) as stream:
        pieces = [e.text for e in stream if e.type == "text"]
        final = stream.get_final_message()
    assert (
        "".join(pieces) == ANSWER and len(pieces) > 1 and final.stop_reason == "end_turn"
    )  # streamed, not held
    assert "assistant: Checking.\n<tool_call>" in engine.prompts[1] and RESULT in engine.prompts[1]


def test_raw_shapes_are_anthropics(served, engine: ScriptedEngine) -> None:
    """The wire JSON, not the client's lenient objects, validated against the anthropic package's types."""
    body = {
        "model": MODEL,
        "max_tokens": 200,
        "messages": [{"role": "user", "content": "x"}],
        "tools": [WEATHER],
    }
    r = post(served, body)
    assert r.status_code == 200, r.text
    Message.model_validate(r.json())
    with httpx.stream("POST", f"{served.url}/v1/messages", json={**body, "stream": True},
                      headers={"x-api-key": KEY}, timeout=30) as s:  # fmt: skip
        lines = [x for x in s.iter_lines() if x]
    names = [x.removeprefix("event: ") for x in lines if x.startswith("event: ")]
    data = [json.loads(x.removeprefix("data: ")) for x in lines if x.startswith("data: ")]
    adapter = TypeAdapter(RawMessageStreamEvent)
    assert names == [d["type"] for d in data]  # each event is named by its type
    for d in data:
        adapter.validate_python(d)
    assert data[-2]["usage"]["output_tokens"] == len(engine.completions[-1].token_ids)


def test_tool_choice(client: anthropic.Anthropic, engine: ScriptedEngine) -> None:
    kw = {
        "model": MODEL,
        "max_tokens": 200,
        "messages": [{"role": "user", "content": "x"}],
        "tools": [WEATHER, TIME],
    }
    r = client.messages.create(**kw, tool_choice={"type": "none"})
    assert (r.stop_reason, r.content[0].text) == ("end_turn", CALL)  # offered, but no call is read
    assert "<tools>" in engine.prompts[-1]
    assert client.messages.create(**kw, tool_choice={"type": "any"}).content[0].name == "get_weather"
    r = client.messages.create(**kw, tool_choice={"type": "tool", "name": "get_time"})
    assert (r.stop_reason, r.content[0].type) == ("end_turn", "text")  # a call to another tool is not one
    engine.reply = lambda p: CALL + TIME_CALL
    r = client.messages.create(**kw, tool_choice={"type": "auto"})
    assert [b.name for b in r.content] == ["get_weather", "get_time"] and r.content[1].input == {"tz": "CET"}
    r = client.messages.create(**kw, tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert [b.name for b in r.content] == ["get_weather"]


def test_stop_sequences_and_system_blocks(client: anthropic.Anthropic, engine: ScriptedEngine) -> None:
    engine.reply = lambda p: "one two three four five six"
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "count"}], "max_tokens": 100}
    # this client sends no sampling fields of its own; older ones did, and the server takes them
    r = client.messages.create(**kw, stop_sequences=[" four"], extra_body={"temperature": 0.0, "top_k": 3})
    assert (r.stop_reason, r.stop_sequence, r.content[0].text) == ("stop_sequence", " four", "one two three")
    with client.messages.stream(**kw, stop_sequences=["six", " t"]) as stream:  # " t" occurs first
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, final.content[0].text) == ("stop_sequence", " t", "one")
    r = client.messages.create(**kw, stop_sequences=["seven"])  # never met: the model's own end
    assert (r.stop_reason, r.stop_sequence) == ("end_turn", None)
    r = client.messages.create(**kw, system=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])
    assert engine.prompts[-1].startswith("system: ab\nuser: count")


def test_the_real_engine_stops_at_max_tokens(tiny_ckpt) -> None:
    """The tiny random model on the hf engine: cut at max_tokens, the message says so."""
    engine = HFEngine(str(tiny_ckpt["actor"]), device="cpu")
    app = create_app(engine, engine.tokenizer, model_name=MODEL, http=HTTPConfig(),
                     metrics=ServerMetrics(engine), max_context=engine.max_positions)  # fmt: skip
    server = HTTPServer(app, "127.0.0.1", 0).start()
    try:
        client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="x", max_retries=0)
        kw = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "say a"}],
            "extra_body": {"temperature": 0.0},
        }
        r = client.messages.create(**kw, max_tokens=3)
        assert (r.stop_reason, r.usage.output_tokens) == ("max_tokens", 3)
        with client.messages.stream(**kw, max_tokens=3) as stream:
            final = stream.get_final_message()
        assert (final.stop_reason, final.usage.output_tokens) == ("max_tokens", 3)
        assert final.content[0].text == r.content[0].text  # greedy: the same three tokens
    finally:
        server.stop()


def test_the_api_key_is_taken_either_way(served, engine: ScriptedEngine) -> None:
    body = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    assert post(served, body).status_code == 200  # x-api-key
    r = httpx.post(
        f"{served.url}/v1/messages", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
    )
    assert r.status_code == 200
    r = post(served, body, **{"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=served.url, api_key="wrong", max_retries=0).messages.create(**body)


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"max_tokens": None}, 400, "max_tokens: Field required"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
         "messages.0.content.0.type: 'image' blocks are not served here"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]},
         400, "messages.0.content.0.type: a user message holds no 'tool_use' blocks"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a",
                                                      "content": [{"type": "image"}]}]}]},
         400, "messages.0.content.0.content.0.type: a tool result holds text blocks only"),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": [1]}]}]},
         400, "messages.0.content.0.input"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "tools.0.type: 'web_search_20250305'"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, 400, "tool_choice.name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, 400, "'nope' is not among tools"),
        ({"temperature": 1.5}, 400, "temperature"),
        ({"model": "other"}, 404, "The model 'other' does not exist"),
        ({"max_tokens": 10**6}, 400, "max_tokens 1000000 exceeds the server's limit"),
    ],
)  # fmt: skip
def test_errors_answer_in_anthropics_shape(served, engine, body, status, says) -> None:
    request = {"model": MODEL, "max_tokens": 10, "messages": [{"role": "user", "content": "x"}], **body}
    r = post(served, {k: v for k, v in request.items() if v is not None})
    assert r.status_code == status, r.text
    answer = r.json()
    assert answer["type"] == "error" and says in answer["error"]["message"], answer
    kind = {400: "invalid_request_error", 404: "not_found_error"}[status]
    assert answer["error"]["type"] == kind
    assert engine.prompts == []  # refused before anything was generated


def test_the_client_reports_a_bad_block(client: anthropic.Anthropic, engine) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=10, messages=[
            {"role": "user", "content": [{"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}
        ])  # fmt: skip
    assert "'document' blocks are not served here" in e.value.message


def test_a_session_records_what_the_chat_api_records(served, client: anthropic.Anthropic, engine) -> None:
    """The same agent turn (call, result, answer) in two sessions, once on the Messages API and once on
    the chat API: the two trajectories hold the same tokens, mask and behaviour logprobs."""
    url, sunk = served.url, served.sunk
    compact = (
        '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>'  # not re-serialisable
    )
    engine.reply = lambda p: ANSWER if RESULT in p else compact
    auth = {"Authorization": f"Bearer {KEY}"}
    sids = [httpx.post(f"{url}/v1/sessions", headers=auth, timeout=30).json()["id"] for _ in range(2)]

    headers = {"X-Session-Id": sids[0]}
    messages = [{"role": "user", "content": "weather in paris?"}]
    r = client.messages.create(
        model=MODEL, max_tokens=200, messages=messages, tools=[WEATHER], extra_headers=headers
    )
    (call,) = r.content
    messages += [
        {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21"}]},
    ]
    r = client.messages.create(
        model=MODEL, max_tokens=200, messages=messages, tools=[WEATHER], extra_headers=headers
    )
    assert r.content[0].text == ANSWER

    chat = openai.OpenAI(
        base_url=f"{url}/v1", api_key=KEY, max_retries=0, default_headers={"X-Session-Id": sids[1]}
    )
    tools = [{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]  # fmt: skip
    chat_messages = [{"role": "user", "content": "weather in paris?"}]
    (tool_call,) = (
        chat.chat.completions.create(model=MODEL, max_tokens=200, messages=chat_messages, tools=tools)
        .choices[0]
        .message.tool_calls
    )
    chat_messages += [
        {"role": "assistant", "content": None, "tool_calls": [tool_call.model_dump()]},
        {"role": "tool", "tool_call_id": tool_call.id, "content": "21"},
    ]
    assert (
        chat.chat.completions.create(model=MODEL, max_tokens=200, messages=chat_messages, tools=tools)
        .choices[0]
        .message.content
        == ANSWER
    )

    for sid in sids:
        done = httpx.post(f"{url}/v1/sessions/{sid}/finish", json={"reward": 1.0}, headers=auth, timeout=30)
        assert done.status_code == 200, done.text
    via_messages, via_chat = ([t for t in sunk if t.meta["session_id"] == sid] for sid in sids)
    assert len(via_messages) == len(via_chat) == 1
    a, b = via_messages[0], via_chat[0]
    assert list(a.prompt_tokens) == list(b.prompt_tokens) and list(a.response_tokens) == list(
        b.response_tokens
    )
    assert list(a.loss_mask) == list(b.loss_mask)
    np.testing.assert_array_equal(a.behav_logp, b.behav_logp)
    generated = [t for t, m in zip(a.response_tokens, a.loss_mask, strict=True) if m]
    first, second = engine.completions[:2]  # the Messages session's two completions, exactly as sampled
    assert generated == first.token_ids + second.token_ids
    assert engine.tokenizer.decode(first.token_ids, skip_special_tokens=True) == compact


# ----------------------------------------------------------------- thinking: the chat path's reasoning


def test_reasoning_becomes_a_thinking_block() -> None:
    """Where the chat path reads reasoning out of the text (``rollout.http.reasoning_parser``), its
    ``reasoning_content`` comes first, as a thinking block."""
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    chat = {"id": "chatcmpl-1", "usage": usage, "choices": [{"finish_reason": "tool_calls", "message": {
        "role": "assistant", "reasoning_content": "think", "content": "ok", "tool_calls": [call]}}]}  # fmt: skip
    m = Message.model_validate(message(chat, MODEL))
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"]
    assert (m.content[0].thinking, m.content[2].input, m.stop_reason) == ("think", {"a": 1}, "tool_use")
    assert (m.usage.input_tokens, m.usage.output_tokens) == (3, 4)


def test_streamed_reasoning_is_a_thinking_block_before_the_text() -> None:
    async def chunks():
        for delta in ({"reasoning_content": "th"}, {"reasoning_content": "ink"}, {"content": "ok"}):
            yield {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
        yield {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}

    async def collect() -> list[dict]:
        return [d async for _, d in events(chunks(), MODEL)]

    out = asyncio.run(collect())
    adapter = TypeAdapter(RawMessageStreamEvent)
    for d in out:
        adapter.validate_python(d)
    assert [d["type"] for d in out] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]  # fmt: skip
    assert out[1]["content_block"]["type"] == "thinking" and out[5]["content_block"]["type"] == "text"
    assert [out[2]["delta"]["thinking"], out[3]["delta"]["thinking"]] == ["th", "ink"]
    assert out[5]["index"] == 1 and out[-2]["delta"]["stop_reason"] == "max_tokens"


# ------------------------------------------------------------------- the calculator agent on this API


def test_the_anthropic_calculator_agent_earns_its_reward(served, engine: ScriptedEngine) -> None:
    """toy/tasks/calc_agent_anthropic.py, handed an OpenAI client on a session as a run hands it: its
    calls reach the session, the tool's result reaches the model, and the right sum is rewarded."""
    url = served.url
    auth = {"Authorization": f"Bearer {KEY}"}
    call = '<tool_call>{"name": "add", "arguments": {"a": 37, "b": 48}}</tool_call>'
    engine.reply = lambda p: "85" if "<tool_response>\n85\n</tool_response>" in p else call
    record = {"prompt": "37+48=", "result": 85}

    async def episode() -> tuple[dict, str]:
        sid = httpx.post(f"{url}/v1/sessions", headers=auth, timeout=30).json()["id"]
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, default_headers={"X-Session-Id": sid})
        async with client:
            return await calc_agent_anthropic.agent(client, record, model=MODEL), sid

    reward, sid = asyncio.run(episode())
    assert reward == {"correct": 1.0} and len(engine.prompts) == 2
    done = httpx.post(
        f"{url}/v1/sessions/{sid}/finish", json={"reward": 1.0}, headers=auth, timeout=30
    ).json()
    assert done["calls"] == 2  # both of the agent's calls were on its session
    engine.reply = lambda p: "86" if "<tool_response>" in p else call
    assert asyncio.run(episode())[0] == {"correct": 0.0}


def test_thinking_blocks_from_the_servers_reasoning_parser() -> None:
    """A server with ``reasoning_parser: think``: the model's ``<think>`` text comes back as a thinking
    block ahead of the text and the call, whole and streamed, through the official client."""
    engine = ScriptedEngine(byte_tokenizer())
    engine.reply = lambda p: "<think>it is a weather question</think>Checking. " + CALL
    server = serve(engine, reasoning_parser="think")
    try:
        client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="x", max_retries=0)
        kw = {
            "model": MODEL,
            "max_tokens": 200,
            "messages": [{"role": "user", "content": "x"}],
            "tools": [WEATHER],
        }
        r = client.messages.create(**kw)
        assert [b.type for b in r.content] == ["thinking", "text", "tool_use"] and r.stop_reason == "tool_use"
        assert r.content[0].thinking == "it is a weather question" and "<think>" not in r.content[1].text
        with client.messages.stream(**kw) as stream:
            final = stream.get_final_message()
        assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
        assert final.content[0].thinking == "it is a weather question"
        assert (final.content[1].text.strip(), final.content[2].input) == ("Checking.", {"city": "Paris"})
    finally:
        server.stop()


# ------------------------------------------------- a real model, its call forced by constrained decoding

DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}  # a call short enough for max_tokens
ADD = {
    "name": "add",
    "description": "The sum of two integers.",
    "input_schema": {
        "type": "object",
        "properties": {"a": DIGIT, "b": DIGIT},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
}


def test_a_real_model_forced_to_call_then_answering(tmp_path) -> None:
    """A tiny random model on the hf engine: a named ``tool_choice`` makes its reply one valid call
    (constrained decoding, docs/environments.md §10.8), the call's result goes back as a ``tool_result``,
    and the model's next reply, free, is its answer, plain and streamed."""
    from toy.tiny import make_tiny

    path = make_tiny(tmp_path, tokenizer="bytes", hidden=32, layers=1)["actor"]
    engine = HFEngine(str(path))
    app = create_app(
        engine, engine.tokenizer, model_name=MODEL, http=HTTPConfig(), metrics=ServerMetrics(engine)
    )
    server = HTTPServer(app, "127.0.0.1", 0).start()
    try:
        client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "add 2 and 3"}]
        kw = {"model": MODEL, "max_tokens": 120, "tools": [ADD]}
        r = client.messages.create(**kw, messages=messages, tool_choice={"type": "tool", "name": "add"})
        assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"]
        (call,) = r.content
        assert call.name == "add" and set(call.input) == {"a", "b"}
        assert all(isinstance(v, int) and not isinstance(v, bool) for v in call.input.values())
        result = str(call.input["a"] + call.input["b"])
        messages += [
            {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": result}]},
        ]
        r = client.messages.create(
            **{**kw, "max_tokens": 16}, messages=messages, tool_choice={"type": "none"}
        )  # free
        assert r.stop_reason in ("end_turn", "max_tokens") and all(b.type == "text" for b in r.content)
        with client.messages.stream(**kw, messages=messages[:1], tool_choice={"type": "any"}) as stream:
            final = stream.get_final_message()
        assert final.stop_reason == "tool_use" and final.content[-1].name == "add"
    finally:
        server.stop()
