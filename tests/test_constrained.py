"""Constrained decoding: forced tool calls and ``response_format`` on the chat API, decoded under an xgrammar
mask by the hf engine (rollout/engines/constraint.py, rollout/http/constraints.py).

A tiny random byte-level model (one token per byte) writes whatever its weights say; only the mask makes its
output a valid call or valid JSON, so every assertion here fails without the constraint.
"""

from __future__ import annotations

import json
import threading

import jsonschema
import openai
import pytest

from rollout.engines.base import SamplingParams
from rollout.engines.constraint import json_schema_constraint
from rollout.engines.hf import HFEngine
from rollout.engines.sglang import generate_body as sglang_body
from rollout.engines.vllm import generate_body as vllm_body
from rollout.http.app import create_app
from rollout.http.constraints import constraint_for
from rollout.http.schemas import APIError
from rollout.http.serve import HTTPServer
from rollout.http.tools import parse_hermes
from rollout.metrics import ServerMetrics
from tandem.config import HTTPConfig

MODEL = "tiny"
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": DIGIT, "b": DIGIT},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "neg",
            "parameters": {
                "type": "object",
                "properties": {"x": {"type": "boolean"}},
                "required": ["x"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ANSWER = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": DIGIT, "c": {"enum": ["red", "blue"]}},
    "required": ["ok", "n", "c"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "add 2 and 3"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> HFEngine:
    from toy.tiny import make_tiny

    path = make_tiny(tmp_path_factory.mktemp("tiny-json"), tokenizer="bytes", hidden=32, layers=1)["actor"]
    return HFEngine(str(path), gather_s=0.05)


@pytest.fixture(scope="module")
def client(engine: HFEngine):
    http = HTTPConfig(tool_parser="hermes")
    app = create_app(engine, engine.tokenizer, model_name=MODEL, http=http, metrics=ServerMetrics(engine))
    server = HTTPServer(app, "127.0.0.1", 0).start()
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", timeout=60, max_retries=0)
    server.stop()


def _check_calls(choice, names: set[str], one: bool) -> None:
    assert choice.finish_reason == "tool_calls", choice.message.content
    calls = choice.message.tool_calls
    assert calls and (len(calls) == 1 or not one)
    assert choice.message.content is None  # nothing but calls
    for call in calls:
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", [0, 1])
def test_required_tool_choice_always_calls_an_offered_function_validly(client, seed: int) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        n=4, temperature=1.0, seed=seed, max_tokens=80,
    )  # fmt: skip
    for choice in out.choices:
        _check_calls(choice, {"add", "neg"}, one=True)


def test_required_with_parallel_calls_is_calls_and_nothing_else(engine: HFEngine) -> None:
    """Parallel calls: one or more, separated by a newline; every row that ended (not cut by max_tokens)
    is exactly its calls, each valid."""
    c = constraint_for(TOOLS, "required", None, "hermes")
    (rows,) = engine.generate(
        [_prompt(engine)], SamplingParams(n=4, max_new_tokens=250, seed=3, constraint=c)
    )
    ended = [r for r in rows if r.finish_reason == "stop"]
    assert ended
    for r in ended:
        text = engine.tokenizer.decode(r.token_ids, skip_special_tokens=True)
        content, calls = parse_hermes(text, SCHEMAS)
        assert content is None and len(calls) == text.count("<tool_call>") >= 1, text
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_stop_strings_do_not_cut_a_forced_call(client) -> None:
    """A stop string written for the answer (the calculator agent's "\n") would end a hermes call after
    ``<tool_call>\n``: the grammar ends a constrained reply, so it is not applied there."""
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        n=3, temperature=1.0, seed=7, max_tokens=80, stop=["\n", "}"],
    )  # fmt: skip
    for choice in out.choices:
        _check_calls(choice, {"add", "neg"}, one=True)


def test_a_named_tool_choice_is_exactly_one_call_of_it(client) -> None:
    for seed, temperature in [(2, 1.0), (3, 1.0), (4, 0.0)]:
        out = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
            n=3, temperature=temperature, seed=seed, max_tokens=80,
        )  # fmt: skip
        for choice in out.choices:
            _check_calls(choice, {"add"}, one=True)


def test_response_format_json_schema_is_valid_json_of_the_schema(client) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    for seed in (5, 6):
        out = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, response_format=rf, n=4, temperature=1.0, seed=seed, max_tokens=60
        )
        for choice in out.choices:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), ANSWER)


def test_response_format_json_object_on_completions(client) -> None:
    out = client.completions.create(
        model=MODEL, prompt="json: ", max_tokens=60, n=4, temperature=1.0, seed=7,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}},
    )  # fmt: skip
    for choice in out.choices:
        jsonschema.validate(json.loads(choice.text), ANSWER)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nope"}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": 3}}}],
          "tool_choice": "required"}, "tools[0].function.parameters"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format"),
    ],
)  # fmt: skip
def test_a_bad_schema_is_a_400_naming_the_field(client, body: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, extra_body=body)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param, e.value.body
    assert e.value.body["message"].startswith(param)


def test_a_call_cut_by_max_tokens_is_what_it_is(client) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=5, seed=0
    )
    choice = out.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content == "<tool"  # five bytes of the forced opening tag


def _prompt(engine: HFEngine) -> list[int]:
    return engine.tokenizer("user: hi\nassistant: ").input_ids


