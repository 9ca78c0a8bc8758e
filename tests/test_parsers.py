"""Reasoning and tool-call parsers of the chat API (docs/environments.md §10.8), on model text written
the way each model family writes it: whole completions, then the same text streamed in arbitrary chunk
splits (inside markers too), which must join to the whole; then the real app and server with the official
``openai`` client.

The end-to-end tests use test_tool_calls' scripted engine (a random tiny model cannot be made to reason or
call a tool) over a real byte-level tokenizer, the real app, uvicorn and client.
"""

from __future__ import annotations

import json
import random

import httpx
import openai
import pytest
from pydantic import ValidationError

from rollout.http.parsers import TOOL_FORMATS, ChatReader, ParsedCall, harmony, parse_reasoning
from rollout.http.parsers import think as think_format
from rollout.http.parsers.qwen3_coder import typed
from tandem.config import HTTPConfig
from tests.scripted_engine import MODEL, ScriptedEngine, byte_tokenizer, serve
from tests.test_tool_calls import AUTH, KEY
from toy.tiny import CHAT_TEMPLATE

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
SEARCH = {
    "type": "object",
    "properties": {
        "query": {"type": "string"},
        "limit": {"type": ["integer", "null"]},
        "score": {"type": "number"},
        "exact": {"type": "boolean"},
        "filters": {"type": "object"},
        "tags": {"type": "array"},
    },
}
ALLOWED = {"get_weather": WEATHER, "search": SEARCH}


def reader(tools: str | None = None, reasoning: str | None = None, **kw: object) -> ChatReader:
    return ChatReader(
        reasoning=reasoning, tools=TOOL_FORMATS[tools] if tools else None, allowed=ALLOWED, **kw
    )  # type: ignore[arg-type]


def args(call: ParsedCall) -> dict:
    return json.loads(call.arguments)


# ----------------------------------------------------------------------------------------- reasoning


@pytest.mark.parametrize(
    ("text", "inside", "expected"),
    [
        ("<think>\nThe user wants 2+2.\n</think>\n\n4", False, ("The user wants 2+2.", "4")),
        ("The user wants 2+2.\n</think>\n\n4", True, ("The user wants 2+2.", "4")),  # template opened it
        ("<think>\nStill thinking about", False, ("Still thinking about", None)),  # cut off inside
        ("Still thinking about", True, ("Still thinking about", None)),
        ("<think>\n\n</think>\n\nHi there", False, (None, "Hi there")),  # thinking switched off
        ("Just an answer.", False, (None, "Just an answer.")),
        ("A </think> in prose", False, (None, "A </think> in prose")),  # no block opened: content
        ("<think>日本語で考える 🙂</think>答え", False, ("日本語で考える 🙂", "答え")),
    ],
)
def test_think_splits_reasoning_from_content(text: str, inside: bool, expected: tuple) -> None:
    assert parse_reasoning(text, inside) == expected


