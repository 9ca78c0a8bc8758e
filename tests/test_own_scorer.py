"""``placement.reference: own``: a reference worker scores every trajectory as it is appended, on threads of its
own, and the learner reads the numbers (docs/placement.md §11.1).

Real Redis, real tiny checkpoints, a real DeepSpeed learner engine (one gloo rank) for the reference numbers
the learner would compute itself, and ``launch.py`` runs for the process wiring and a kill -9 of the worker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import numpy as np
import pytest
import torch

from buffer.stream_scores import StreamScores
from buffer.streams import ReplayBuffer
from learner.batch import make_batch
from learner.ppo import PPOLearner
from placement.configured import aux_threads, configured_plan, thread_split
from rollout.own_scorer import Scorer, ScoringWorker
from rollout.reference import reference_of
from tandem.config import load_config
from tandem.telemetry import Telemetry, history_path, read_history
from tests.test_reference_placement import learner_of, mixed_trajectories, other_ckpt, ppo_config

__all__ = ["other_ckpt"]  # the fixture, shared with test_reference_placement


GROUP = CONSUMER = "reference"  # the reference worker's consumer group on the stream, and its one consumer


def ref_scores(client, run: str) -> StreamScores:
    return StreamScores(client, run, "reference")


def worker_for(cfg, client, run: str, stop: threading.Event, batch: int = 4) -> ScoringWorker:
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": run})})
    return ScoringWorker(
        "reference",
        Scorer.of_reference(reference_of(cfg)),
        ref_scores(client, run),
        Telemetry(cfg, "reference", client),
        batch=batch,
        stop=stop,
    )


def run_until(worker: ScoringWorker, done) -> None:
    """The worker in a thread until ``done()`` holds (or 30 s pass), then stopped."""
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)
    worker.stop.set()
    thread.join(10)
    assert not thread.is_alive()


def test_worker_scores_equal_the_learners_reference(
    redis_client, run_id, tiny_ckpt, other_ckpt, tmp_path
) -> None:
    """Trajectories appended to the stream, scored by the worker: each equals the learner's own reference
    forward within 1e-5 on every trained token, 0 on environment tokens; the learner under ``own`` trains on
    exactly these numbers; and the entries stay in the stream for the learner's group."""
    want_cfg = ppo_config(tiny_ckpt, other_ckpt, tmp_path, "learner")
    learner = learner_of(want_cfg, tmp_path)
    trajs = mixed_trajectories()
    _, want, _ = learner.score(make_batch(trajs, 0))  # (B, R)

    buffer = ReplayBuffer(redis_client, run_id, consumer="learner-0")
    ids = buffer.put(trajs)
    scores = ref_scores(redis_client, run_id)
    cfg = ppo_config(tiny_ckpt, other_ckpt, tmp_path, "own")
    worker = worker_for(cfg, redis_client, run_id, threading.Event(), batch=4)  # two reads of 4 and 2
    run_until(worker, lambda: len(scores.fetch(ids)) == len(ids))
    got = scores.fetch(ids)
    for i, (entry, t) in enumerate(zip(ids, trajs, strict=True)):
        r = len(t.response_tokens)
        assert got[entry].shape == (r,) and got[entry].dtype == np.float32
        np.testing.assert_allclose(got[entry], want[i, :r].numpy(), atol=1e-5, rtol=0)
        assert np.all(got[entry][~t.generated] == 0)
    assert scores.pending() == 0  # acknowledged to the worker's own group...
    assert buffer.trajectories_pending() == len(ids)  # ...never deleted: the entries are the learner's

    own_learner = PPOLearner(cfg, tmp_path)
    own_learner.models = learner.models  # the reference it would not load is never read
    assert own_learner.served_reference and cfg.reference_scorer == "own"
    own_learner.stream_scores = {"reference": scores}
    taken = buffer.take(len(ids), timeout_s=5)
    assert [t.id for t in taken] == ids
    filled = own_learner.with_stream_scores(taken)
    _, got_batch, _ = own_learner.score(make_batch([t.traj for t in filled], 0))
    torch.testing.assert_close(got_batch, want, atol=1e-5, rtol=0)


