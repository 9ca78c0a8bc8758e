"""The harmony format of gpt-oss (vLLM's ``openai`` tool parser and ``openai_gptoss`` reasoning parser),
read from the completion's text with its special tokens kept.

A completion is a run of messages; the prompt ends with ``<|start|>assistant``, so the first message's
header follows directly::

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>

A header names the channel (``<|channel|>NAME``) and may name a recipient (``to=NAME``, before or after
the channel). ``analysis`` messages are reasoning; ``final`` messages and ``commentary`` without a
recipient (a preamble to calls) are content; a message to ``functions.NAME`` whose body is a JSON object
is a call of NAME. Any other message (a call to a function not allowed, a body that is no JSON object, a
built-in tool such as ``browser.search``) stays in the content as written, tokens included. Text with no
``<|message|>`` at all is content as it is.

The ``openai-harmony`` package reads the same format from token ids; it is not a dependency here, and its
upstream release fetches its vocabulary over the network on first use.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rollout.http.parsers.calls import Allowed, ParsedCall, json_at, make_call, tail_start

SPECIALS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
START = "<|start|>"  # a message that skips its end token ends where the next one starts
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
FUNCTIONS = "functions."


@dataclass(frozen=True)
class Message:
    header: str  # from the message's start to <|message|>, tokens included
    body: str
    raw: str  # the message as written

    @property
    def channel(self) -> str | None:
        return m.group(1) if (m := _CHANNEL.search(self.header)) else None

    @property
    def recipient(self) -> str | None:
        return m.group(1) if (m := _RECIPIENT.search(self.header)) else None


def messages(text: str) -> tuple[list[Message], str]:
    """The messages of ``text`` (the last one possibly cut off) and the text after them that has not
    reached its ``<|message|>``."""
    out: list[Message] = []
    pos = 0
    while (at := text.find(MESSAGE, pos)) >= 0:
        body_at = at + len(MESSAGE)
        stop, end = _stop(text, body_at)
        out.append(Message(text[pos:at], text[body_at:stop], text[pos:end]))
        pos = end
    return out, text[pos:]


def _stop(text: str, start: int) -> tuple[int, int]:
    """Where the body from ``start`` ends, and where its message ends (after its end token)."""
    at = text.find("<|", start)
    while at >= 0:
        if end := next((t for t in ENDS if text.startswith(t, at)), None):
            return at, at + len(end)
        if text.startswith(START, at):
            return at, at
        at = text.find("<|", at + 2)
    return len(text), len(text)


@dataclass(frozen=True)
class Reading:
    reasoning: str | None
    content: str | None
    calls: list[ParsedCall]


def read(text: str, allowed: Allowed, *, calls: bool, final: bool = True) -> Reading:
    """The reasoning, content and calls of a completion (``calls``: read calls at all). Not ``final``: a
    prefix of a stream, whose content stops where a message with a recipient begins (it may turn out a
    call) and which leaves out a tail that could be the beginning of a special token."""
    if not final:
        text = text[: min(tail_start(text, s) for s in SPECIALS)]
    found, rest = messages(text)
    if final and not found:
        return Reading(None, text or None, [])
    reasoning: list[str] = []
    content: list[str] = []
    parsed: list[ParsedCall] = []
    held = False  # content from a message with a recipient on waits for the end
    for m in found:
        if m.channel == "analysis" and m.recipient is None:
            reasoning.append(m.body)
        elif not final and (held or m.recipient is not None):
            held = True
            continue
        elif m.recipient is None:
            content.append(m.body)
        elif calls and (call := _call(m, allowed)) is not None:
            parsed.append(call)
        else:
            held = True
            content.append(m.raw)
        held = held or m.recipient is not None
    if final and rest:
        content.append(rest)
    return Reading("\n".join(reasoning) if reasoning else None, "\n".join(content) or None, parsed)


def _call(m: Message, allowed: Allowed) -> ParsedCall | None:
    recipient = m.recipient or ""
    if not recipient.startswith(FUNCTIONS):
        return None
    found = json_at(m.body, 0)
    if found is None or m.body[found[1] :].strip():
        return None
    return make_call(recipient[len(FUNCTIONS) :], found[0], allowed)


def split(text: str, allowed: Allowed) -> tuple[str, list[ParsedCall]]:
    """``(content, calls)`` as a tool format: the reasoning is left out (``reasoning_parser: harmony``
    returns it)."""
    r = read(text, allowed, calls=True)
    return r.content or "", r.calls
