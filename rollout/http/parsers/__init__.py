"""Reasoning and tool calls read out of a chat completion's text (docs/environments.md §10.8).

Pure functions of text: no tokenizer, no engine. They shape the HTTP response only; the tokens the engine
sampled (and an agent session records, and a run trains on) are untouched.

Formats (``rollout.http.reasoning_parser`` and ``rollout.http.tool_parser``):

- reasoning: ``think`` (:mod:`.think`, ``<think>…</think>``), ``harmony`` (:mod:`.harmony`, gpt-oss's
  ``analysis`` channel);
- tool calls: ``hermes`` (:mod:`.hermes`), ``qwen3_coder`` (:mod:`.qwen3_coder`), ``llama3_json``
  (:mod:`.llama3_json`), ``mistral`` (:mod:`.mistral`), ``harmony`` (:mod:`.harmony`).

Interface:

- :func:`parse_reasoning` ``(text, inside=False) -> (reasoning, content)``: ``<think>`` reasoning of a
  whole completion;
- ``TOOL_FORMATS[name]`` (:class:`ToolFormat`): ``.parse(text, allowed) -> (content, calls)``, the calls
  of a whole completion (``allowed``: names, or a mapping name -> parameters schema, or None for any);
- :class:`ChatReader` (reasoning format, tool format, allowed functions, ``parallel``, ``inside``): a
  request's reading. ``.read(text) -> Reading(reasoning, content, calls)`` for a whole completion;
  ``.stream()`` gives a :class:`ChatStream` per choice, whose ``feed(text) -> deltas`` and
  ``finish() -> deltas`` return ``{"reasoning_content": …}``, ``{"content": …}`` and (at the end)
  ``{"tool_calls": [ParsedCall, …]}``; the deltas joined equal ``.read`` of the whole text.
- :func:`kept_specials`: the special tokens a configuration's formats are written in, which the decoded
  text must keep.

Malformed output (bad JSON, an unknown function, a call cut off before it is complete) stays content as
the model wrote it; no input raises.
"""

from __future__ import annotations

from rollout.http.parsers import harmony, hermes, llama3_json, mistral, qwen3_coder
from rollout.http.parsers.calls import Allowed, ParsedCall, ToolFormat
from rollout.http.parsers.reader import ChatReader, ChatStream, Reading
from rollout.http.parsers.think import parse_reasoning

TOOL_FORMATS: dict[str, ToolFormat] = {
    f.name: f
    for f in (
        hermes.FORMAT,
        qwen3_coder.FORMAT,
        llama3_json.FORMAT,
        mistral.FORMAT,
        ToolFormat("harmony", (), harmony.split, specials=harmony.SPECIALS),
    )
}


def kept_specials(reasoning_parser: str | None, tool_parser: str | None) -> tuple[str, ...]:
    """The special tokens the configured formats are written in (decoding keeps them, skips the rest)."""
    kept = TOOL_FORMATS[tool_parser].specials if tool_parser else ()
    return kept + (harmony.SPECIALS if reasoning_parser == "harmony" else ())


__all__ = [
    "TOOL_FORMATS",
    "Allowed",
    "ChatReader",
    "ChatStream",
    "ParsedCall",
    "Reading",
    "ToolFormat",
    "kept_specials",
    "parse_reasoning",
]
