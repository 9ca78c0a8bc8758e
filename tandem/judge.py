"""An LLM judge as a reward function: any OpenAI-compatible chat endpoint grades each completion by a rubric.

Named in a config like any reward function, with its settings as ``kwargs``::

    reward:
      timeout_s: 30
      functions:
        - path: tandem.judge:judge
          kwargs: {base_url: "http://127.0.0.1:8000/v1", model: judge, rubric: "...{prompt}...{completion}..."}

Each call renders the rubric (``str.format`` with ``prompt``, ``completion`` and the record's fields), asks
the endpoint through the official ``openai`` async client (as one user message of ``/v1/chat/completions``,
or with ``api: completions`` as the raw prompt of ``/v1/completions``, for a judge trained without a chat
template), and reads the first number of the reply as the
score, divided by ``score_max`` and clipped to [0, 1]. A reply without a number raises, which the reward
machinery scores 0 and counts in ``reward/errors`` (tandem/rewards.py). Requests to one judge are limited
to ``max_concurrency`` at a time (a semaphore), and a judge prompt already asked (the same rubric, prompt
and completion: GRPO's groups repeat completions often) is answered from a cache without a second call;
the same prompt asked twice at once is one call.

With ``serve: <checkpoint dir>`` instead of ``base_url``, each rollout server starts its own judge, ``python
-m rollout.server --standalone`` on that checkpoint (a free local port), on the first call, and stops it
when it exits: the run needs no other process. The endpoint and model may come from the environment instead (``TANDEM_JUDGE_BASE_URL``,
``TANDEM_JUDGE_MODEL``). The API key only ever comes from the environment variable named by
``api_key_env`` (``TANDEM_JUDGE_API_KEY`` by default), never from the config, the command line or a log.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import re
import subprocess
import sys
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import openai

from tandem.procs import popen

DEFAULT_RUBRIC = (
    "Grade the response to the prompt below from 0 (useless) to 10 (perfect).\n\n"
    "Prompt:\n{prompt}\n\nResponse:\n{completion}\n\nReply with the score alone."
)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def parse_score(reply: str, score_max: float) -> float:
    """The first number in ``reply``, divided by ``score_max`` and clipped to [0, 1]."""
    found = NUMBER.search(reply or "")
    if found is None:
        raise ValueError(f"judge reply has no score: {reply[:80]!r}")
    return min(1.0, max(0.0, float(found.group()) / score_max))


class Judge:
    """One endpoint, model and rubric: its client, its cache and its concurrency limit (on one event loop)."""

    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        rubric: str = DEFAULT_RUBRIC,
        api_key_env: str = "TANDEM_JUDGE_API_KEY",
        max_concurrency: int = 8,
        score_max: float = 10.0,
        temperature: float = 0.0,
        max_tokens: int = 8,
        cache_size: int = 100_000,
        request_timeout_s: float = 60.0,
        api: str = "chat",
    ) -> None:
        if max_concurrency < 1 or score_max <= 0 or cache_size < 0:
            raise ValueError("judge: max_concurrency must be >= 1, score_max > 0 and cache_size >= 0")
        if api not in ("chat", "completions"):
            raise ValueError(f"judge: api must be chat or completions, not {api!r}")
        # A local server needs no key, but the client insists on one.
        key = os.environ.get(api_key_env) or "no-key"
        self.client = openai.AsyncOpenAI(
            base_url=base_url, api_key=key, timeout=request_timeout_s, max_retries=1
        )
        self.model, self.rubric, self.score_max, self.api = model, rubric, score_max, api
        self.temperature, self.max_tokens, self.cache_size = temperature, max_tokens, cache_size
        self.limit = asyncio.Semaphore(max_concurrency)
        self.cache: OrderedDict[str, asyncio.Task[float]] = OrderedDict()  # judge prompt -> its score
        self.calls = self.cache_hits = 0  # requests sent; answers taken from the cache (or a shared call)

    def render(self, prompt: str, completion: str, record: dict[str, Any]) -> str:
        fields = {**(record or {}), "prompt": prompt, "completion": completion}
        try:
            return self.rubric.format_map(fields)
        except KeyError as e:
            raise ValueError(f"judge rubric names {{{e.args[0]}}}, which the record does not hold") from None

    async def score(self, prompt: str, completion: str, record: dict[str, Any]) -> float:
        text = self.render(prompt, completion, record)
        task = self.cache.get(text)
        if task is not None:
            self.cache_hits += 1
        else:
            task = asyncio.ensure_future(self.ask(text))
            task.add_done_callback(lambda t, k=text: self.forget_failed(k, t))
            self.cache[text] = task
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        # Shielded: a caller timed out still leaves the answer to the cache for the next one.
        return await asyncio.shield(task)

    def forget_failed(self, text: str, task: asyncio.Task[float]) -> None:
        if (task.cancelled() or task.exception() is not None) and self.cache.get(text) is task:
            del self.cache[text]  # asked again next time

    async def ask(self, text: str) -> float:
        sampling = {"model": self.model, "temperature": self.temperature, "max_tokens": self.max_tokens}
        async with self.limit:
            self.calls += 1
            if self.api == "completions":  # the rubric as raw text: a judge trained without a chat template
                raw = await self.client.completions.create(prompt=text, **sampling)
                return parse_score(raw.choices[0].text, self.score_max)
            chat = await self.client.chat.completions.create(
                messages=[{"role": "user", "content": text}], **sampling
            )
        return parse_score(chat.choices[0].message.content or "", self.score_max)


JUDGES: dict[tuple[Any, ...], Judge] = {}  # one per event loop and settings
SERVED: dict[str, str] = {}  # checkpoint directory -> base URL of the judge server this process started
_serve_lock = threading.Lock()
SERVING = re.compile(r"serving .* on (http://\S+)")


def serve_locally(model_dir: str) -> str:
    """The base URL of ``python -m rollout.server --standalone`` serving ``model_dir``, started by this process
    on first use (a free port, one CPU thread) and stopped when it exits (or dies: ``tandem.procs.popen``)."""
    with _serve_lock:
        if model_dir in SERVED:
            return SERVED[model_dir]
        if not Path(model_dir, "config.json").is_file():
            raise ValueError(f"judge: serve={model_dir!r} is not a checkpoint directory (no config.json)")
        cmd = [sys.executable, "-m", "rollout.server", "--standalone", "--model", model_dir]
        proc = popen([*cmd, "--port", "0", "--threads", "1", "--device", "cpu"], stdout=subprocess.PIPE)
        atexit.register(proc.terminate)
        assert proc.stdout is not None
        for line in proc.stdout:  # its one stdout line says where it listens
            if found := SERVING.search(line.decode(errors="replace")):
                SERVED[model_dir] = f"{found.group(1)}/v1"
                return SERVED[model_dir]
        raise RuntimeError(f"judge: the server of {model_dir} exited with {proc.wait()} before serving")


def judge_for(**settings: Any) -> Judge:
    """The judge of these settings on the running loop (its client and semaphore belong to that loop)."""
    key = (id(asyncio.get_running_loop()), *sorted(settings.items()))
    if key not in JUDGES:
        JUDGES[key] = Judge(**settings)
    return JUDGES[key]


async def judge(
    prompt: str,
    completion: str,
    record: dict[str, Any],
    *,
    base_url: str | None = None,
    model: str | None = None,
    serve: str | None = None,
    **settings: Any,
) -> float:
    """The reward function: the judge's score of ``completion``, in [0, 1]. With ``serve`` (a checkpoint
    directory) the judge is that model, served by this process's own standalone server. ``settings`` are
    :class:`Judge`'s (rubric, score_max, max_concurrency, ...); a name it lacks is a TypeError naming it."""
    if serve is not None:
        base_url = await asyncio.to_thread(serve_locally, serve)
        model = model or Path(serve).name
    base_url = base_url or os.environ.get("TANDEM_JUDGE_BASE_URL")
    model = model or os.environ.get("TANDEM_JUDGE_MODEL")
    if not base_url or not model:
        raise ValueError(
            "judge: give kwargs base_url and model (or $TANDEM_JUDGE_BASE_URL, $TANDEM_JUDGE_MODEL)"
        )
    j = judge_for(base_url=base_url, model=model, **settings)
    return await j.score(prompt, completion, record)


def metrics() -> dict[str, float]:
    """Requests sent and answers taken from the cache, over every judge of this process (reward metrics)."""
    judges = list(JUDGES.values())
    return {
        "judge/calls": float(sum(j.calls for j in judges)),
        "judge/cache_hits": float(sum(j.cache_hits for j in judges)),
    }


judge.metrics = metrics  # type: ignore[attr-defined]  # read by RewardFunctions.metrics