def test_a_prompt_that_opened_think_is_told_from_one_that_closed_it() -> None:
    assert think_format.opened("<｜User｜>hi<｜Assistant｜><think>\n")  # DeepSeek-R1
    assert not think_format.opened("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3, thinking off
    assert not think_format.opened("<|im_start|>assistant\n")


# --------------------------------------------------------------------------------------- qwen3_coder

QWEN_CALL = """<tool_call>
<function=get_weather>
<parameter=city>
Paris
</parameter>
<parameter=days>
3
</parameter>
</function>
</tool_call>"""


def test_qwen3_coder_types_values_by_the_schema() -> None:
    text = (
        "Let me search.\n<tool_call>\n<function=search>\n"
        "<parameter=query>\n007 café 東京\n</parameter>\n<parameter=limit>\nnull\n</parameter>\n"
        "<parameter=score>\n2.5\n</parameter>\n<parameter=exact>\nTrue\n</parameter>\n"
        '<parameter=filters>\n{"year": {"gte": 2020}, "lang": ["en", "fr"]}\n</parameter>\n'
        '<parameter=tags>\n[1, "two"]\n</parameter>\n<parameter=extra>\n12\n</parameter>\n'
        "</function>\n</tool_call>\n" + QWEN_CALL
    )
    content, calls = TOOL_FORMATS["qwen3_coder"].parse(text, ALLOWED)
    assert content == "Let me search."
    assert [c.name for c in calls] == ["search", "get_weather"]
    assert args(calls[0]) == {
        "query": "007 café 東京",  # a string stays a string, digits or not
        "limit": None,
        "score": 2.5,
        "exact": True,
        "filters": {"year": {"gte": 2020}, "lang": ["en", "fr"]},
        "tags": [1, "two"],
        "extra": "12",  # not in the schema: as written
    }
    assert args(calls[1]) == {"city": "Paris", "days": 3}
    assert "東京" in calls[0].arguments


@pytest.mark.parametrize(
    ("value", "schema", "expected"),
    [
        ("3", {"type": "integer"}, 3),
        ("3.5", {"type": "integer"}, "3.5"),  # not an integer: the text
        ("-1e3", {"type": "number"}, -1000.0),
        ("NaN", {"type": "number"}, "NaN"),  # no JSON number
        ("false", {"type": "boolean"}, False),
        ("1", {"type": "boolean"}, "1"),
        ("yes", {"type": "boolean"}, "yes"),
        ("[1]", {"type": "object"}, "[1]"),
        ("{bad", {"type": "object"}, "{bad"),
        ("null", {"type": "string"}, "null"),
        ("line one\nline two", None, "line one\nline two"),
    ],
)
def test_qwen3_coder_value_types(value: str, schema: dict | None, expected: object) -> None:
    assert typed(value, schema) == expected and type(typed(value, schema)) is type(expected)


@pytest.mark.parametrize(
    "text",
    [
        QWEN_CALL[:60],  # cut off mid-call
        QWEN_CALL.replace("get_weather", "launch_rocket"),  # a function not offered
        "<tool_call>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",  # no function
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",  # unclosed
    ],
)
def test_qwen3_coder_malformed_stays_content(text: str) -> None:
    assert TOOL_FORMATS["qwen3_coder"].parse(text, ALLOWED) == (text, [])


# --------------------------------------------------------------------------------------- llama3_json


def test_llama3_json_calls_after_the_python_tag_separated_by_semicolons() -> None:
    text = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Zürich", "days": 2}}; '
        '{"name": "search", "parameters": {"query": "x", "filters": {"a": {"b": [1, {"c": null}]}}}}'
    )
    content, calls = TOOL_FORMATS["llama3_json"].parse(text, ALLOWED)
    assert content is None
    assert [(c.name, args(c)) for c in calls] == [
        ("get_weather", {"city": "Zürich", "days": 2}),
        ("search", {"query": "x", "filters": {"a": {"b": [1, {"c": None}]}}}),
    ]
    bare = '{"name": "get_weather", "parameters": {"city": "Paris"}}'  # the tag decoded away
    assert TOOL_FORMATS["llama3_json"].parse(bare, ALLOWED)[1] == [
        ParsedCall("get_weather", '{"city": "Paris"}')
    ]


@pytest.mark.parametrize(
    "text",
    [
        'Sure: {"name": "get_weather", "parameters": {"city": "Paris"}}',  # a call only opens the turn
        '{"name": "get_weather", "parameters": {"city": "Par',  # cut off
        '{"name": "get_weather", "parameters": {}}; {"name": "rm_rf", "parameters": {}}',  # one unknown
        '{"name": "get_weather", "parameters": [1]}',
        "{not json",
    ],
)
def test_llama3_json_malformed_stays_content(text: str) -> None:
    assert TOOL_FORMATS["llama3_json"].parse(text, ALLOWED) == (text, [])


# ------------------------------------------------------------------------------------------- mistral


def test_mistral_list_and_named_forms() -> None:
    listed = (
        'I will check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Kraków"}}, '
        '{"name": "search", "arguments": {"query": "q", "filters": {"deep": {"er": [{}]}}}}]'
    )
    content, calls = TOOL_FORMATS["mistral"].parse(listed, ALLOWED)
    assert content == "I will check."
    assert [(c.name, args(c)) for c in calls] == [
        ("get_weather", {"city": "Kraków"}),
        ("search", {"query": "q", "filters": {"deep": {"er": [{}]}}}),
    ]
    named = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]search[CALL_ID]a1b2c3d4e[ARGS]{"query": "q"}'
    content, calls = TOOL_FORMATS["mistral"].parse(named, ALLOWED)
    assert content is None
    assert [(c.name, args(c)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("search", {"query": "q"}),
    ]


@pytest.mark.parametrize(
    "text",
    [
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par',  # cut off
        '[TOOL_CALLS]get_weather[ARGS]{"city": ',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {}}, {"name": "nope", "arguments": {}}]',
        "[TOOL_CALLS]get_weather",
        "[TOOL_CALLS]not json at all",
    ],
)
def test_mistral_malformed_stays_content(text: str) -> None:
    assert TOOL_FORMATS["mistral"].parse(text, ALLOWED) == (text, [])


# ------------------------------------------------------------------------------------------- harmony

