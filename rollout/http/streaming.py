"""Streamed completions (``stream: true``): the engine's tokens as OpenAI's chunks, sent as server-sent events.

Each choice's text goes out as it is sampled, but text that could be the start of a stop string (or an
incomplete character) is held back until it cannot be, so no stop string ever leaks into the stream.
Departure from OpenAI: streamed choices send their ``finish_reason`` once the whole request has finished.
A client that goes away mid-stream cancels the generation (:mod:`rollout.http.disconnect`); an error
once the headers are sent is reported in-band, as OpenAI does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import StreamingResponse

from rollout.engines.base import Completion, Engine, SamplingParams, cut_at_stop
from rollout.http.choices import Choices, Entry, chat_logprobs, completion_logprobs, openai_call, usage
from rollout.http.disconnect import between_steps
from rollout.http.parsers import ChatReader
from rollout.http.schemas import APIError
from rollout.metrics import ServerMetrics
from tandem.vision import VisionInputs

log = logging.getLogger(__name__)

Images = list[VisionInputs | None] | None  # each prompt's image inputs; None: a text request


def with_images(images: Images) -> dict[str, Any]:
    """The engine's ``images`` keyword for a request with images, nothing for a text one (engines without
    a vision tower take no such keyword)."""
    return {} if images is None else {"images": images}


@dataclass
class _Choice:
    """One streamed choice: the tokens so far and how much of their text was sent."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sent_chars: int = 0
    sent_tokens: int = 0
    stopped: bool = False


