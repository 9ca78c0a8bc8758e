"""Forced tool calls and structured outputs: a request's ``tools``/``tool_choice``/``response_format`` as a
decoding constraint (docs/environments.md §10.8).

:func:`constraint_for` is the one entry point; every route that forces tools or structured output calls it
and puts the result on ``SamplingParams.constraint``. The engine then decodes under it
(:mod:`rollout.engines.constraint`: xgrammar on the hf engine, the engine's own structured outputs on vLLM
and SGLang), so the completion is what the request asked for:

- ``tool_choice: "required"``: one or more calls (exactly one with ``parallel_tool_calls: false``) of the
  offered functions, in the tool parser's format and nothing else; each call's arguments valid against
  that function's ``parameters`` schema;
- ``tool_choice: {"type": "function", "function": {"name": N}}``: exactly one call of ``N``;
- ``response_format: {"type": "json_object"}``: a JSON object; ``{"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}}``: JSON valid against ``schema`` (``strict`` is accepted; the schema is
  always enforced).

Arguments and JSON are written compactly (``{"a": 1, "b": 2}``, no free whitespace), as models trained on
``json.dumps`` output write them. A completion cut by ``max_tokens`` stops where it was cut
(``finish_reason: "length"``): its text is a prefix of a valid one, not valid itself.

Pure functions of the request: no tokenizer, no engine. Grammars are built with xgrammar (its JSON-schema
converter and structural tags), so a schema xgrammar cannot use is refused here, as a 400 naming the field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr
from xgrammar.structural_tag import (
    GrammarFormat,
    JSONSchemaFormat,
    StructuralTag,
    TagFormat,
    TagsWithSeparatorFormat,
)

from rollout.engines.constraint import Constraint, json_schema_constraint
from rollout.http.schemas import APIError


@dataclass(frozen=True)
class CallFormat:
    """How a tool parser's calls are spelled (xgrammar's own, where it has the model): ``tags(name)`` gives
    the text before and after a call's arguments, ``separator`` the text between two calls, ``style`` how
    the arguments are written (``json``: compact JSON; ``qwen_xml``: ``<parameter=k>`` blocks)."""

    tags: Callable[[str], tuple[str, str]]
    separator: str
    style: str = "json"


CALL_FORMATS: dict[str, CallFormat] = {
    "hermes": CallFormat(
        lambda name: (f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": ', "}\n</tool_call>"), "\n"
    ),
    "qwen3_coder": CallFormat(
        lambda name: (f"<tool_call>\n<function={name}>\n", "\n</function>\n</tool_call>"), "\n", "qwen_xml"
    ),
    "llama3_json": CallFormat(lambda name: (f'{{"name": {json.dumps(name)}, "parameters": ', "}"), "; "),
    # Mistral's spelling from its v11 tokenizers (Mistral Small 3.2, Devstral, Magistral): one [TOOL_CALLS]
    # per call, the arguments right after [ARGS]; the parser also reads the older JSON-list spelling.
    "mistral": CallFormat(lambda name: (f"[TOOL_CALLS]{name}[ARGS]", ""), ""),
    # gpt-oss: each call a commentary message to functions.NAME (the prompt ends with <|start|>assistant,
    # so the first header follows directly and later ones start a message of their own).
    "harmony": CallFormat(
        lambda name: (f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>", "<|call|>"),
        "<|start|>assistant",
    ),
}
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: ")  # "[03:55:29] /project/cpp/x.cc:4944: "


def constraint_for(
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: Any,
    response_format: Mapping[str, Any] | None,
    parser: str | None,
    *,
    parallel_tool_calls: bool = True,
) -> Constraint | None:
    """The constraint a request asks for, or None (free text, or ``tool_choice`` ``"auto"``/``"none"``).

    ``tools``: OpenAI chat tool objects (``{"type": "function", "function": {"name", "parameters"}}``);
    ``tool_choice``: ``None``, ``"none"``, ``"auto"``, ``"required"`` or ``{"type": "function", "function":
    {"name": ...}}``; ``parser``: the server's tool parser (``rollout.http.tool_parser``). Raises
    :class:`APIError` 400 naming the field when the request is malformed, a schema is invalid, or the
    parser has no call format to force.
    """
    forced = tool_choice == "required" or isinstance(tool_choice, Mapping)
    rf = _response_format(response_format)
    if forced and rf is not None:
        raise APIError(
            400,
            "response_format: a forced tool_choice and a JSON response_format cannot both constrain the reply",
            param="response_format",
        )
    if forced:
        return _tool_calls(list(tools or []), tool_choice, parser, parallel_tool_calls)
    return rf


def _response_format(rf: Mapping[str, Any] | None) -> Constraint | None:
    if rf is None:
        return None
    if not isinstance(rf, Mapping) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise APIError(
            400,
            'response_format.type: must be "text", "json_object" or "json_schema"',
            param="response_format.type",
        )
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return json_schema_constraint({"type": "object"})
    js = rf.get("json_schema")
    if not isinstance(js, Mapping):
        raise APIError(
            400,
            'response_format.json_schema: an object {"name", "schema", "strict"} is required',
            param="response_format.json_schema",
        )
    if "name" in js and not isinstance(js["name"], str):
        raise APIError(
            400,
            "response_format.json_schema.name: must be a string",
            param="response_format.json_schema.name",
        )
    schema = js.get("schema", {})  # OpenAI: no schema is any JSON
    if not isinstance(schema, (Mapping, bool)):
        raise APIError(
            400,
            "response_format.json_schema.schema: must be a JSON schema (an object)",
            param="response_format.json_schema.schema",
        )
    _check_schema(schema, "response_format.json_schema.schema")
    return json_schema_constraint(schema)  # type: ignore[arg-type]


def _tool_calls(
    tools: list[Mapping[str, Any]], tool_choice: Any, parser: str | None, parallel: bool
) -> Constraint:
    if parser not in CALL_FORMATS:
        raise APIError(
            400,
            f"tool_choice: {tool_choice!r} needs a tool-call format to force, and tool_parser {parser!r} has "
            f"none (forced calls support: {', '.join(CALL_FORMATS)})",
            param="tool_choice",
        )
    call_format = CALL_FORMATS[parser]
    named = tool_choice["function"]["name"] if isinstance(tool_choice, Mapping) else None
    formats = []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        if named is not None and fn["name"] != named:
            continue
        schema = fn.get("parameters") or {"type": "object"}  # no parameters: any object
        where = f"tools[{i}].function.parameters"
        _check_schema(schema, where)
        begin, end = call_format.tags(fn["name"])
        formats.append(TagFormat(begin=begin, content=_arguments(schema, call_format.style), end=end))
    if not formats:
        raise APIError(400, f"tool_choice: no tool matches {tool_choice!r}", param="tool_choice")
    tag = StructuralTag(
        format=TagsWithSeparatorFormat(
            tags=formats,
            separator=call_format.separator,
            at_least_one=True,
            stop_after_first=named is not None or not parallel,
        )
    )
    return Constraint("structural_tag", tag.model_dump_json())


def _arguments(schema: Any, style: str) -> GrammarFormat | JSONSchemaFormat:
    """A call's arguments: compact JSON (xgrammar's converter without free whitespace), or the schema in
    xgrammar's ``qwen_xml`` style."""
    if style == "json":
        return GrammarFormat(
            grammar=str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
        )
    return JSONSchemaFormat(json_schema=schema, style=style)


def _check_schema(schema: Any, where: str) -> None:
    """400 naming ``where`` when xgrammar cannot turn ``schema`` into a grammar (what every engine needs)."""
    try:
        json_schema_constraint(schema).grammar()
    except ValueError as e:
        reason = _XGRAMMAR_PREFIX.sub("", str(e)).strip() or "not a usable JSON schema"
        raise APIError(400, f"{where}: {reason}", param=where) from None
