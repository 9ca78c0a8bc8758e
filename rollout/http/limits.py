"""Depth and size limits of the JSON a request carries (docs/design.md §6.4), in one place.

Python's JSON decoder, pydantic and the chat template's ``tojson`` recurse once per nesting level, so a
value nested a few thousand levels deep would exhaust the stack (a ``RecursionError``, a 500). Every JSON
value the server reads is checked first, without recursion: the request body once parsed (tool schemas,
``response_format``, ``logit_bias``, any field, known or not) by :func:`value_depth`, and JSON text inside
it (an assistant's ``tool_calls[].function.arguments``) by :func:`loads` before it is parsed. Over a limit
is a 400 that names it.
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

MAX_JSON_DEPTH = 64  # nesting levels of any JSON value in a request (objects and arrays)
MAX_JSON_TEXT_CHARS = 1 << 20  # characters of JSON text carried inside a request (tool-call arguments)

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


class JSONLimitError(ValueError):
    """A JSON value over :data:`MAX_JSON_DEPTH` or :data:`MAX_JSON_TEXT_CHARS`; the message names the limit."""


def too_deep(depth: int) -> str:
    return f"nests {depth} levels deep; the limit is {MAX_JSON_DEPTH} (max_json_depth)"


def value_depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0, ``[]`` and ``{}`` are 1), without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            v = list(v.values())
        elif not isinstance(v, list):
            continue
        deepest = max(deepest, depth)
        stack.extend((x, depth + 1) for x in v if isinstance(x, (dict, list)))
    return deepest


def text_depth(text: str) -> int:
    """Nesting depth of JSON text, read from its brackets outside strings, without parsing it."""
    brackets = _BRACKET.findall(_STRING.sub("", text))
    return max(accumulate(_STEP[b] for b in brackets), default=0)


def loads(text: str) -> Any:
    """``json.loads(text)`` within the limits: :class:`JSONLimitError` over them, ``ValueError`` for text
    that is not JSON."""
    if len(text) > MAX_JSON_TEXT_CHARS:
        raise JSONLimitError(
            f"holds {len(text)} characters of JSON; the limit is {MAX_JSON_TEXT_CHARS} (max_json_text_chars)"
        )
    if (depth := text_depth(text)) > MAX_JSON_DEPTH:
        raise JSONLimitError(too_deep(depth))
    return json.loads(text)
