"""Function calling on the chat API (docs/environments.md §10.8): the Hermes parser as pure functions, then the
official ``openai`` client against the real app and HTTP server.

The end-to-end tests run the engine as a test double, :class:`ScriptedEngine`, and nothing else: a random
tiny model cannot be made to write a tool call, and a scripted reply to what the server actually rendered
(tool result included) shows the whole loop. The tokenizer (byte-level BPE, every byte a token, so JSON and
any Unicode text round-trip), its chat template, the app, uvicorn and the client are all real.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest

from rollout.engines.hf import HFEngine
from rollout.http.app import create_app
from rollout.http.serve import HTTPServer
from rollout.http.tools import ParsedCall, hermes_messages, parse_hermes
from rollout.metrics import ServerMetrics
from tandem.config import HTTPConfig
from tests.scripted_engine import (
    ANSWER,
    CALL,
    MODEL,
    ScriptedEngine,
    Served,
    byte_tokenizer,
    serve,
    serving,
    weather_agent_reply,
)

KEY = "tool-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


# ------------------------------------------------------------------------------------------ the parser


def test_a_single_call_is_parsed() -> None:
    content, calls = parse_hermes(CALL, {"get_weather"})
    assert content is None
    assert calls == [ParsedCall("get_weather", '{"city": "Paris"}')]


def test_parallel_calls_keep_their_order() -> None:
    text = CALL + '\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    content, calls = parse_hermes(text, {"get_weather", "get_time"})
    assert content is None
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert [json.loads(c.arguments) for c in calls] == [{"city": "Paris"}, {}]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"</tool_call>',  # cut short
        "<tool_call>not json</tool_call>",
        '<tool_call>["get_weather"]</tool_call>',  # not an object
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": 7, "arguments": {}}</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "get_weather", "arguments": "{oops"}</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": {"city": "\\ud800"}}</tool_call>',  # lone surrogate
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',  # ended inside the call
        "no call at all",
        "",
    ],
)
def test_malformed_calls_stay_content_as_written(text: str) -> None:
    assert parse_hermes(text, {"get_weather"}) == (text, [])


def test_text_around_calls_is_the_content() -> None:
    text = f"Let me look.\n{CALL}\nOne moment. "
    content, calls = parse_hermes(text, {"get_weather"})
    assert content == "Let me look.\n\nOne moment."
    assert [c.name for c in calls] == ["get_weather"]


def test_a_valid_call_next_to_a_malformed_one() -> None:
    text = f"<tool_call>{{broken</tool_call>{CALL}"
    content, calls = parse_hermes(text, {"get_weather"})
    assert content == "<tool_call>{broken</tool_call>" and [c.name for c in calls] == ["get_weather"]


def test_a_function_outside_the_allowed_ones_is_content() -> None:
    """Under a named tool_choice only that function is allowed; a call to another is not invented into
    one, it stays the model's text."""
    assert parse_hermes(CALL, {"get_time"}) == (CALL, [])
    assert [c.name for c in parse_hermes(CALL, None)[1]] == ["get_weather"]  # None: any name


def test_unicode_arguments_round_trip() -> None:
    text = '<tool_call>{"name": "say", "arguments": {"text": "café 東京 🙂", "esc": "\\u00e9"}}</tool_call>'
    _, (call,) = parse_hermes(text, {"say"})
    assert json.loads(call.arguments) == {"text": "café 東京 🙂", "esc": "é"}
    assert "東京 🙂" in call.arguments  # UTF-8 text, not \u escapes


def test_arguments_written_as_json_text_and_an_unclosed_last_call() -> None:
    text = '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}'
    assert parse_hermes(text, {"get_time"}) == (None, [ParsedCall("get_time", '{"tz": "UTC"}')])


