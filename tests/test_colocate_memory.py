"""Colocated runs release memory (docs/placement.md §11.1): engine sleep and wake, the learner's offload.

What runs here for real: the hf engine's sleep/wake on a tiny model saved with ``save_pretrained``, the
rollout loop's sleep and wake against a real Redis and the real shm transport, and DeepSpeed's gradients
between steps on CPU. What cannot run here is checked against replays and the real signatures, and each
test says so: vLLM's CPU build refuses ``--enable-sleep-mode`` ("Sleep mode is not supported on current
platform", ``vllm/config/model.py``), SGLang's memory saver needs CUDA, and DeepSpeed's ``offload_states``
moves states to host memory, which on CPU is where they already are. The routes and fields the vLLM and
SGLang paths use are rows of ``VLLM_API`` / ``SGLANG_API``, which tests/test_engines_contract.py checks
against the installed vLLM and the SGLang 0.5.23 wheel.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch
from deepspeed.runtime.engine import DeepSpeedEngine
from transformers import AutoModelForCausalLM

from buffer.admission import Admission
from learner.online import OnlineRuntime, offloads_states
from rollout.engines import sglang, vllm
from rollout.engines.base import SamplingParams
from rollout.engines.hf import HFEngine
from tandem.config import load_config
from tandem.net import EngineHTTPError
from tests.test_engines_protocol import disk_update, log, make_cfg, replays, urls  # noqa: F401 (fixtures)
from tests.test_rollout_loop import TIMEOUT, Harness, Learner, behaviour_logp, queue_prompts
from tests.test_rollout_loop import make_cfg as loop_cfg
from weightsync import make_subscriber
from weightsync.base import Publisher, Update, WeightSyncError

GREEDY = SamplingParams(max_new_tokens=8, temperature=0)


@pytest.fixture(scope="module")
def v1_weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """Another version of the tiny actor (same architecture, other weights), as a learner publishes it."""
    from toy.tiny import make_tiny

    path = make_tiny(tmp_path_factory.mktemp("tiny-v1"), seed=7)["actor"]
    model = AutoModelForCausalLM.from_pretrained(path)
    return {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}


def full_update(weights: dict[str, torch.Tensor], version: int) -> Update:
    return Update(version, [], lambda: iter(weights.items()))


def prompts_of(engine: HFEngine) -> list[list[int]]:
    return [engine.tokenizer(t).input_ids for t in ("say a:", "say bcd, then 12:", "x")]


# ------------------------------------------------------------------------------------------------ hf


def test_hf_sleep_frees_parameters_and_a_woken_engine_generates_as_a_never_slept_one(
    tiny_ckpt, v1_weights
) -> None:
    slept = HFEngine(str(tiny_ckpt["actor"]), device="cpu", seed=0)
    awake = HFEngine(str(tiny_ckpt["actor"]), device="cpu", seed=0)
    prompts = prompts_of(slept)
    model = slept.model
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    tied = model.config.tie_word_embeddings
    slept.sleep()
    assert slept.asleep and all(p.numel() == 0 for p in model.parameters())
    # Non-persistent buffers (rotary inv_freq) stay: no update carries them.
    assert buffers and all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    with pytest.raises(RuntimeError, match="released"):
        slept.generate(prompts, GREEDY)
    slept.wake_up(["weights"])
    with pytest.raises(RuntimeError, match="released"):  # allocated, not yet filled
        slept.generate(prompts, GREEDY)
    with pytest.raises(WeightSyncError, match="only a full update refills them"):
        slept.update_weights(full_update({k: v1_weights[k] for k in list(v1_weights)[:-1]}, 1))
    slept.update_weights(full_update(v1_weights, 1))
    slept.wake_up(["kv_cache"])
    awake.update_weights(full_update(v1_weights, 1))
    assert not slept.asleep
    if tied:  # one Parameter under two names: still one tensor after the refill
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    got, want = slept.generate(prompts, GREEDY), awake.generate(prompts, GREEDY)
    assert [g[0].token_ids for g in got] == [w[0].token_ids for w in want]
    assert [g[0].logprobs for g in got] == [w[0].logprobs for w in want]
    assert all(v == 1 for g in got for v in g[0].versions)
    with pytest.raises(ValueError, match="unknown tag"):
        slept.wake_up(["scheduling"])


def test_hf_zero_copy_engine_runs_on_the_shm_files_pages(
    redis_client, run_id, tiny_ckpt, tmp_path, v1_weights
) -> None:
    """Colocated with release (``zero_copy``), a woken engine's weights are the version's read-only file
    pages, not a copy: the same tokens and log-probabilities as a copying engine, through a second update
    without a sleep between (rebound, never written), and released again by ``sleep``."""
    from weightsync.shm import ShmPublisher, ShmSubscriber

    pub, sub = ShmPublisher(redis_client, run_id, tmp_path), ShmSubscriber(redis_client, run_id, "s0")
    shared = HFEngine(str(tiny_ckpt["actor"]), device="cpu", seed=0, zero_copy=True)
    copying = HFEngine(str(tiny_ckpt["actor"]), device="cpu", seed=0)
    prompts = prompts_of(shared)
    v0 = {k: v.clone() for k, v in copying.model.state_dict().items() if k != "lm_head.weight"}
    shared.sleep()
    shared.wake_up(["weights"])
    assert all(p.numel() == 0 for p in shared.model.parameters())  # nothing allocated: the files will do
    for version, weights in ((1, v1_weights), (2, v0)):
        pub.publish(weights.items(), version)
        upd = sub.poll()
        shared.update_weights(upd)
        copying.update_weights(upd)
        views = dict(upd.tensors())
        embed = "model.embed_tokens.weight"
        assert shared.model.get_parameter(embed).data_ptr() == views[embed].data_ptr()  # the file's pages
        assert copying.model.get_parameter(embed).data_ptr() != views[embed].data_ptr()
        shared.wake_up(["kv_cache"])
        got, want = shared.generate(prompts, GREEDY), copying.generate(prompts, GREEDY)
        assert [g[0].token_ids for g in got] == [w[0].token_ids for w in want]
        assert [g[0].logprobs for g in got] == [w[0].logprobs for w in want]
    shared.sleep()
    assert all(p.numel() == 0 for p in shared.model.parameters())


# ---------------------------------------------------------------------------------- vLLM and SGLang


def test_vllm_sleeps_at_level_2_and_wakes_weights_then_sync_then_kv_cache(urls, tmp_path) -> None:  # noqa: F811
    """Replay server (vLLM's CPU build refuses sleep mode): the routes and their order. The replay refuses
    a weight load while the weights sleep and generation while anything sleeps, as a level-2 sleep would."""
    cfg = make_cfg(tmp_path, engine="vllm", vllm={"url": urls["vllm"]})
    engine = vllm.VLLMEngine(cfg, "/models/none", server_index=0, device=None)
    engine.sleep()
    with pytest.raises(EngineHTTPError):
        engine.generate([[5]], SamplingParams(max_new_tokens=2))
    with pytest.raises(EngineHTTPError, match="collective_rpc"):
        engine.update_weights(disk_update(4, "/dev/shm/run/v4"))  # before wake_up(weights)
    start = len(log(urls["vllm"]))
    engine.wake_up(["weights"])
    engine.update_weights(disk_update(4, "/dev/shm/run/v4"))
    engine.wake_up(["kv_cache"])
    entries = log(urls["vllm"])[start:]
    # Asleep, scheduling is already paused and the prefix cache gone: no /pause, /reset_prefix_cache, /resume.
    assert [(e["route"], (e["body"] or {}).get("tags")) for e in entries] == [
        ("/wake_up", ["weights"]),
        ("/collective_rpc", None),
        ("/update_weight_version", None),
        ("/wake_up", ["kv_cache"]),
    ]
    sleep = next(e for e in log(urls["vllm"]) if e["route"] == "/sleep")
    assert sleep["query"] == {"level": "2", "mode": "wait"}
    assert engine.generate([[5]], SamplingParams(max_new_tokens=2))[0][0].versions == [4, 4]
    engine.close()
    # Every route and parameter used is a row the contract test checks against the real vLLM.
    rows = {(a.name, p) for a in vllm.VLLM_API if a.kind == "route" for p in ("", *a.params)}
    assert {("POST /sleep", "level"), ("POST /sleep", "mode"), ("POST /wake_up", "")} <= rows


def test_sglang_releases_and_resumes_weights_then_sync_then_kv_cache(urls, tmp_path) -> None:  # noqa: F811
    """Replay server (SGLang needs CUDA): release both tags, resume weights, load from disk without a cache
    flush (the cache is released), resume the KV cache."""
    cfg = make_cfg(tmp_path, engine="sglang", sglang={"url": urls["sglang"]})
    engine = sglang.SGLangEngine(cfg, "/models/none", server_index=0, device=None)
    engine.sleep()
    with pytest.raises(EngineHTTPError, match="resume_memory_occupation"):
        engine.update_weights(disk_update(2, "/dev/shm/run/v2"))
    start = len(log(urls["sglang"]))
    engine.wake_up(["weights"])
    engine.update_weights(disk_update(2, "/dev/shm/run/v2"))
    engine.wake_up(["kv_cache"])
    entries = log(urls["sglang"])[start:]
    assert [e["route"] for e in entries] == [
        "/resume_memory_occupation",
        "/update_weights_from_disk",
        "/resume_memory_occupation",
    ]
    assert [entries[0]["body"], entries[2]["body"]] == [{"tags": ["weights"]}, {"tags": ["kv_cache"]}]
    assert entries[1]["body"]["flush_cache"] is False
    released = next(e for e in log(urls["sglang"]) if e["route"] == "/release_memory_occupation")
    assert released["body"] == {"tags": ["weights", "kv_cache"]}
    assert engine.generate([[5]], SamplingParams(max_new_tokens=2))[0][0].versions == [2, 2]
    engine.close()


def test_engine_servers_start_able_to_sleep_only_colocated_on_gpu(tmp_path) -> None:
    def cfg(engine: str, mode: str, release: bool):
        c = make_cfg(tmp_path, engine=engine)
        run = c.run.model_copy(update={"mode": mode})
        return c.model_copy(
            update={"run": run, "placement": c.placement.model_copy(update={"release_memory": release})}
        )

    gpu = vllm.serve_argv(cfg("vllm", "sync", True), "/m", "127.0.0.1", 1)
    assert "--enable-sleep-mode" in gpu
    assert "--enable-sleep-mode" not in vllm.serve_argv(cfg("vllm", "sync", True), "/m", "h", 1, cpu=True)
    assert "--enable-sleep-mode" not in vllm.serve_argv(cfg("vllm", "async", True), "/m", "h", 1)
    assert "--enable-sleep-mode" not in vllm.serve_argv(cfg("vllm", "sync", False), "/m", "h", 1)
    assert "--enable-memory-saver" in sglang.launch_argv(cfg("sglang", "sync", True), "/m", "h", 1)
    assert "--enable-memory-saver" not in sglang.launch_argv(cfg("sglang", "async", True), "/m", "h", 1)


# ------------------------------------------------------------------------------------- the rollout loop


class RecordingHF(HFEngine):
    """The real hf engine, recording its sleep/wake/update calls in order."""

    calls: list[str]

    def sleep(self) -> None:
        self.calls.append("sleep")
        super().sleep()

    def wake_up(self, tags=None) -> None:
        self.calls.append(f"wake:{','.join(tags or [])}")
        super().wake_up(tags)

    def update_weights(self, update: Update) -> None:
        self.calls.append(f"update:{update.version}")
        super().update_weights(update)


def colocated(run_id, redis_url, tiny_ckpt, tmp_path, release: bool):
    cfg = loop_cfg(run_id, redis_url, tiny_ckpt, tmp_path)
    raw = json.loads(cfg.model_dump_json())
    raw["run"]["mode"] = "sync"
    raw["placement"].update(mode="colocate", release_memory=release)
    return load_config(None, raw=raw)


def wait_until(what, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize("release", [True, False])
def test_colocated_loop_sleeps_while_the_learner_trains_and_wakes_weights_sync_kv(
    redis_server, redis_client, run_id, tiny_ckpt, tmp_path, v1_weights, release
) -> None:
    cfg = colocated(run_id, redis_server.url, tiny_ckpt, tmp_path, release)
    assert cfg.releases_memory is release
    engine = RecordingHF(str(tiny_ckpt["actor"]), device="cpu", seed=0)
    engine.calls = []
    v0 = {k: v.clone() for k, v in engine.model.state_dict().items() if k != "lm_head.weight"}
    learner = Learner(cfg, redis_client, v0)
    queue_prompts(learner.buffer, engine, 8)
    with Harness(cfg, redis_client, engine, make_subscriber(cfg, redis_client, "server-0")) as h:
        learner.take(4)
        if release:  # the batch is in: the server waits for v1 with its memory freed
            wait_until(lambda: h.loop.weights.asleep)  # after the engine's release and the subscriber's
            assert all(p.numel() == 0 for p in engine.model.parameters())
            # v1's weights are announced, but admission stays closed while the learner offloads its
            # states (on GPU): the server must not wake beside them.
            learner.publisher.publish(v1_weights.items(), 1)
            time.sleep(1.0)
            assert engine.asleep and "wake:weights" not in engine.calls
            learner.version = 1
            learner.admission.set_version(1)
        else:
            time.sleep(1.0)
            assert not engine.asleep
            learner.step(v1_weights)
        second = learner.take(4)
    i = engine.calls.index("update:1")
    if release:
        assert engine.calls[: i + 2] == ["update:0", "sleep", "wake:weights", "update:1", "wake:kv_cache"]
        assert h.loop.totals["time/sleep"] > 0 and h.loop.totals["time/wake"] > 0
    else:
        assert engine.calls[: i + 1] == ["update:0", "update:1"]
    assert all(set(t.token_versions.tolist()) == {1} for t in second)
    np.testing.assert_allclose(
        second[0].behav_logp, behaviour_logp(v1_weights, tiny_ckpt, second[0]), atol=1e-4
    )


def test_the_servers_reference_sleeps_with_the_engine_and_scores_again_after(
    redis_server, redis_client, run_id, tiny_ckpt, tmp_path, v1_weights
) -> None:
    """``placement.reference: server``, colocated with ``release_memory``: the reference's memory goes with
    the engine's while the learner trains (on CPU dropped, then read again from its checkpoint), and the
    next batch, generated by v1, is scored by the reference's own weights, not the engine's."""
    import threading

    from buffer.streams import ReplayBuffer
    from rollout.loop import RolloutLoop
    from rollout.reference import load_reference
    from tandem.rewards import RewardFunctions
    from tandem.telemetry import Telemetry

    raw = json.loads(colocated(run_id, redis_server.url, tiny_ckpt, tmp_path, True).model_dump_json())
    raw["placement"]["reference"], raw["algorithm"]["kl_coef"], raw["rollout"]["temperature"] = (
        "server",
        0.1,
        1.0,
    )
    cfg = load_config(None, raw=raw)
    engine = RecordingHF(str(tiny_ckpt["actor"]), device="cpu", seed=0)
    engine.calls = []
    v0 = {k: v.clone() for k, v in engine.model.state_dict().items() if k != "lm_head.weight"}
    learner = Learner(cfg, redis_client, v0)
    queue_prompts(learner.buffer, engine, 8)
    reference = load_reference(cfg)
    assert reference is not None
    loop = RolloutLoop(
        cfg, engine, engine.tokenizer, ReplayBuffer.from_config(redis_client, cfg, consumer="server-0"),
        make_subscriber(cfg, redis_client, "server-0"), Telemetry(cfg, "server-0", redis_client),
        server_index=0, rewards=RewardFunctions(cfg.reward), reference=reference,
    )  # fmt: skip
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        learner.take(4)
        wait_until(lambda: loop.weights.asleep)  # set after the engine's and the reference's release
        assert reference.released and reference.model is None  # CPU: dropped, not parked
        learner.step(v1_weights)
        second = learner.take(4)
    finally:
        loop.stop_event.set()
        thread.join(TIMEOUT)
    assert not thread.is_alive()
    for t in second:
        assert set(t.token_versions.tolist()) == {1}
        np.testing.assert_allclose(t.ref_logp, behaviour_logp(v0, tiny_ckpt, t), atol=1e-4)
        assert not np.allclose(t.ref_logp, t.behav_logp, atol=1e-3)  # the engine's v1 differs


def test_admission_reopened_at_the_held_version_wakes_from_its_shm_files(
    redis_server, redis_client, run_id, tiny_ckpt, tmp_path, v1_weights
) -> None:
    """A group given back (dynamic sampling, a server gone) reopens admission before a new version: the
    sleeping server reloads the version it holds from its shm directory and generates with it."""
    cfg = colocated(run_id, redis_server.url, tiny_ckpt, tmp_path, True)
    engine = RecordingHF(str(tiny_ckpt["actor"]), device="cpu", seed=0)
    engine.calls = []
    learner = Learner(cfg, redis_client, v1_weights)  # v0 published: other weights than the checkpoint's
    queue_prompts(learner.buffer, engine, 8)
    with Harness(cfg, redis_client, engine, make_subscriber(cfg, redis_client, "server-0")) as h:
        first = learner.take(4)
        wait_until(lambda: h.loop.weights.asleep)
        slept = len(engine.calls)
        learner.admission.refund(4)  # one batch's admission back, at version 0
        again = learner.take(4)
    assert engine.calls[slept : slept + 3] == ["wake:weights", "update:0", "wake:kv_cache"]
    for t in (first[0], again[0]):
        assert set(t.token_versions.tolist()) == {0}
        np.testing.assert_allclose(t.behav_logp, behaviour_logp(v1_weights, tiny_ckpt, t), atol=1e-4)


def test_a_server_woken_after_the_learner_freed_its_files_waits_for_the_next_version(
    redis_server, redis_client, run_id, tiny_ckpt, tmp_path, v1_weights
) -> None:
    """The learner frees every version's files while it trains (``trim(held_too=True)``). Admission reopened
    at the held version then finds no files to wake with: the server waits for the next version, which
    that training makes, and generates with it."""
    cfg = colocated(run_id, redis_server.url, tiny_ckpt, tmp_path, True)
    engine = RecordingHF(str(tiny_ckpt["actor"]), device="cpu", seed=0)
    engine.calls = []
    v0 = {k: v.clone() for k, v in engine.model.state_dict().items() if k != "lm_head.weight"}
    learner = Learner(cfg, redis_client, v0)
    queue_prompts(learner.buffer, engine, 8)
    with Harness(cfg, redis_client, engine, make_subscriber(cfg, redis_client, "server-0")) as h:
        learner.take(4)
        wait_until(lambda: h.loop.weights.asleep)
        learner.publisher.trim(held_too=True)
        assert learner.publisher.versions_on_disk() == []
        learner.admission.refund(4)  # admission back at version 0, whose files are gone
        time.sleep(0.5)
        assert engine.asleep  # no files to wake with: it waits
        learner.step(v1_weights)
        again = learner.take(4)
    assert all(set(t.token_versions.tolist()) == {1} for t in again)


# ------------------------------------------------------------------------------------------- learner


def test_learner_offloads_states_around_the_wait_only_where_it_frees_something(tmp_path) -> None:
    """Mocks built from DeepSpeedEngine's real signatures (a GPU call: on CPU there is nowhere to offload
    to). Offloaded before the wait, reloaded after it, the wait in between; admission for the published
    version opens between the offload and the wait, not at the publish; nothing on CPU."""
    raw = {
        "run": {"output_dir": str(tmp_path), "mode": "sync"},
        "model": {"actor": "/models/none"},
        "data": {"prompts": "/data/none.jsonl"},
        "reward": {"functions": [{"path": "toy.tasks.reverse:reward"}]},
        "learner": {"zero_stage": 2},
    }
    cfg = load_config(None, raw=raw)
    assert offloads_states(cfg, torch.device("cuda"))
    assert not offloads_states(cfg, torch.device("cpu"))
    raw["learner"]["zero_stage"] = 0  # the torch optimizer has no offload_states
    assert not offloads_states(load_config(None, raw=raw), torch.device("cuda"))
    raw["learner"]["zero_stage"], raw["placement"] = 2, {"release_memory": False}
    assert not offloads_states(load_config(None, raw=raw), torch.device("cuda"))

    order = mock.Mock()
    actor = mock.create_autospec(DeepSpeedEngine, instance=True)
    critic = mock.create_autospec(DeepSpeedEngine, instance=True)
    order.attach_mock(actor, "actor")
    order.attach_mock(critic, "critic")
    rt = object.__new__(OnlineRuntime)
    rt.cfg, rt.device, rt.lead, rt.version, rt.world = cfg, torch.device("cuda"), True, 3, 1
    rt.models = SimpleNamespace(actor=actor, critic=critic)
    rt.publisher = mock.create_autospec(Publisher, instance=True)
    rt.admission = mock.create_autospec(Admission, instance=True)
    order.attach_mock(rt.publisher, "publisher")
    order.attach_mock(rt.admission, "admission")
    rt.published_tensors = lambda: iter([])
    rt.sync_weights()  # publishes v3 with no announce of the version: admission stays closed
    assert [c[0] for c in order.mock_calls] == ["publisher.publish"]
    assert order.mock_calls[0].kwargs["announce"] is None and rt.admission_due
    order.reset_mock()
    rt._take_batch = lambda: order.wait()
    rt.take_batch()
    assert [c[0] for c in order.mock_calls] == [
        "actor.offload_states",
        "critic.offload_states",
        "admission.set_version",  # the servers wake only now, beside no training state
        "wait",
        "actor.reload_states",
        "critic.reload_states",
        "publisher.trim",  # the servers hold the newest version: the older files go before training
    ]
    assert set(rt.switch) == {"time/offload", "time/reload"}
    assert order.mock_calls[2].args == (3,)
    actor.reset_mock()
    rt.device = torch.device("cpu")
    rt.sync_weights()  # nothing to offload: the publish announces the version at once
    assert rt.publisher.publish.call_args.kwargs["announce"] == rt.admission.queue_version
    assert not rt.admission_due
    rt.take_batch()
    actor.offload_states.assert_not_called()


def test_deepspeed_holds_no_gradients_between_steps_on_cpu(tiny_ckpt, tmp_path) -> None:
    """The colocated peak on CPU depends on it: after each step the learner's gradients are freed
    (DeepSpeed zeroes them with set_to_none at stage 0), so between steps only weights and Adam state stay."""
    from learner.models import init_distributed, make_engine

    raw = {
        "run": {"output_dir": str(tmp_path), "device": "cpu"},
        "model": {"actor": str(tiny_ckpt["actor"])},
        "data": {"prompts": "/data/none.jsonl"},
        "reward": {"functions": [{"path": "toy.tasks.reverse:reward"}]},
    }
    cfg = load_config(None, raw=raw)
    init_distributed(torch.device("cpu"))
    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt["actor"])
    engine = make_engine(model, cfg, torch.float32, 1e-3)
    ids = torch.randint(0, 20, (2, 6))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    assert any(p.grad is not None for p in model.parameters())
    engine.step()
    assert all(p.grad is None for p in model.parameters())
    assert not hasattr(engine.optimizer, "offload_states")  # stage 0: a torch optimizer, nothing to call
    with pytest.raises(AttributeError):
        engine.offload_states()
