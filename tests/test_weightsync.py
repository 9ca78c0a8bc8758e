"""Weight sync: both transports against a real Redis, subscribers in real (spawned) processes."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time
from pathlib import Path

import pytest
import redis
import torch
from safetensors.torch import load_file, save_file

from tandem.config import Config
from weightsync import (
    DrainPublisher,
    PeersMissing,
    WeightSyncError,
    latest_version,
    make_publisher,
    make_subscriber,
    named_full_parameters,
    shm,
    wait_for,
)
from weightsync.base import Registry, weights_key
from weightsync.dist import DistPublisher, DistSubscriber
from weightsync.shm import ShmPublisher, ShmSubscriber

SPAWN = mp.get_context("spawn")


def make_cfg(run: str, actor: str | Path, **weightsync: object) -> Config:
    return Config.model_validate(
        {
            "run": {"name": run},
            "model": {"actor": str(actor)},
            "data": {"prompts": "unused.jsonl"},
            "reward": {"functions": [{"path": "toy.tasks.echo:reward"}]},
            "weightsync": {"timeout_s": 3.0, "bucket_mb": 1, **weightsync},
        }
    )


def weights(version: int) -> dict[str, torch.Tensor]:
    """A small model-shaped mix of fp32 / bf16 / int tensors, different for every version.

    The embedding (1.2 MB) is bigger than a 1 MiB bucket/shard, so dist sends it alone and shm writes two
    shards (with an index), exercising both paths.
    """
    g = torch.Generator().manual_seed(1000 + version)
    out = {"model.embed_tokens.weight": torch.randn(300, 1024, generator=g)}
    for i in range(2):
        p = f"model.layers.{i}.self_attn.q_proj"
        out[f"{p}.weight"] = torch.randn(32, 32, generator=g)
        out[f"{p}.bias"] = torch.randn(32, generator=g).to(torch.bfloat16)
        out[f"model.layers.{i}.mlp.up_proj.weight"] = torch.randn(64, 32, generator=g).to(torch.bfloat16)
    out["model.norm.weight"] = torch.randn(32, generator=g)
    out["step"] = torch.tensor(version, dtype=torch.int64)
    return out


def assert_bit_identical(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *, ordered: bool = True
) -> None:
    assert list(got) == list(want) if ordered else sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


def received(upd) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in upd.tensors()}


# ------------------------------------------------------------------------------ real-process exchange


def _subscriber_main(url: str, cfg_raw: dict, server_id: str, out_dir: str) -> None:
    """A rollout server's weight loop: poll, copy what arrives, save it for the test to compare."""
    cfg = Config.model_validate(cfg_raw)
    client = redis.Redis.from_url(url)
    sub = make_subscriber(cfg, client, server_id)
    control = f"{cfg.run.name}:test:{server_id}"
    while (cmd := client.get(control)) != b"stop":
        if cmd == b"pause":  # a server busy elsewhere: no polls, so no heartbeats either
            client.set(f"{control}:paused", 1)
            time.sleep(0.05)
            continue
        upd = sub.poll(timeout=0.2)
        if upd is not None:
            tmp = Path(out_dir) / f".{server_id}-v{upd.version}"
            save_file(received(upd), tmp)
            os.rename(tmp, Path(out_dir) / f"{server_id}-v{upd.version}.safetensors")
    sub.close()


