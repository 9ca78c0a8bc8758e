"""Function calling on the chat API: the Hermes-style prompt for chat templates that cannot render tools
(docs/environments.md §10.8), and the Hermes parser's names as they were (:mod:`rollout.http.parsers`
holds every format).
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from rollout.http.parsers import ParsedCall
from rollout.http.parsers.hermes import END as HERMES_END
from rollout.http.parsers.hermes import FORMAT as HERMES
from rollout.http.parsers.hermes import START as HERMES_START

__all__ = [
    "HERMES_END",
    "HERMES_START",
    "ParsedCall",
    "hermes_messages",
    "hermes_tools_prompt",
    "parse_hermes",
]


def parse_hermes(text: str, allowed: Collection[str] | None = None) -> tuple[str | None, list[ParsedCall]]:
    """``(content, calls)`` of a completion in the Hermes format (:mod:`rollout.http.parsers.hermes`).

    Without a valid call the content is ``text`` unchanged. With calls, it is the text outside them,
    stripped, or None when nothing but whitespace is left (OpenAI's null content).
    """
    return HERMES.parse(text, allowed)


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
