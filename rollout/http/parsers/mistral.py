"""The Mistral format (vLLM's ``mistral`` parser), in both of its spellings:

- ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]``: a JSON list of calls (Mistral 7B v0.3,
  Mixtral, Nemo; tokenizers up to v7);
- ``[TOOL_CALLS]f[ARGS]{...}``, once per call (tokenizers from v11: Mistral Small 3.2, Devstral, Magistral),
  with an optional ``[CALL_ID]id`` after the name.

``[TOOL_CALLS]`` and ``[ARGS]`` are special tokens; the decoded text keeps them. Content is the text before
the first ``[TOOL_CALLS]``. A group that is not all valid calls stays content as written.
"""

from __future__ import annotations

import re

from rollout.http.parsers.calls import Allowed, ParsedCall, ToolFormat, json_at, make_call

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAMED = re.compile(r"\s*([^\[\]{}\s]+)\s*(?:\[CALL_ID\]\s*\S+?\s*)?\[ARGS\]")


def split(text: str, allowed: Allowed) -> tuple[str, list[ParsedCall]]:
    """``(text outside the valid calls, calls)``."""
    pieces = text.split(TOOL_CALLS)
    outside, calls = [pieces[0]], []
    for piece in pieces[1:]:
        group, rest = _group(piece, allowed)
        if group is None:
            outside.append(TOOL_CALLS + piece)
            continue
        calls += group
        outside.append(rest)
    return "".join(outside), calls


def _group(piece: str, allowed: Allowed) -> tuple[list[ParsedCall] | None, str]:
    """The calls one ``[TOOL_CALLS]`` opens and the text after them; None if they are not all valid."""
    if m := _NAMED.match(piece):
        found = json_at(piece, m.end())
        if found is None or (call := make_call(m.group(1), found[0], allowed)) is None:
            return None, piece
        return [call], piece[found[1] :]
    found = json_at(piece, 0)
    if found is None:
        return None, piece
    value, end = found
    items = value if isinstance(value, list) else [value]
    group = [
        make_call(x.get("name"), x.get("arguments", {}), allowed) if isinstance(x, dict) else None
        for x in items
    ]
    if not group or None in group:
        return None, piece
    return group, piece[end:]  # type: ignore[return-value]


FORMAT = ToolFormat("mistral", (TOOL_CALLS,), split, specials=(TOOL_CALLS, ARGS, CALL_ID))