def test_a_restarted_worker_scores_what_its_earlier_life_read(
    redis_client, run_id, tiny_ckpt, other_ckpt, tmp_path
) -> None:
    """An earlier life read entries and died before writing: they stay pending in the worker's group and its
    next life scores them first. An entry the learner deleted meanwhile is acknowledged, not scored."""
    buffer = ReplayBuffer(redis_client, run_id, consumer="learner-0")
    ids = buffer.put(mixed_trajectories())
    scores = ref_scores(redis_client, run_id)
    scores.ensure_group()
    read = scores.read(len(ids), 100, pending=False)  # read, then "killed": nothing written, nothing acked
    assert [i for i, _ in read] == ids and scores.pending() == len(ids)
    redis_client.xdel(f"{run_id}:traj", ids[0])  # trained and acked by the learner meanwhile
    assert scores.read(len(ids), 100, pending=False) == []  # nothing new: they are pending, not undelivered

    cfg = ppo_config(tiny_ckpt, other_ckpt, tmp_path, "own")
    worker = worker_for(cfg, redis_client, run_id, threading.Event())
    run_until(worker, lambda: scores.pending() == 0)
    assert set(scores.fetch(ids)) == set(ids[1:])  # every survivor scored, the deleted one skipped
    assert worker.scored == len(ids) - 1


