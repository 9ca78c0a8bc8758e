"""The vLLM/SGLang adapters and the learner's EnginePublisher against a local replay of the engines' protocol.

No GPU engine runs in these tests. ``tests/engine_replay_server.py`` replays the documented vLLM 0.33.0 and
SGLang 0.5.23 routes and rules; what is checked is our side: request order, payloads, pause modes, version
stamping and error handling. The weight data plane is a real gloo broadcast between this process and the
replay servers (SGLang's own ``backend: gloo`` option; for vLLM, gloo stands in for PyNccl, which needs a GPU).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from rollout.engines._http import ManagedServer
from rollout.engines.base import EngineExited, SamplingParams
from rollout.engines.sglang import SGLangEngine
from rollout.engines.vllm import VLLMEngine
from tandem.config import Config, load_config
from tandem.net import EngineHTTPError
from weightsync.base import Update, WeightSyncError, latest_version
from weightsync.engine_push import (
    EngineEndpoint,
    EnginePublisher,
    EngineVersionSubscriber,
    TorchGroup,
    register_engine,
)

REPLAY = Path(__file__).with_name("engine_replay_server.py")
ROOT = Path(__file__).resolve().parents[1]


def start_replay(kind: str, tmp: Path) -> tuple[ManagedServer, str]:
    port_file = tmp / f"{kind}.port"
    argv = [sys.executable, str(REPLAY), "--kind", kind, "--port-file", str(port_file)]
    env = {"PYTHONPATH": str(ROOT)}
    server = ManagedServer(f"{kind} replay", argv, env=env, log_path=tmp / f"{kind}.log")
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if time.monotonic() > deadline or server.proc.poll() is not None:
            server.stop()
            raise RuntimeError(f"{kind} replay server did not start:\n{server.log_tail()}")
        time.sleep(0.1)
    url = f"http://127.0.0.1:{port_file.read_text()}"
    from tandem.net import EngineClient

    client = EngineClient(url, f"{kind} replay", timeout=5)
    server.wait_healthy(client, "/health", 60)
    client.close()
    return server, url


@pytest.fixture(scope="module")
def replays(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("replay")
    servers = {kind: start_replay(kind, tmp) for kind in ("vllm", "sglang")}
    yield {kind: url for kind, (_, url) in servers.items()}
    for server, _ in servers.values():
        server.stop(grace_s=5)


@pytest.fixture
def urls(replays: dict[str, str]) -> dict[str, str]:
    for url in replays.values():
        httpx.post(f"{url}/_reset", timeout=5).raise_for_status()
    return replays


def make_cfg(tmp_path: Path, **rollout: object) -> Config:
    raw = {
        "run": {"output_dir": str(tmp_path)},
        "model": {"actor": "/models/none"},
        "data": {"prompts": "/data/none.jsonl"},
        "reward": {"functions": [{"path": "toy.tasks.reverse:reward"}]},
        "rollout": rollout,
        "weightsync": {"timeout_s": 20, "bucket_mb": 1},
    }
    return load_config(None, raw=raw)


def log(url: str) -> list[dict]:
    return httpx.get(f"{url}/_log", timeout=5).json()


def routes(url: str) -> list[str]:
    return [e["route"] for e in log(url)]


def fault(url: str, route: str, **kw: object) -> None:
    httpx.post(f"{url}/_fault", json={"route": route, **kw}, timeout=5).raise_for_status()


def disk_update(version: int, path: str) -> Update:
    return Update(version=version, manifest=[], _iter=lambda: iter(()), path=path)


# ------------------------------------------------------------------------------------------ vLLM


def test_vllm_generate_payload_and_parse(urls, tmp_path):
    cfg = make_cfg(tmp_path, engine="vllm", vllm={"url": urls["vllm"]})
    engine = VLLMEngine(cfg, "/models/none", server_index=0, device=None)
    calls, streamed, groups = [], [], {}
    out = engine.generate(
        [[1, 2, 3], [9]],
        SamplingParams(n=2, max_new_tokens=4, temperature=0.7, top_p=0.9),
        between_steps=lambda: calls.append(1),
        on_token=lambda row, tok, lp: streamed.append((row, tok, lp)),
        on_prompt=lambda i, group: groups.setdefault(i, []).append(group),
    )
    assert calls == [1]
    assert groups == {0: [out[0]], 1: [out[1]]}  # each prompt reported once, with what is returned
    assert [r for r, _, _ in streamed] == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    # One token-in/token-out request per prompt, sent concurrently (so in any order).
    bodies = sorted((e["body"] for e in log(urls["vllm"]) if e["route"] == "/inference/v1/generate"),
                    key=lambda b: len(b["token_ids"]), reverse=True)  # fmt: skip
    assert [b["token_ids"] for b in bodies] == [[1, 2, 3], [9]]
    assert {b["output_mode"] for b in bodies} == {"tokens"}
    sp = bodies[0]["sampling_params"]
    assert (sp["logprobs"], sp["detokenize"], sp["stop"]) == (0, False, [])
    assert (sp["n"], sp["max_tokens"], sp["temperature"], sp["top_p"]) == (2, 4, 0.7, 0.9)
    assert sp["repetition_penalty"] == 1.0 and "seed" not in sp
    assert [len(o) for o in out] == [2, 2]
    c = out[1][1]
    assert c.token_ids == [(9 + 7 + k + 1) % 97 for k in range(4)]
    assert c.logprobs == [-0.25] * 4 and c.finish_reason == "length" and c.versions == [0] * 4
    # The initial weights were labelled "0" at startup, so versions parse as policy versions.
    assert routes(urls["vllm"])[:2] == ["/version", "/update_weight_version"]
    # A seed gives prompt i the seed seed + i*n (vLLM seeds sample j of a request with seed + j).
    engine.generate([[1], [2, 2], [3, 3, 3]], SamplingParams(n=2, max_new_tokens=1, seed=10))
    seeds = {
        len(e["body"]["token_ids"]): e["body"]["sampling_params"]["seed"] for e in log(urls["vllm"])[-3:]
    }
    assert seeds == {1: 10, 2: 12, 3: 14}
    engine.close()


def test_vllm_reload_from_disk_sequence(urls, tmp_path):
    cfg = make_cfg(tmp_path, engine="vllm", vllm={"url": urls["vllm"], "pause_mode": "keep"})
    engine = VLLMEngine(cfg, "/models/none", server_index=0, device=None)
    engine.update_weights(disk_update(3, "/dev/shm/run/v3"))
    entries = log(urls["vllm"])[2:]
    assert [e["route"] for e in entries] == [
        "/pause",
        "/collective_rpc",
        "/reset_prefix_cache",
        "/update_weight_version",
        "/resume",
    ]
    assert entries[0]["query"] == {"mode": "keep"}
    assert entries[1]["body"]["method"] == "tandem_load_weights"
    assert entries[1]["body"]["kwargs"] == {"weights_path": "/dev/shm/run/v3"}
    assert entries[2]["query"] == {"reset_running_requests": "true"}
    assert entries[3]["body"] == {"new_version": "3"}
    assert engine.version == 3
    assert engine.generate([[5]], SamplingParams(max_new_tokens=2))[0][0].versions == [3, 3]
    engine.close()


def test_vllm_errors_name_server_route_and_version(urls, tmp_path):
    cfg = make_cfg(tmp_path, engine="vllm", vllm={"url": urls["vllm"], "request_timeout_s": 1.0})
    engine = VLLMEngine(cfg, "/models/none", server_index=0, device=None)
    fault(urls["vllm"], "/collective_rpc", status=500)
    with pytest.raises(EngineHTTPError) as err:
        engine.update_weights(disk_update(4, "/x"))
    msg = str(err.value)
    assert "vLLM 0.33.0" in msg and urls["vllm"] in msg and "/collective_rpc" in msg and "500" in msg
    assert "weight version 4" in msg and engine.version == 0
    fault(urls["vllm"], "/inference/v1/generate", delay=2.5)
    with pytest.raises(EngineHTTPError, match=r"/inference/v1/generate.*no answer within 1 s"):
        engine.generate([[1]], SamplingParams())
    # Generation while paused in abort mode is refused by vLLM with 503, and reported as such.
    httpx.post(f"{urls['vllm']}/pause", params={"mode": "abort"}, timeout=5)
    with pytest.raises(EngineHTTPError, match="HTTP 503"):
        engine.generate([[1]], SamplingParams())
    engine.close()


# ------------------------------------------------------------------------------------------ SGLang


def test_sglang_generate_payload_and_parse(urls, tmp_path):
    cfg = make_cfg(tmp_path, engine="sglang", sglang={"url": urls["sglang"]})
    engine = SGLangEngine(cfg, "/models/none", server_index=0, device=None)
    out = engine.generate([[4, 5], [6]], SamplingParams(n=2, max_new_tokens=3, seed=10))
    # One request per prompt, its n samples the prompt repeated, sent concurrently (so in any order).
    bodies = sorted((e["body"] for e in log(urls["sglang"]) if e["route"] == "/generate"),
                    key=lambda b: len(b["input_ids"][0]), reverse=True)  # fmt: skip
    assert [b["input_ids"] for b in bodies] == [[[4, 5], [4, 5]], [[6], [6]]]
    assert {b["return_logprob"] for b in bodies} == {True}
    # Sample j of prompt i is seeded seed + i*n + j, as when the batch was one request.
    assert [[sp["sampling_seed"] for sp in b["sampling_params"]] for b in bodies] == [[10, 11], [12, 13]]
    assert "top_k" not in bodies[0]["sampling_params"][0]  # disabled: SGLang's own default
    assert out[1][0].token_ids == [(6 + 7 * 12 + k + 1) % 97 for k in range(3)]
    assert out[0][1].logprobs == [-0.5] * 3 and out[0][1].versions == [0] * 3
    engine.close()


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_a_slow_prompt_does_not_hold_back_the_others_groups(urls, tmp_path, kind):
    """Each prompt is its own request: the groups whose replies are back are reported while one is still
    being answered (here held 1.5 s by the replay server), so the loop scores them meanwhile."""
    engine_cls, route = (
        (VLLMEngine, "/inference/v1/generate") if kind == "vllm" else (SGLangEngine, "/generate")
    )
    engine = engine_cls(
        make_cfg(tmp_path, engine=kind, **{kind: {"url": urls[kind]}}), "m", server_index=0, device=None
    )
    fault(urls[kind], route, delay=1.5)  # the first request to arrive, whichever prompt's it is
    sent, post = [], engine.client.post
    engine.client.post = lambda r, body=None, **kw: sent.append(kw.get("resend")) or post(r, body, **kw)
    reported: list[tuple[int, list, float]] = []
    out = engine.generate(
        [[1], [2, 2], [3, 3, 3]],
        SamplingParams(n=2, max_new_tokens=2),
        on_prompt=lambda i, group: reported.append((i, group, time.monotonic())),
    )
    engine.close()
    assert sorted(i for i, _, _ in reported) == [0, 1, 2]
    times = [t for _, _, t in reported]
    assert times[-1] - times[1] > 1.0  # two groups were in a second before the held one
    assert {i: g for i, g, _ in reported} == dict(enumerate(out))  # each group in its prompt's place
    assert sent == [True] * 3  # a generation is resent once if its connection breaks unanswered
    assert all(c.token_ids[0] == (i + 2) % 97 for i, g in enumerate(out) for c in g[:1])


def test_sglang_refuses_truncated_sampling(urls, tmp_path):
    with pytest.raises(ValueError, match=r"top_p=0\.9.*allow_truncated_sampling"):
        SGLangEngine(
            make_cfg(tmp_path, engine="sglang", top_p=0.9, sglang={"url": urls["sglang"]}),
            "m",
            server_index=0,
            device=None,
        )
    engine = SGLangEngine(
        make_cfg(tmp_path, engine="sglang", sglang={"url": urls["sglang"]}), "m", server_index=0, device=None
    )
    with pytest.raises(ValueError, match="top_k=5"):
        engine.generate([[1]], SamplingParams(top_k=5))
    assert "/generate" not in routes(urls["sglang"])
    engine.close()


def test_sglang_reload_from_disk_sequence(urls, tmp_path):
    cfg = make_cfg(tmp_path, engine="sglang", sglang={"url": urls["sglang"], "pause_mode": "retract"})
    engine = SGLangEngine(cfg, "/models/none", server_index=0, device=None)
    engine.update_weights(disk_update(2, "/dev/shm/run/v2"))
    entries = log(urls["sglang"])[1:]
    assert [e["route"] for e in entries] == [
        "/pause_generation",
        "/update_weights_from_disk",
        "/continue_generation",
    ]
    assert entries[0]["body"] == {"mode": "retract"}
    assert entries[1]["body"] == {
        "model_path": "/dev/shm/run/v2",
        "weight_version": "2",
        "flush_cache": True,
        "abort_all_requests": False,
    }
    assert engine.version == 2
    assert engine.generate([[1]], SamplingParams(max_new_tokens=2))[0][0].versions == [2, 2]
    engine.close()


# ------------------------------------------------------------------------------------------ publisher


def gloo_for_vllm(kind, address, port, world, name):
    """Learner end of a group over gloo; for vLLM it replaces PyNccl (no GPU here), for SGLang it is real."""
    return TorchGroup(
        address, port, world, backend="gloo", group_name="vllm-replay" if kind == "vllm" else name, timeout=20
    )


def test_publisher_feeds_a_mix_of_vllm_and_sglang(urls, tmp_path, redis_client, run_id):
    cfg = make_cfg(tmp_path, engine="vllm", vllm={"url": urls["vllm"]}, sglang={"url": urls["sglang"]})
    vllm = VLLMEngine(cfg, "m", server_index=0, device=None)
    sgl = SGLangEngine(cfg, "m", server_index=1, device=None)
    register_engine(redis_client, run_id, EngineEndpoint(0, "vllm", vllm.url, vllm.world_size()))
    register_engine(redis_client, run_id, EngineEndpoint(1, "sglang", sgl.url, sgl.world_size()))
    pub = EnginePublisher(
        cfg, redis_client, run_id, master_address="127.0.0.1", backend="gloo", open_group=gloo_for_vllm
    )
    sub = EngineVersionSubscriber(redis_client, run_id, server_id="0")
    # 1 MiB buckets: "big" (exactly 1 MiB) fills one alone, so three buckets per version.
    weights = {
        "a.weight": torch.randn(4, 3),
        "big": torch.randn(512, 512),
        "c.bias": torch.arange(5, dtype=torch.bfloat16),
    }
    for version in (1, 2):
        sent = {k: v * version for k, v in weights.items()}
        pub.publish(iter(sent.items()), version)
        update = sub.poll(timeout=1.0)
        assert update is not None and update.version == version and update.path is None
        vllm.update_weights(update)
        sgl.update_weights(update)
        assert vllm.version == sgl.version == version
        for url in urls.values():
            got = httpx.get(f"{url}/_weights", timeout=10).json()
            for k, v in sent.items():
                assert torch.equal(torch.tensor(got[k]), v.float().flatten()), (url, k)
    assert sub.poll() is None

    v_entries = [
        e for e in log(urls["vllm"]) if e["route"] not in ("/weight_info", "/get_world_size", "/version")
    ]
    assert [e["route"] for e in v_entries] == ["/update_weight_version", "/init_weight_transfer_engine"] + 2 * [
        "/pause", "/start_weight_update", "/update_weights", "/update_weights", "/update_weights",
        "/finish_weight_update", "/reset_prefix_cache", "/resume",
    ]  # fmt: skip
    init = v_entries[1]["body"]["init_info"]
    assert (init["rank_offset"], init["world_size"], init["packed"]) == (1, 2, False)
    assert v_entries[2]["query"] == {"mode": "keep"}
    assert v_entries[4]["body"]["update_info"] == {
        "names": ["a.weight"],
        "dtype_names": ["float32"],
        "shapes": [[4, 3]],
    }
    assert v_entries[7]["body"] == {"weight_version": "1"}

    s_entries = [e for e in log(urls["sglang"]) if e["route"] != "/model_info"]
    assert [e["route"] for e in s_entries] == ["/update_weight_version", "/init_weights_update_group"] + 2 * [
        "/pause_generation", "/begin_weight_update", "/update_weights_from_distributed",
        "/update_weights_from_distributed", "/update_weights_from_distributed", "/end_weight_update",
        "/update_weight_version",
        "/flush_cache", "/continue_generation",
    ]  # fmt: skip
    g = s_entries[1]["body"]
    assert (g["rank_offset"], g["world_size"], g["backend"]) == (1, 2, "gloo")
    assert s_entries[2]["body"] == {"mode": "retract"}
    assert s_entries[5]["body"]["names"] == ["big"]
    third = s_entries[6]["body"]
    assert third["names"] == ["c.bias"] and third["dtypes"] == ["bfloat16"] and third["shapes"] == [[5]]
    assert third["flush_cache"] is False and third["group_name"] == g["group_name"]
    assert s_entries[8]["body"] == {"new_version": "1", "abort_all_requests": False}
    pub.close()
    vllm.close()
    sgl.close()


def test_publisher_failure_names_server_and_regroups(urls, tmp_path, redis_client, run_id):
    cfg = make_cfg(tmp_path, engine="sglang", sglang={"url": urls["sglang"]})
    register_engine(redis_client, run_id, EngineEndpoint(3, "sglang", urls["sglang"], 1))
    pub = EnginePublisher(cfg, redis_client, run_id, master_address="127.0.0.1", backend="gloo")
    fault(urls["sglang"], "/begin_weight_update", status=500)
    announced: list[int] = []  # the learner's version, queued in the publisher's announce transaction
    announce = lambda pipe, v: (announced.append(v), pipe.set(f"{run_id}:version", v))  # noqa: E731
    with pytest.raises(
        WeightSyncError, match=rf"version 1 .*{urls['sglang']}.*/begin_weight_update.*HTTP 500"
    ):
        pub.publish(iter({"w": torch.ones(2)}.items()), 1, announce=announce)
    assert pub.groups == []  # dropped; the still-registered server is re-grouped on the next publish
    assert announced == [] and redis_client.get(f"{run_id}:version") is None
    pub.publish(iter({"w": torch.ones(2)}.items()), 2, announce=announce)
    assert [e["route"] for e in log(urls["sglang"])].count("/init_weights_update_group") == 2
    assert latest_version(redis_client, run_id) == 2
    assert announced == [2] and int(redis_client.get(f"{run_id}:version")) == 2
    pub.close()


def test_publisher_without_servers_fails_clearly(tmp_path, redis_client, run_id):
    pub = EnginePublisher(
        make_cfg(tmp_path), redis_client, run_id, master_address="127.0.0.1", backend="gloo"
    )
    with pytest.raises(
        WeightSyncError, match=rf"no vLLM/SGLang server registered under {run_id}:engines:servers"
    ):
        pub.publish(iter(()), 1)


# ------------------------------------------------------------------------------------------ subprocess


def test_managed_server_dies_with_its_parent(tmp_path):
    """A managed engine (here `sleep`) is SIGTERMed when the rollout server is SIGKILLed (PR_SET_PDEATHSIG)."""
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from rollout.engines._http import ManagedServer; "
            f"s = ManagedServer('sleeper', ['sleep', '60'], env={{}}, log_path={str(tmp_path / 'x.log')!r}); "
            f"open({str(pid_file)!r}, 'w').write(str(s.proc.pid)); time.sleep(60)",
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "parent did not start the managed server"
        time.sleep(0.05)
    child = int(pid_file.read_text())
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=10)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and Path(f"/proc/{child}/stat").read_text().split()[2] != "Z":
        assert time.monotonic() < deadline, "managed server outlived its parent"
        time.sleep(0.05)


def orphaned_engine(log: Path) -> list[int]:
    """An engine that ignores SIGTERM (as vLLM does while it starts) with a child that does too, started by
    a parent that is then SIGKILLed: the death signal alone leaves both running. Returns their pids."""
    pids = log.with_suffix(".pids")
    script = f"trap '' TERM; sleep 600 & echo $$ $! > {pids}; wait"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; from rollout.engines._http import ManagedServer; "
            f"ManagedServer('stubborn', ['bash', '-c', {script!r}], env={{}}, log_path={str(log)!r}); "
            "time.sleep(60)",
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    deadline = time.monotonic() + 30
    while not pids.exists() or len(pids.read_text().split()) < 2:
        assert time.monotonic() < deadline, "the parent did not start its engine"
        time.sleep(0.05)
    parent.kill()
    parent.wait(timeout=10)
    return [int(p) for p in pids.read_text().split()]


def test_what_a_killed_rollout_server_leaves_of_its_engine_is_reaped(tmp_path):
    """The next server logging to the same file kills what the last one left of its process group, and only
    that; launch.py's stop does the same for every server of a run (``logs/*.group``)."""
    from tandem.procs import alive, reap_group

    server0, server1 = orphaned_engine(tmp_path / "server0.log"), orphaned_engine(tmp_path / "server1.log")
    time.sleep(1.0)
    assert all(alive(p) for p in server0 + server1), "the death signal alone stopped them: no case to test"
    successor = ManagedServer("next", ["sleep", "60"], env={}, log_path=tmp_path / "server0.log")
    deadline = time.monotonic() + 10
    while any(alive(p) for p in server0):
        assert time.monotonic() < deadline, "the successor left its predecessor's processes running"
        time.sleep(0.05)
    assert all(alive(p) for p in server1) and alive(successor.proc.pid)  # another server's, and its own
    successor.stop(grace_s=5)
    assert not (tmp_path / "server0.group").exists()  # a clean stop leaves nothing to reap
    assert sorted(reap_group(tmp_path / "server1.group")) == sorted(server1)
    deadline = time.monotonic() + 10
    while any(alive(p) for p in server1):
        assert time.monotonic() < deadline, "reap_group left a process of the group running"
        time.sleep(0.05)