def _await(cond, what: str, procs: dict, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        dead = {k: p.exitcode for k, p in procs.items() if p.exitcode is not None}
        assert not dead, f"subscriber process(es) exited while waiting for {what}: {dead}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _stop_subscribers(client: redis.Redis, run: str, procs: dict) -> None:
    """Tell every ``_subscriber_main`` to stop, then join it (killed after 30 s)."""
    for sid in procs:
        client.set(f"{run}:test:{sid}", "stop")
    for p in procs.values():
        p.join(timeout=30)
        if p.is_alive():
            p.kill()


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", ["shm", "dist"])
def test_exchange_late_join_and_skip(transport, redis_server, redis_client, run_id, tiny_ckpt, tmp_path):
    cfg = make_cfg(run_id, tiny_ckpt["actor"], transport=transport, shm_dir=str(tmp_path / "shm"))
    out = tmp_path / "received"
    out.mkdir()
    registry = Registry(redis_client, run_id, cfg.weightsync.timeout_s)
    pub = make_publisher(cfg, redis_client)
    procs: dict[str, mp.Process] = {}

    def start(sid: str) -> None:
        procs[sid] = SPAWN.Process(
            target=_subscriber_main, args=(redis_server.url, cfg.model_dump(), sid, str(out)), daemon=True
        )
        procs[sid].start()

    def have(sid: str, v: int) -> bool:
        return (out / f"{sid}-v{v}.safetensors").exists()

    def publish(v: int, to: list[str]) -> None:
        pub.publish(weights(v).items(), v)
        _await(lambda: all(have(s, v) for s in to), f"v{v} at {to}", procs)

    def live(sids: set[str], present: bool = True) -> None:
        _await(lambda: (sids <= set(registry.live())) == present, f"{sids} live={present}", procs)

    try:
        start("A")
        start("B")
        live({"A", "B"})
        for v in range(3):
            publish(v, ["A", "B"])

        start("C")  # late: shm serves it the current version at once, dist the next one it publishes
        live({"C"})
        if transport == "shm":
            _await(lambda: have("C", 2), "late joiner C at v2", procs)
        publish(3, ["A", "B", "C"])

        redis_client.set(f"{run_id}:test:B", "pause")
        _await(lambda: redis_client.exists(f"{run_id}:test:B:paused"), "B to pause", procs)
        if transport == "dist":  # the learner stops waiting for B once its heartbeat expires
            live({"B"}, present=False)
        publish(4, ["A", "C"])
        publish(5, ["A", "C"])
        redis_client.delete(f"{run_id}:test:B")
        if transport == "shm":  # B's next poll skips v4 for the newest
            _await(lambda: have("B", 5), "B to catch up at v5", procs)
        live({"B"})
        publish(6, ["A", "B", "C"])
    finally:
        _stop_subscribers(redis_client, run_id, procs)
        pub.close()
    assert {sid: p.exitcode for sid, p in procs.items()} == {"A": 0, "B": 0, "C": 0}

    versions = {sid: sorted(int(f.stem.split("-v")[1]) for f in out.glob(f"{sid}-v*")) for sid in procs}
    assert versions["A"] == [0, 1, 2, 3, 4, 5, 6]
    assert versions["C"] == ([2, 3, 4, 5, 6] if transport == "shm" else [3, 4, 5, 6])
    # B missed v4 and v5 while paused: shm skips straight to the newest (v5), dist to the next version.
    assert versions["B"] == ([0, 1, 2, 3, 5, 6] if transport == "shm" else [0, 1, 2, 3, 6])
    for f in out.glob("*.safetensors"):
        assert_bit_identical(load_file(f), weights(int(f.stem.split("-v")[1])), ordered=False)


# ----------------------------------------------------------------------------------------------- shm


def test_shm_rejects_corrupt_and_truncated_files_and_keeps_previous(redis_client, run_id, tmp_path, caplog):
    pub = ShmPublisher(redis_client, run_id, tmp_path, shard_bytes=1 << 20, keep_versions=1)
    sub = ShmSubscriber(redis_client, run_id, "s0")
    pub.publish(weights(0).items(), 0)
    applied = received(sub.poll())

    pub.publish(weights(1).items(), 1)
    manifest = redis_client.get(weights_key(run_id, "manifest", 1))
    assert manifest is not None
    shard = tmp_path / "v00000001" / "model-00002-of-00002.safetensors"
    with open(shard, "r+b") as f:  # flip one byte in the middle of the tensor data
        f.seek(shard.stat().st_size - 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with caplog.at_level(logging.ERROR, logger="weightsync.shm"):
        assert sub.poll() is None
    assert "checksum mismatch" in caplog.text and "v1" in caplog.text
    assert sub.version == 0 and sub.rejected == 1

    pub.publish(weights(2).items(), 2)
    shard = tmp_path / "v00000002" / "model-00001-of-00002.safetensors"
    os.truncate(shard, shard.stat().st_size // 2)
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="weightsync.shm"):
        assert sub.poll(timeout=0.2) is None
    assert "truncated" in caplog.text
    assert sub.version == 0 and sub.rejected == 2
    # v0 is still on disk (s0 holds it) and what the engine applied is unchanged
    assert (tmp_path / "v00000000").is_dir()
    assert_bit_identical(applied, weights(0))

    pub.publish(weights(3).items(), 3)
    upd = sub.poll()
    assert upd.version == 3 and sub.version == 3
    assert_bit_identical(received(upd), weights(3))
    assert [m.name for m in upd.manifest] == list(weights(3))
    assert all(m.checksum.startswith(("xxh3_64:", "crc32:")) for m in upd.manifest)


def test_shm_version_dir_loads_with_transformers(redis_client, run_id, tmp_path, tiny_ckpt):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt["actor"])
    for shard_bytes, files in ((1 << 30, {"model.safetensors"}), (20_000, None)):
        run = f"{run_id}-{shard_bytes}"
        pub = ShmPublisher(
            redis_client, run, tmp_path / run, config_dir=tiny_ckpt["actor"], shard_bytes=shard_bytes
        )
        pub.publish(named_full_parameters(model), 7)
        upd = ShmSubscriber(redis_client, run, "s0").poll()
        names = {p.name for p in Path(upd.path).glob("*.safetensors")}
        if files is not None:
            assert names == files
        else:
            assert len(names) > 1 and (Path(upd.path) / "model.safetensors.index.json").exists()
        reloaded = AutoModelForCausalLM.from_pretrained(upd.path)
        AutoTokenizer.from_pretrained(upd.path)
        # The checkpoint's other files are linked into each version from one copy, not copied per version.
        assert (Path(upd.path) / "config.json").stat().st_nlink == 2
        want = model.state_dict()
        for name, t in reloaded.state_dict().items():
            assert torch.equal(t, want[name]), name
        assert "lm_head.weight" not in {m.name for m in upd.manifest}  # tied: sent once


def test_shm_garbage_collection_waits_for_live_subscribers_and_recycles_files(redis_client, run_id, tmp_path):
    pub = ShmPublisher(redis_client, run_id, tmp_path, shard_bytes=1 << 20, keep_versions=2, live_s=30)
    slow = ShmSubscriber(redis_client, run_id, "slow", live_s=30)
    fast = ShmSubscriber(redis_client, run_id, "fast", live_s=30)
    for v in range(2):
        pub.publish(weights(v).items(), v)
        fast.poll()
    assert slow.poll().version == 1
    assert slow.poll() is None  # v1 is in use from this poll on: v0 may go
    for v in range(2, 5):
        pub.publish(weights(v).items(), v)
        fast.poll()
    assert pub.versions_on_disk() == pub._versions == [1, 2, 3, 4]  # slow still holds v1

    assert slow.poll().version == 4
    pub.publish(weights(5).items(), 5)  # slow may still be reading v1 until it polls again: kept
    assert pub.versions_on_disk() == pub._versions == [1, 2, 3, 4, 5]
    assert slow.poll().version == 5 and fast.poll().version == 5
    assert slow.poll() is None and fast.poll() is None  # both use v5 now
    pub.publish(weights(6).items(), 6)  # v1..v4 retire; two of their files stay in the free pool
    assert pub.versions_on_disk() == pub._versions == [5, 6]
    assert redis_client.get(weights_key(run_id, "manifest", 2)) is None
    free = {p.stat().st_ino for p in (tmp_path / ".free").iterdir()}
    assert len(free) == 2  # no more than one version's shards
    pub.publish(weights(7).items(), 7)
    assert {p.stat().st_ino for p in (tmp_path / "v00000007").glob("*.safetensors")} == free  # rewritten
    assert_bit_identical(received(fast.poll()), weights(7))

    # A subscriber whose heartbeat expired no longer pins anything.
    stale = ShmSubscriber(redis_client, run_id, "stale", live_s=0.2)
    assert stale.poll().version == 7 and stale.poll() is None
    slow.close()
    fast.close()
    for v in range(8, 10):
        pub.publish(weights(v).items(), v)
    assert pub.versions_on_disk() == pub._versions == [7, 8, 9]  # stale (live) holds v7
    time.sleep(0.3)
    pub.publish(weights(10).items(), 10)
    assert pub.versions_on_disk() == pub._versions == [9, 10]


def test_shm_progress_notes_only_for_shards_worth_checking_early(redis_client, run_id, tmp_path, monkeypatch):
    """A shard under PROGRESS_BYTES gets no note (its manifest follows at once); a bigger one does."""
    pub = ShmPublisher(redis_client, run_id, tmp_path, shard_bytes=1 << 20)
    noted: list[int] = []
    note = pub._note_progress
    monkeypatch.setattr(
        pub, "_note_progress", lambda path, spans: (noted.append(len(spans)), note(path, spans))
    )
    pub.publish(weights(0).items(), 0)
    assert noted == []
    monkeypatch.setattr(shm, "PROGRESS_BYTES", 64 << 10)
    pub.publish(weights(1).items(), 1)
    assert noted == [1]  # the embedding's shard (1.2 MB, one tensor); the small tensors' shard is not


def test_shm_wait_for_names_the_missing_learner(redis_client, run_id):
    sub = ShmSubscriber(redis_client, run_id, "server-0")
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match=rf"server-0: no weights version >= 0 .* run '{run_id}'"):
        wait_for(sub, 0, 0.5, run=run_id)
    assert time.monotonic() - start < 2.0


