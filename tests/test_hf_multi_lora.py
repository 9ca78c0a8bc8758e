"""Several LoRA adapters served at once by the hf engine (rollout/engines/hf_lora.py).

Real peft adapters on the tiny checkpoint, saved with ``save_pretrained``; each adapter's reference is its
merged model (``merge_and_unload``), served alone by a plain engine. A row of adapter ``a`` must decode as
``a``'s merged model does, whichever rows of other adapters share its steps.
"""

from __future__ import annotations

import threading
from pathlib import Path

import anthropic
import openai
import pytest
import torch

from learner.lora import merge
from rollout.engines.adapter_view import AdapterEngine
from rollout.engines.base import SamplingParams
from rollout.engines.hf import HFEngine
from rollout.engines.hf_lora import check_adapter_dir, load_adapters
from rollout.http.app import create_app
from rollout.http.serve import HTTPServer
from rollout.metrics import ServerMetrics
from rollout.server import parse_args
from tandem.config import HTTPConfig
from toy.tiny import make_tiny_lora
from weightsync.base import Update, WeightSyncError

NAMES = ("echo", "reverse")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)


def make_adapter(base: Path, out: Path, seed: int, **extra: object) -> Path:
    """A rank-4 LoRA of ``base`` whose large B moves the greedy tokens away from the base model's."""
    return make_tiny_lora(base, out, rank=4, seed=seed, b_scale=20.0, **extra)


@pytest.fixture(scope="module")
def adapters(tiny_ckpt: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {name: make_adapter(tiny_ckpt["actor"], root / name, seed=i) for i, name in enumerate(NAMES)}


@pytest.fixture(scope="module")
def references(
    tiny_ckpt: dict[str, Path], adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str | None, HFEngine]:
    """Each adapter's merged model, and the base model (key None), each in an engine of its own."""
    root = tmp_path_factory.mktemp("merged")
    out: dict[str | None, HFEngine] = {None: HFEngine(str(tiny_ckpt["actor"]), device="cpu")}
    for name, path in adapters.items():
        out[name] = HFEngine(str(merge(tiny_ckpt["actor"], path, root / name)), device="cpu")
    return out


@pytest.fixture(scope="module")
def engine(tiny_ckpt: dict[str, Path], adapters: dict[str, Path]) -> HFEngine:
    return HFEngine(str(tiny_ckpt["actor"]), device="cpu", loras={n: str(p) for n, p in adapters.items()})


def prompts(engine: HFEngine) -> list[list[int]]:
    return [engine.tokenizer(t, add_special_tokens=False).input_ids for t in ("say a b c:", "hi")]


def test_rows_of_different_adapters_share_steps_and_decode_as_their_merged_models(
    engine: HFEngine, references: dict[str | None, HFEngine]
) -> None:
    rows = prompts(engine)
    seen: list[set[str | None]] = []  # the adapters of each forward's rows
    forward = engine._forward

    def recording(ids, mask, positions, cache, adapters=(), **kw):
        seen.append(set(adapters))
        return forward(ids, mask, positions, cache, adapters, **kw)

    engine._forward = recording  # type: ignore[method-assign]
    got: dict[str | None, list] = {}
    start = threading.Barrier(3)

    def call(adapter: str | None) -> None:
        start.wait()
        sampling = SamplingParams(max_new_tokens=24, temperature=0.0, adapter=adapter)
        got[adapter] = engine.generate(rows, sampling)

    threads = [threading.Thread(target=call, args=(a,)) for a in (*NAMES, None)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        del engine._forward
    assert any(len(s) >= 2 for s in seen), f"no step held rows of two adapters: {seen[:5]}"
    for adapter, out in got.items():
        want = references[adapter].generate(rows, SamplingParams(max_new_tokens=24, temperature=0.0))
        for g, w in zip(out, want, strict=True):
            assert g[0].token_ids == w[0].token_ids, adapter
            assert g[0].logprobs == pytest.approx(w[0].logprobs, abs=2e-4), adapter
    # The adapters do change the model, so a row given another's adapter would have been caught above.
    firsts = {a: tuple(out[0][0].token_ids) for a, out in got.items()}
    assert len(set(firsts.values())) == 3, firsts


def test_the_prefix_cache_never_hands_one_adapters_kv_to_another(
    engine: HFEngine, references: dict[str | None, HFEngine]
) -> None:
    assert engine.prefix_cache is not None
    prompt = prompts(engine)[0]
    (first,) = engine.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0.0, adapter="echo"))[0]
    turn = prompt + first.token_ids + prompt  # the next turn extends the cached sequence
    hits = engine.prefix_cache.stats.hits
    (other,) = engine.generate([turn], SamplingParams(max_new_tokens=6, temperature=0.0, adapter="reverse"))[
        0
    ]
    assert engine.prefix_cache.stats.hits == hits  # echo's KV is not reverse's
    (want,) = references["reverse"].generate([turn], SamplingParams(max_new_tokens=6, temperature=0.0))[0]
    assert other.token_ids == want.token_ids
    (again,) = engine.generate([turn], SamplingParams(max_new_tokens=6, temperature=0.0, adapter="echo"))[0]
    assert engine.prefix_cache.stats.hits == hits + 1  # and the same adapter does reuse its own
    (want,) = references["echo"].generate([turn], SamplingParams(max_new_tokens=6, temperature=0.0))[0]
    assert again.token_ids == want.token_ids


