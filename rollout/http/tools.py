"""Function calling on the chat API: tool calls parsed out of the model's text, and the Hermes-style prompt
for chat templates that cannot render tools (docs/environments.md §10.8).

Pure functions: no tokenizer, no engine. The parser (``rollout.http.tool_parser``) turns a completion's text
into ``(content, calls)``; the HTTP response carries the calls, while the tokens the engine sampled (and an
agent session records) are untouched.

The Hermes format (Hermes 2 Pro, Qwen 2.5 and 3, as vLLM's and SGLang's ``hermes`` parsers read it): each
call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, several in a row for parallel calls.
A block is a call only if its body is a JSON object whose ``name`` is a string among the allowed functions
and whose ``arguments`` is an object (or JSON text of one); anything else (malformed JSON, an unknown
function) stays in the content, as the model wrote it. A last block the completion ended inside (no
closing tag) counts if its JSON is complete.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from rollout.http import limits


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as OpenAI's ``function.arguments`` carries it


@dataclass(frozen=True)
class ToolParser:
    """``start``: the text that opens a call (a stream holds text back from it on); ``parse``:
    ``(text, allowed names or None for any) -> (content, calls)``."""

    start: str
    parse: Callable[[str, Collection[str] | None], tuple[str | None, list[ParsedCall]]]


HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


def parse_hermes(text: str, allowed: Collection[str] | None = None) -> tuple[str | None, list[ParsedCall]]:
    """``(content, calls)`` of a completion in the Hermes format.

    Without a valid call the content is ``text`` unchanged. With calls, it is the text outside them,
    stripped, or None when nothing but whitespace is left (OpenAI's null content).
    """
    calls: list[ParsedCall] = []
    outside: list[str] = []
    pos = 0
    for m in _HERMES_BLOCK.finditer(text):
        call = _call(m.group(1), allowed)
        if call is None:
            continue
        outside.append(text[pos : m.start()])
        pos = m.end()
        calls.append(call)
    if not calls:
        return text, []
    outside.append(text[pos:])
    return "".join(outside).strip() or None, calls


def _call(body: str, allowed: Collection[str] | None) -> ParsedCall | None:
    try:  # within the depth limit: a model can write a thousand brackets too
        obj = limits.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    name, args = obj.get("name"), obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = limits.loads(args)
        except ValueError:
            return None
    if not isinstance(name, str) or not isinstance(args, dict):
        return None
    if allowed is not None and name not in allowed:
        return None
    arguments = json.dumps(args, ensure_ascii=False)
    try:  # JSON can spell a lone surrogate ("\ud800"), which no response could encode
        name.encode()
        arguments.encode()
    except UnicodeEncodeError:
        return None
    return ParsedCall(name, arguments)


PARSERS: dict[str, ToolParser] = {"hermes": ToolParser(HERMES_START, parse_hermes)}


# ----------------------------------------------------------------------------- Hermes-style rendering


def hermes_tools_prompt(tools: list[dict[str, Any]]) -> str:
    """The system-prompt block that offers ``tools`` (OpenAI tool objects) and asks for Hermes calls."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def hermes_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """``messages`` (template form: ``tool_calls`` arguments as objects) rewritten as plain role/content
    messages in the Hermes style, for a chat template that renders neither tools nor tool calls.

    The tools block joins the first system message (or becomes one); an assistant's calls follow its
    content as ``<tool_call>`` blocks; a tool result is wrapped in ``<tool_response>``.
    """
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            blocks = [
                f"{HERMES_START}\n"
                + json.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                    ensure_ascii=False,
                )
                + f"\n{HERMES_END}"
                for c in m["tool_calls"]
            ]
            out.append({"role": "assistant", "content": "\n".join(filter(None, [m["content"], *blocks]))})
        elif m["role"] == "tool":
            out.append({"role": "tool", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools:
        block = hermes_tools_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out
