"""Hostile clients against the real HTTP API and hf engine (docs/design.md §6.4): each bad request fails
alone, with a 4xx naming what is wrong, while a well-behaved client's request running at the same time
succeeds; and a bind other hosts can reach is refused without a key."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

import rollout.engines.hf as hf
from buffer.schema import Trajectory
from rollout.engines.hf import HFEngine
from rollout.http.app import create_app
from rollout.http.limits import MAX_JSON_DEPTH
from rollout.http.serve import HTTPServer
from rollout.metrics import ServerMetrics
from tandem.config import ConfigError, HTTPConfig, load_config

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny"
KEY = "hostile-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CLIP = 5.0
GOOD = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 24, "temperature": 1.0, "seed": 1}


@pytest.fixture(scope="module")
def engine(tiny_ckpt: dict[str, Path]) -> HFEngine:
    return HFEngine(str(tiny_ckpt["actor"]), device="cpu")


@pytest.fixture(scope="module")
def served(engine: HFEngine) -> Iterator[tuple[str, list[Trajectory]]]:
    """A server as a run attaches it: a sink for finished sessions, the key, ``reward.clip``."""
    sunk: list[Trajectory] = []
    http = HTTPConfig(api_key=KEY, max_tokens_limit=64, max_total_tokens_per_request=4096)
    app = create_app(engine, engine.tokenizer, model_name=MODEL, http=http, metrics=ServerMetrics(engine),
                     max_context=engine.max_positions, sink=sunk.append, reward_clip=CLIP)  # fmt: skip
    server = HTTPServer(app, "127.0.0.1", 0).start()
    yield f"http://127.0.0.1:{server.port}", sunk
    server.stop()


@pytest.fixture
def url(served: tuple[str, list[Trajectory]]) -> str:
    return served[0]


def post(url: str, route: str, body: object, **kw: object) -> httpx.Response:
    """POST a body: a dict as JSON, a str as it is (Python's JSON reader takes NaN and Infinity)."""
    content = body if isinstance(body, str) else json.dumps(body)
    headers = {**AUTH, "Content-Type": "application/json", **kw.pop("headers", {})}  # type: ignore[dict-item]
    return httpx.post(f"{url}{route}", content=content, headers=headers, **{"timeout": 60, **kw})  # type: ignore[arg-type]


def alongside(url: str, bad: Callable[[], httpx.Response]) -> httpx.Response:
    """Run ``bad`` while a well-behaved completion is generating; the good one must succeed."""
    good: list[httpx.Response] = []
    t = threading.Thread(target=lambda: good.append(post(url, "/v1/completions", GOOD)))
    t.start()
    time.sleep(0.05)  # the good request is in the engine's batch
    try:
        r = bad()
    finally:
        t.join(60)
    assert good and good[0].status_code == 200, good[0].text if good else "no answer"
    assert good[0].json()["usage"]["completion_tokens"] > 0
    return r


def assert_400(r: httpx.Response, param: str, says: str = "") -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error


# ------------------------------------------------------------------------------------ sampling parameters


@pytest.mark.parametrize(
    "extra",
    [{"temperature": 1e-300}, {"temperature": 1e-30, "top_p": 1e-30}, {"temperature": 5e-324, "top_k": 1}],
)
def test_a_tiny_temperature_is_greedy(url: str, extra: dict) -> None:
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 8, **extra}
    r = alongside(url, lambda: post(url, "/v1/completions", body))
    assert r.status_code == 200, r.text
    greedy = post(url, "/v1/completions", {**body, "temperature": 0, "top_p": 1})
    assert r.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


@pytest.mark.parametrize(
    ("raw", "param", "says"),
    [
        ('"temperature": NaN', "temperature", "finite"),
        ('"temperature": Infinity', "temperature", "finite"),
        ('"top_p": NaN', "top_p", "finite"),
        ('"top_p": 0', "top_p", "greater than 0"),
        ('"presence_penalty": -Infinity', "presence_penalty", "finite"),
        ('"presence_penalty": 2.5', "presence_penalty", "less than or equal to 2"),
        ('"frequency_penalty": -3', "frequency_penalty", "greater than or equal to -2"),
        ('"repetition_penalty": 0', "repetition_penalty", "greater than 0"),
        ('"repetition_penalty": NaN', "repetition_penalty", "finite"),
        ('"logit_bias": {"5": NaN}', "logit_bias", "finite"),
        ('"logit_bias": {"5": 101}', "logit_bias", "[-100, 100]"),
        ('"logit_bias": {"x": 1}', "logit_bias", "token ids"),
        ('"n": 65', "n", "less than or equal to 64"),
        ('"max_tokens": 65', "max_tokens", "limit of 64"),
        ('"seed": 1180591620717411303424', "seed", "less than"),
        ('"stop": ["' + "x" * 600 + '"]', "stop", "limit is 512"),
    ],
)
def test_bad_sampling_parameters_get_400_naming_the_field(url: str, raw: str, param: str, says: str) -> None:
    body = '{"model": "tiny", "prompt": "hi", "max_tokens": 4, ' + raw + "}"
    assert_400(alongside(url, lambda: post(url, "/v1/completions", body)), param, says)
    chat = '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, ' + raw + "}"
    assert_400(post(url, "/v1/chat/completions", chat), param, says)