def test_a_full_weight_update_reaches_the_base_under_the_adapters(
    tiny_ckpt: dict[str, Path], adapters: dict[str, Path], references: dict[str | None, HFEngine]
) -> None:
    """The base weights keep their names and tensors under peft, so a full update still lands in them: the
    base model updated to echo's merged weights decodes as echo does."""
    engine = HFEngine(str(tiny_ckpt["actor"]), device="cpu", loras={n: str(p) for n, p in adapters.items()})
    echo = dict(references["echo"].model.state_dict())
    engine.update_weights(Update(1, [], lambda: iter(echo.items())))
    rows = prompts(engine)
    (got,) = engine.generate(rows[:1], GREEDY)[0]
    (want,) = references["echo"].generate(rows[:1], GREEDY)[0]
    assert got.token_ids == want.token_ids and engine.version == 1
    (with_adapter,) = engine.generate(
        rows[:1], SamplingParams(max_new_tokens=12, temperature=0.0, adapter="echo")
    )[0]
    assert with_adapter.token_ids != want.token_ids  # echo's adapter now sits on top of echo's merged weights


def test_an_adapter_not_served_is_refused_naming_those_that_are(engine: HFEngine) -> None:
    with pytest.raises(ValueError, match=r"'nope' is not served here \(served: echo, reverse\)"):
        engine.generate(prompts(engine)[:1], SamplingParams(adapter="nope"))


def test_the_http_api_lists_the_adapters_and_routes_each_request_by_model(engine: HFEngine) -> None:
    app = create_app(
        engine,
        engine.tokenizer,
        model_name="tiny",
        http=HTTPConfig(),
        metrics=ServerMetrics(engine),
        max_context=engine.max_positions,
        adapters=engine.adapters,
    )
    server = HTTPServer(app, "127.0.0.1", 0).start()
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="-", max_retries=0)
        listed = client.models.list().data
        assert [m.id for m in listed] == ["tiny", *NAMES]
        assert [getattr(m, "parent", None) for m in listed] == [None, "tiny", "tiny"]
        prompt = prompts(engine)[0]
        for model, adapter in (("tiny", None), ("echo", "echo"), ("reverse", "reverse")):
            r = client.completions.create(model=model, prompt="say a b c:", max_tokens=8, temperature=0)
            (c,) = engine.generate(
                [prompt], SamplingParams(max_new_tokens=8, temperature=0, adapter=adapter)
            )[0]
            assert r.choices[0].text == engine.tokenizer.decode(c.token_ids, skip_special_tokens=True)
            assert r.model == model
        with pytest.raises(openai.NotFoundError, match="'nope' does not exist"):
            client.completions.create(model="nope", prompt="hi", max_tokens=2)
        # Chat and the Messages API pass the model through too: the same adapter answers both alike.
        said = {}
        for model in ("tiny", "echo"):
            chat = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0
            )
            said[model] = chat.choices[0].message.content
            claude = anthropic.Anthropic(
                base_url=f"http://127.0.0.1:{server.port}", api_key="-", max_retries=0
            )
            reply = claude.messages.create(  # (this SDK release no longer takes temperature itself)
                model=model,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=8,
                extra_body={"temperature": 0},
            )
            assert "".join(b.text for b in reply.content if b.type == "text") == said[model]
        assert said["tiny"] != said["echo"]
    finally:
        server.stop()


