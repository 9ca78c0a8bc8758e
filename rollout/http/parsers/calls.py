"""What every tool-call format shares: a parsed call, the check that makes text a call, and JSON read from
the middle of model text within the request limits."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from rollout.http import limits

# The functions a call may name: a mapping name -> JSON schema of its parameters (qwen3_coder converts
# values by it), any collection of names, or None for any name.
Allowed = Mapping[str, Any] | Collection[str] | None


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as OpenAI's ``function.arguments`` carries it


def make_call(name: Any, args: Any, allowed: Allowed) -> ParsedCall | None:
    """The call ``name(args)``, or None when it is none: a name that is not a string among ``allowed``,
    arguments that are not an object (or JSON text of one), text no response could encode."""
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


def json_at(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value starting at ``text[pos]`` (after whitespace) and where it ends; None if there is
    none, or it nests deeper than the request limit (a model can write a thousand brackets too)."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    try:
        value, end = _DECODER.raw_decode(text, pos)
    except (ValueError, RecursionError):
        return None
    if limits.value_depth(value) > limits.MAX_JSON_DEPTH:
        return None
    return value, end


_DECODER = json.JSONDecoder()


def tail_start(text: str, marker: str) -> int:
    """Where the longest tail of ``text`` that could be the beginning of ``marker`` starts (``len(text)``
    if none): a stream holds that tail until the next text tells."""
    for at in range(max(0, len(text) - len(marker) + 1), len(text)):  # the longest tail first
        if text[at] == marker[0] and marker.startswith(text[at:]):
            return at
    return len(text)


Split = Callable[[str, Allowed], tuple[str, list[ParsedCall]]]


def split_blocks(
    text: str, block: re.Pattern[str], call: Callable[[str, Allowed], ParsedCall | None], allowed: Allowed
) -> tuple[str, list[ParsedCall]]:
    """``(text outside the valid calls, calls)`` of a format whose calls are ``block`` matches (group 1 the
    body, read by ``call``); a block whose body is no valid call stays in the text."""
    calls: list[ParsedCall] = []
    outside: list[str] = []
    pos = 0
    for m in block.finditer(text):
        if (parsed := call(m.group(1), allowed)) is None:
            continue
        outside.append(text[pos : m.start()])
        pos = m.end()
        calls.append(parsed)
    outside.append(text[pos:])
    return "".join(outside), calls


@dataclass(frozen=True)
class ToolFormat:
    """One model family's tool-call format.

    ``split(text, allowed) -> (outside, calls)``: the valid calls in order and the text outside them as the
    model wrote it (a malformed call or an unknown function is outside). ``markers``: the texts that open
    a call; a stream holds text back from the first one on. ``at_start``: calls only open the turn
    (Llama 3), so text that begins otherwise is all content. ``specials``: special tokens the format is
    written in, which the decoded text must keep.
    """

    name: str
    markers: tuple[str, ...]
    split: Split
    at_start: bool = False
    specials: tuple[str, ...] = ()

    def parse(self, text: str, allowed: Allowed = None) -> tuple[str | None, list[ParsedCall]]:
        """``(content, calls)``: without a valid call, ``(text, [])``; with calls, the text outside them,
        stripped, or None when nothing but whitespace is left (OpenAI's null content)."""
        outside, calls = self.split(text, allowed)
        if not calls:
            return text, []
        return outside.strip() or None, calls

    def hold_from(self, text: str) -> int:
        """Where a call could begin in ``text`` (``len(text)`` if nowhere yet): content before it may be
        streamed, the rest is held until the completion ends."""
        if self.at_start:
            body = text.lstrip()
            opens = any(body.startswith(m) or m.startswith(body) for m in self.markers)
            return 0 if opens else len(text)
        found = [i for m in self.markers if (i := text.find(m)) >= 0]
        if found:
            return min(found)
        return min(tail_start(text, m) for m in self.markers)