ANALYSIS = "<|channel|>analysis<|message|>User asks weather in Paris. Call the tool.<|end|>"
HARMONY_CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris", "days": 2}<|call|>'
)


def test_harmony_reasoning_call_and_final() -> None:
    r = reader("harmony", "harmony").read(ANALYSIS + HARMONY_CALL)
    assert r.reasoning == "User asks weather in Paris. Call the tool."
    assert r.content is None
    assert [(c.name, args(c)) for c in r.calls] == [("get_weather", {"city": "Paris", "days": 2})]
    final = ANALYSIS + "<|start|>assistant<|channel|>final<|message|>Il fait 21 °C à Paris.<|return|>"
    r = reader("harmony", "harmony").read(final)
    assert (r.reasoning, r.content, r.calls) == (
        "User asks weather in Paris. Call the tool.",
        "Il fait 21 °C à Paris.",
        [],
    )
    # the recipient may come before the channel
    before = (
        '<|start|>assistant to=functions.search<|channel|>commentary json<|message|>{"query": "q"}<|call|>'
    )
    assert [c.name for c in reader("harmony", "harmony").read(ANALYSIS + before).calls] == ["search"]


@pytest.mark.parametrize(
    "call",
    [
        HARMONY_CALL.replace("get_weather", "delete_all"),  # not offered
        HARMONY_CALL.replace("<|call|>", "")[:-6],  # cut off mid-JSON
        HARMONY_CALL.replace('{"city": "Paris", "days": 2}', "[1, 2]"),
        '<|start|>assistant<|channel|>analysis to=browser.search<|message|>{"query": "x"}<|call|>',  # built-in
    ],
)
def test_harmony_malformed_call_is_content_as_written(call: str) -> None:
    r = reader("harmony", "harmony").read(ANALYSIS + call)
    assert r.calls == [] and r.content == call
    assert r.reasoning == "User asks weather in Paris. Call the tool."


def test_harmony_without_tools_keeps_calls_as_text_and_plain_text_as_content() -> None:
    r = ChatReader(reasoning="harmony").read(ANALYSIS + HARMONY_CALL)
    assert r.calls == [] and r.content == HARMONY_CALL
    assert ChatReader(reasoning="harmony").read("no tokens here").content == "no tokens here"


# --------------------------------------------------------------------------------- one reader, streamed

CASES = [
    (
        reader("hermes"),
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    ),
    (reader("hermes"), '<tool_call>{"name": "get_weather", "arguments": {"city": "Par'),
    (reader("hermes"), "1 <tool 2 <tool_cal  "),
    (
        reader("hermes", "think"),
        '<think>\nneed weather\n</think>\n\n<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>',
    ),
    (reader("hermes", "think", inside=True), "need weather</think>\n\nIt is 21 °C."),
    (reader(None, "think"), "<think>\ncut off mid-thought </thi"),
    (reader(None, "think", inside=True), "<think>\nopened twice</think>answer"),  # the template opened it too
    (reader(None, "think"), "  no thinking here  "),
    (
        reader("qwen3_coder", "think"),
        "<think>\nplan\n</think>\n\nOK.\n" + QWEN_CALL + "\n" + QWEN_CALL.replace("3", "5"),
    ),
    (reader("qwen3_coder"), QWEN_CALL[:70]),
    (reader("qwen3_coder", parallel=False), QWEN_CALL + QWEN_CALL.replace("Paris", "Rome")),
    (
        reader("llama3_json"),
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "search", "parameters": {"query": "東京"}}',
    ),
    (reader("llama3_json"), 'Plain answer {"name": "get_weather"}'),
    (reader("llama3_json"), '{"name": "get_weather", "parameters": {"ci'),
    (reader("mistral"), 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
    (
        reader("mistral"),
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]search[ARGS]{"query": "q"}',
    ),
    (reader("mistral"), "[TOOL_CALLS]broken"),
    (reader("harmony", "harmony"), ANALYSIS + HARMONY_CALL),
    (
        reader("harmony", "harmony"),
        ANALYSIS + "<|start|>assistant<|channel|>final<|message|>Done 🙂<|return|>",
    ),
    (reader("harmony", "harmony"), ANALYSIS + HARMONY_CALL.replace("get_weather", "nope")),
    (reader("harmony", "harmony"), "<|channel|>analysis<|message|>cut off in reaso"),
]


def splits(text: str) -> list[list[str]]:
    """Chunkings of ``text``: one character at a time, every cut in two, and random ones."""
    out = [list(text), *[[text[:k], text[k:]] for k in range(1, len(text))]]
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


