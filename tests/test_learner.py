"""The DeepSpeed learner against a real Redis, real DeepSpeed engines and the tiny real checkpoints.

In-process tests build a :class:`learner.ppo.PPOLearner` (one gloo rank); the slow ones start
``python -m learner.train`` (and torchrun) as subprocesses, as launch.py does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from buffer.admission import Admission
from buffer.schema import Trajectory
from buffer.streams import ReplayBuffer
from learner.batch import decode_batch, encode_batch, make_batch
from learner.losses import logprobs_from_logits
from learner.models import load_models
from learner.ppo import PPOLearner as Learner
from tandem.config import Config, load_config
from tandem.net import free_port
from tandem.telemetry import history_key, ready_key, stop_key

REPO = Path(__file__).resolve().parents[1]
VOCAB = (4, 40)  # token ids of the tiny tokenizer's ordinary characters


def raw_config(tiny_ckpt, redis_url: str, run_id: str, tmp_path: Path, **sections) -> dict:
    raw = {
        "run": {"name": run_id, "device": "cpu", "seed": 0},
        "redis": {"url": redis_url, "claim_idle_ms": 60_000},
        "model": {"actor": str(tiny_ckpt["actor"])},
        "data": {"prompts": str(REPO / "pyproject.toml")},  # required by the schema, unused by the learner
        "reward": {"functions": [{"path": "toy.tasks.echo:reward"}]},
        "rollout": {"n_samples": 4, "temperature": 1.0},
        "algorithm": {"advantage": "grpo", "batch_size": 8, "minibatch_size": 8, "max_staleness": 100},
        "learner": {"micro_batch_size": 4, "actor_lr": 1e-2, "critic_lr": 1e-2, "take_timeout_s": 60},
        "weightsync": {"shm_dir": str(tmp_path / "weights")},
        "logging": {"wandb_mode": "disabled"},
    }
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return raw


def group(g: int, n: int, *, version: int = 0, seed: int = 0) -> list[Trajectory]:
    """n samples of prompt g: fixed content per (seed, g); the first sample is the rewarded one."""
    rng = np.random.default_rng([seed, g])
    prompt = rng.integers(*VOCAB, size=rng.integers(2, 7))
    out = []
    for i in range(n):
        resp = rng.integers(*VOCAB, size=rng.integers(1, 9))
        out.append(
            Trajectory(
                traj_id=f"{g}-{i}",
                group_id=f"g{g}",
                prompt_id=f"p{g}",
                prompt_tokens=prompt,
                response_tokens=resp,
                behav_logp=np.full(len(resp), -3.5, dtype=np.float32),
                token_versions=np.full(len(resp), version),
                reward=1.0 if i == 0 else 0.0,
            )
        )
    return out


def history(client, run_id: str) -> list[dict]:
    return [json.loads(row) for row in client.lrange(history_key(run_id, "learner"), 0, -1)]


# --------------------------------------------------------------------------------------------- in-process


@pytest.fixture(scope="module")
def grpo_learner(tiny_ckpt, tmp_path_factory):
    """A learner rank with models loaded but no Redis: for the pure forward-pass checks."""
    tmp = tmp_path_factory.mktemp("grpo")
    cfg = load_config(None, raw=raw_config(tiny_ckpt, "redis://unused", "layout", tmp))
    learner = Learner(cfg, tmp)
    learner.models = load_models(cfg, learner.device)
    return learner


@pytest.mark.parametrize("layout", ["pack", "pad"])
def test_forward_layouts_equal_one_sequence_at_a_time(grpo_learner: Learner, layout: str) -> None:
    trajs = [t for g in range(2) for t in group(g, 4, seed=1)]
    trajs[5].finish_reason = "abort"
    batch = make_batch(trajs, 0)
    grpo_learner.layout = layout
    prox_logp, ref_logp, values = grpo_learner.score(batch)
    assert ref_logp is None and values is None  # grpo without KL builds neither critic nor reference
    module = grpo_learner.models.actor.module
    for i, t in enumerate(trajs):
        ids = torch.tensor(np.concatenate([t.prompt_tokens, t.response_tokens]), dtype=torch.long)[None]
        with torch.no_grad():
            logits = module(input_ids=ids).logits[0, len(t.prompt_tokens) - 1 : -1]  # (R, V)
        expected = logprobs_from_logits(logits[None], torch.from_numpy(t.response_tokens)[None])[0]
        r = len(t.response_tokens)
        if t.finish_reason == "abort":  # masked: an aborted tail is never trained on
            assert batch.mask[i].sum() == 0 and torch.all(prox_logp[i] == 0)
        else:
            torch.testing.assert_close(prox_logp[i, :r], expected, atol=1e-5, rtol=1e-5)
            assert torch.all(prox_logp[i, r:] == 0)


def test_the_grad_norm_deepspeed_clips_by_at_zero_stage_0_is_reported(grpo_learner: Learner) -> None:
    """fp32 at ZeRO stage 0: DeepSpeed clips by the gradient's norm but would report none; the learner's
    engine keeps it. It equals a naive loop over the parameters before the step: the norm before clipping."""
    engine = grpo_learner.models.actor
    assert engine.get_global_grad_norm() is None  # no step yet
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    ids = torch.tensor([[5, 9, 12, 7, 30, 4]])
    engine.backward(engine.module(input_ids=ids, labels=ids).loss * 100)  # far above the clip of 1
    grads = [p.grad.double() for p in engine.module.parameters() if p.grad is not None]
    naive = sum(float((g**2).sum()) for g in grads) ** 0.5
    try:
        engine.step()
        assert engine.get_global_grad_norm() == pytest.approx(naive, rel=1e-5)
        assert naive > 10 * engine.gradient_clipping()
    finally:  # the module's other tests compare this actor with the checkpoint it was loaded from
        with torch.no_grad():
            for n, p in engine.module.named_parameters():
                p.copy_(before[n])


def test_update_kl_is_the_k3_token_mean_of_a_plain_forward(grpo_learner: Learner) -> None:
    """``algorithm.stop_kl``'s measure against a naive loop: one sequence at a time through the module, k3 of
    KL(proximal ‖ current) = exp(cur − prox) − (cur − prox) − 1 per response token, mean over the rows."""
    trajs = [t for g in range(3) for t in group(g, 4, seed=2)]
    batch = make_batch(trajs, 0)
    grpo_learner.layout = "pack"
    current, _, _ = grpo_learner.score(batch)
    prox = current + 0.3 * torch.randn(current.shape, generator=torch.Generator().manual_seed(0))
    rows = torch.tensor([1, 4, 6, 7, 10])
    module, terms = grpo_learner.models.actor.module, []
    for i in rows.tolist():
        t = trajs[i]
        ids = torch.tensor(np.concatenate([t.prompt_tokens, t.response_tokens]), dtype=torch.long)[None]
        with torch.no_grad():
            logits = module(input_ids=ids).logits[0, len(t.prompt_tokens) - 1 : -1]
        cur = logprobs_from_logits(logits[None], torch.from_numpy(t.response_tokens)[None])[0]
        for c, q in zip(cur.tolist(), prox[i, : len(cur)].tolist(), strict=True):
            terms.append(np.exp(c - q) - (c - q) - 1)
    assert grpo_learner.update_kl(batch, rows, prox) == pytest.approx(np.mean(terms), rel=1e-4)
    assert grpo_learner.update_kl(batch, rows, current) == pytest.approx(0.0, abs=1e-9)


def test_batch_wire_round_trip() -> None:
    trajs = group(3, 4)
    back = decode_batch(encode_batch(trajs))
    assert [t.traj_id for t in back] == [t.traj_id for t in trajs]
    assert all(np.array_equal(a.response_tokens, b.response_tokens) for a, b in zip(back, trajs, strict=True))


@pytest.mark.parametrize("advantage", ["grpo", "gae"])
def test_learner_trains_on_fixed_trajectories(
    tiny_ckpt, redis_server, redis_client, run_id, tmp_path, advantage: str
) -> None:
    """Fed the same trajectories every step (with a KL loss; gae with a critic): losses fall, the version
    advances, weights are published at every version, every id is acked once, the final actor loads."""
    steps = 6
    raw = raw_config(
        tiny_ckpt,
        redis_server.url,
        run_id,
        tmp_path,
        algorithm={"advantage": advantage, "kl_coef": 0.05, "minibatch_size": 4, "ppo_epochs": 2},
        learner={"total_steps": steps, "checkpoint_interval": 3, "actor_lr": 3e-3},
    )
    cfg = load_config(None, raw=raw)
    buffer = ReplayBuffer.from_config(redis_client, cfg, "test-producer")
    ids = [i for step in range(steps) for g in range(2) for i in buffer.put(group(g, 4))]
    learner = Learner(cfg, tmp_path / "run")
    learner.run()

    rows = history(redis_client, run_id)
    assert [r["learner/version"] for r in rows] == list(range(1, steps + 1))
    policy = [r["loss/policy"] for r in rows]
    assert np.mean(policy[-2:]) < np.mean(policy[:2]) - 0.05, policy
    if advantage == "gae":
        value = [r["loss/value"] for r in rows]
        assert np.mean(value[-2:]) < np.mean(value[:2]), value
    else:
        assert not any("loss/value" in r for r in rows)  # no critic without gae
    assert all(r["staleness/max"] <= r["learner/version"] for r in rows)
    # every token is of version 0, so step v trains on tokens v - 1 stale: one bucket, s0 to s3 (3 or more)
    buckets = [sorted(k for k in r if k.startswith("mismatch/kl_k3/")) for r in rows]
    assert buckets == [[f"mismatch/kl_k3/s{min(v - 1, 3)}"] for v in range(1, steps + 1)]
    grad_norms = ["actor/grad_norm"] + (["critic/grad_norm"] if advantage == "gae" else [])
    for key in (
        "loss/kl",
        "policy/kl",
        "policy/clipfrac",
        "policy/entropy",
        "reward/mean",
        "time/train",
        *grad_norms,
    ):
        assert all(np.isfinite(r[key]) for r in rows), key
    assert int(redis_client.get(f"{run_id}:version")) == steps
    assert (tmp_path / "weights" / f"v{steps:08d}" / "config.json").exists()  # the last published version
    assert buffer.trajectories_pending() == 0  # every id acked (ack deletes)
    trained = [json.loads(line) for line in (tmp_path / "run" / "trained.jsonl").read_text().splitlines()]
    assert sorted(i for row in trained for i in row["ids"]) == sorted(ids)
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    live = dict(learner.models.actor.module.named_parameters())
    for name, p in final.named_parameters():
        torch.testing.assert_close(p, live[name].detach())


@pytest.mark.parametrize("kl_in_reward", [False, True])
def test_skipping_the_proximal_forward_is_the_same_math(
    tiny_ckpt, redis_server, redis_client, tmp_path, kl_in_reward: bool
) -> None:
    """One optimizer step per batch: prox_logp = logp.detach() gives the run the separate pass gives."""
    runs = {}
    for prox in ("auto", "always"):
        run = f"prox-{prox}-{kl_in_reward}-{time.monotonic_ns()}"
        raw = raw_config(
            tiny_ckpt, redis_server.url, run, tmp_path / prox,
            algorithm={"kl_coef": 0.1, "kl_in_reward": kl_in_reward, "prox_forward": prox},
            learner={"total_steps": 3, "save_hf_final": False},
        )  # fmt: skip
        cfg = load_config(None, raw=raw)
        buffer = ReplayBuffer.from_config(redis_client, cfg, "test-producer")
        for g in range(6):
            buffer.put(group(g, 4, seed=3))
        learner = Learner(cfg, tmp_path / prox / "run")
        # Folding the KL into the reward needs prox before the first backward: never skipped then.
        assert learner.prox_is_current == (prox == "auto" and not kl_in_reward)
        learner.run()
        runs[prox] = history(redis_client, run)
    for key in ("loss/policy", "loss/kl", "policy/kl", "policy/entropy", "policy/clipfrac", "policy/ess"):
        if key in runs["always"][0]:
            got, want = [r[key] for r in runs["auto"]], [r[key] for r in runs["always"]]
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=key)
    assert len({r["loss/policy"] for r in runs["always"]}) == 3  # the steps differ: not vacuous


def test_poison_pills_are_dead_lettered_and_training_goes_on(
    tiny_ckpt, redis_server, redis_client, run_id, tmp_path
) -> None:
    """A trajectory that decodes but cannot be trained on (a token outside the vocabulary, an empty prompt)
    is dead-lettered and counted; the learner trains on the rest, and a restart does not meet it again."""
    cfg = load_config(
        None, raw=raw_config(tiny_ckpt, redis_server.url, run_id, tmp_path, learner={"total_steps": 2})
    )
    buffer = ReplayBuffer.from_config(redis_client, cfg, "test-producer")
    out_of_vocab, empty_prompt = group(90, 1), group(91, 1)
    out_of_vocab[0].response_tokens[-1] = 10_000  # decodes fine: only the learner knows its vocabulary
    empty_prompt[0].prompt_tokens = np.zeros(0, dtype=np.int32)
    buffer.put(out_of_vocab)
    buffer.put(empty_prompt)
    good = [i for g in range(4) for i in buffer.put(group(g, 4))]
    Learner(cfg, tmp_path / "run").run()

    rows = history(redis_client, run_id)
    assert [r["learner/version"] for r in rows] == [1, 2]
    assert rows[-1]["buffer/dead"] == 2
    dead = {f[b"reason"].decode() for _, f in redis_client.xrange(f"{run_id}:traj:dead")}
    assert any("response_tokens: token id 10000 outside the model's vocabulary" in r for r in dead), dead
    assert any(r.startswith("prompt_tokens: empty prompt") for r in dead), dead
    trained = [
        i
        for line in (tmp_path / "run" / "trained.jsonl").read_text().splitlines()
        for i in json.loads(line)["ids"]
    ]
    assert sorted(trained) == sorted(good)
    assert buffer.trajectories_pending() == 0


def test_start_fails_fast_without_redis(tiny_ckpt, tmp_path) -> None:
    # A Redis that never answered fails the start once supervision.reconnect_s (the ride-out of a restart) is
    # spent, with the reason; 2 s here instead of the default 60.
    raw = raw_config(tiny_ckpt, f"redis://127.0.0.1:{free_port()}", "down", tmp_path)
    cfg = load_config(None, raw={**raw, "supervision": {"reconnect_s": 2.0}})
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match="does not answer"):
        Learner(cfg, tmp_path / "run").start()
    assert time.monotonic() - t0 < 30


def test_stop_request_while_waiting_publishes_and_checkpoints(
    tiny_ckpt, redis_server, redis_client, run_id, tmp_path
) -> None:
    """No data, a stop request: the learner still published version 0, said ready, and checkpointed."""
    cfg = load_config(None, raw=raw_config(tiny_ckpt, redis_server.url, run_id, tmp_path))
    redis_client.set(stop_key(run_id), 1)
    learner = Learner(cfg, tmp_path / "run")
    learner.run()
    assert learner.version == 0
    assert redis_client.exists(ready_key(run_id, "learner"))
    assert (tmp_path / "weights" / "v00000000" / "model.safetensors").exists()
    assert json.loads((tmp_path / "run" / "checkpoints" / "latest.json").read_text())["version"] == 0
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()


def run_with_admission_producer(cfg: Config, redis_client, tmp_path: Path, make_group=None) -> list[dict]:
    """Run a learner against a producer thread that emulates a rollout server honouring admission;
    ``make_group(g, n, version=, seed=)`` makes its groups (:func:`group` by default)."""
    make_group = make_group or group
    n = cfg.rollout.n_samples
    stop = threading.Event()
    errors: list[BaseException] = []

    def produce() -> None:
        buffer = ReplayBuffer.from_config(redis_client, cfg, "server-0")
        admission = Admission.from_config(redis_client, cfg, "server-0")
        g = 0
        try:
            while not stop.is_set():
                if admission.wait(1, timeout_s=0.5, should_stop=stop.is_set):
                    buffer.put(make_group(g, n, version=admission.version(), seed=7))
                    g += 1
        except BaseException as e:  # surfaced by the test below
            errors.append(e)

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    try:
        Learner(cfg, tmp_path).run()
    finally:
        stop.set()
        thread.join(timeout=10)
    assert not errors, errors
    return history(redis_client, cfg.run.name)


# Three representative loss variants (docs/design.md §4.9), not every combination: each case runs two
# learners for four steps (~7 s on two idle cores, several times that under load). Together they cover
# each loss, both importance levels and treatments, and three of the four aggregations.
LOSS_VARIANTS = {
    "ppo-token-truncate": {},
    "gspo-sequence-mask": {
        "loss": "gspo",
        "importance": {"level": "sequence", "treatment": "mask", "mask_low": 0.2},
        "loss_agg": "seq-mean-token-mean",
    },
    "cispo-token-mask": {
        "loss": "cispo",
        "importance": {"treatment": "mask", "mask_low": 0.2},
        "loss_agg": "seq-mean-token-sum-norm",
    },
}


@pytest.mark.parametrize("variant", LOSS_VARIANTS)
def test_async_at_staleness_zero_equals_sync(
    variant, tiny_ckpt, redis_server, redis_client, tmp_path
) -> None:
    runs = {}
    for mode, max_staleness in (("async", 0), ("sync", 3)):  # sync forces 0 whatever the config says
        run = f"eq-{mode}-{os.getpid()}-{time.monotonic_ns()}"
        raw = raw_config(
            tiny_ckpt,
            redis_server.url,
            run,
            tmp_path / mode,
            run={"mode": mode},
            algorithm={
                "max_staleness": max_staleness,
                "minibatch_size": 4,
                "ppo_epochs": 2,
                **LOSS_VARIANTS[variant],
            },
            learner={"total_steps": 4, "save_hf_final": False},
        )
        runs[mode] = run_with_admission_producer(load_config(None, raw=raw), redis_client, tmp_path / mode)
    for rows in runs.values():
        assert [r["learner/version"] for r in rows] == [1, 2, 3, 4]
        assert all(r["staleness/max"] == 0 for r in rows)  # on-policy: trained only on its own version
        # the mismatch metrics are logged every step, per staleness bucket present (only s0 here)
        assert all("mismatch/kl_k3/s0" in r and "mismatch/kl_k3/s1" not in r for r in rows)
    losses = {mode: [(r["loss/policy"], r["policy/entropy"]) for r in rows] for mode, rows in runs.items()}
    assert losses["async"] == losses["sync"]
    assert len({p for p, _ in losses["sync"]}) == 4  # the steps differ: the comparison is not vacuous


def test_stop_kl_skips_the_rest_of_a_step_once_the_update_passes_it(
    tiny_ckpt, redis_server, redis_client, tmp_path
) -> None:
    """Three epochs of one minibatch per step. stop_kl far below any update's KL: every step trains its first
    minibatch only, so the actor ends as a one-epoch run's; far above: as a run without stop_kl."""

    def run(name: str, epochs: int, stop_kl: float | None) -> tuple[list[dict], dict[str, torch.Tensor]]:
        run_id = f"stop-{name}-{os.getpid()}-{time.monotonic_ns()}"
        algorithm = {"ppo_epochs": epochs, "stop_kl": stop_kl}
        learner = {"total_steps": 3, "save_hf_final": False}
        raw = raw_config(
            tiny_ckpt, redis_server.url, run_id, tmp_path / name, algorithm=algorithm, learner=learner
        )
        cfg = load_config(None, raw=raw)
        buffer = ReplayBuffer.from_config(redis_client, cfg, "test-producer")
        for g in range(6):
            buffer.put(group(g, 4, seed=3))
        trained = Learner(cfg, tmp_path / name / "run")
        trained.run()
        weights = {n: p.detach().clone() for n, p in trained.models.actor.module.named_parameters()}
        return history(redis_client, run_id), weights

    tight, tight_w = run("tight", 3, 1e-9)
    one_w = run("one", 1, None)[1]
    loose, loose_w = run("loose", 3, 1e9)
    full_w = run("full", 3, None)[1]
    assert [r["policy/kl_skipped_frac"] for r in tight] == pytest.approx([2 / 3] * 3)
    assert [r["policy/kl_skipped_frac"] for r in loose] == [0.0] * 3
    for name, p in one_w.items():
        torch.testing.assert_close(tight_w[name], p, rtol=1e-5, atol=1e-7, msg=name)
        torch.testing.assert_close(loose_w[name], full_w[name], rtol=0, atol=0, msg=name)
    assert any(
        not torch.allclose(full_w[n], p) for n, p in one_w.items()
    )  # the epochs after the first matter