def test_hermes_messages_render_tools_calls_and_results() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "21", "tool_call_id": "call_1"},
    ]  # fmt: skip
    out = hermes_messages(messages, [WEATHER])
    assert out[0]["role"] == "system" and out[0]["content"].startswith("be brief\n\n# Tools")
    assert f"<tools>\n{json.dumps(WEATHER)}\n</tools>" in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": CALL}
    assert out[3] == {"role": "tool", "content": "<tool_response>\n21\n</tool_response>"}
    assert hermes_messages(messages[1:2], [WEATHER])[0]["role"] == "system"  # a system message is added


# -------------------------------------------------------------------------------- end to end: the double


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serving(KEY) as served:  # a sink takes finished sessions only with a key
        yield served


@pytest.fixture
def engine(served: Served) -> ScriptedEngine:
    return served.engine.reset(weather_agent_reply)


@pytest.fixture
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEY, timeout=30, max_retries=0)


def stream_message(stream) -> tuple[str, list[dict], str, list[str]]:
    """``(content, tool_calls, finish_reason, content pieces)`` assembled from a chat stream's deltas."""
    pieces, calls, finish = [], {}, None
    for chunk in stream:
        (choice,) = chunk.choices
        if choice.delta.content:
            pieces.append(choice.delta.content)
        for d in choice.delta.tool_calls or []:
            c = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            c["id"] += d.id or ""
            c["name"] += d.function.name or ""
            c["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return "".join(pieces), [calls[k] for k in sorted(calls)], finish, pieces


def test_tool_call_then_result_then_answer(client: openai.OpenAI, engine: ScriptedEngine) -> None:
    messages = [{"role": "user", "content": "weather in paris?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=200)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and len(call.id) > len("call_") and call.type == "function"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    # the tiny chat template ignores tools, so the server wrote the Hermes-style system prompt
    assert f"<tools>\n{json.dumps(WEATHER)}\n</tools>" in engine.prompts[0]
    assert "system: # Tools" in engine.prompts[0]

    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "21"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=200)
    (choice,) = r.choices
    assert choice.message.content == ANSWER and not choice.message.tool_calls
    assert choice.finish_reason == "stop"
    assert f"assistant: {CALL}\ntool: <tool_response>\n21\n</tool_response>\nassistant: " in engine.prompts[1]


def test_tool_call_then_result_then_answer_streamed(client: openai.OpenAI, engine: ScriptedEngine) -> None:
    engine.reply = lambda p: "Checking. " + weather_agent_reply(p) if "<tool_response>" not in p else ANSWER
    messages = [{"role": "user", "content": "weather in paris?"}]
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], max_tokens=200, stream=True
    )
    content, calls, finish, pieces = stream_message(stream)
    assert finish == "tool_calls"
    # no tag leaks into the content; the space before the call goes, as in the whole response
    assert content == "Checking." and not any("<" in p for p in pieces)
    (call,) = calls
    assert call["id"].startswith("call_") and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris"}

    tool_call = {"id": call["id"], "type": "function",
                 "function": {"name": call["name"], "arguments": call["arguments"]}}  # fmt: skip
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [tool_call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "21"},
    ]
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], max_tokens=200, stream=True
    )
    content, calls, finish, pieces = stream_message(stream)
    assert content == ANSWER and calls == [] and finish == "stop" and len(pieces) > 1  # streamed, not held


def test_text_like_a_tag_that_is_no_call_streams_as_content(client: openai.OpenAI, engine) -> None:
    engine.reply = lambda p: "1 <tool 2 <tool_cal"  # starts of the tag, never a call
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]}
    content, calls, finish, _ = stream_message(client.chat.completions.create(**kw, stream=True))
    assert (content, calls, finish) == ("1 <tool 2 <tool_cal", [], "stop")
    assert client.chat.completions.create(**kw).choices[0].message.content == "1 <tool 2 <tool_cal"


def test_parallel_tool_calls(client: openai.OpenAI, engine: ScriptedEngine) -> None:
    engine.reply = lambda p: CALL + '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>'
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER, TIME]}
    calls = client.chat.completions.create(**kw).choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert len({c.id for c in calls}) == 2
    _, streamed, _, _ = stream_message(client.chat.completions.create(**kw, stream=True))
    assert [c["name"] for c in streamed] == ["get_weather", "get_time"]
    assert json.loads(streamed[1]["arguments"]) == {"tz": "CET"}
    (one,) = client.chat.completions.create(**kw, parallel_tool_calls=False).choices[0].message.tool_calls
    assert one.function.name == "get_weather"