@pytest.mark.parametrize(("r", "text"), CASES)
def test_the_stream_joins_to_the_whole_response(r: ChatReader, text: str) -> None:
    whole = r.read(text)
    for chunks in splits(text):
        stream = r.stream()
        sent: dict[str, str] = {"reasoning_content": "", "content": ""}
        for c in chunks:
            for d in stream.feed(c):
                assert "tool_calls" not in d  # calls go out once the choice ends
                ((key, value),) = d.items()
                sent[key] += value
        calls = []
        for d in stream.finish():
            if "tool_calls" in d:
                calls += d["tool_calls"]
            else:
                ((key, value),) = d.items()
                sent[key] += value
        assert (sent["reasoning_content"], sent["content"], calls) == (
            whole.reasoning or "",
            whole.content or "",
            whole.calls,
        ), chunks


# ------------------------------------------------------------------------------ through the real server

THINKING_CALL = "<think>\nThe user wants the weather; call the tool.\n</think>\n\n" + QWEN_CALL
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "weather in paris for 3 days?"}]


@pytest.fixture(scope="module")
def thinking_server():
    engine = ScriptedEngine(byte_tokenizer())
    sunk: list = []
    server = serve(engine, sink=sunk.append, api_key=KEY, reasoning_parser="think", tool_parser="qwen3_coder")
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, timeout=30, max_retries=0
    )
    yield engine, client, sunk
    server.stop()


def collect(stream) -> tuple[str, str, list[tuple[str, dict]], str]:
    """``(reasoning, content, calls, finish_reason)`` joined from a chat stream."""
    reasoning, content, calls, finish = "", "", [], None
    for chunk in stream:
        (choice,) = chunk.choices
        reasoning += getattr(choice.delta, "reasoning_content", None) or ""
        content += choice.delta.content or ""
        calls += [(c.function.name, json.loads(c.function.arguments)) for c in choice.delta.tool_calls or []]
        finish = choice.finish_reason or finish
    return reasoning, content, calls, finish


def test_reasoning_and_qwen3_coder_calls_whole_and_streamed(thinking_server) -> None:
    engine, client, _ = thinking_server
    engine.reply = lambda prompt: THINKING_CALL
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
    (choice,) = r.choices
    assert choice.message.reasoning_content == "The user wants the weather; call the tool."
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 3})  # days typed by the schema
    ]
    streamed = collect(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, stream=True))
    assert streamed == (
        "The user wants the weather; call the tool.",
        "",
        [("get_weather", {"city": "Paris", "days": 3})],
        "tool_calls",
    )
    engine.reply = lambda prompt: "<think>\nEasy.\n</think>\n\n21 °C."  # no tools: reasoning still split
    r = client.chat.completions.create(model=MODEL, messages=ASK)
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == ("Easy.", "21 °C.")
    assert collect(client.chat.completions.create(model=MODEL, messages=ASK, stream=True)) == (
        "Easy.", "21 °C.", [], "stop"
    )  # fmt: skip


def test_a_session_keeps_the_sampled_reasoning_tokens(thinking_server) -> None:
    """Reasoning is split in the response only: the trajectory is every sampled token, <think> included."""
    engine, client, sunk = thinking_server
    engine.reply = lambda prompt: THINKING_CALL
    engine.completions.clear()
    url = str(client.base_url).removesuffix("/v1/")
    sid = httpx.post(f"{url}/v1/sessions", headers=AUTH, timeout=30).json()["id"]
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, extra_headers={"X-Session-Id": sid}
    )
    assert r.choices[0].message.reasoning_content == "The user wants the weather; call the tool."
    done = httpx.post(f"{url}/v1/sessions/{sid}/finish", json={"reward": 1.0}, headers=AUTH, timeout=30)
    assert done.status_code == 200, done.text
    (t,) = [x for x in sunk if x.meta["session_id"] == sid]
    (sampled,) = engine.completions
    assert list(t.response_tokens) == sampled.token_ids and set(t.loss_mask) == {1}
    assert engine.tokenizer.decode(sampled.token_ids, skip_special_tokens=True) == THINKING_CALL


def test_mistral_calls_written_in_a_special_token_end_to_end() -> None:
    """``[TOOL_CALLS]`` is a special token of Mistral's tokenizers: decoding keeps it for the parser (and
    still skips the others, EOS here)."""
    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    engine = ScriptedEngine(tok)
    engine.reply = lambda p: 'On it.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    assert len(tok("[TOOL_CALLS]", add_special_tokens=False).input_ids) == 1
    server = serve(engine, api_key=KEY, tool_parser="mistral")
    try:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, timeout=30, max_retries=0
        )
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
        (choice,) = r.choices
        assert choice.message.content == "On it." and choice.finish_reason == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
            ("get_weather", {"city": "Paris"})
        ]
        streamed = collect(
            client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, stream=True)
        )
        assert streamed == ("", "On it.", [("get_weather", {"city": "Paris"})], "tool_calls")
    finally:
        server.stop()


