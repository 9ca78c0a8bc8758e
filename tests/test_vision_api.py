"""Images through the OpenAI-compatible chat API (rollout/http/images.py): the official ``openai`` client
sends ``image_url`` parts to the server's app on the real hf engine and the tiny Qwen2-VL, saved by path.

What the server answers is what the engine generates from the same tokens and pixels; another image
changes it; streamed equals non-streamed; each bad part is a 400 naming it.
"""

from __future__ import annotations

import random
from pathlib import Path

import openai
import pytest

from rollout.engines.base import SamplingParams
from rollout.engines.hf import HFEngine
from rollout.http.app import create_app
from rollout.http.serve import HTTPServer
from rollout.metrics import ServerMetrics
from tandem.config import HTTPConfig
from tests.test_api import standalone
from toy.tasks import colour
from toy.tiny import make_tiny

MODEL = "tiny-vl"


@pytest.fixture(scope="module")
def vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny-vl"), arch="qwen2-vl")["actor"]


@pytest.fixture(scope="module")
def engine(vl: Path) -> HFEngine:
    return HFEngine(str(vl), gather_s=0.01)


@pytest.fixture(scope="module")
def client(engine: HFEngine):
    app = create_app(
        engine, engine.tokenizer, model_name=MODEL, http=HTTPConfig(), metrics=ServerMetrics(engine)
    )
    server = HTTPServer(app, "127.0.0.1", 0).start()
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", timeout=60, max_retries=0)
    server.stop()


def record(answer: str) -> dict:
    r = colour.make_record(random.Random(0), 0)
    return {**r, "answer": answer, "square": [8, 8, 36]}


def ask(answer: str, text: str = colour.PROMPT) -> list[dict]:
    image = {"type": "image_url", "image_url": {"url": colour.data_url(record(answer))}}
    return [{"role": "user", "content": [image, {"type": "text", "text": text}]}]


def test_an_image_in_a_chat_request_is_what_the_engine_generates_from(client, engine: HFEngine) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=ask("red"), max_tokens=8, temperature=1.0, seed=3, logprobs=True
    )
    choice = out.choices[0]
    assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")
    # The engine's own call on the same prompt and pixels, with the same seed.
    assert engine.vision is not None
    ids, vision = engine.vision.encode(colour.PROMPT, [colour.draw(record("red"))])
    assert out.usage.prompt_tokens == len(ids)  # each placeholder expanded to the tokens its image fills
    (rows,) = engine.generate(
        [ids], SamplingParams(n=1, max_new_tokens=8, temperature=1.0, seed=3), images=[vision]
    )
    assert choice.message.content == engine.tokenizer.decode(rows[0].token_ids, skip_special_tokens=True)
    # One entry per token here (the random model's bytes decode one by one; a trailing byte that does not
    # complete a character has no entry).
    served = [t.logprob for t in choice.logprobs.content]
    assert 0 < len(served) <= len(rows[0].logprobs)
    assert served == pytest.approx(rows[0].logprobs[: len(served)], abs=1e-5)
    assert out.usage.completion_tokens == len(rows[0].token_ids)


def test_another_image_changes_the_answer_distribution(client) -> None:
    lps = {}
    for answer in ("red", "blue"):
        out = client.chat.completions.create(
            model=MODEL, messages=ask(answer), max_tokens=1, temperature=1.0, seed=5, logprobs=True
        )
        lps[answer] = out.choices[0].logprobs.content[0]
    # The same seed samples from both; either the token or its log-probability differs.
    assert (lps["red"].token, lps["red"].logprob) != pytest.approx((lps["blue"].token, lps["blue"].logprob))


def test_streamed_equals_non_streamed_with_an_image(client) -> None:
    kwargs = {"model": MODEL, "messages": ask("green"), "max_tokens": 8, "temperature": 1.0, "seed": 7}
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(stream=True, **kwargs)
        if c.choices
    )
    assert streamed == whole


@pytest.mark.parametrize(
    "content, role, param, says",
    [
        ([{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}], "user",
         "messages.0.content.0.image_url.url", "downloads nothing"),
        ([{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
         "user", "messages.0.content.1.image_url.url", "not a readable image"),
        ([{"type": "image_url", "image_url": {}}], "user", "messages.0.content.0.image_url.url", "must be a data"),
        ([{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}], "user",
         "messages.0.content.0.image_url.url", "reads no files"),
        ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}], "system",
         "messages.0.content.0", "user messages"),
    ],
)  # fmt: skip
def test_a_bad_image_part_is_a_400_naming_it(client, content: list, role: str, param: str, says: str) -> None:
    messages = [{"role": role, "content": content}] + (
        [{"role": "user", "content": "hi"}] if role != "user" else []
    )
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    error = e.value.body
    assert error["param"] == param and says in error["message"], error
    # The server goes on serving.
    assert client.chat.completions.create(model=MODEL, messages=ask("red"), max_tokens=2).choices


def test_a_text_model_refuses_images(tmp_path: Path) -> None:
    engine = HFEngine(str(make_tiny(tmp_path / "tiny")["actor"]))
    app = create_app(
        engine, engine.tokenizer, model_name=MODEL, http=HTTPConfig(), metrics=ServerMetrics(engine)
    )
    server = HTTPServer(app, "127.0.0.1", 0).start()
    try:
        text = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="no vision tower"):
            text.chat.completions.create(model=MODEL, messages=ask("red"), max_tokens=2)
    finally:
        server.stop()


def test_the_standalone_server_answers_an_image(vl: Path) -> None:
    """``python -m rollout.server --standalone --model DIR`` on the tiny Qwen2-VL: the official client's
    image request gets an answer, as it does from the in-process app above."""
    with standalone(vl) as (proc, model, base):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=60, max_retries=0)
        out = client.chat.completions.create(model=model, messages=ask("blue"), max_tokens=4)
        assert out.choices[0].message.content is not None and out.usage.completion_tokens >= 1
        assert out.usage.prompt_tokens > 4  # the image's placeholders, expanded
        proc.terminate()
        assert proc.wait(timeout=30) == 0