def test_wait_for_applying_follows_a_moving_target_and_stops(redis_client, run_id, tmp_path):
    """A rollout server's wait: every version handed out is applied at once; the target is re-read at
    each poll; a stop ends the wait early; a target never reached names what the engine holds."""
    pub, sub = ShmPublisher(redis_client, run_id, tmp_path), ShmSubscriber(redis_client, run_id, "server-0")
    applied: list[int] = []
    pub.publish(weights(0).items(), 0)
    targets = iter([0, 1, 1, 1])
    threading.Timer(0.2, lambda: pub.publish(weights(1).items(), 1)).start()
    wait_for(sub, lambda: next(targets), 10.0, run=run_id, apply=lambda u: applied.append(u.version))
    assert applied == [0, 1]
    start = time.monotonic()
    wait_for(sub, 5, 30.0, run=run_id, apply=applied.append, should_stop=lambda: True)
    assert time.monotonic() - start < 2.0 and applied == [0, 1]
    with pytest.raises(WeightSyncError, match=r"server-0: holds weights v1 but needs >= v5"):
        wait_for(sub, 5, 0.3, run=run_id, apply=applied.append)
    pub.close()


def test_shm_waiting_subscriber_verifies_while_the_publisher_writes(
    redis_server, run_id, tmp_path, monkeypatch
):
    """A subscriber blocked in poll checksums each range as soon as a progress note says it is final."""
    monkeypatch.setattr(shm, "PROGRESS_BYTES", 64 << 10)  # a note every few tensors of this small model
    client = redis.Redis.from_url(redis_server.url)
    pub = ShmPublisher(client, run_id, tmp_path, shard_bytes=1 << 20)
    sub = ShmSubscriber(redis.Redis.from_url(redis_server.url), run_id, "s0")
    pub.publish(weights(0).items(), 0)
    assert sub.poll().version == 0 and sub.early_bytes == 0  # polled after the write: all checked at load

    got: dict[str, object] = {}
    ready = threading.Event()

    def wait() -> None:
        ready.set()
        upd = sub.poll(timeout=30)
        got["update"], got["tensors"] = upd, received(upd)

    def slow_model():  # the learner's gather: the subscriber has time to check each note's ranges
        for item in weights(1).items():
            yield item
            time.sleep(0.05)

    waiter = threading.Thread(target=wait)
    waiter.start()
    ready.wait()
    pub.publish(slow_model(), 1)
    waiter.join(timeout=30)
    assert got["update"].version == 1
    assert_bit_identical(got["tensors"], weights(1))
    # The embedding fills the first shard, written and noted while the rest was still being gathered; only
    # the last note (the small tensors' shard) may be left for the load.
    assert weights(1)["model.embed_tokens.weight"].nbytes <= sub.early_bytes
    assert sub.early_bytes <= sum(t.nbytes for t in weights(1).values())
    assert not redis_client_keys(client, run_id, "progress")  # the notes are deleted with the announcement