def test_a_template_that_opens_think_starts_the_completion_inside_it() -> None:
    """DeepSeek-R1's template ends the prompt with ``<think>\\n``: the completion has only ``</think>``."""
    template = CHAT_TEMPLATE.replace("assistant: {% endif %}", "assistant: <think>\n{% endif %}")
    engine = ScriptedEngine(byte_tokenizer(template))
    engine.reply = lambda p: "2+2 is 4.\n</think>\n\nFour."
    server = serve(engine, api_key=KEY, reasoning_parser="think")
    try:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, timeout=30, max_retries=0
        )
        message = client.chat.completions.create(model=MODEL, messages=ASK).choices[0].message
        assert engine.prompts[-1].endswith("assistant: <think>\n")
        assert (message.reasoning_content, message.content) == ("2+2 is 4.", "Four.")
        assert collect(client.chat.completions.create(model=MODEL, messages=ASK, stream=True))[:2] == (
            "2+2 is 4.",
            "Four.",
        )
    finally:
        server.stop()


def test_harmony_reads_reasoning_and_calls_together() -> None:
    assert HTTPConfig(reasoning_parser="harmony", tool_parser="harmony").tool_parser == "harmony"
    assert HTTPConfig(reasoning_parser="harmony", tool_parser=None).tool_parser is None
    for fields in ({"reasoning_parser": "harmony"}, {"tool_parser": "harmony"}, {"reasoning_parser": "think", "tool_parser": "harmony"}):  # fmt: skip
        with pytest.raises(ValidationError, match="harmony"):
            HTTPConfig(**fields)


def test_harmony_end_to_end_keeps_its_special_tokens() -> None:
    """gpt-oss's harmony tokens are special tokens: decoding keeps them for the parser."""
    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": list(harmony.SPECIALS)})
    engine = ScriptedEngine(tok)
    engine.reply = lambda p: ANALYSIS + HARMONY_CALL
    server = serve(engine, api_key=KEY, reasoning_parser="harmony", tool_parser="harmony")
    try:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, timeout=30, max_retries=0
        )
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
        (choice,) = r.choices
        assert choice.message.reasoning_content == "User asks weather in Paris. Call the tool."
        assert choice.message.content is None and choice.finish_reason == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
            ("get_weather", {"city": "Paris", "days": 2})
        ]
        streamed = collect(
            client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, stream=True)
        )
        assert streamed == (
            "User asks weather in Paris. Call the tool.", "", [("get_weather", {"city": "Paris", "days": 2})], "tool_calls"
        )  # fmt: skip
    finally:
        server.stop()


PIECES = [
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<function=get_weather>", "</function>",
    "<parameter=days>", "</parameter>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "<|channel|>", "analysis",
    "final", "commentary to=functions.get_weather", "<|message|>", "<|end|>", "<|call|>", "<|start|>assistant",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}', '[{"name": "search", "arguments": {}}]',
    '{"city": "Rome"}', "{", "}", "[", ";", "<", "|", "\n", " ", "  ", "3", "text", "東京", "🙂",
]  # fmt: skip
READERS = [
    reader("hermes", "think"), reader("qwen3_coder", "think", inside=True), reader("llama3_json"),
    reader("mistral"), reader("harmony", "harmony"), reader(None, "think"),
]  # fmt: skip


@pytest.mark.parametrize("r", READERS)
def test_random_text_never_raises_and_streams_as_whole(r: ChatReader) -> None:
    """Text stitched at random from the formats' markers and JSON: reading never raises, and the stream
    joins to the whole for a random chunking."""
    rng = random.Random(0)
    for _ in range(150):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 14)))
        whole = r.read(text)
        stream, sent, calls = r.stream(), {"reasoning_content": "", "content": ""}, []
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 4)))
        for c in [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]:
            for d in stream.feed(c):
                ((key, value),) = d.items()
                sent[key] += value
        for d in stream.finish():
            ((key, value),) = d.items()
            if key == "tool_calls":
                calls += value
            else:
                sent[key] += value
        assert (sent["reasoning_content"], sent["content"], calls) == (
            whole.reasoning or "",
            whole.content or "",
            whole.calls,
        ), text
