"""The Qwen3-Coder format (Qwen3-Coder, Qwen3.5; vLLM's ``qwen3_coder`` parser)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A block is a call if it holds one ``<function=NAME>…</function>`` naming an allowed function; a last block
the completion ended inside counts if its ``</function>`` came. A parameter's value loses one newline on
each side (the template's markup) and is read by the type the tool's JSON schema gives that parameter:
``integer``, ``number``, ``boolean`` and ``null`` as JSON scalars, ``object`` and ``array`` as JSON; a
value that does not read as its type, an unknown parameter or one without a type stays a string.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from rollout.http import limits
from rollout.http.parsers.calls import Allowed, ParsedCall, ToolFormat, make_call, split_blocks

START = "<tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
# A parameter ends at its closing tag, or where the next one opens (models drop the closing tag).
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


def split(text: str, allowed: Allowed) -> tuple[str, list[ParsedCall]]:
    """``(text outside the valid calls, calls)``."""
    return split_blocks(text, _BLOCK, _call, allowed)


def _call(body: str, allowed: Allowed) -> ParsedCall | None:
    m = _FUNCTION.fullmatch(body)
    if m is None:
        return None
    name = m.group(1).strip()
    schema = allowed.get(name) if isinstance(allowed, Mapping) else None
    properties = (schema or {}).get("properties") or {}
    args = {
        p.group(1).strip(): typed(_unwrap(p.group(2)), properties.get(p.group(1).strip()))
        for p in _PARAMETER.finditer(m.group(2))
    }
    return make_call(name, args, allowed)


def _unwrap(value: str) -> str:
    """The value without the one newline the template puts on each side."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def typed(value: str, schema: Any) -> Any:
    """``value`` read as the type ``schema`` gives (the first that reads, for a list of types); as
    written when there is none or it does not read."""
    kinds = schema.get("type") if isinstance(schema, dict) else None
    for kind in kinds if isinstance(kinds, list) else [kinds]:
        if (read := _read(value.strip(), kind)) is not _NO:
            return read
    return value


_NO = object()
_SCALARS = {"integer": (int,), "number": (int, float), "boolean": (bool,), "null": (type(None),)}


def _read(value: str, kind: Any) -> Any:
    if kind in ("object", "array"):
        try:
            read = limits.loads(value)
        except ValueError:
            return _NO
        return read if isinstance(read, dict if kind == "object" else list) else _NO
    if kind not in _SCALARS:
        return _NO
    if kind == "boolean":
        value = value.lower()  # models write True / False too
    try:
        read = limits.loads(value)
    except ValueError:
        return _NO
    if isinstance(read, bool) != (kind == "boolean"):  # JSON's true is a Python int
        return _NO
    if isinstance(read, float) and not math.isfinite(read):  # NaN and Infinity are no JSON to send on
        return _NO
    return read if isinstance(read, _SCALARS[kind]) else _NO


FORMAT = ToolFormat("qwen3_coder", (START,), split)