def test_a_generate_call_fails_as_engine_exited_when_its_server_is_killed(tmp_path):
    """A managed server SIGKILLed while it answers: the call raises EngineExited with the exit code, not a
    connection error the rollout loop would count and retry forever against a dead server."""
    server, url = start_replay("vllm", tmp_path)
    engine = VLLMEngine(
        make_cfg(tmp_path, engine="vllm", vllm={"url": url}), "m", server_index=0, device=None
    )
    engine.server = server  # as if the adapter had started it
    fault(url, "/inference/v1/generate", delay=30)  # the first request is held: the kill lands mid-call
    threading.Timer(1.0, server.proc.kill).start()
    start = time.monotonic()
    with pytest.raises(EngineExited, match=r"vllm replay exited with code -9"):
        engine.generate([[1], [2]], SamplingParams(n=1, max_new_tokens=2))
    assert time.monotonic() - start < 10
    engine.close()
    # A server that answers with an error is not mistaken for a dead one.
    live, live_url = start_replay("vllm", tmp_path / "live")
    engine = VLLMEngine(
        make_cfg(tmp_path, engine="vllm", vllm={"url": live_url}), "m", server_index=0, device=None
    )
    engine.server = live
    fault(live_url, "/inference/v1/generate", status=500)
    with pytest.raises(EngineHTTPError, match="HTTP 500") as refused:
        engine.generate([[1]], SamplingParams(n=1, max_new_tokens=2))
    assert not isinstance(refused.value, EngineExited) and refused.value.status == 500
    engine.close()


def test_managed_server_reports_early_exit(tmp_path):
    from tandem.net import EngineClient

    server = ManagedServer(
        "broken engine",
        [sys.executable, "-c", "print('boom'); raise SystemExit(3)"],
        env={},
        log_path=tmp_path / "b.log",
    )
    client = EngineClient("http://127.0.0.1:9", "test", timeout=1)
    with pytest.raises(EngineHTTPError, match=r"(?s)broken engine exited with code 3 .*boom"):
        server.wait_healthy(client, "/health", timeout=30)
    server.stop()
