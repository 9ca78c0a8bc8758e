"""The engine's completions as OpenAI's output objects: a choice's text, finish reason, logprobs and
usage, and on chat its message, with reasoning and tool calls read from the text (docs/environments.md §10.8).

A completion's text is cut before the first stop string it holds; its special tokens are skipped, but for
those the server's reasoning and tool-call formats are written in (:func:`kept_specials`). Departure from
OpenAI: ``top_logprobs`` lists only the sampled token (engines record the behaviour logprob of what they
sampled, not alternatives).
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from rollout.engines.base import Completion, cut_at_stop
from rollout.http.parsers import TOOL_FORMATS, ChatReader, ParsedCall, kept_specials, think
from rollout.http.schemas import APIError, ChatRequest
from tandem.config import HTTPConfig

Entry = tuple[str, float, int]  # a token's text, its logprob, and its offset in the choice's text


class Choices:
    """Completions read into choices, with one tokenizer and the server's reasoning and tool-call formats."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, http: HTTPConfig) -> None:
        self.tokenizer = tokenizer
        self.tool_parser = TOOL_FORMATS[http.tool_parser] if http.tool_parser else None
        self.reasoning_parser = http.reasoning_parser
        self.special_ids = set(tokenizer.all_special_ids)
        # The special tokens a format is written in (harmony's, Mistral's [TOOL_CALLS]) survive decoding.
        names = list(kept_specials(http.reasoning_parser, http.tool_parser))
        kept = set(tokenizer.convert_tokens_to_ids(names))
        special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special} | self.special_ids
        self.kept_ids, self.skipped_ids = kept & special, special - kept

    # ------------------------------------------------------------------------------------------ text

    def decode(self, token_ids: list[int]) -> str:
        """A completion's text: special tokens skipped, but those the parsers read (``kept_specials``)."""
        if not self.kept_ids:
            return self.tokenizer.decode(token_ids, skip_special_tokens=True)
        return self.tokenizer.decode([t for t in token_ids if t not in self.skipped_ids])

    def text_and_finish(self, c: Completion, stop: list[str]) -> tuple[str, str]:
        text, hit = cut_at_stop(self.decode(c.token_ids), stop)
        return text, "stop" if hit or c.finish_reason == "stop" else "length"

    def finish_reason(self, tokens: list[int], stopped: bool, max_tokens: int) -> str:
        """A streamed choice's finish reason: ``stop`` if it ended before ``max_tokens``, else ``length``."""
        ended_early = stopped or len(tokens) < max_tokens or tokens[-1] in self.special_ids
        return "stop" if ended_early else "length"

    def matched_stop(self, token_ids: list[int], stop: list[str]) -> str | None:
        """The stop string the completion ended at (the first to occur), or None: vLLM's ``stop_reason``."""
        text = self.decode(token_ids)
        found = [(text.find(s), k, s) for k, s in enumerate(stop) if s and s in text]
        return min(found)[2] if found else None

    def token_entries(
        self, tokens: list[int], logprobs: list[float], limit_chars: int | None = None
    ) -> list[Entry]:
        """``(text, logprob, offset)`` per non-special token, up to ``limit_chars`` of text."""
        out, offset = [], 0
        for t, lp in zip(tokens, logprobs, strict=True):
            if t in self.special_ids:
                continue
            if limit_chars is not None and offset >= limit_chars:
                break
            s = self.tokenizer.decode([t])
            out.append((s, lp, offset))
            offset += len(s)
        return out

    # --------------------------------------------------------------------------------------- readers

    def tool_calls(self, req: ChatRequest) -> ChatReader | None:
        """How to read the request's completions for tool calls; None: not at all (no tools, or
        ``tool_choice: "none"``). Checks ``tools`` and ``tool_choice`` against each other."""
        names = [t.function.name for t in req.tools or []]
        if dup := sorted({x for x in names if names.count(x) > 1}):
            raise APIError(400, f"tools: the function {dup[0]!r} is defined more than once", param="tools")
        named = req.tool_choice_name()
        if (req.tool_choice == "required" or named is not None) and not names:
            raise APIError(400, f"tool_choice: {req.tool_choice!r} needs tools", param="tool_choice")
        if named is not None and named not in names:
            raise APIError(
                400,
                f"tool_choice: the function {named!r} is not among tools ({', '.join(names)})",
                param="tool_choice",
            )
        if not names or req.tool_choice == "none":
            return None
        if self.tool_parser is None:
            raise APIError(
                400,
                'tools: this server reads no tool calls (rollout.http.tool_parser is null); use tool_choice "none"',
                param="tools",
            )
        tools = [t.function for t in req.tools or [] if named in (None, t.function.name)]
        allowed = {f.name: f.parameters or {} for f in tools}  # qwen3_coder types values by the schema
        return ChatReader(tools=self.tool_parser, allowed=allowed, parallel=req.parallel_tool_calls)

    def reader(self, tools: ChatReader | None, prompt: list[int]) -> ChatReader | None:
        """How to read a chat completion: ``tools`` (:meth:`tool_calls`) and the server's reasoning format,
        told whether the prompt's last tokens opened a ``<think>`` block; None: as plain content."""
        if self.reasoning_parser is None:
            return tools
        inside = self.reasoning_parser == "think" and think.opened(self.tokenizer.decode(prompt[-32:]))
        return replace(tools or ChatReader(), reasoning=self.reasoning_parser, inside=inside)

    # --------------------------------------------------------------------------------------- choices

    def completion_choices(
        self, out: list[list[Completion]], stop: list[str], logprobs: bool
    ) -> list[dict[str, Any]]:
        """The choices of a (non-streamed) completion request: every prompt's completions in turn."""
        choices = []
        for i, c in enumerate(c for g in out for c in g):
            text, finish = self.text_and_finish(c, stop)
            lp = None
            if logprobs:
                lp = completion_logprobs(self.token_entries(c.token_ids, c.logprobs, len(text)))
            choices.append(completion_choice(i, text, finish, lp))
        return choices

    def chat_choices(
        self, out: list[Completion], stop: list[str], logprobs: bool, top: bool, tools: ChatReader | None
    ) -> list[dict[str, Any]]:
        """The choices of a (non-streamed) chat request; ``top``: ``top_logprobs`` was asked for."""
        choices = []
        for i, c in enumerate(out):
            text, finish = self.text_and_finish(c, stop)
            lp = None
            if logprobs:
                lp = chat_logprobs(self.token_entries(c.token_ids, c.logprobs, len(text)), top)
            choices.append(self.chat_choice(i, c, text, finish, stop, tools, lp))
        return choices

    def chat_choice(
        self,
        index: int,
        c: Completion,
        text: str,
        finish: str,
        stop: list[str],
        tools: ChatReader | None,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One chat choice of ``c``, whose ``text`` and ``finish`` reason :meth:`text_and_finish` gave."""
        message, finish = chat_message(text, finish, tools)
        return {
            "index": index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish,
            "stop_reason": self.matched_stop(c.token_ids, stop),
        }


def completion_choice(index: int, text: str, finish: str, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def chat_message(text: str, finish: str, tools: ChatReader | None) -> tuple[dict[str, Any], str]:
    """The assistant message of a completion's text, and its finish reason (``tool_calls`` with calls)."""
    if tools is None:
        return {"role": "assistant", "content": text}, finish
    read = tools.read(text)
    message: dict[str, Any] = {"role": "assistant", "content": read.content}
    if tools.reasoning is not None:
        message["reasoning_content"] = read.reasoning
    if not read.calls:
        return message, finish
    return {**message, "tool_calls": [openai_call(c) for c in read.calls]}, "tool_calls"


def openai_call(c: ParsedCall) -> dict[str, Any]:
    """A parsed call as OpenAI's ``tool_calls`` entry, under a fresh call id."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": c.name, "arguments": c.arguments},
    }


def completion_logprobs(entries: list[Entry], base: int = 0) -> dict[str, Any]:
    return {
        "tokens": [s for s, _, _ in entries],
        "token_logprobs": [lp for _, lp, _ in entries],
        "top_logprobs": [{s: lp} for s, lp, _ in entries],
        "text_offset": [base + off for _, _, off in entries],
    }


def chat_logprobs(entries: list[Entry], top: bool) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": s,
                "logprob": lp,
                "bytes": list(s.encode()),
                "top_logprobs": [{"token": s, "logprob": lp, "bytes": list(s.encode())}] if top else [],
            }
            for s, lp, _ in entries
        ]
    }


def usage(prompts: list[list[int]], out: list[list[Completion]], n: int) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in prompts) * n
    completion_tokens = sum(len(c.token_ids) for g in out for c in g)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
