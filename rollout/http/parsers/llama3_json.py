"""The Llama 3.x JSON format (Llama 3.1-3.3 with JSON tool calls; vLLM's ``llama3_json`` parser).

The turn is the calls and nothing before them: ``{"name": "f", "parameters": {...}}`` (``arguments`` is
read too), optionally after ``<|python_tag|>``, several separated by ``;``. Text after the last call is
content. A turn that begins any other way, or whose calls are not all valid, is content as written.
"""

from __future__ import annotations

from rollout.http.parsers.calls import Allowed, ParsedCall, ToolFormat, json_at, make_call

PYTHON_TAG = "<|python_tag|>"


def split(text: str, allowed: Allowed) -> tuple[str, list[ParsedCall]]:
    """``(text outside the calls, calls)``; all or nothing: one invalid call leaves every call as text."""
    body = text.lstrip()
    pos = len(text) - len(body)
    if body.startswith(PYTHON_TAG):
        pos += len(PYTHON_TAG)
    calls: list[ParsedCall] = []
    while (found := json_at(text, pos)) is not None:
        obj, end = found
        args = obj.get("parameters", obj.get("arguments", {})) if isinstance(obj, dict) else None
        if (call := make_call(obj.get("name") if isinstance(obj, dict) else None, args, allowed)) is None:
            return text, []
        calls.append(call)
        pos = end
        rest = text[pos:].lstrip()
        if not rest.startswith(";"):
            break
        pos = len(text) - len(rest) + 1
    return (text[pos:], calls) if calls else (text, [])


FORMAT = ToolFormat("llama3_json", (PYTHON_TAG, "{"), split, at_start=True, specials=(PYTHON_TAG,))