def test_tool_choice_none_returns_the_text(client: openai.OpenAI, engine: ScriptedEngine) -> None:
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]}
    (choice,) = client.chat.completions.create(**kw, tool_choice="none").choices
    assert choice.message.content == CALL and not choice.message.tool_calls and choice.finish_reason == "stop"
    assert "<tools>" in engine.prompts[-1]  # the tools are still offered in the prompt


def test_required_and_named_choice_never_invent_a_call(client: openai.OpenAI, engine: ScriptedEngine) -> None:
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER, TIME]}
    engine.reply = lambda p: "no idea"
    (choice,) = client.chat.completions.create(**kw, tool_choice="required").choices
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (
        "no idea",
        None,
        "stop",
    )
    engine.reply = weather_agent_reply  # calls get_weather, but get_time is the named choice
    named = {"type": "function", "function": {"name": "get_time"}}
    (choice,) = client.chat.completions.create(**kw, tool_choice=named).choices
    assert choice.message.content == CALL and choice.message.tool_calls is None
    named = {"type": "function", "function": {"name": "get_weather"}}
    (choice,) = client.chat.completions.create(**kw, tool_choice=named).choices
    assert choice.message.tool_calls[0].function.name == "get_weather"


def test_malformed_tool_json_from_the_model_is_content(client: openai.OpenAI, engine: ScriptedEngine) -> None:
    bad = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    engine.reply = lambda p: bad
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]}
    (choice,) = client.chat.completions.create(**kw).choices
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (bad, None, "stop")
    content, calls, finish, _ = stream_message(client.chat.completions.create(**kw, stream=True))
    assert (content, calls, finish) == (bad, [], "stop")


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "'nope' is not among tools"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", 'must be "none", "auto"'),
        ({"tools": [WEATHER, WEATHER]}, "tools", "'get_weather' is defined more than once"),
        ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools.0.function.name", "Field required"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name", "pattern"),
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type", "'function'"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]},
         "messages.1.content", "only an assistant message with tool_calls"),
        ({"messages": [{"role": "user", "content": None}]}, "messages.0.content", "may omit content"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{x"}}]}]},
         "messages.0.tool_calls.0.function.arguments", "must be a JSON object"),
    ],
)  # fmt: skip
def test_invalid_tool_requests_get_400_naming_the_field(served, engine, body, param, says) -> None:
    request = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], **body}
    r = httpx.post(f"{served.url}/v1/chat/completions", json=request, headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert engine.prompts == []  # refused before anything was generated


def test_the_official_client_reports_the_field(client: openai.OpenAI, engine) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_time"}},
        )  # fmt: skip
    assert e.value.param == "tool_choice"


def test_without_a_parser_tools_are_refused_unless_tool_choice_is_none() -> None:
    engine = ScriptedEngine(byte_tokenizer())
    engine.reply = weather_agent_reply
    server = serve(engine, tool_parser=None)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)
        kw = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]}
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**kw)
        assert e.value.param == "tools" and "tool_parser" in e.value.message
        assert client.chat.completions.create(**kw, tool_choice="none").choices[0].message.content == CALL
    finally:
        server.stop()