def test_shm_announce_carries_the_learner_version_in_one_transaction(redis_client, run_id, tmp_path):
    """With ``announce=admission.queue_version`` (the learner's call), one publish is one MULTI/EXEC that
    announces the weights and then the version opening admission, in that order; without, none is set."""
    from buffer.admission import Admission

    buf = Admission(redis_client, run_id, consumer="learner-0", batch_size=1, max_staleness=0, n_samples=1)
    pub = ShmPublisher(redis_client, run_id, tmp_path)
    pubsub = redis_client.pubsub()
    pubsub.subscribe(weights_key(run_id, "announce"), f"{run_id}:version:changed")

    def execs() -> int:
        return redis_client.info("commandstats").get("cmdstat_exec", {}).get("calls", 0)

    pub.publish(weights(0).items(), 0)
    assert redis_client.get(f"{run_id}:version") is None  # no announce: the version is the caller's to set
    before = execs()
    pub.publish(weights(1).items(), 1, announce=buf.queue_version)
    assert execs() - before == 1
    assert buf.version() == 1 and latest_version(redis_client, run_id) == 1
    seen = []
    while (m := pubsub.get_message(timeout=1)) is not None:  # subscribe confirmations, then messages
        if m["type"] == "message":
            seen.append((m["channel"].decode().rsplit(":", 1)[-1], m["data"]))
    assert [s for s in seen if s[1] != b"progress"] == [
        ("announce", b"0"),
        ("announce", b"1"),
        ("changed", b"1"),
    ]
    pubsub.close()


