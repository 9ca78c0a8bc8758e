"""Reasoning between ``<think>`` and ``</think>`` (Qwen3, QwQ, DeepSeek-R1; vLLM's ``qwen3`` and
``deepseek_r1`` reasoning parsers).

A completion either opens with ``<think>`` (leading whitespace aside), or begins inside the block when the
chat template already opened it at the end of the prompt (DeepSeek-R1, Qwen3 thinking-only templates):
then only ``</think>`` comes. Reasoning is the block's text, stripped; content is what follows
``</think>``, without its leading whitespace. A completion cut off inside the block is all reasoning.
"""

from __future__ import annotations

from rollout.http.parsers.calls import tail_start

THINK, END = "<think>", "</think>"


def opened(prompt_text: str) -> bool:
    """Whether the prompt ends inside a ``<think>`` block its template opened (its last ``<think>`` is
    not closed)."""
    return prompt_text.rfind(THINK) > prompt_text.rfind(END)


def split(text: str, *, inside: bool = False, final: bool = True) -> tuple[str | None, str]:
    """``(reasoning as written or None without a block, the text after it)``. ``inside``: the prompt
    opened the block. Not ``final``: a prefix of a stream, where text that could still become a marker is
    left out of both."""
    start = 0
    body = text.lstrip()
    if body.startswith(THINK):
        start = len(text) - len(body) + len(THINK)
    elif not final and THINK.startswith(body):  # "", "<", "<th", ...: not yet known
        return "", ""
    elif not inside:
        return None, text
    end = text.find(END, start)
    if end >= 0:
        return text[start:end], text[end + len(END) :].lstrip()
    reasoning = text[start:]
    return (reasoning if final else reasoning[: tail_start(reasoning, END)]), ""


def parse_reasoning(text: str, inside: bool = False) -> tuple[str | None, str | None]:
    """``(reasoning, content)`` of a whole completion: None for an empty part; without a block,
    ``(None, text)``."""
    reasoning, rest = split(text, inside=inside)
    if reasoning is None:
        return None, text
    return reasoning.strip() or None, rest or None