def test_forced_tokens_carry_the_masked_logprob(engine: HFEngine) -> None:
    """Every token of the forced prefix is the only one allowed: its logprob under the masked distribution
    is 0 (under the model's unmasked one it would be about -log(vocab))."""
    c = constraint_for(TOOLS, {"type": "function", "function": {"name": "neg"}}, None, "hermes")
    ((out,),) = engine.generate([_prompt(engine)], SamplingParams(max_new_tokens=80, seed=0, constraint=c))
    prefix = len(engine.tokenizer('<tool_call>\n{"name": "neg", "arguments": {"x": ').input_ids)
    assert engine.tokenizer.decode(out.token_ids[:prefix]).endswith('"x": ')
    assert out.logprobs[:prefix] == [0.0] * prefix
    free = out.logprobs[prefix]  # true or false: two of the 260 tokens
    assert -5.0 < free < 0.0


def test_an_unconstrained_row_batched_with_a_constrained_one_is_unaffected(engine: HFEngine) -> None:
    plain = SamplingParams(max_new_tokens=30, temperature=1.0, seed=11)
    (alone,) = engine.generate([_prompt(engine)], plain)
    constrained = SamplingParams(
        max_new_tokens=60, temperature=1.0, seed=12, constraint=json_schema_constraint(ANSWER)
    )
    batched: dict[str, object] = {}
    widths: list[int] = []

    def run(name: str, sampling: SamplingParams) -> None:
        hook = (lambda: widths.append(engine.stats().requests_running or 0)) if name == "plain" else None
        batched[name] = engine.generate([_prompt(engine)], sampling, between_steps=hook)

    threads = [threading.Thread(target=run, args=a) for a in (("plain", plain), ("json", constrained))]
    engine.gather_s = 1.0  # an idle engine waits this long for other calls before its first step
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        engine.gather_s = 0.05
    assert max(widths) == 2  # the two calls did share decode steps
    (together,) = batched["plain"]  # type: ignore[misc]
    assert together[0].token_ids == alone[0].token_ids
    # A batch of two rows sums in another order than one alone: the same values to float32 rounding.
    assert together[0].logprobs == pytest.approx(alone[0].logprobs, abs=1e-5)
    (json_out,) = batched["json"]  # type: ignore[misc]
    jsonschema.validate(
        json.loads(engine.tokenizer.decode(json_out[0].token_ids, skip_special_tokens=True)), ANSWER
    )


def test_constraint_for_unconstrained_requests_is_none() -> None:
    assert constraint_for(TOOLS, "auto", None, "hermes") is None
    assert constraint_for(TOOLS, "none", {"type": "text"}, "hermes") is None
    assert constraint_for(None, None, None, None) is None
    with pytest.raises(APIError, match="tool_parser None"):
        constraint_for(TOOLS, "required", None, None)


def test_vllm_and_sglang_receive_the_constraint_as_their_structured_outputs() -> None:
    """SGLang cannot run here: its payload is checked as data (field names: tests/test_engines_contract.py)."""
    schema = json_schema_constraint(ANSWER)
    tag = constraint_for(TOOLS, "required", None, "hermes")
    assert tag is not None
    for c, vllm_so, sglang_key in [
        (schema, {"json": schema.spec, "disable_any_whitespace": True}, "json_schema"),
        (tag, {"structural_tag": tag.spec}, "structural_tag"),
    ]:
        sampling = SamplingParams(n=2, constraint=c)
        assert vllm_body([1, 2], sampling, 0).sampling_params.structured_outputs == vllm_so
        for params in sglang_body([1, 2], sampling, 0).sampling_params:
            assert params[sglang_key] == c.spec
    plain = sglang_body([1], SamplingParams(), 0).sampling_params[0]
    assert "json_schema" not in plain and "structural_tag" not in plain
    assert vllm_body([1], SamplingParams(), 0).sampling_params.structured_outputs is None


def test_the_agents_front_never_batches_a_constrained_call_with_a_free_one(engine: HFEngine) -> None:
    """The gathering path of rollout/agents/batching.py (told the engine does not batch by itself): calls
    that differ only in their constraint are two engine calls, each decoded under its own."""
    from concurrent.futures import ThreadPoolExecutor

    from rollout.agents.batching import BatchingEngine

    engine.continuous_batching = False
    front = BatchingEngine(engine, gather_s=0.2)
    free = SamplingParams(max_new_tokens=40, temperature=0.0)
    constrained = SamplingParams(
        max_new_tokens=40, temperature=0.0, constraint=json_schema_constraint(ANSWER)
    )
    try:
        with ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(lambda s: front.generate([_prompt(engine)], s), [free, constrained]))
    finally:
        front.close()
        del engine.continuous_batching  # the class's again
    assert (front.batches, front.calls) == (2, 2)
    text = engine.tokenizer.decode(outs[1][0][0].token_ids, skip_special_tokens=True)
    jsonschema.validate(json.loads(text), ANSWER)
    (alone,) = engine.generate([_prompt(engine)], free)
    assert outs[0][0][0].token_ids == alone[0].token_ids  # greedy: the free call decoded unconstrained


@pytest.mark.parametrize("parser", ["hermes", "qwen3_coder", "llama3_json", "mistral", "harmony"])
def test_forced_calls_are_written_in_the_tool_parsers_format(engine: HFEngine, parser: str) -> None:
    """Each format that can be forced: every row is calls only, read back whole by that parser, each valid."""
    from rollout.http.parsers import TOOL_FORMATS

    c = constraint_for(TOOLS, "required", None, parser)
    (rows,) = engine.generate(
        [_prompt(engine)], SamplingParams(n=8, max_new_tokens=250, seed=5, constraint=c)
    )
    counts = []
    for r in rows:
        if r.finish_reason != "stop":
            continue  # cut by max_tokens
        text = engine.tokenizer.decode(r.token_ids, skip_special_tokens=True)
        content, calls = TOOL_FORMATS[parser].parse(text, SCHEMAS)
        assert calls and not (content or "").strip(), text
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        counts.append(len(calls))
    assert counts and max(counts) >= 2, counts  # parallel calls too: the separator is the parser's