def test_shm_range_corrupted_before_its_early_check_is_rejected(
    redis_client, run_id, tmp_path, caplog, monkeypatch
):
    monkeypatch.setattr(shm, "PROGRESS_BYTES", 64 << 10)  # shards this small are noted (and checked early)
    pub = ShmPublisher(redis_client, run_id, tmp_path, shard_bytes=1 << 20)
    sub = ShmSubscriber(redis_client, run_id, "s0")
    pub.publish(weights(0).items(), 0)
    assert sub.poll().version == 0

    def corrupting_model():
        for i, item in enumerate(weights(1).items()):
            if i == 1:  # the first shard (the embedding alone) is written and noted: corrupt it, then check
                pub._join_notes()
                (shard,) = tmp_path.glob(".tmp-v00000001-*/shard-000000")
                with open(shard, "r+b") as f:
                    f.seek(-10, os.SEEK_END)
                    f.write(b"\xff" * 4)
                assert sub.poll() is None  # a server's between-steps poll: checks the noted range
            yield item

    pub.publish(corrupting_model(), 1)
    with caplog.at_level(logging.ERROR, logger="weightsync.shm"):
        assert sub.poll() is None
    assert "checksum mismatch" in caplog.text and "model.embed_tokens.weight" in caplog.text
    assert sub.version == 0 and sub.rejected == 1
    assert sub.early_bytes == weights(1)["model.embed_tokens.weight"].nbytes  # caught by the early check