class Streaming:
    """Chunks of streamed completions, from one engine, read by ``choices``."""

    def __init__(self, engine: Engine, metrics: ServerMetrics, choices: Choices) -> None:
        self.engine, self.metrics, self.choices = engine, metrics, choices

    async def tokens(
        self, prompts: list[list[int]], sampling: SamplingParams, images: Images = None
    ) -> AsyncIterator[tuple[int, int, float]]:
        """Tokens ``(row, token, logprob)`` as the engine samples them; closing the iterator cancels.
        ``images``: each prompt's image inputs, for a vision-language model."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, int, float] | None] = asyncio.Queue()
        cancelled = threading.Event()
        check = between_steps(cancelled)

        def on_token(row: int, token: int, logp: float) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (row, token, logp))

        future = loop.run_in_executor(
            None,
            lambda: self.engine.generate(
                prompts, sampling, between_steps=check, on_token=on_token, **with_images(images)
            ),
        )
        future.add_done_callback(lambda _: queue.put_nowait(None))  # runs after every queued token
        # A client gone mid-stream leaves nobody to await the future: mark its ClientGone as seen.
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        tokens = 0
        try:
            while (item := await queue.get()) is not None:
                tokens += 1
                yield item
            await future  # re-raise an engine error
        finally:
            cancelled.set()
            self.metrics.generated_tokens.labels(source="http").inc(tokens)

    async def completion_chunks(
        self, head: dict[str, Any], prompts: list[list[int]], sampling: SamplingParams, logprobs: bool
    ) -> AsyncIterator[dict[str, Any]]:
        choices = [_Choice() for _ in range(len(prompts) * sampling.n)]
        async for row, text, entries, ch in self._tracked(prompts, sampling, choices):
            lp = completion_logprobs(entries, ch.sent_chars - len(text)) if logprobs else None
            yield {**head, "choices": [{"index": row, "text": text, "logprobs": lp, "finish_reason": None}]}
        for row, ch in enumerate(choices):
            reason = self.choices.finish_reason(ch.tokens, ch.stopped, sampling.max_new_tokens)
            yield {**head, "choices": [{"index": row, "text": "", "logprobs": None, "finish_reason": reason}]}

    async def chat_chunks(
        self,
        head: dict[str, Any],
        prompt: list[int],
        sampling: SamplingParams,
        logprobs: bool,
        top: bool,
        tools: ChatReader | None = None,
        include_usage: bool = False,
        images: Images = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """Chat chunks. With a reader (tools, a reasoning format), each choice's text goes through its
        :class:`ChatStream`: reasoning as ``reasoning_content`` deltas, content until a call could begin;
        when the choice ends its calls are sent as one ``tool_calls`` delta. ``include_usage``: a last
        chunk without choices carries the usage (``stream_options.include_usage``)."""
        choices = [_Choice() for _ in range(sampling.n)]
        streams = [tools.stream() for _ in choices] if tools else []
        held: list[list[Entry]] = [[] for _ in choices]  # logprobs not sent yet
        started: set[int] = set()  # choices whose first delta (which carries the role) was sent

        def delta(row: int, **content: Any) -> dict[str, Any]:
            first = row not in started
            started.add(row)
            return {"role": "assistant", **content} if first else content

        def chunk(
            row: int, entries: list[Entry] | None, reason: str | None = None, **content: Any
        ) -> dict[str, Any]:
            lp = chat_logprobs(entries, top) if logprobs and entries is not None else None
            choice = {"index": row, "delta": delta(row, **content), "logprobs": lp, "finish_reason": reason}
            return {**head, "choices": [choice]}

        async for row, text, entries, _ in self._tracked([prompt], sampling, choices, images):
            if not streams:
                yield chunk(row, entries, content=text)
                continue
            held[row] += entries
            for d in streams[row].feed(text):
                yield chunk(row, held[row], **d)
                held[row] = []
        for row, ch in enumerate(choices):
            reason = self.choices.finish_reason(ch.tokens, ch.stopped, sampling.max_new_tokens)
            for d in streams[row].finish() if streams else []:
                if "tool_calls" in d:
                    reason = "tool_calls"
                    calls = enumerate(d.pop("tool_calls"))
                    d = {"tool_calls": [{"index": k, **openai_call(c)} for k, c in calls]}
                yield chunk(row, held[row], **d)
                held[row] = []
            last = chunk(row, held[row] or None, reason)
            last["choices"][0]["stop_reason"] = self.choices.matched_stop(ch.tokens, sampling.stop)
            yield last
        if include_usage:
            out = [[Completion(ch.tokens, ch.logprobs, "stop", []) for ch in choices]]
            yield {**head, "choices": [], "usage": usage([prompt], out, sampling.n)}

    async def _tracked(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        choices: list[_Choice],
        images: Images = None,
    ) -> AsyncIterator[tuple[int, str, list[Entry], _Choice]]:
        """Text deltas per row. Text that could be the start of a stop string (or an incomplete character)
        is held back until it cannot be, so no stop string ever leaks into the stream."""
        hold = max(map(len, sampling.stop), default=1) - 1
        decode = self.choices.decode
        async for row, token, logp in self.tokens(prompts, sampling, images):
            ch = choices[row]
            if ch.stopped:
                continue
            ch.tokens.append(token)
            ch.logprobs.append(logp)
            text, ch.stopped = cut_at_stop(decode(ch.tokens), sampling.stop)
            safe = len(text) if ch.stopped else len(text) - hold
            while safe > ch.sent_chars and text[safe - 1] == "\ufffd":  # an incomplete multi-byte character
                safe -= 1
            entries = self.choices.token_entries(ch.tokens[ch.sent_tokens :], ch.logprobs[ch.sent_tokens :])
            ch.sent_tokens = len(ch.tokens)
            new = text[ch.sent_chars : max(safe, ch.sent_chars)]
            ch.sent_chars += len(new)
            if new or entries:
                yield row, new, entries, ch
        for row, ch in enumerate(choices):  # held-back text that no stop string followed
            text, _ = cut_at_stop(decode(ch.tokens), sampling.stop)
            if len(text) > ch.sent_chars:
                new, ch.sent_chars = text[ch.sent_chars :], len(text)
                yield row, new, [], ch


async def sse(chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    """Stream chunks as server-sent events. The first chunk is awaited before the response starts, so
    an engine that rejects the request still gets a proper 400 rather than an in-band error."""
    try:
        first = await anext(chunks)
    except ValueError as e:
        raise APIError(400, str(e), param="prompt") from None

    async def events() -> AsyncIterator[str]:
        yield f"data: {json.dumps(first)}\n\n"
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
        except Exception as e:  # headers are sent: report in-band, as OpenAI does
            log.exception("streaming failed")
            error = {"message": str(e), "type": "server_error", "param": None, "code": None}
            yield f"data: {json.dumps({'error': error})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
