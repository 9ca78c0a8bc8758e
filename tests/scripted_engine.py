"""The engine's test double for the HTTP surfaces (chat, Messages, Responses, parsers, sessions), and a
real app and server around it.

A random tiny model cannot be made to write a tool call, so :class:`ScriptedEngine` "samples" a scripted
reply to the prompt text the server actually rendered (tool results included). Everything around it is
real: the byte-level tokenizer (every byte a token, so JSON and any Unicode text round-trip) with its chat
template, the app, uvicorn, and the clients the tests drive it with.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

from transformers import PreTrainedTokenizerFast

from buffer.schema import Trajectory
from rollout.engines.base import Completion, SamplingParams
from rollout.http.app import create_app
from rollout.http.serve import HTTPServer
from rollout.metrics import ServerMetrics
from tandem.config import HTTPConfig
from toy.tiny import CHAT_TEMPLATE, build_byte_tokenizer

MODEL = "tiny"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "it is 21 degrees in paris."
RESULT = "<tool_response>\n21\n</tool_response>"


def byte_tokenizer(chat_template: str = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """toy.tiny's byte-level tokenizer under the Hermes chat template (or the one given)."""
    return build_byte_tokenizer(chat_template)


class ScriptedEngine:
    """The engine's test double: it "samples" ``reply(prompt text)``, token by token through ``on_token``,
    then EOS, with a distinct logprob per token; it keeps every prompt and completion it served."""

    version = 0
    continuous_batching = False  # serves one call at a time, as hf does

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        self.tokenizer = tokenizer
        self.reply: Callable[[str], str] = lambda prompt: ""
        self.prompts: list[str] = []
        self.completions: list[Completion] = []

    def reset(self, reply: Callable[[str], str]) -> ScriptedEngine:
        """Forget what was served and script ``reply``: each test starts from a clean double."""
        self.reply = reply
        self.prompts.clear()
        self.completions.clear()
        return self

    def generate(self, prompts, sampling: SamplingParams, *, between_steps=None, on_token=None):
        out = []
        for i, prompt in enumerate(prompts):
            text = self.tokenizer.decode(prompt)
            self.prompts.append(text)
            ids = self.tokenizer(self.reply(text), add_special_tokens=False).input_ids
            # the reply and EOS, or cut at max_new_tokens as an engine cuts it
            finish = "stop" if len(ids) < sampling.max_new_tokens else "length"
            ids = [*ids, self.tokenizer.eos_token_id] if finish == "stop" else ids[: sampling.max_new_tokens]
            logps = [-0.01 * (j + 1) for j in range(len(ids))]
            group = []
            for k in range(sampling.n):
                for t, lp in zip(ids, logps, strict=True):
                    if between_steps is not None:
                        between_steps()
                    if on_token is not None:
                        on_token(i * sampling.n + k, t, lp)
                group.append(Completion(list(ids), list(logps), finish, [self.version] * len(ids)))
            self.completions += group
            out.append(group)
        return out


def serve(engine: ScriptedEngine, sink=None, **http: object) -> HTTPServer:
    app = create_app(engine, engine.tokenizer, model_name=MODEL, http=HTTPConfig(**http),  # type: ignore[arg-type]
                     metrics=ServerMetrics(engine), sink=sink)  # fmt: skip
    return HTTPServer(app, "127.0.0.1", 0).start()


def weather_agent_reply(prompt: str) -> str:
    """The 'model': calls the tool until the prompt holds its result, then answers from it."""
    return ANSWER if RESULT in prompt else CALL


class Served(NamedTuple):
    engine: ScriptedEngine
    url: str
    sunk: list[Trajectory]  # finished sessions, as the buffer would receive them


@contextmanager
def serving(api_key: str) -> Iterator[Served]:
    """A scripted engine behind the real app and server, with a sink (sessions are kept only with a key)."""
    engine = ScriptedEngine(byte_tokenizer())
    sunk: list[Trajectory] = []
    server = serve(engine, sink=sunk.append, api_key=api_key)
    try:
        yield Served(engine, f"http://127.0.0.1:{server.port}", sunk)
    finally:
        server.stop()