def test_shm_mappings_are_reused_across_versions_and_dropped_with_their_files(redis_client, run_id, tmp_path):
    pub = ShmPublisher(redis_client, run_id, tmp_path, shard_bytes=1 << 20, keep_versions=1)
    sub = ShmSubscriber(redis_client, run_id, "s0")
    seen: dict[int, object] = {}  # inode -> the subscriber's mapping of it
    for v in range(6):
        pub.publish(weights(v).items(), v)
        assert_bit_identical(received(sub.poll()), weights(v))
        sub.applied()  # as a server does once the engine holds it
        for f in (tmp_path / f"v{v:08d}").glob("*.safetensors"):
            st = f.stat()
            mm = sub._maps._maps[st.st_dev, st.st_ino]
            assert seen.setdefault(st.st_ino, mm) is mm  # a recycled file keeps its mapping
        on_disk = {(p.stat().st_dev, p.stat().st_ino) for p in tmp_path.glob("v*/*.safetensors")}
        on_disk |= {(p.stat().st_dev, p.stat().st_ino) for p in (tmp_path / ".free").iterdir()}
        assert set(pub._maps._maps) <= on_disk and set(sub._maps._maps) <= on_disk
    # Three versions' files (two shards each) rotate: the newest, the one s0 held while it was written,
    # and the free pool's; six versions without recycling would have made twelve.
    assert len(seen) == 6


def _mapped_deleted(root: Path) -> int:
    """Bytes of this process's mappings of deleted files under ``root``: pages nothing on disk accounts for."""
    total = 0
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith(str(root)) and parts[5].endswith("(deleted)"):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            total += hi - lo
    return total


def test_shm_run_that_releases_memory_keeps_only_the_held_version(redis_client, run_id, tmp_path, tiny_ckpt):
    """Colocated with placement.release_memory, the learner trims while it waits: the files of every
    version but the one the server holds are deleted, and neither side's mappings pin them."""
    cfg = make_cfg(run_id, tiny_ckpt["actor"], transport="shm", shm_dir=str(tmp_path))
    colocated = cfg.model_copy(
        update={"placement": cfg.placement.model_copy(update={"mode": "colocate", "release_memory": True})}
    )
    assert colocated.releases_memory and not cfg.releases_memory
    pub, sub = make_publisher(colocated, redis_client), make_subscriber(colocated, redis_client, "s0")
    assert (pub.keep_versions, pub.recycle) == (1, False)
    one_version = None
    for v in range(4):
        pub.publish(weights(v).items(), v)  # the learner's step ends: v joins the version the server holds
        assert_bit_identical(received(sub.poll()), weights(v))  # the server wakes and loads v
        sub.applied()  # ... applies it,
        sub.release()  # ... generates, sleeps
        pub.trim()  # the learner takes the batch: now it trains
        assert pub.versions_on_disk() == [v]
        assert not any((tmp_path / ".free").iterdir())
        assert _mapped_deleted(tmp_path) == 0
        files = sum(p.stat().st_blocks * 512 for p in tmp_path.rglob("*.safetensors"))
        assert files == (one_version := one_version or files)  # one version's worth, every step
    # Once the learner has its batch it frees the held version too: the server sleeps, its weights released.
    pub.trim(held_too=True)
    assert pub.versions_on_disk() == [] and not list(tmp_path.rglob("*.safetensors"))
    pub.publish(weights(4).items(), 4)  # the next version, made by that training, wakes it
    assert_bit_identical(received(sub.poll()), weights(4))
    # By default the same run keeps two versions and a free pool (rewritten in place: faster, more memory).
    pub2 = make_publisher(
        make_cfg(f"{run_id}b", tiny_ckpt["actor"], shm_dir=str(tmp_path / "b")), redis_client
    )
    assert (pub2.keep_versions, pub2.recycle) == (2, True)


def redis_client_keys(client: redis.Redis, run: str, kind: str) -> list[bytes]:
    return list(client.scan_iter(weights_key(run, kind, "*")))


def test_shm_subscriber_skips_to_newest(redis_client, run_id, tmp_path):
    pub = ShmPublisher(redis_client, run_id, tmp_path)
    sub = ShmSubscriber(redis_client, run_id, "s0")
    assert sub.latest_version() == -1 and sub.poll() is None
    for v in range(4):
        pub.publish(weights(v).items(), v)
    assert sub.latest_version() == 3
    upd = sub.poll()
    assert upd.version == 3 and sub.poll() is None
    assert_bit_identical(received(upd), weights(3))
    assert wait_for(sub, 2, 1.0, run=run_id) is None  # already holds >= 2


