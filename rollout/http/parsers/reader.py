"""One chat request's completions read into reasoning, content and tool calls, whole or as a stream.

A stream is read by parsing the text so far again at each step and sending what grew. Every format's
reading of a prefix (text that could still become a marker left out, content held from where a call could
begin, trailing whitespace held) is a prefix of its reading of the whole, so the deltas joined equal the
whole response.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal

from rollout.http.parsers import harmony, think
from rollout.http.parsers.calls import Allowed, ParsedCall, ToolFormat

log = logging.getLogger(__name__)

Reasoning = Literal["think", "harmony"]


@dataclass(frozen=True)
class Reading:
    """A whole completion read: None for a part it lacks."""

    reasoning: str | None
    content: str | None
    calls: list[ParsedCall]


@dataclass(frozen=True)
class ChatReader:
    """How one chat request's completions are read.

    ``reasoning``: the reasoning format, or None to leave reasoning in the content. ``tools``: the
    tool-call format, or None to read no calls (no tools offered, ``tool_choice: "none"``). ``allowed``:
    the functions a call may name (name -> parameters schema). ``parallel``: False keeps the first call.
    ``inside``: the prompt opened a ``<think>`` block (:func:`think.opened`).
    """

    reasoning: Reasoning | None = None
    tools: ToolFormat | None = None
    allowed: Allowed = None
    parallel: bool = True
    inside: bool = False

    def read(self, text: str) -> Reading:
        """The whole completion's reasoning, content and calls. Without calls or reasoning the content
        is ``text`` as written; with calls it is the text outside them, right-stripped (None if empty)."""
        if self.reasoning == "harmony":
            r = harmony.read(text, self.allowed, calls=self.tools is not None)
            return Reading(r.reasoning, r.content, self._some(r.calls))
        reasoning, rest = think.split(text, inside=self.inside) if self.reasoning else (None, text)
        calls: list[ParsedCall] = []
        content: str | None = rest
        if self.tools is not None:
            outside, calls = self.tools.split(rest, self.allowed)
            if calls:
                content = outside.rstrip()
        if reasoning is not None or calls:
            content = content or None
        return Reading(
            reasoning.strip() or None if reasoning is not None else None, content, self._some(calls)
        )

    def prefix(self, text: str) -> tuple[str, str]:
        """``(reasoning, content)`` of a stream so far that the whole completion will begin with."""
        if self.reasoning == "harmony":
            r = harmony.read(text, self.allowed, calls=self.tools is not None, final=False)
            return r.reasoning or "", r.content or ""
        reasoning, rest = think.split(text, inside=self.inside, final=False) if self.reasoning else ("", text)
        if self.tools is not None:
            rest = rest[: self.tools.hold_from(rest)]
        return (reasoning or "").strip(), rest.rstrip()

    def stream(self) -> ChatStream:
        return ChatStream(self)

    def _some(self, calls: list[ParsedCall]) -> list[ParsedCall]:
        return calls if self.parallel else calls[:1]


@dataclass
class ChatStream:
    """One streamed choice: ``feed(text)`` the decoded text as it comes, ``finish()`` when it ends; each
    returns deltas, ``{"reasoning_content": str}``, ``{"content": str}`` or ``{"tool_calls": [ParsedCall]}``."""

    reader: ChatReader
    text: str = ""
    sent: dict[str, str] = field(default_factory=lambda: {"reasoning_content": "", "content": ""})

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.text += text
        return self._grown(*self.reader.prefix(self.text))

    def finish(self) -> list[dict[str, Any]]:
        whole = self.reader.read(self.text)
        out = self._grown(whole.reasoning or "", whole.content or "")
        return [*out, {"tool_calls": whole.calls}] if whole.calls else out

    def _grown(self, reasoning: str, content: str) -> list[dict[str, Any]]:
        out = []
        for key, now in (("reasoning_content", reasoning), ("content", content)):
            before = self.sent[key]
            if len(now) <= len(before):
                continue
            if not now.startswith(before):  # a format's prefix reading broke its promise: say so
                log.warning("streamed %s no longer begins with what was sent", key)
            out.append({key: now[len(before) :]})
            self.sent[key] = now
        return out