def test_adapter_directories_that_cannot_share_a_batch_are_refused(
    tiny_ckpt: dict[str, Path], adapters: dict[str, Path], tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=r"LoRA adapter x=.*: no adapter_config.json"):
        check_adapter_dir("x", tmp_path)
    saved = make_adapter(tiny_ckpt["actor"], tmp_path / "norm", seed=3, modules_to_save=["lm_head"])
    with pytest.raises(ValueError, match=r"modules_to_save \['lm_head'\]"):
        check_adapter_dir("norm", saved)
    with pytest.raises(ValueError, match="use_dora"):
        check_adapter_dir("d", make_adapter(tiny_ckpt["actor"], tmp_path / "dora", seed=4, use_dora=True))
    with pytest.raises(ValueError, match="__base__"):
        load_adapters(torch.nn.Linear(2, 2), {"__base__": adapters["echo"]})


def test_the_standalone_server_reads_lora_modules(tmp_path: Path) -> None:
    args = parse_args(["--standalone", "--model", "m", "--lora", "a=/x", "--lora", "b=/y"])
    assert args.lora == {"a": "/x", "b": "/y"}
    for bad in (["--lora", "a"], ["--lora", "=x"], ["--lora", "a=/x", "--lora", "a=/y"]):
        with pytest.raises(SystemExit):
            parse_args(["--standalone", "--model", "m", *bad])
    with pytest.raises(SystemExit):
        parse_args(["--config", "c.yaml", "--lora", "a=/x"])


def test_an_empty_adapter_takes_a_learners_adapter_only_updates_each_with_its_own_version(
    tiny_ckpt: dict[str, Path], adapters: dict[str, Path], references: dict[str | None, HFEngine]
) -> None:
    """As each adapter's run does (learner.lora.adapters): the adapter starts as the base model, then a
    LoRA actor's published update (learner/lora.py adapter_tensors) makes it decode as that actor."""
    from peft import LoraConfig, PeftModel
    from transformers import AutoModelForCausalLM

    from learner.lora import adapter_tensors

    empty = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS)
    engine = HFEngine(str(tiny_ckpt["actor"]), device="cpu", loras={"one": empty, "two": empty})
    rows = prompts(engine)[:1]
    as_base = SamplingParams(max_new_tokens=12, temperature=0.0, adapter="one")
    (base,) = references[None].generate(rows, GREEDY)[0]
    assert engine.generate(rows, as_base)[0][0].token_ids == base.token_ids
    actor = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_ckpt["actor"]), str(adapters["echo"])
    )
    published = dict(adapter_tensors(actor, actor.named_parameters()))
    view = AdapterEngine(engine, "one")  # what adapter one's rollout loop drives
    view.update_weights(Update(7, [], lambda: iter(published.items())))
    assert view.version == 7 and engine.version == 0
    (got,) = view.generate(rows, GREEDY)[0]
    (want,) = references["echo"].generate(rows, GREEDY)[0]
    assert got.token_ids == want.token_ids
    assert got.logprobs == pytest.approx(want.logprobs, abs=2e-4)
    assert set(got.versions) == {7} and engine.adapter_version("one") == 7
    (other,) = engine.generate(rows, SamplingParams(max_new_tokens=12, temperature=0.0, adapter="two"))[0]
    assert other.token_ids == base.token_ids and set(other.versions) == {0}  # b and the base untouched
    assert engine.generate(rows, GREEDY)[0][0].token_ids == base.token_ids
    wrong = {k: (v[:2] if k.endswith("lora_A.weight") else v) for k, v in published.items()}
    with pytest.raises(WeightSyncError, match="the update's A"):
        engine.update_adapter("two", Update(1, [], lambda: iter(wrong.items())))
    assert engine.adapter_version("two") == 0