def test_shm_version_whose_folder_was_removed_is_taken_when_published_again(redis_client, run_id, tmp_path):
    """A clean stop removes the run's /dev/shm folder, but Redis still announces its last version. A server
    started for the resume must wait for the resumed learner to publish that version again in its new
    folder, not refuse the version number (it then waited for a newer one that sync runs never make)."""
    import shutil

    old, new = tmp_path / "old", tmp_path / "new"
    ShmPublisher(redis_client, run_id, old).publish(weights(2).items(), 2)
    shutil.rmtree(old)
    sub = ShmSubscriber(redis_client, run_id, "s0")
    assert sub.poll() is None and sub.rejected == 0
    ShmPublisher(redis_client, run_id, new).publish(weights(2).items(), 2)
    upd = sub.poll()
    assert upd is not None and upd.version == 2 and upd.path.startswith(str(new))
    assert_bit_identical(received(upd), weights(2))


# ---------------------------------------------------------------------------------------------- dist


def test_dist_publisher_names_a_registered_peer_that_never_joins(redis_client, run_id):
    Registry(redis_client, run_id, live_s=30).heartbeat("ghost", -1)
    pub = DistPublisher(redis_client, run_id, backend="gloo", timeout_s=1.0)
    consumed = []
    start = time.monotonic()
    announced: list[int] = []
    announce = lambda pipe, v: announced.append(v)  # noqa: E731
    with pytest.raises(PeersMissing, match=r"dist v3: subscriber\(s\) \['ghost'\]") as err:
        pub.publish(((n, consumed.append(n) or t) for n, t in weights(3).items()), 3, announce=announce)
    assert 1.0 <= time.monotonic() - start < 3.0
    assert err.value.peers == ["ghost"] and err.value.version == 3
    assert consumed == list(weights(3))  # drained: a ZeRO-3 gather stays matched
    assert "ghost" not in Registry(redis_client, run_id, live_s=30).live()
    assert announced == []  # a failed publish announces nothing of the caller's
    pub.publish(weights(4).items(), 4, announce=announce)  # nobody to wait for now
    assert announced == [4]


def test_dist_subscriber_names_a_publisher_that_never_starts(redis_client, run_id):
    import msgpack

    offer = {"version": 5, "host": "127.0.0.1", "port": 1, "backend": "gloo"}
    redis_client.set(weights_key(run_id, "offer"), msgpack.packb(offer))
    sub = DistSubscriber(redis_client, run_id, "server-1", timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match=r"server-1: publisher 127.0.0.1:1 did not start dist v5"):
        sub.poll()
    assert time.monotonic() - start < 2.0
    assert sub.version == -1 and sub.poll() is None  # v5 is not retried


def test_dist_buckets_pack_aligned_and_send_large_tensors_alone(redis_client, run_id):
    pub = DistPublisher(redis_client, run_id, backend="gloo", bucket_bytes=64)
    tensors = [
        ("a", torch.arange(3, dtype=torch.bfloat16)),  # 6 bytes
        ("b", torch.arange(4, dtype=torch.float32)),  # 16 bytes at offset 16
        ("big", torch.arange(40, dtype=torch.float32)),  # 160 bytes > bucket: alone, own memory
        ("c", torch.arange(10, dtype=torch.float32)),  # 40 bytes
        ("d", torch.arange(10, dtype=torch.float32)),  # 40 more bytes do not fit: next bucket
    ]
    import msgpack

    buckets = [(msgpack.unpackb(h), p.clone()) for h, p in pub._buckets(iter(tensors))]
    assert [[e[0] for e in h] for h, _ in buckets] == [["a", "b"], ["big"], ["c"], ["d"]]
    assert [[e[3] for e in h] for h, _ in buckets] == [[0, 16], [0], [0], [0]]
    assert [p.numel() for _, p in buckets] == [32, 160, 40, 40]
    got = {
        name: payload[off : off + n].view(getattr(torch, dtype)).view(shape)
        for header, payload in buckets
        for name, dtype, shape, off, n in header
    }
    for name, t in tensors:
        assert torch.equal(got[name], t)