# -------------------------------------------------------------------------------------------- subprocesses


def write_config(raw: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw))
    return path


DIST_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def learner_env() -> dict[str, str]:
    """This process's environment minus the rendezvous of the in-process learners above."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run_two_learner_ranks(
    cfg_path: Path, run_dir: Path, *, env: dict[str, str] | None = None, timeout: float = 240
) -> None:
    """``learner.train`` on two torchrun ranks (gloo, on CPU); fails with the tail of its stderr."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
        "-m", "learner.train", "--config", str(cfg_path), "--run-dir", str(run_dir),
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=REPO, env={**learner_env(), **(env or {})}, capture_output=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr.decode()[-4000:]


def wait_for_version(
    client, run_id: str, version: int, proc: subprocess.Popen, timeout_s: float, log: Path
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = history(client, run_id)
        if rows and rows[-1]["learner/version"] >= version:
            return
        if proc.poll() is not None:
            raise AssertionError(f"learner exited early with {proc.returncode}: {log.read_text()[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"learner did not reach version {version} within {timeout_s}s")


def lineage(run_dir: Path) -> dict[int, list[str]]:
    """The ids of each version the surviving model contains: the last line written for each version."""
    out: dict[int, list[str]] = {}
    for line in (run_dir / "trained.jsonl").read_text().splitlines():
        row = json.loads(line)
        out[row["version"]] = row["ids"]
    return out


@pytest.mark.slow
@pytest.mark.faults
def test_sigkill_and_resume_trains_every_trajectory_once(
    tiny_ckpt, redis_server, redis_client, run_id, tmp_path
) -> None:
    steps = 6
    raw = raw_config(
        tiny_ckpt,
        redis_server.url,
        run_id,
        tmp_path,
        learner={"total_steps": steps, "checkpoint_interval": 2, "save_hf_final": False},
    )
    cfg_path = write_config(raw, tmp_path / "learner.yaml")
    buffer = ReplayBuffer.from_config(redis_client, load_config(cfg_path), "test-producer")
    ids = [i for g in range(2 * steps) for i in buffer.put(group(g, 4))]
    cmd = [
        sys.executable,
        "-m",
        "learner.train",
        "--config",
        str(cfg_path),
        "--run-dir",
        str(tmp_path / "run"),
    ]

    log_path = tmp_path / "first.log"
    with open(log_path, "wb") as log_file:
        first = subprocess.Popen(cmd, cwd=REPO, env=learner_env(), stderr=log_file)
    try:
        wait_for_version(redis_client, run_id, 3, first, timeout_s=120, log=log_path)  # a step past ckpt 2
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    done_before = max(lineage(tmp_path / "run"))
    assert 3 <= done_before < steps

    second = subprocess.run([*cmd, "--resume"], cwd=REPO, env=learner_env(), capture_output=True, timeout=180)
    assert second.returncode == 0, second.stderr.decode()[-3000:]
    trained = lineage(tmp_path / "run")
    assert sorted(trained) == list(range(1, steps + 1))
    flat = [i for v in sorted(trained) for i in trained[v]]
    assert len(flat) == len(set(flat))  # none twice
    assert sorted(flat) == sorted(ids)  # none lost
    assert buffer.trajectories_pending() == 0
    # The steps after the surviving checkpoint were trained again by the resumed run (their update was lost).
    resumed = [line for line in second.stderr.decode().splitlines() if "resumed at version" in line]
    assert len(resumed) == 1
    resumed_at = int(resumed[0].split("resumed at version ")[1].split()[0])
    assert resumed_at in (2, 4) and resumed_at <= done_before
    lines = (tmp_path / "run" / "trained.jsonl").read_text().splitlines()
    assert len(lines) == steps + done_before - resumed_at


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_two_ranks_on_cpu(tiny_ckpt, redis_server, redis_client, run_id, tmp_path, zero_stage: int) -> None:
    steps = 2
    raw = raw_config(
        tiny_ckpt,
        redis_server.url,
        run_id,
        tmp_path,
        algorithm={"advantage": "gae", "minibatch_size": 4},
        learner={"total_steps": steps, "zero_stage": zero_stage, "micro_batch_size": 2, "num_ranks": 2},
    )
    cfg_path = write_config(raw, tmp_path / "learner.yaml")
    buffer = ReplayBuffer.from_config(redis_client, load_config(cfg_path), "test-producer")
    ids = [i for g in range(2 * steps) for i in buffer.put(group(g, 4))]
    run_two_learner_ranks(cfg_path, tmp_path / "run")
    rows = history(redis_client, run_id)
    assert [r["learner/version"] for r in rows] == [1, 2]
    assert all(np.isfinite(r["loss/policy"]) and np.isfinite(r["loss/value"]) for r in rows)
    assert sorted(i for v in lineage(tmp_path / "run").values() for i in v) == sorted(ids)
    assert buffer.trajectories_pending() == 0
    assert (tmp_path / "weights" / f"v{steps:08d}" / "model.safetensors").exists()
    assert (tmp_path / "run" / "final" / "config.json").exists()

    # One rank on the same data computes the same update (token means over the whole minibatch).
    single = {**raw, "run": {**raw["run"], "name": f"{run_id}-one"}}
    single["learner"] = {**raw["learner"], "num_ranks": 1}
    single_cfg = load_config(None, raw=single)
    buffer = ReplayBuffer.from_config(redis_client, single_cfg, "test-producer")
    for g in range(2 * steps):
        buffer.put(group(g, 4))
    Learner(single_cfg, tmp_path / "one").run()
    # the gradient's norm too: the ranks' mean gradient's, as DeepSpeed clips by it at every stage
    for key in ("loss/policy", "loss/value", "policy/entropy", "actor/grad_norm", "critic/grad_norm"):
        one = [r[key] for r in history(redis_client, f"{run_id}-one")]
        np.testing.assert_allclose([r[key] for r in rows], one, rtol=1e-4, atol=1e-6, err_msg=key)


def test_reward_part_means_by_hand() -> None:
    from learner.ppo import reward_part_means

    def t(parts: dict[str, float]) -> Trajectory:
        return Trajectory(
            traj_id="t", group_id="g", prompt_id="p", prompt_tokens=[1], response_tokens=[2],
            behav_logp=[-1.0], token_versions=[0], reward=0.0, reward_parts=parts,
        )  # fmt: skip

    means = reward_part_means(
        [t({"reverse/exact": 1.0, "reverse/digits": 0.5}), t({"reverse/exact": 0.0, "reverse/digits": 1.0})]
    )
    assert means == {"reward/reverse/exact": 0.5, "reward/reverse/digits": 0.75}


def test_truncated_sampling_shows_as_an_importance_weight_equal_to_the_kept_mass(
    grpo_learner: Learner, tiny_ckpt
) -> None:
    """The chosen treatment of top-k/top-p (docs/design.md §4.2): the engine's behav_logp is of the
    truncated, renormalised distribution, the learner's prox_logp of the full one, so on-policy the
    importance weight exp(prox_logp - behav_logp) is exactly the probability mass the sampler kept."""
    from rollout.engines.base import SamplingParams
    from rollout.engines.hf import HFEngine

    engine = HFEngine(str(tiny_ckpt["actor"]), device="cpu")  # the same weights as the learner's actor
    prompt = engine.tokenizer("say q:").input_ids
    top_k = 3
    (group,) = engine.generate(
        [prompt], SamplingParams(n=4, max_new_tokens=6, temperature=1.0, top_k=top_k, seed=2)
    )
    trajs = [
        Trajectory(
            traj_id=str(i), group_id="g", prompt_id="p", prompt_tokens=prompt, response_tokens=c.token_ids,
            behav_logp=c.logprobs, token_versions=[0] * len(c.token_ids), reward=0.0,
        )
        for i, c in enumerate(group)
    ]  # fmt: skip
    batch = make_batch(trajs, 0)
    prox_logp, _, _ = grpo_learner.score(batch)
    module = grpo_learner.models.actor.module
    for i, t in enumerate(trajs):
        ids = torch.tensor([*prompt, *t.response_tokens.tolist()])[None]
        with torch.no_grad():
            probs = module(input_ids=ids).logits[0, len(prompt) - 1 : -1].float().softmax(-1)  # (R, V)
        kept_mass = probs.topk(top_k, dim=-1).values.sum(-1)  # naive: the sampler's top-k at each step
        r = len(t.response_tokens)
        weight = torch.exp(prox_logp[i, :r] - batch.behav_logp[i, :r])
        torch.testing.assert_close(weight, kept_mass, atol=1e-4, rtol=1e-4)
        assert torch.all(weight < 1.0)  # below 1 on-policy: truncation, not staleness