# A template in the shape of Qwen 2.5's: it renders tools and tool calls itself (arguments as objects).
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{{ m.role }}: "
    "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} "
    "{{ c.function.arguments.city }}{% endfor %}"
    "{% elif m.role == 'tool' %}RESULT {{ m.tool_call_id }} {{ m.content }}"
    "{% else %}{{ m.content }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def test_a_template_that_renders_tools_is_used_as_it_is() -> None:
    engine = ScriptedEngine(byte_tokenizer(TOOL_TEMPLATE))
    engine.reply = lambda p: ANSWER if "RESULT" in p else CALL
    server = serve(engine)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "weather?"}]
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME])
        (call,) = r.choices[0].message.tool_calls
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "21"},
        ]
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME])
        assert r.choices[0].message.content == ANSWER
        assert engine.prompts[1] == (
            f"TOOLS: get_weather get_time\nuser: weather?\nassistant: CALL get_weather Paris\n"
            f"tool: RESULT {call.id} 21\nassistant: "
        )  # the template's own rendering, arguments handed over as an object; no Hermes fallback
    finally:
        server.stop()


def test_a_session_keeps_the_sampled_tool_call_tokens(served, client: openai.OpenAI, engine) -> None:
    """An agent session with a tool call: the client gets parsed calls, the trajectory gets the sampled
    tokens, tool-call text included, and the agent's echo of the call extends the transcript exactly."""
    url, sunk = served.url, served.sunk
    # written unlike the server's own rendering of a call, which would not extend what was sampled
    compact = '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>'
    engine.reply = lambda p: ANSWER if "<tool_response>\n21\n</tool_response>" in p else compact
    sid = httpx.post(f"{url}/v1/sessions", headers=AUTH, timeout=30).json()["id"]  # the server's id
    headers = {"X-Session-Id": sid}
    messages = [{"role": "user", "content": "weather in paris?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], extra_headers=headers)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "21"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], extra_headers=headers)
    assert r.choices[0].message.content == ANSWER
    done = httpx.post(f"{url}/v1/sessions/{sid}/finish", json={"reward": 1.0}, headers=AUTH, timeout=30)
    assert done.status_code == 200, done.text
    (t,) = [x for x in sunk if x.meta["session_id"] == sid]

    first, second = engine.completions
    tokens, mask = list(t.response_tokens), list(t.loss_mask)
    generated = [x for x, m in zip(tokens, mask, strict=True) if m]
    assert generated == first.token_ids + second.token_ids  # exactly what was sampled, the call included
    assert engine.tokenizer.decode(first.token_ids, skip_special_tokens=True) == compact
    assert tokens[: len(first.token_ids)] == first.token_ids and mask[: len(first.token_ids)] == [1] * len(
        first.token_ids
    )
    np.testing.assert_allclose(
        [lp for lp, m in zip(t.behav_logp, mask, strict=True) if m], first.logprobs + second.logprobs
    )
    added = tokens[len(first.token_ids) : len(tokens) - len(second.token_ids)]
    assert engine.tokenizer.decode(added) == "\ntool: <tool_response>\n21\n</tool_response>\nassistant: "
    assert set(mask[len(first.token_ids) : len(tokens) - len(second.token_ids)]) == {0}


def test_the_real_engine_serves_a_tools_request(tiny_ckpt) -> None:
    """The tiny random model on the hf engine: offered tools, it writes no call, and the answer is its
    text with the usual finish reason."""
    engine = HFEngine(str(tiny_ckpt["actor"]), device="cpu")
    app = create_app(engine, engine.tokenizer, model_name=MODEL, http=HTTPConfig(),
                     metrics=ServerMetrics(engine), max_context=engine.max_positions)  # fmt: skip
    server = HTTPServer(app, "127.0.0.1", 0).start()
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "say a"}],
            tools=[TIME],
            max_tokens=8,
            seed=3,
        )
        (choice,) = r.choices
        assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
        assert isinstance(choice.message.content, str)
    finally:
        server.stop()


def test_streamed_logprobs_cover_every_token_once(client: openai.OpenAI, engine: ScriptedEngine) -> None:
    engine.reply = lambda p: "Checking. " + CALL
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], tools=[WEATHER], stream=True, logprobs=True
    )
    tokens = [
        e.token for chunk in stream if chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content
    ]
    (sampled,) = engine.completions
    assert "".join(tokens) == "Checking. " + CALL
    assert len(tokens) == len(sampled.token_ids) - 1  # all but EOS
