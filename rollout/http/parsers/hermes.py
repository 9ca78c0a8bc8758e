"""The Hermes format (Hermes 2 Pro, Qwen 2.5 and 3; vLLM's and SGLang's ``hermes`` parser).

Each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, several in a row for parallel
calls. A block is a call only if its body is a JSON object whose ``name`` is an allowed function and whose
``arguments`` is an object (or JSON text of one). A last block the completion ended inside (no closing
tag) counts if its JSON is complete.
"""

from __future__ import annotations

import re

from rollout.http import limits
from rollout.http.parsers.calls import Allowed, ParsedCall, ToolFormat, make_call, split_blocks

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


def split(text: str, allowed: Allowed) -> tuple[str, list[ParsedCall]]:
    """``(text outside the valid calls, calls)``."""
    return split_blocks(text, _BLOCK, _call, allowed)


def _call(body: str, allowed: Allowed) -> ParsedCall | None:
    try:  # within the depth limit: a model can write a thousand brackets too
        obj = limits.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    return make_call(obj.get("name"), obj.get("arguments", {}), allowed)


FORMAT = ToolFormat("hermes", (START,), split)
