"""The LLM-judge reward plug-in (tandem/judge.py) through the real ``openai`` async client, against a small
FastAPI app started here that speaks the chat-completions shape. Its "model" is a rule: the score it replies
is the number of ``a`` in the response the rubric shows it, so every expected score is known by hand.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from fastapi import FastAPI, Request

from rollout.http.serve import HTTPServer
from tandem import judge as judge_module
from tandem.config import RewardConfig
from tandem.config.rollout import RewardFunction
from tandem.judge import parse_score
from tandem.rewards import RewardFunctions

RUBRIC = "Count the letter a.\nResponse: {completion}"


@dataclass
class Seen:
    bodies: list[dict] = field(default_factory=list)
    keys: set[str] = field(default_factory=set)
    inflight: int = 0
    peak: int = 0


def rule_judge(seen: Seen) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict:
        body = await request.json()
        seen.bodies.append(body)
        seen.keys.add(request.headers.get("authorization", ""))
        seen.inflight += 1
        seen.peak = max(seen.peak, seen.inflight)
        await asyncio.sleep(0.05)  # long enough for concurrent requests to overlap
        seen.inflight -= 1
        response = body["messages"][-1]["content"].split("Response: ", 1)[1]
        reply = "no idea" if response == "?" else f"Score: {response.count('a')}"
        return {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict:
        body = await request.json()
        seen.bodies.append(body)
        text = body["prompt"].split("Response: ", 1)[1].count("a")
        return {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 0,
            "model": body["model"],
            "choices": [{"index": 0, "text": f" {text}", "finish_reason": "stop", "logprobs": None}],
        }

    return app


@pytest.fixture
def endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Seen]]:
    monkeypatch.setenv("TANDEM_JUDGE_API_KEY", "sk-from-env")
    seen = Seen()
    server = HTTPServer(rule_judge(seen), "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{server.port}/v1", seen
    finally:
        server.stop()


def judge_rewards(base_url: str, **kwargs: object) -> RewardFunctions:
    settings = {"base_url": base_url, "model": "rule", "rubric": RUBRIC, "score_max": 8, **kwargs}
    cfg = RewardConfig(functions=[RewardFunction(path="tandem.judge:judge", kwargs=settings)], timeout_s=10)
    return RewardFunctions(cfg)


def only_judge() -> judge_module.Judge:
    (j,) = judge_module.JUDGES.values()
    return j


def test_the_judge_scores_caches_and_limits_concurrency(endpoint: tuple[str, Seen]) -> None:
    base_url, seen = endpoint
    judge_module.JUDGES.clear()
    rf = judge_rewards(base_url, max_concurrency=2)
    first = ["aaaa", "abab", "bbbb", "aaaaaaaa", "a", "ba"]
    groups = [("say a:", first, {}), ("say a:", list(reversed(first)), {})]  # each completion twice
    scored = rf.score_groups(groups)
    expected = [c.count("a") / 8 for c in first]  # by hand: the rule's count over score_max
    assert [t for t, _ in scored[0]] == expected
    assert [t for t, _ in scored[1]] == list(reversed(expected))
    j = only_judge()
    assert len(seen.bodies) == j.calls == 6  # the duplicates asked nothing
    assert j.cache_hits == 6
    assert rf.metrics() == {"reward/errors": 0, "reward/timeouts": 0, "judge/calls": 6, "judge/cache_hits": 6}
    assert seen.peak == 2  # concurrent, and never more than max_concurrency
    assert seen.bodies[0]["messages"][0]["content"].startswith("Count the letter a.")
    assert seen.keys == {"Bearer sk-from-env"}  # the key came from the environment
    rf.score_groups(groups)  # the next batch: all from the cache
    assert len(seen.bodies) == 6 and j.cache_hits == 18
    rf.close()


def test_a_reply_without_a_score_costs_only_its_sample(endpoint: tuple[str, Seen]) -> None:
    base_url, _ = endpoint
    judge_module.JUDGES.clear()
    rf = judge_rewards(base_url)
    scored = rf.score_group("say a:", ["aa", "?"], {})
    assert [t for t, _ in scored] == [0.25, 0.0]
    assert rf.errors == 1
    rf.close()


def test_a_rubric_field_the_record_lacks_is_an_error_naming_it(endpoint: tuple[str, Seen]) -> None:
    base_url, seen = endpoint
    judge_module.JUDGES.clear()
    rf = judge_rewards(base_url, rubric="Expected {answer}. Response: {completion}")
    assert rf.score_group("p", ["aa"], {"answer": "aaaa"})[0][0] == 0.25  # record fields fill the rubric
    assert rf.score_group("p", ["aa"], {})[0][0] == 0.0
    assert rf.errors == 1 and len(seen.bodies) == 1
    with pytest.raises(ValueError, match=r"names \{answer\}"):
        only_judge().render("p", "aa", {})
    rf.close()


def test_the_completions_api_sends_the_rubric_as_raw_text(endpoint: tuple[str, Seen]) -> None:
    base_url, seen = endpoint
    judge_module.JUDGES.clear()
    rf = judge_rewards(base_url, api="completions")
    assert [t for t, _ in rf.score_group("p", ["aaab", "b"], {})] == [3 / 8, 0.0]
    assert sorted(b["prompt"] for b in seen.bodies) == [
        "Count the letter a.\nResponse: aaab",
        "Count the letter a.\nResponse: b",
    ]
    rf.close()


def test_parse_score_reads_the_first_number_and_clips() -> None:
    assert parse_score("Score: 7/10", 10) == 0.7
    assert parse_score("12", 10) == 1.0
    assert parse_score("-3", 10) == 0.0
    assert parse_score("2.5", 5) == 0.5
    with pytest.raises(ValueError, match="no score"):
        parse_score("excellent", 10)


def test_a_served_judge_checkpoint_resolves_like_a_model_path(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tandem.config import load_config

    monkeypatch.chdir(tmp_path)
    judge = {"path": "tandem.judge:judge", "kwargs": {"serve": "assets/judge", "rubric": "assets/x"}}
    raw = {
        "run": {"name": "j"},
        "model": {"actor": "assets/tiny"},
        "data": {"prompts": "p.jsonl"},
        "reward": {"functions": [judge], "group_functions": [judge]},
    }
    cfg = load_config(None, raw=raw)
    for f in (*cfg.reward.functions, *cfg.reward.group_functions):
        assert f.kwargs == {"serve": str(tmp_path / "assets/judge"), "rubric": "assets/x"}  # only serve
