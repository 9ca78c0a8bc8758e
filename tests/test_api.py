"""The OpenAI-compatible API, driven by the official ``openai`` client and raw HTTP against a real server."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rollout.engines.base import SamplingParams
from rollout.engines.hf import HFEngine
from rollout.http.app import create_app
from rollout.http.serve import HTTPServer
from rollout.metrics import ServerMetrics
from tandem.config import HTTPConfig

MODEL = "tiny"


@pytest.fixture(scope="module")
def engine(tiny_ckpt: dict[str, Path]) -> HFEngine:
    return HFEngine(str(tiny_ckpt["actor"]), device="cpu")


def serve(engine: HFEngine, **http: object) -> HTTPServer:
    cfg = HTTPConfig(max_request_bytes=4096, max_tokens_limit=64, **http)
    app = create_app(
        engine,
        engine.tokenizer,
        model_name=MODEL,
        http=cfg,
        metrics=ServerMetrics(engine),
        max_context=engine.max_positions,
    )
    return HTTPServer(app, "127.0.0.1", 0).start()


@pytest.fixture(scope="module")
def url(engine: HFEngine):
    server = serve(engine)
    yield f"http://127.0.0.1:{server.port}"
    server.stop()


@pytest.fixture
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60, max_retries=0)


def test_completions_match_the_engine(client: openai.OpenAI, engine: HFEngine) -> None:
    r = client.completions.create(
        model=MODEL, prompt="say a:", max_tokens=8, temperature=1.0, seed=7, logprobs=1
    )
    (choice,) = r.choices
    prompt = engine.tokenizer("say a:", add_special_tokens=False).input_ids
    (c,) = engine.generate([prompt], SamplingParams(max_new_tokens=8, temperature=1.0, seed=7))[0]
    assert choice.text == engine.tokenizer.decode(c.token_ids, skip_special_tokens=True)
    special = set(engine.tokenizer.all_special_ids)
    want = [lp for t, lp in zip(c.token_ids, c.logprobs, strict=True) if t not in special]
    assert choice.logprobs.token_logprobs == pytest.approx(want)
    assert "".join(choice.logprobs.tokens) == choice.text
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(c.token_ids)
    assert choice.finish_reason == ("stop" if c.finish_reason == "stop" else "length")


def test_completions_batch_and_n(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=["say a:", "say b:"], n=2, max_tokens=4, seed=1)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)


def test_chat_uses_the_chat_template(client: openai.OpenAI, engine: HFEngine) -> None:
    messages = [{"role": "user", "content": "say b"}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=1
    )
    (choice,) = r.choices
    text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "user: say b\nassistant: "
    prompt = engine.tokenizer(text, add_special_tokens=False).input_ids
    (c,) = engine.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0))[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == engine.tokenizer.decode(c.token_ids, skip_special_tokens=True)
    assert all(e.logprob <= 0 and e.top_logprobs[0].token == e.token for e in choice.logprobs.content)


def test_streaming_equals_non_streaming(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt="say c:", max_tokens=10, temperature=1.0, seed=3, n=2)
    whole = client.completions.create(**kw)
    parts = {0: "", 1: ""}
    finish = {}
    for chunk in client.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            parts[ch.index] += ch.text
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert [parts[i] for i in (0, 1)] == [c.text for c in whole.choices]
    assert [finish[i] for i in (0, 1)] == [c.finish_reason for c in whole.choices]

    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0)
    text = client.chat.completions.create(**chat).choices[0].message.content
    deltas = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**chat, stream=True, logprobs=True)
    ]
    assert "".join(deltas) == text


def test_stop_strings_never_leak(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt="say d:", max_tokens=16, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    stop = full[5:7]
    assert len(stop) == 2
    want = full[: full.index(stop)]
    r = client.completions.create(**kw, stop=[stop]).choices[0]
    assert (r.text, r.finish_reason) == (want, "stop")
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stop=stop, stream=True))
    assert streamed == want


def test_models_and_health(client: openai.OpenAI, url: str) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok", "model": MODEL, "version": 0}


BAD_REQUESTS = [
    ("malformed JSON", b'{"model": "tiny", "prompt": ', 400, None),
    ("not an object", b"[1, 2]", 400, None),
    ("unknown model", {"model": "gpt-9", "prompt": "x"}, 404, "model_not_found"),
    ("negative max_tokens", {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, None),
    ("max_tokens over the limit", {"model": MODEL, "prompt": "x", "max_tokens": 65}, 400, None),
    (
        "prompt over the context",
        {"model": MODEL, "prompt": "a" * 500, "max_tokens": 20},
        400,
        "context_length_exceeded",
    ),
    ("oversize body", {"model": MODEL, "prompt": "a" * 5000}, 413, "request_too_large"),
    ("string temperature", {"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, None),
    ("bool n", {"model": MODEL, "prompt": "x", "n": True}, 400, None),
    ("string max_tokens", {"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, None),
    ("token id out of range", {"model": MODEL, "prompt": [1, 10**6]}, 400, None),
    ("token id out of range, streamed", {"model": MODEL, "prompt": [1, 10**6], "stream": True}, 400, None),
    ("missing prompt", {"model": MODEL}, 400, None),
]


@pytest.mark.parametrize(("what", "body", "status", "code"), BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_openai_errors_and_the_server_stays_up(
    url: str, what: str, body: object, status: int, code: str | None
) -> None:
    kw = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    r = httpx.post(f"{url}/v1/completions", timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code
    ok = httpx.post(
        f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=30
    )
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None


# Hostile text (docs/design.md §6.4): raw bodies, since a well-behaved client cannot send these strings.
# JSON spells a lone surrogate as "\ud800"; the UTF-8 bytes ED A0 80 decode to one as well.
SURROGATE, NUL = '"\\ud800"', '"a\\u0000b"'
HOSTILE_TEXT = [
    ("prompt, surrogate", "/v1/completions", f'{{"model": "tiny", "prompt": {SURROGATE}}}', "prompt"),
    ("prompt, NUL", "/v1/completions", f'{{"model": "tiny", "prompt": {NUL}}}', "prompt"),
    ("prompt list", "/v1/completions", f'{{"model": "tiny", "prompt": ["ok", {SURROGATE}]}}', "prompt.1"),
    (
        "prompt, streamed",
        "/v1/completions",
        f'{{"model": "tiny", "prompt": {SURROGATE}, "stream": true}}',
        "prompt",
    ),
    ("model", "/v1/completions", f'{{"model": {SURROGATE}, "prompt": "x"}}', "model"),
    ("stop", "/v1/completions", f'{{"model": "tiny", "prompt": "x", "stop": ["\\n", {NUL}]}}', "stop.1"),
    ("unknown field", "/v1/completions", f'{{"model": "tiny", "prompt": "x", "user": {NUL}}}', "user"),
    (
        "message content",
        "/v1/chat/completions",
        f'{{"model": "tiny", "messages": [{{"role": "user", "content": {SURROGATE}}}]}}',
        "messages.0.content",
    ),
    (
        "message content part",
        "/v1/chat/completions",
        '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}, '
        f'{{"role": "user", "content": [{{"type": "text", "text": {NUL}}}]}}]}}',
        "messages.1.content.0.text",
    ),
    (
        "session id",
        "/v1/chat/completions",
        f'{{"model": "tiny", "session_id": {NUL}, "messages": [{{"role": "user", "content": "x"}}]}}',
        "session_id",
    ),
    ("finish group_id", "/v1/sessions/s/finish", f'{{"reward": 1.0, "group_id": {SURROGATE}}}', "group_id"),
]


@pytest.mark.parametrize(("what", "route", "body", "param"), HOSTILE_TEXT, ids=[h[0] for h in HOSTILE_TEXT])
def test_invalid_text_gets_400_naming_the_field(
    url: str, what: str, route: str, body: str, param: str
) -> None:
    r = httpx.post(
        f"{url}{route}", content=body.encode(), headers={"content-type": "application/json"}, timeout=30
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert err["message"].startswith(f"{param}: contains a ")
    assert "lone surrogate (\\ud800)" in err["message"] or "NUL" in err["message"]
    ok = httpx.post(
        f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=30
    )
    assert ok.status_code == 200


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/v1/sessions/s/finish"])
def test_a_body_that_is_not_utf8_gets_400(url: str, route: str) -> None:
    headers = {"content-type": "application/json"}
    r = httpx.post(
        f"{url}{route}", content=b'{"model": "tiny", "prompt": "a\xff"}', headers=headers, timeout=30
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_utf8", r.text
    # UTF-8 bytes that encode a surrogate are accepted by Python's decoder: the field check names them.
    r = httpx.post(
        f"{url}{route}", content=b'{"model": "tiny", "prompt": "a\xed\xa0\x80"}', headers=headers, timeout=30
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_a_session_path_with_nul_gets_400(url: str) -> None:
    r = httpx.post(f"{url}/v1/sessions/a%00b/finish", json={"reward": 1.0}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "session_id", r.text


def test_unicode_text_is_served(url: str) -> None:
    """What the checks refuse is narrow: non-ASCII text, emoji, escapes of valid characters all pass."""
    body = '{"model": "tiny", "max_tokens": 2, "prompt": "caf\\u00e9 \\ud83d\\ude00 日本 \\t"}'
    r = httpx.post(
        f"{url}/v1/completions",
        content=body.encode(),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    chat = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "naïve ✓"}]}
    assert httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=30).status_code == 200


def test_chat_errors(url: str, client: openai.OpenAI) -> None:
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": "hi"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=0)


def test_metrics_parse_as_prometheus_text(url: str, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="x", max_tokens=3)
    text = httpx.get(f"{url}/metrics", timeout=10).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("tandem_generated_tokens_total", (("source", "http"),))] >= 3
    assert samples[("tandem_http_requests_total", (("route", "/v1/completions"), ("status", "200")))] >= 1
    assert samples[("tandem_weight_version", ())] == 0
    assert ("tandem_weight_update_seconds_count", ()) in samples


def test_bearer_token(engine: HFEngine) -> None:
    server = serve(engine, api_key="s3cret")
    try:
        base = f"http://127.0.0.1:{server.port}"
        r = httpx.get(f"{base}/v1/models", timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=f"{base}/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model=MODEL, prompt="x", max_tokens=2).choices
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200  # probes need no token
    finally:
        server.stop()


@pytest.mark.slow
@contextlib.contextmanager
def standalone(model_dir: Path) -> Iterator[tuple[subprocess.Popen, str, str]]:
    """``python -m rollout.server --standalone --model DIR`` started and serving: ``(process, model name,
    base URL)``; killed on the way out if the test left it running."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout.server", "--standalone", "--model", str(model_dir), "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        deadline, found = time.monotonic() + 120, None
        assert proc.stdout is not None
        while found is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "server exited before serving"
            found = re.search(r"serving (\S+) on (http://\S+)", line)
        assert found is not None, "no 'serving' line within 120 s"
        yield proc, found.group(1), found.group(2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_standalone_entry_point_answers_http(tiny_ckpt: dict[str, Path]) -> None:
    """``python -m rollout.server --standalone --model DIR`` serves, answers, and exits on SIGTERM."""
    with standalone(tiny_ckpt["actor"]) as (proc, model, base):
        assert model == "actor"
        r = httpx.post(
            f"{base}/v1/completions", json={"model": "actor", "prompt": "say a:", "max_tokens": 4}, timeout=30
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        proc.terminate()
        assert proc.wait(timeout=30) == 0


# ---------------------------------------------------------------------------------------- request limits


class SlowEngine(HFEngine):
    """The real hf engine, slowed to ``step_s`` per decode step, counting the steps it ran."""

    def __init__(self, path: str, step_s: float) -> None:
        super().__init__(path, device="cpu")
        self.step_s, self.steps = step_s, 0

    def generate(self, prompts, sampling, *, between_steps=None, on_token=None):
        def step() -> None:
            self.steps += 1
            time.sleep(self.step_s)
            if between_steps is not None:
                between_steps()

        return super().generate(prompts, sampling, between_steps=step, on_token=on_token)


def test_request_size_limits_name_the_parameter(engine: HFEngine) -> None:
    server = serve(engine, max_prompts_per_request=2, max_total_tokens_per_request=100)
    url = f"http://127.0.0.1:{server.port}/v1/completions"
    try:
        r = httpx.post(url, json={"model": MODEL, "prompt": ["a", "b", "c"], "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert "1..2 prompts (got 3)" in r.json()["error"]["message"]
        r = httpx.post(url, json={"model": MODEL, "prompt": ["a", "b"], "n": 7, "max_tokens": 8})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        assert (
            "(2 prompt tokens + 2 prompt(s) × max_tokens=8) × n=7 = 126 tokens exceeds"
            in r.json()["error"]["message"]
        )
        r = httpx.post(url, json={"model": MODEL, "prompt": ["a", "b"], "n": 5, "max_tokens": 8})
        assert r.status_code == 200 and len(r.json()["choices"]) == 10  # 90 tokens: within the limit
    finally:
        server.stop()


def test_requests_past_the_concurrency_limit_get_429(tiny_ckpt) -> None:
    slow = SlowEngine(str(tiny_ckpt["actor"]), step_s=0.05)
    server = serve(slow, max_concurrent_requests=1)
    url = f"http://127.0.0.1:{server.port}/v1/completions"
    # 8 seeded rows: the request runs its whole 40 steps (all rows ending early at once is not a risk)
    body = {"model": MODEL, "prompt": "say a:", "max_tokens": 40, "n": 8, "seed": 3, "temperature": 1.0}
    try:
        with (
            httpx.Client(timeout=30) as http,
            http.stream("POST", url, json={**body, "stream": True}) as first,
        ):
            assert first.status_code == 200
            lines = first.iter_lines()  # kept: an abandoned iterator closes the stream
            next(lines)  # the first chunk: the stream holds the only slot now
            r = httpx.post(url, json=body, timeout=30)
            assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
            assert "max_concurrent_requests" in r.json()["error"]["message"]
            assert [line for line in lines if line][-1] == "data: [DONE]"
        deadline = time.monotonic() + 10
        while (r := httpx.post(url, json={**body, "max_tokens": 2}, timeout=30)).status_code == 429:
            assert time.monotonic() < deadline, "the slot was never released"
            time.sleep(0.1)
        assert r.status_code == 200
    finally:
        server.stop()


def test_a_client_that_disconnects_cancels_its_generation(tiny_ckpt) -> None:
    slow = SlowEngine(str(tiny_ckpt["actor"]), step_s=0.05)
    server = serve(slow)
    url = f"http://127.0.0.1:{server.port}/v1/completions"
    body = {"model": MODEL, "prompt": "say a:", "max_tokens": 60, "n": 8, "seed": 3, "temperature": 1.0}
    try:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up after ~0.5 s of a ~3 s generation
            httpx.post(url, json=body, timeout=0.5)
        time.sleep(1.0)
        steps = slow.steps
        assert 0 < steps < 40, steps  # stopped soon after the disconnect, far short of 60 steps
        time.sleep(0.5)
        assert slow.steps == steps  # and does not go on
        metrics = httpx.get(f"http://127.0.0.1:{server.port}/metrics").text
        assert 'tandem_http_requests_total{route="/v1/completions",status="499"} 1.0' in metrics
    finally:
        server.stop()