def test_a_call_that_cannot_be_sampled_fails_alone(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's guard: a call whose rows the sampler fails on (seed 666 here) gets 400, its batch-mates
    decode on, and the server keeps serving."""
    real = hf.sample_tokens

    def failing(logits, sampling, generator):
        if sampling.seed == 666:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, sampling, generator)

    monkeypatch.setattr(hf, "sample_tokens", failing)
    bad = {"model": MODEL, "prompt": "a b c", "max_tokens": 8, "seed": 666, "n": 2}
    r = alongside(url, lambda: post(url, "/v1/completions", bad))
    assert r.status_code == 400 and "sampling failed for this request" in r.json()["error"]["message"], r.text
    stream = alongside(url, lambda: post(url, "/v1/completions", {**bad, "stream": True}))
    assert stream.status_code == 400, stream.text
    assert post(url, "/v1/completions", GOOD).status_code == 200


# ---------------------------------------------------------------------------------------- JSON limits


def test_deep_tool_call_arguments_get_400_naming_the_limit(url: str) -> None:
    deep = "[" * 20_000 + "]" * 20_000
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}
    body = {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}  # fmt: skip
    r = alongside(url, lambda: post(url, "/v1/chat/completions", body))
    assert_400(r, "messages.1.tool_calls.0.function.arguments", "max_json_depth")
    assert r.json()["error"]["code"] == "json_limit_exceeded"


def nested(depth: int) -> dict:
    v: dict = {}
    for _ in range(depth - 1):
        v = {"x": v}
    return v


@pytest.mark.parametrize("field", ["tools", "response_format", "body"])
def test_deep_json_values_get_400_naming_the_limit(url: str, field: str) -> None:
    chat = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    if field == "tools":
        fn = {"name": "f", "parameters": nested(MAX_JSON_DEPTH + 5)}
        body = json.dumps({**chat, "tools": [{"type": "function", "function": fn}]})
    elif field == "response_format":
        body = json.dumps({**chat, "response_format": nested(MAX_JSON_DEPTH + 1)})
    else:  # deeper than Python's JSON reader recurses
        body = json.dumps(chat)[:-1] + ', "extra": ' + "[" * 50_000 + "]" * 50_000 + "}"
    r = alongside(url, lambda: post(url, "/v1/chat/completions", body))
    assert r.status_code == 400 and "max_json_depth" in r.json()["error"]["message"], r.text


def test_prompt_tokens_times_n_count_in_the_request_budget(url: str, engine: HFEngine) -> None:
    prompt = [5, 6, 7, 8] * 25  # 100 tokens: (100 + 1) × 64 = 6464 > 4096, although 64 × 1 is tiny
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "n": 64}
    r = alongside(url, lambda: post(url, "/v1/completions", body))
    assert_400(r, "max_tokens", "max_total_tokens_per_request")
    assert "(100 prompt tokens + 1 prompt(s) × max_tokens=1) × n=64 = 6464" in r.json()["error"]["message"]
    ok = post(url, "/v1/completions", {**body, "n": 32})  # 3232: within
    assert ok.status_code == 200, ok.text


# ------------------------------------------------------------------------------------------- sessions


def test_sessions_take_only_ids_the_server_issued(served: tuple[str, list[Trajectory]]) -> None:
    url, sunk = served
    call = {"model": MODEL, "prompt": "12+30=", "max_tokens": 3}
    r = alongside(url, lambda: post(url, "/v1/completions", call, headers={"X-Session-Id": "mine"}))
    assert_400(r, "session_id", "POST /v1/sessions")
    assert_400(post(url, "/v1/completions", {**call, "session_id": "mine"}), "session_id", "not open")
    # finishing needs the key, and an id the server issued
    assert (
        post(url, "/v1/sessions/mine/finish", {"reward": 1.0}, headers={"Authorization": ""}).status_code
        == 401
    )
    assert post(url, "/v1/sessions/mine/finish", {"reward": 1.0}).status_code == 404
    assert post(url, "/v1/sessions", "", headers={"Authorization": ""}).status_code == 401
    sid = post(url, "/v1/sessions", "").json()["id"]
    assert sid.startswith("sess-") and len(sid) == 37 and sid != post(url, "/v1/sessions", "").json()["id"]
    assert post(url, "/v1/completions", call, headers={"X-Session-Id": sid}).status_code == 200
    r = post(url, f"/v1/sessions/{sid}/finish", '{"reward": 1e308}')
    assert r.status_code == 200, r.text
    (t,) = [x for x in sunk if x.meta["session_id"] == sid]
    assert t.reward == CLIP  # reward.clip holds for agents' rewards too
    assert post(url, f"/v1/sessions/{sid}/finish", {"reward": 1.0}).status_code == 404  # finished once
    assert_400(post(url, f"/v1/sessions/{sid}/finish", '{"reward": Infinity}'), "reward")


def test_a_run_without_a_key_finishes_no_session(engine: HFEngine) -> None:
    """With a sink attached (a run) and no key, nobody may add a trajectory through the API."""
    sunk: list[Trajectory] = []
    app = create_app(engine, engine.tokenizer, model_name=MODEL, http=HTTPConfig(),
                     metrics=ServerMetrics(engine), sink=sunk.append)  # fmt: skip
    server = HTTPServer(app, "127.0.0.1", 0).start()
    try:
        url = f"http://127.0.0.1:{server.port}"
        sid = post(url, "/v1/sessions", "").json()["id"]
        post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "session_id": sid})
        r = post(url, f"/v1/sessions/{sid}/finish", {"reward": 1.0})
        assert r.status_code == 403 and "api_key" in r.json()["error"]["message"], r.text
        assert sunk == []
    finally:
        server.stop()


# ------------------------------------------------------------------------------------- binding refused


def test_a_bind_others_reach_needs_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.org"):
        with pytest.raises(
            ValueError, match="--api-key standalone, or the environment variable TANDEM_API_KEY"
        ):
            HTTPConfig(host=host)
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert HTTPConfig(host=host).api_key is None
    assert HTTPConfig(host="0.0.0.0", enabled=False).api_key is None  # no server, nothing to guard
    assert HTTPConfig(host="0.0.0.0", api_key="k").api_key == "k"
    with pytest.raises(ConfigError, match=r"rollout\.http\.host='0\.0\.0\.0'.*rollout\.http\.api_key"):
        load_config(ROOT / "configs/tiny.yaml", ["rollout.http.host=0.0.0.0"])
    monkeypatch.setenv("TANDEM_API_KEY", "from-env")
    cfg = load_config(ROOT / "configs/tiny.yaml", ["rollout.http.host=0.0.0.0"])
    assert cfg.rollout.http.api_key == "from-env"


def test_the_standalone_server_refuses_an_open_bind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rollout.server import parse_args, serve_standalone

    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    args = parse_args(["--standalone", "--model", str(tmp_path), "--host", "0.0.0.0"])
    with pytest.raises(SystemExit, match=r"can be reached from other hosts.*--api-key"):
        serve_standalone(args, threading.Event())  # before the model loads


def test_shipped_configs_hold_no_engine_key() -> None:
    for path in (ROOT / "configs").glob("*.yaml"):
        assert "change-me" not in path.read_text(), path


# --------------------------------------------------------------------------------- a run under attack


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BAD_REQUESTS: list[tuple[str, str]] = [
    ("/v1/completions", '{"model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": 1e-300}'),
    ("/v1/completions", '{"model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": 1e-30, "top_p": 1e-30}'),
    ("/v1/completions", '{"model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": NaN}'),
    ("/v1/completions", '{"model": "tiny", "prompt": "hi", "max_tokens": 4, "logit_bias": {"1": Infinity}}'),
    ("/v1/chat/completions", json.dumps({"model": "tiny", "max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 20_000}}]}]})),
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "extra": ' + "[" * 30_000 + "]" * 30_000 + "}"),
    ("/v1/sessions/guessed/finish", '{"reward": 1e308}'),
    ("/v1/completions", '{"model": "tiny", "prompt": "hi", "max_tokens": 4, "session_id": "guessed"}'),
]  # fmt: skip


@pytest.mark.faults
def test_a_run_under_attack_finishes_without_a_restart(tiny_ckpt, tmp_path: Path) -> None:
    from tandem.data import write_prompts
    from tests.test_launch import attach, launch_cmd, leftover_processes
    from toy.tasks import make_records

    prompts = write_prompts(tmp_path / "echo.jsonl", make_records("echo", 200))
    port, steps = free_port(), 15
    out = tmp_path / "out"
    cmd = launch_cmd(tiny_ckpt, prompts, out, f"learner.total_steps={steps}", f"rollout.http.port={port}",
                     f"rollout.http.api_key={KEY}", "supervision.server_restarts=2")  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    statuses: list[int] = []
    try:
        deadline = time.monotonic() + 50
        run_dir, client = attach(proc, out, deadline)
        url = f"http://127.0.0.1:{port}"
        while not client.exists(f"{run_dir.name}:ready:server-0"):
            assert time.monotonic() < deadline and proc.poll() is None, "the server did not get ready"
            time.sleep(0.05)
        while proc.poll() is None and int(client.get(f"{run_dir.name}:version") or 0) < steps - 2:
            for route, body in BAD_REQUESTS:
                try:
                    statuses.append(post(url, route, body, timeout=10).status_code)
                except httpx.TransportError:
                    break  # the run ended meanwhile
            assert time.monotonic() < deadline + 10, "the run did not finish in time"
        client.close()
        stdout, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stdout[-4000:]
    assert f"learner finished at step {steps}" in stdout
    assert statuses and not [s for s in statuses if s >= 500], statuses
    assert {200, 400, 403, 404} & set(statuses)  # greedy ones answered, the others refused
    assert (run_dir / "logs" / "server-0.log").read_text().count("=== ") == 1  # never restarted
    assert leftover_processes(run_dir) == []