def test_a_running_worker_scores_a_delivery_whose_scoring_was_lost(
    redis_client, run_id, tiny_ckpt, other_ckpt, tmp_path
) -> None:
    """A Redis restart can keep a delivery to the worker's group and lose the transaction that scored it:
    the entry sits pending under the worker's name while the worker runs on. It reads its own pending
    entries again whenever a wait brings nothing new, so the entry is scored and the learner never waits
    for it forever."""
    buffer = ReplayBuffer(redis_client, run_id, consumer="learner-0")
    scores = ref_scores(redis_client, run_id)
    scores.ensure_group()
    ids = buffer.put(mixed_trajectories()[:2])
    # Delivered, so never read again as new; held under another name until the worker is running.
    redis_client.xreadgroup(GROUP, "elsewhere", {f"{run_id}:traj": ">"}, count=2)
    cfg = ppo_config(tiny_ckpt, other_ckpt, tmp_path, "own")
    worker = worker_for(cfg, redis_client, run_id, threading.Event())
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        time.sleep(0.5)  # the worker's first scan of its own pending entries found none
        assert scores.fetch(ids) == {}
        redis_client.xclaim(f"{run_id}:traj", GROUP, CONSUMER, 0, ids)  # now pending under its name
        deadline = time.monotonic() + 10
        while len(scores.fetch(ids)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert set(scores.fetch(ids)) == set(ids) and scores.pending() == 0
    finally:
        worker.stop.set()
        thread.join(10)


def test_learner_waits_for_missing_scores_and_drops_those_of_entries_gone(redis_client, run_id) -> None:
    buffer = ReplayBuffer(redis_client, run_id, consumer="learner-0")
    ids = buffer.put(mixed_trajectories()[:3])
    scores = ref_scores(redis_client, run_id)
    scores.ensure_group()
    scores.write([(ids[0], np.array([-1.0, -2.0]))], [ids[0]])
    with pytest.raises(TimeoutError, match=r"2 of 3 trajectories .*placement.reference=own"):
        scores.wait(ids, timeout_s=0.05)
    assert scores.wait(ids, timeout_s=5, stop=lambda: True) is None  # a stop request ends the wait

    late = threading.Timer(0.2, scores.write, args=([(i, np.array([-0.5])) for i in ids[1:]], ids[1:]))
    late.start()
    t0 = time.monotonic()
    got = scores.wait(ids, timeout_s=5)
    assert time.monotonic() - t0 >= 0.15 and set(got) == set(ids)
    np.testing.assert_array_equal(got[ids[0]], np.array([-1.0, -2.0], dtype=np.float32))

    buffer.ack(ids[:2])  # trained and checkpointed: deleted from the stream
    assert scores.drop_gone() == 2
    assert set(scores.fetch(ids)) == {ids[2]}  # the entry still in the stream keeps its scores
    buffer.ack(ids[2:])
    assert scores.drop_gone() == 1 and scores.fetch(ids) == {}


def test_own_is_separate_only_and_gets_threads_of_its_own(tiny_ckpt, other_ckpt, tmp_path) -> None:
    cfg = ppo_config(tiny_ckpt, other_ckpt, tmp_path, "own")
    assert cfg.reference_scorer == "own"
    per_server, learner = thread_split(cfg, 8)
    aux = aux_threads(cfg, 8)
    # Three processes: a server 8 // 3, the worker round(8 / 3), the learner what is left.
    assert (per_server, aux, learner) == (2, 3, 3)
    shared = cfg.model_copy(update={"placement": cfg.placement.model_copy(update={"aux_share": 0.5})})
    assert aux_threads(shared, 8) == 4 and thread_split(shared, 8) == (2, 2)
    plan = configured_plan(cfg, 8)
    assert (plan.generation, plan.learning, plan.aux, plan.reference) == (3, 2, 3, "own")
    assert (configured_plan(shared, 8).aux, configured_plan(shared, 8).learning) == (4, 1)
    no_kl = ppo_config(tiny_ckpt, other_ckpt, tmp_path, "own")
    no_kl = no_kl.model_copy(update={"algorithm": no_kl.algorithm.model_copy(update={"kl_coef": 0.0})})
    assert no_kl.reference_scorer is None and aux_threads(no_kl, 8) == 0
    raw = json.loads(cfg.model_dump_json())
    raw["run"]["mode"] = "sync"
    with pytest.raises(ValueError, match=r"placement.reference=own .*colocated"):
        load_config(None, raw=raw)


@pytest.mark.slow
@pytest.mark.faults  # kill -9 of a role through launch.py (make test-faults)
def test_ppo_with_both_scoring_workers_survives_kills_at_random_times(tiny_ckpt, tmp_path) -> None:
    """``launch.py`` with ``placement.reference=own`` and ``placement.reward_model=own``: four processes; the
    learner loads no reference, the servers no reward model, and the learner trains with a KL term and the
    reward model's score from the workers' numbers. The workers are killed with SIGKILL four times in turn,
    at random steps (seeded, printed): each time the one killed is restarted, the run finishes, every step
    trains a distinct batch (no trajectory twice, audited from ``trained.jsonl``), and no trained entry's
    scores are left in Redis."""
    import random

    from tandem.data import write_prompts
    from tests.test_launch import ROOT, attach, inspect_redis, launch_cmd
    from toy.tasks import make_records

    prompts = write_prompts(tmp_path / "echo.jsonl", make_records("echo", 200))
    steps, out, kills, roles = 60, tmp_path / "runs", 4, ("reference", "reward_model")
    seed = random.randrange(1 << 16)
    at = sorted(random.Random(seed).sample(range(3, steps - 20), kills))
    print(f"killing the scoring workers in turn at versions {at} (seed {seed})")
    cmd = launch_cmd(
        tiny_ckpt, prompts, out, f"learner.total_steps={steps}", "algorithm.kl_coef=0.05",
        f"model.reward_model={tiny_ckpt['critic']}", "placement.reference=own", "placement.reward_model=own",
        "learner.checkpoint_interval=10", "supervision.backoff_s=0.2",
    )  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed: list[tuple[str, int]] = []
    try:
        deadline = time.monotonic() + 400
        run_dir, client = attach(proc, out, deadline)
        version = f"{run_dir.name}:version"
        pids: set[int] = set()
        for k, target in enumerate(at):
            role = roles[k % 2]
            # a live worker (ready, a process not killed before) and the learner at the target step
            while True:
                ready = client.get(f"{run_dir.name}:ready:{role}")  # deleted while it is restarted
                pid = json.loads(ready)["pid"] if ready else None
                if pid not in (None, *pids) and int(client.get(version) or 0) >= target:
                    break
                assert time.monotonic() < deadline and proc.poll() is None, f"run did not reach step {target}"
                time.sleep(0.02)
            os.kill(pid, signal.SIGKILL)
            pids.add(pid)
            killed.append((role, int(client.get(version))))
        print(f"killed at versions {killed}")
        out_text, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out_text[-4000:]
    assert len(killed) == kills and max(v for _, v in killed) < steps, killed
    assert "started learner, server-0, reference, reward_model" in out_text
    for role in roles:  # restarted each time
        assert (run_dir / "logs" / f"{role}.log").read_text().count("=== ") == kills // 2 + 1

    rows = read_history(run_dir, "learner")
    trained = [r for r in rows if "reward/mean" in r]
    assert len(trained) == steps and all(np.isfinite(r["policy/kl"]) for r in trained)
    assert all("time/reference_wait" in r and "time/reference" not in r for r in trained)
    assert all("time/reward_model_wait" in r and np.isfinite(r["reward/reward_model"]) for r in trained)
    for role in roles:
        worker_rows = read_history(run_dir, role)
        assert sum(r[f"{role}/trajectories"] for r in worker_rows) >= steps * 8
    server_rows = history_path(run_dir, "server-0").read_text()
    assert "time/reward_model" not in server_rows  # the servers hold no reward model

    ids = [
        i for line in (run_dir / "trained.jsonl").read_text().splitlines() for i in json.loads(line)["ids"]
    ]
    assert len(ids) == steps * 8 and len(set(ids)) == len(ids)  # exactly once, from the learner's records
    server, client, run = inspect_redis(run_dir)
    try:
        for key in ("ref_logp", "rm_score"):
            left = {f.decode() for f in client.hkeys(f"{run}:{key}")}
            assert not left & set(ids), f"{key} of trained, acknowledged trajectories stayed in Redis"
        assert set(roles) <= {g["name"].decode() for g in client.xinfo_groups(f"{run}:traj")}
    finally:
        client.close()
        server.stop()


# --------------------------------------------------------------------- the reward model on its own worker


def test_reward_model_worker_gives_the_rewards_the_servers_give(
    redis_server, redis_client, run_id, tiny_ckpt, tmp_path
) -> None:
    """One batch of completions scored by two rollout loops: one holding the reward model
    (``placement.reward_model: server``), one not (``own``). The second's trajectories, scored by the reward
    model worker and filled by the learner, carry the first's rewards and parts within 1e-5: the weighted
    score added to the rules' total, clipped, then the over-long penalty, clipped (weights chosen so that
    both clips bite). A multi-turn trajectory, which the reward model does not score, is acknowledged
    unscored and keeps its reward."""
    from transformers import AutoTokenizer

    from buffer.schema import PromptRecord
    from rollout.engines.base import Completion, SamplingParams
    from rollout.reward_model import RewardModel
    from rollout.scoring import GroupScorer
    from tandem.rewards import RewardFunctions
    from tandem.timing import Timers
    from tests.test_rollout_loop import make_cfg

    def cfg_for(placement: str):
        return make_cfg(run_id, redis_server.url, tiny_ckpt, tmp_path, **{
            "model.reward_model": str(tiny_ckpt["critic"]), "placement.reward_model": placement,
            "reward.model_weight": 40.0, "reward.clip": 0.6, "algorithm.overlong_buffer": 4,
            "rollout.max_new_tokens": 6,
        })  # fmt: skip

    tok = AutoTokenizer.from_pretrained(tiny_ckpt["actor"])
    prompts = [
        PromptRecord(f"p{i}", text, tok(text).input_ids, {"id": f"p{i}", "prompt": text})
        for i, text in enumerate(["repeat: ab", "repeat: hello there"])
    ]
    rng = np.random.default_rng(3)
    completions = [
        [
            Completion(ids, [-1.0] * len(ids), "stop", [0] * len(ids))
            for ids in (rng.integers(5, 60, size=k).tolist() for k in (2, 5, 6))
        ]
        for _ in prompts
    ]

    def scorer_for(cfg, reward_model):  # as server 0 scores
        sampling = SamplingParams(n=3, max_new_tokens=cfg.rollout.max_new_tokens)
        return GroupScorer(
            cfg, tok, sampling, RewardFunctions(cfg.reward), server_index=0, timers=Timers(),
            reward_model=reward_model,
        )  # fmt: skip

    server_cfg, own_cfg = cfg_for("server"), cfg_for("own")
    assert own_cfg.own_scorers == ["reward_model"] and server_cfg.own_scorers == []
    rm = RewardModel(str(tiny_ckpt["critic"]), device="cpu")
    want = [t for g in scorer_for(server_cfg, rm).score(prompts, completions) for t in g]
    own = [t for g in scorer_for(own_cfg, None).score(prompts, completions) for t in g]
    clip = lambda r: max(-0.6, min(0.6, r))  # noqa: E731
    for t in want:  # by hand: both clips bite (the score alone passes 0.6; the penalty reaches -1)
        p = t.reward_parts
        assert t.reward == pytest.approx(clip(clip(p["echo"] + 40 * p["reward_model"]) + p["overlong"]))
    assert any(40 * t.reward_parts["reward_model"] > 0.6 for t in want)
    assert any(t.reward_parts["overlong"] < -0.6 for t in want)
    assert all("reward_model" not in t.reward_parts for t in own)

    buffer = ReplayBuffer(redis_client, run_id, consumer="learner-0")
    episode = mixed_trajectories()[5]  # a multi-turn trajectory: nothing for the reward model to read
    ids = buffer.put([*own, episode])
    scores = StreamScores(redis_client, run_id, "reward_model")
    worker = ScoringWorker(
        "reward_model", Scorer.of_reward_model(rm), scores, Telemetry(own_cfg, "reward_model", redis_client),
        batch=4, stop=threading.Event(),
    )  # fmt: skip
    run_until(worker, lambda: scores.pending() == 0 and len(scores.fetch(ids)) == len(own))
    assert ids[-1] not in scores.fetch(ids)

    learner = PPOLearner(own_cfg, tmp_path)
    learner.stream_scores = {"reward_model": scores}
    taken = learner.with_stream_scores(buffer.take(len(ids), timeout_s=5))
    assert [t.id for t in taken] == ids and "time/reward_model_wait" in learner.score_waits
    for w, t in zip(want, taken, strict=False):
        assert t.traj.reward == pytest.approx(w.reward, abs=1e-5)
        assert t.traj.reward_parts == pytest.approx(w.reward_parts, abs=1e-5)
    assert taken[-1].traj.reward == episode.reward
