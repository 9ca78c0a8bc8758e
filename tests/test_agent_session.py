"""A black-box agent on the OpenAI client: its session becomes a token-exact trajectory that trains
(docs/environments.md §10.6). Real openai client, real HTTP server, real hf engine, the learner's forward pass."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from buffer.schema import Trajectory, decode_trajectory, encode_trajectory
from learner.batch import make_batch
from rollout.engines.hf import HFEngine
from rollout.http.app import create_app
from rollout.http.serve import HTTPServer
from rollout.metrics import ServerMetrics
from tandem.config import HTTPConfig
from tests.test_env_episode import learner_logp


def calculator_agent(client: openai.OpenAI, question: str, session: str) -> str:
    """A tool-using agent that knows nothing of tandem: asks, runs a 'tool', asks again with the result."""
    headers = {"X-Session-Id": session}
    first = (
        client.completions.create(
            model="tiny", prompt=question, max_tokens=6, stop=["\n"], extra_headers=headers
        )
        .choices[0]
        .text
    )
    transcript = question + first + "\n=85\n"  # the tool's answer, added as text by the agent
    second = (
        client.completions.create(
            model="tiny", prompt=transcript, max_tokens=6, extra_body={"session_id": session}
        )
        .choices[0]
        .text
    )
    return second


KEY = "agent-test-key"  # a server with a sink takes finished sessions only with its key
AUTH = {"Authorization": f"Bearer {KEY}"}


def open_session(url: str) -> str:
    """A session id issued by the server (it takes no other)."""
    return httpx.post(f"{url}/v1/sessions", headers=AUTH, timeout=30).json()["id"]


@pytest.fixture(scope="module")
def served(tiny_ckpt):
    engine = HFEngine(str(tiny_ckpt["actor"]), device="cpu", seed=11)
    sunk: list[Trajectory] = []
    app = create_app(engine, engine.tokenizer, model_name="tiny", http=HTTPConfig(api_key=KEY),
                     metrics=ServerMetrics(engine), max_context=engine.max_positions, sink=sunk.append)  # fmt: skip
    server = HTTPServer(app, "127.0.0.1", 0).start()
    yield engine, f"http://127.0.0.1:{server.port}", sunk
    server.stop()


def test_agent_session_is_a_token_exact_trajectory(served, tiny_ckpt) -> None:
    from transformers import AutoModelForCausalLM

    engine, url, sunk = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=60, max_retries=0)
    sid = open_session(url)
    calculator_agent(client, "37+48=", sid)
    r = httpx.post(
        f"{url}/v1/sessions/{sid}/finish", json={"reward": 1.0, "group_id": "g"}, headers=AUTH, timeout=30
    )
    assert r.status_code == 200, r.text
    assert r.json()["calls"] == 2
    (t,) = sunk
    t = decode_trajectory(encode_trajectory(t))
    kinds = [k for k, _, _ in t.segments()]
    assert kinds == ["model", "env", "model"], kinds  # the tool result is context, mask 0
    tok = engine.tokenizer
    assert t.prompt_tokens.tolist() == tok("37+48=", add_special_tokens=False)["input_ids"]
    _, s, e = t.segments()[1]
    env_text = tok.decode(t.response_tokens[s:e].tolist())
    assert env_text.endswith("=85\n"), env_text
    # behav_logp are the engine's, and equal the learner's forward over the whole sequence
    ref = learner_logp(AutoModelForCausalLM.from_pretrained(tiny_ckpt["actor"]).eval(), [t])[0]
    gen = np.flatnonzero(t.generated)
    np.testing.assert_allclose(t.behav_logp[gen], ref[gen].numpy(), atol=2e-4)
    assert (make_batch([t], 0).mask[0, : len(t.loss_mask)].numpy() == t.loss_mask).all()


def test_a_prompt_that_rewrites_history_starts_a_segment(served) -> None:
    """rollout.http.session.on_rewrite: split (the default); tests/test_agent_segments.py has refuse."""
    _, url, sunk = served
    sunk.clear()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=60, max_retries=0)
    sid = open_session(url)
    for prompt in ["12+30=", "99+1="]:
        client.completions.create(
            model="tiny", prompt=prompt, max_tokens=3, extra_headers={"X-Session-Id": sid}
        )
    r = httpx.post(f"{url}/v1/sessions/{sid}/finish", json={"reward": 0.5}, headers=AUTH, timeout=30)
    assert r.status_code == 200 and len(r.json()["segments"]) == 2
    tok = served[0].tokenizer
    assert [tok.decode(t.prompt_tokens.tolist()) for t in sunk] == ["12+30=", "99+1="]
    assert [t.reward for t in sunk] == [0.5, 0.5]
    r = httpx.post(f"{url}/v1/sessions/nope/finish", json={"reward": 1.0}, headers=AUTH, timeout=30)
    assert r.status_code == 404


@pytest.mark.slow
def test_agent_trajectories_train(served, tiny_ckpt, tmp_path) -> None:
    """Two agent sessions as one group (rewards 1 and 0) through the real learner's train step: the
    rewarded session's generated tokens become more likely."""
    from learner.models import load_models
    from learner.ppo import PPOLearner
    from tandem.config import load_config
    from tests.test_learner import raw_config

    _, url, sunk = served
    sunk.clear()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=60, max_retries=0)
    for reward in [1.0, 0.0]:
        sid = open_session(url)
        calculator_agent(client, "37+48=", sid)
        assert (
            httpx.post(
                f"{url}/v1/sessions/{sid}/finish", json={"reward": reward, "group_id": "g"}, headers=AUTH
            ).status_code
            == 200
        )
    raw = raw_config(tiny_ckpt, "redis://unused", "agent", tmp_path,
                     rollout={"n_samples": 2}, algorithm={"batch_size": 2, "minibatch_size": 2},
                     learner={"micro_batch_size": 2, "actor_lr": 1e-2})  # fmt: skip
    cfg = load_config(None, raw=raw)
    learner = PPOLearner(cfg, tmp_path)
    learner.models = load_models(cfg, learner.device)
    model = learner.models.actor.module
    before = learner_logp(model, sunk)
    stats = learner.train(make_batch(sunk, 0))
    after = learner_logp(model, sunk)
    assert np.isfinite(stats["loss/policy"])
    mask = make_batch(sunk, 0).mask
    gain = ((after - before) * mask).sum(-1) / mask.sum(-1)
    assert gain[0] > 0 > gain[1], gain