def test_factories_choose_by_config(redis_client, run_id, tiny_ckpt, tmp_path):
    shm = make_cfg(run_id, tiny_ckpt["actor"], transport="shm", shm_dir=str(tmp_path))
    assert shm.weight_path == "shm" and not make_publisher(shm, redis_client).joiners_waiting()
    assert isinstance(make_publisher(shm, redis_client), ShmPublisher)
    assert isinstance(make_subscriber(shm, redis_client, "s"), ShmSubscriber)
    dist_cfg = make_cfg(run_id, tiny_ckpt["actor"], transport="dist", backend="gloo")
    assert dist_cfg.weight_path == "dist"
    assert isinstance(make_publisher(dist_cfg, redis_client), DistPublisher)
    assert isinstance(make_subscriber(dist_cfg, redis_client, "s"), DistSubscriber)
    # vLLM/SGLang servers over dist: the learner drives the engines' own groups, servers only track versions
    from weightsync.engine_push import EnginePublisher, EngineVersionSubscriber

    engine_cfg = dist_cfg.model_copy(
        update={"rollout": dist_cfg.rollout.model_copy(update={"engine": "sglang"})}
    )
    assert engine_cfg.weight_path == "engine"
    assert isinstance(engine_publisher := make_publisher(engine_cfg, redis_client), EnginePublisher)
    assert not engine_publisher.joiners_waiting()
    assert isinstance(make_subscriber(engine_cfg, redis_client, "s"), EngineVersionSubscriber)
    seen = []
    DrainPublisher().publish(((n, seen.append(n) or t) for n, t in weights(0).items()), 0)
    assert seen == list(weights(0)) and not DrainPublisher().joiners_waiting()


# ----------------------------------------------------------------------------------------- ZeRO-3


def _zero3_rank(rank: int, port: int, url: str, cfg_raw: dict, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank)
    )
    import deepspeed
    from transformers import AutoModelForCausalLM

    from tandem.prebuild import prepare_extensions

    prepare_extensions()  # as the learner does: a stale torch lock file from a killed loader is cleared
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = Config.model_validate(cfg_raw)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.actor)
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}},
    )
    shard = {n: p.numel() for n, p in engine.module.named_parameters()}
    pub = make_publisher(cfg, redis.Redis.from_url(url))
    pub.publish(named_full_parameters(engine, group_mb=0), 1)  # one parameter per gather
    Path(out_dir, f"rank{rank}.txt").write_text(f"{type(pub).__name__} {sum(shard.values())}")
    # As learner/train.py ends: a rank that exits with gloo's threads alive can abort (SIGABRT) in its exit.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_zero3_engine_publishes_full_parameters(redis_server, redis_client, run_id, tiny_ckpt, tmp_path):
    from transformers import AutoModelForCausalLM

    from tandem.net import free_port

    cfg = make_cfg(run_id, tiny_ckpt["actor"], transport="shm", shm_dir=str(tmp_path / "shm"), timeout_s=120)
    sub = make_subscriber(cfg, redis_client, "server-0")
    port = free_port()
    procs = [
        SPAWN.Process(
            target=_zero3_rank, args=(r, port, redis_server.url, cfg.model_dump(), str(tmp_path)), daemon=True
        )
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    assert [p.exitcode for p in procs] == [0, 0]

    upd = wait_for(sub, 1, 10.0, run=run_id)
    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt["actor"])
    want = dict(model.named_parameters())
    got = received(upd)
    assert list(got) == list(want)  # HF names, tied lm_head once
    for name, t in want.items():
        assert torch.equal(got[name], t.detach()), name
    kinds = [Path(tmp_path, f"rank{r}.txt").read_text().split() for r in range(2)]
    assert [k[0] for k in kinds] == ["ShmPublisher", "DrainPublisher"]
    assert all(int(k[1]) < sum(t.numel() for t in want.values()) for k in kinds)  # really partitioned
