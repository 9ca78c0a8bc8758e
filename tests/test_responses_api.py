"""OpenAI's Responses API on the rollout server (docs/environments.md §10.10), driven by the official
``openai`` client's ``responses.create``: a function call, its output and the answer, plain and streamed;
shapes checked against ``openai.types.responses``; what a stateless server refuses; the chat stream's usage.

The engine is the test double of tests/test_tool_calls.py (:class:`ScriptedEngine`): a random tiny model
cannot be made to write a tool call, so a scripted reply to what the server rendered stands in for it. The
tokenizer, its chat template, the app, uvicorn and the client are real.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from rollout.engines.hf import HFEngine
from rollout.http.app import create_app
from rollout.http.responses_api import ResponsesRequest, events
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
from toy.tasks import calc_agent_responses

KEY = "responses-test-key"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object"}}


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serving(KEY) as served:
        yield served


@pytest.fixture
def engine(served: Served) -> ScriptedEngine:
    return served.engine.reset(weather_agent_reply)


@pytest.fixture
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEY, timeout=30, max_retries=0)


def post(served, body: dict, path: str = "/v1/responses") -> httpx.Response:
    return httpx.post(
        f"{served.url}{path}", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
    )


def test_function_call_then_output_then_answer(client: openai.OpenAI, engine: ScriptedEngine) -> None:
    engine.reply = lambda p: ANSWER if RESULT in p else "Checking.\n" + CALL
    r = client.responses.create(
        model=MODEL, instructions="be brief", input="weather in paris?", tools=[WEATHER]
    )
    assert r.status == "completed" and r.object == "response"
    message, call = r.output
    assert (message.type, message.content[0].type, r.output_text) == ("message", "output_text", "Checking.")
    assert (
        call.type == "function_call"
        and call.name == "get_weather"
        and json.loads(call.arguments) == {"city": "Paris"}
    )
    assert call.call_id.startswith("call_") and call.id != call.call_id
    (sampled,) = engine.completions
    assert r.usage.output_tokens == len(sampled.token_ids)
    assert r.usage.input_tokens == len(
        engine.tokenizer(engine.prompts[0], add_special_tokens=False).input_ids
    )
    assert (
        engine.prompts[0].startswith("system: be brief\n\n# Tools")
        and '"name": "get_weather"' in engine.prompts[0]
    )

    items = [
        {"role": "user", "content": "weather in paris?"},
        *(o.model_dump(exclude_none=True) for o in r.output),
    ]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "21"})
    r = client.responses.create(model=MODEL, instructions="be brief", input=items, tools=[WEATHER])
    assert (r.output_text, r.status, [o.type for o in r.output]) == (ANSWER, "completed", ["message"])
    # the message and the call it was sent with are one assistant turn again, then the tool's output
    assert f"assistant: Checking.\n{CALL}\ntool: {RESULT}\nassistant: " in engine.prompts[1]


def test_function_call_streamed(client: openai.OpenAI, engine: ScriptedEngine) -> None:
    engine.reply = lambda p: ANSWER if RESULT in p else "Checking. " + CALL
    seen = list(client.responses.create(model=MODEL, input="weather in paris?", tools=[WEATHER], stream=True))
    kinds = [e.type for e in seen]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-8:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    text = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
    assert text == "Checking." and "<" not in text  # no tag leaks in; the space before the call goes
    args = "".join(e.delta for e in seen if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris"}
    done = seen[-1].response
    assert [o.type for o in done.output] == ["message", "function_call"] and done.output[
        1
    ].name == "get_weather"
    assert done.usage.output_tokens == len(engine.completions[0].token_ids)
    added = [e.item.id for e in seen if e.type == "response.output_item.added"]
    assert added == [o.id for o in done.output]  # each item keeps its id from added to done

    call = done.output[1]
    items = ["weather in paris?", *(o.model_dump(exclude_none=True) for o in done.output)]
    items = [{"role": "user", "content": [{"type": "input_text", "text": items[0]}]}, *items[1:]]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "21"})
    seen = list(client.responses.create(model=MODEL, input=items, tools=[WEATHER], stream=True))
    pieces = [e.delta for e in seen if e.type == "response.output_text.delta"]
    assert "".join(pieces) == ANSWER and len(pieces) > 1 and seen[-1].response.output_text == ANSWER


def test_raw_shapes_are_the_openai_packages(served, engine: ScriptedEngine) -> None:
    """The wire JSON, not the client's lenient objects, validated against ``openai.types.responses``."""
    body = {
        "model": MODEL,
        "input": "x",
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
    }
    r = post(served, body)
    assert r.status_code == 200, r.text
    Response.model_validate(r.json())
    with httpx.stream("POST", f"{served.url}/v1/responses", json={**body, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as s:  # fmt: skip
        lines = [x for x in s.iter_lines() if x]
    names = [x.removeprefix("event: ") for x in lines if x.startswith("event: ")]
    data = [json.loads(x.removeprefix("data: ")) for x in lines if x.startswith("data: ")]
    assert names == [d["type"] for d in data] and names[-1] == "response.completed"
    adapter = TypeAdapter(ResponseStreamEvent)
    for d in data:
        adapter.validate_python(d)


def test_tool_choice_and_parallel_calls(client: openai.OpenAI, engine: ScriptedEngine) -> None:
    kw = {"model": MODEL, "input": "x", "tools": [WEATHER, TIME]}
    r = client.responses.create(**kw, tool_choice="none")
    assert r.output_text == CALL and [o.type for o in r.output] == ["message"]
    r = client.responses.create(**kw, tool_choice={"type": "function", "name": "get_time"})
    assert [o.type for o in r.output] == ["message"]  # a call to another function is not one
    assert client.responses.create(**kw, tool_choice="required").output[0].name == "get_weather"
    engine.reply = lambda p: CALL + '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert [o.name for o in client.responses.create(**kw).output] == ["get_weather", "get_time"]
    assert [o.name for o in client.responses.create(**kw, parallel_tool_calls=False).output] == [
        "get_weather"
    ]


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses (stateless)"),
        ({"store": True}, "store", "leave store unset or false"),
        ({"conversation": "conv_1"}, "conversation", "keeps no responses"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0.type", "'input_image' items are not served"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input.0.content.0", "takes input_text parts with text only"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input.0.arguments", "Field required"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type", "'web_search' tools are not served here"),
        ({"tools": [{"type": "function", "name": "a b"}]}, "tools.0.name", "pattern"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "'nope' is not among"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text.format", "only plain text"),
        ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(served, engine, body, param, says) -> None:
    r = post(served, {"model": MODEL, "input": "x", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert engine.prompts == []  # refused before anything was generated


def test_the_client_reports_previous_response_id(client: openai.OpenAI, engine) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_123")
    assert e.value.param == "previous_response_id"


def test_the_real_engine_is_incomplete_at_max_output_tokens(tiny_ckpt) -> None:
    """The tiny random model on the hf engine: cut at max_output_tokens, the response is incomplete."""
    engine = HFEngine(str(tiny_ckpt["actor"]), device="cpu")
    app = create_app(engine, engine.tokenizer, model_name=MODEL, http=HTTPConfig(),
                     metrics=ServerMetrics(engine), max_context=engine.max_positions)  # fmt: skip
    server = HTTPServer(app, "127.0.0.1", 0).start()
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)
        r = client.responses.create(model=MODEL, input="say a", max_output_tokens=3, temperature=0.0)
        assert (r.status, r.incomplete_details.reason, r.usage.output_tokens) == (
            "incomplete",
            "max_output_tokens",
            3,
        )
        *_, last = client.responses.create(
            model=MODEL, input="say a", max_output_tokens=3, temperature=0.0, stream=True
        )
        assert last.type == "response.incomplete" and last.response.output_text == r.output_text
    finally:
        server.stop()


def test_chat_streams_usage_when_asked(served, engine: ScriptedEngine) -> None:
    """``stream_options.include_usage`` on the chat API (the streams above read it): a last chunk without
    choices carries the same usage as the call without streaming."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    plain = post(served, body, "/v1/chat/completions").json()["usage"]
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0)
    *_, last = client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True})
    assert last.choices == [] and last.usage.model_dump(exclude_none=True) == plain
    assert plain["completion_tokens"] == len(engine.completions[0].token_ids)
    *_, last = client.chat.completions.create(**body, stream=True)
    assert last.usage is None  # not asked: not sent


def test_streamed_reasoning_is_a_reasoning_item() -> None:
    """Where the chat path reads reasoning out of the text (``rollout.http.reasoning_parser``), its
    ``reasoning_content`` deltas become a reasoning item ahead of the message."""

    async def chunks():
        for delta in ({"reasoning_content": "th"}, {"reasoning_content": "ink"}, {"content": "ok"}):
            yield {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
        yield {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}

    async def collect() -> list[dict]:
        return [d async for _, d in events(ResponsesRequest(model=MODEL, input="x"), chunks())]

    out = asyncio.run(collect())
    adapter = TypeAdapter(ResponseStreamEvent)
    for d in out:
        adapter.validate_python(d)
    reasoning = [d["delta"] for d in out if d["type"] == "response.reasoning_text.delta"]
    assert reasoning == ["th", "ink"]
    done = Response.model_validate(out[-1]["response"])
    assert [o.type for o in done.output] == ["reasoning", "message"]
    assert done.output[0].content[0].text == "think" and done.output_text == "ok"


def test_the_agents_sdk_responses_calculator_earns_its_reward(served, engine: ScriptedEngine) -> None:
    """toy/tasks/calc_agent_responses.py (the Agents SDK's OpenAIResponsesModel), handed an OpenAI client
    on a session as a run hands it: the SDK's loop runs the tool, its result reaches the model, and the
    right sum is rewarded; the session holds both calls."""
    url, auth = served.url, {"Authorization": f"Bearer {KEY}"}
    call = '<tool_call>{"name": "add", "arguments": {"a": 37, "b": 48}}</tool_call>'
    engine.reply = lambda p: "85" if "<tool_response>\n85\n</tool_response>" in p else call
    record = {"prompt": "37+48=", "result": 85}

    async def episode() -> tuple[dict, str]:
        sid = httpx.post(f"{url}/v1/sessions", headers=auth, timeout=30).json()["id"]
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, default_headers={"X-Session-Id": sid})
        async with client:
            return await calc_agent_responses.agent(client, record, model=MODEL), sid

    reward, sid = asyncio.run(episode())
    assert reward == {"correct": 1.0} and len(engine.prompts) == 2
    done = httpx.post(
        f"{url}/v1/sessions/{sid}/finish", json={"reward": 1.0}, headers=auth, timeout=30
    ).json()
    assert done["calls"] == 2
    engine.reply = lambda p: "86" if "<tool_response>" in p else call
    assert asyncio.run(episode())[0] == {"correct": 0.0}
    # a reply cut at max_output_tokens: the SDK raises on the incomplete response; the agent scores it 0
    engine.reply = lambda p: "8" * 200
    assert asyncio.run(episode())[0] == {"correct": 0.0}


def test_reasoning_items_from_the_servers_reasoning_parser() -> None:
    """A server with ``reasoning_parser: think``: the model's ``<think>`` text comes back as a reasoning
    item ahead of the message and the call, whole and streamed, through the official client."""
    engine = ScriptedEngine(byte_tokenizer())
    engine.reply = lambda p: "<think>it is a weather question</think>Checking. " + CALL
    server = serve(engine, reasoning_parser="think")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)
        kw = {"model": MODEL, "input": "x", "tools": [WEATHER]}
        r = client.responses.create(**kw)
        assert [o.type for o in r.output] == ["reasoning", "message", "function_call"]
        assert r.output[0].content[0].text == "it is a weather question" and "<think>" not in r.output_text
        seen = list(client.responses.create(**kw, stream=True))
        thought = "".join(e.delta for e in seen if e.type == "response.reasoning_text.delta")
        assert thought == "it is a weather question"
        done = seen[-1].response
        assert [o.type for o in done.output] == ["reasoning", "message", "function_call"]
        assert done.output_text.strip() == "Checking."
    finally:
        server.stop()


DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}  # a call short enough for max_tokens
ADD = {
    "type": "function",
    "name": "add",
    "description": "The sum of two integers.",
    "parameters": {
        "type": "object",
        "properties": {"a": DIGIT, "b": DIGIT},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
}


def test_a_real_model_forced_to_call_then_answering(tmp_path) -> None:
    """A tiny random model on the hf engine: ``tool_choice: required`` makes its reply one valid call
    (constrained decoding, docs/environments.md §10.8), its output goes back as a ``function_call_output``
    item, and the model's next reply, free, is its answer; streamed as well."""
    from toy.tiny import make_tiny

    path = make_tiny(tmp_path, tokenizer="bytes", hidden=32, layers=1)["actor"]
    engine = HFEngine(str(path))
    app = create_app(
        engine, engine.tokenizer, model_name=MODEL, http=HTTPConfig(), metrics=ServerMetrics(engine)
    )
    server = HTTPServer(app, "127.0.0.1", 0).start()
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)
        kw = {"model": MODEL, "tools": [ADD], "max_output_tokens": 120, "parallel_tool_calls": False}
        r = client.responses.create(**kw, input="add 2 and 3", tool_choice="required")
        (call,) = r.output
        assert call.type == "function_call" and call.name == "add"
        args = json.loads(call.arguments)
        assert set(args) == {"a", "b"} and all(type(v) is int for v in args.values())
        items = [{"role": "user", "content": "add 2 and 3"}, call.model_dump(exclude_none=True),
                 {"type": "function_call_output", "call_id": call.call_id, "output": str(args["a"] + args["b"])}]  # fmt: skip
        r = client.responses.create(
            **{**kw, "max_output_tokens": 16}, input=items, tool_choice="none"
        )  # free
        assert r.status in ("completed", "incomplete") and [o.type for o in r.output] in ([], ["message"])
        *_, last = client.responses.create(**kw, input="add 2 and 3", tool_choice="required", stream=True)
        assert last.type == "response.completed" and [o.type for o in last.response.output] == [
            "function_call"
        ]
    finally:
        server.stop()
