"""``placement.reference: server``: the rollout servers score the frozen reference next to generation and the
learner reads each trajectory's ``ref_logp`` instead of running its own reference (docs/placement.md §11.1).

Real tiny checkpoints, real DeepSpeed learner engines (one gloo rank), real Redis for the rollout loop.
"""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from buffer.schema import Trajectory, decode_trajectory, encode_trajectory
from learner.batch import make_batch
from learner.models import load_models
from learner.ppo import PPOLearner
from rollout.engines.hf import HFEngine
from rollout.envs.base import Action, Env, StepResult, Task
from rollout.loop import RolloutLoop
from rollout.reference import ReferenceModel, _passes, load_reference
from tandem.config import load_config
from tandem.rewards import RewardFunctions
from tandem.telemetry import Telemetry, read_history
from tests.test_learner import raw_config
from tests.test_rollout_loop import TIMEOUT, Learner, make_cfg, queue_prompts
from weightsync import make_subscriber

TEMPERATURE = 0.7  # not 1: a reference scored at another temperature than the learner's differs


@pytest.fixture(scope="module")
def other_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A reference checkpoint that is not the actor: both sides must read ``model.reference``."""
    from toy.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny-ref"), seed=3)["actor"]


def ppo_config(tiny_ckpt, reference: Path, tmp: Path, placement: str, **learner):
    raw = raw_config(
        tiny_ckpt, "redis://unused", "refplace", tmp,
        model={"actor": str(tiny_ckpt["actor"]), "reference": str(reference)},
        rollout={"n_samples": 4, "temperature": TEMPERATURE},
        algorithm={"kl_coef": 0.1, "kl_estimator": "k3"},
        placement={"reference": placement},
        learner={"micro_batch_size": 2, **learner},
    )  # fmt: skip
    return load_config(None, raw=raw)


def mixed_trajectories() -> list[Trajectory]:
    """Different prompt and response lengths, an empty response, and a multi-turn episode whose environment
    tokens (loss_mask 0) are context only."""
    rng = np.random.default_rng(5)
    shapes = [(2, 7), (9, 1), (5, 4), (1, 11), (6, 0), (3, 9)]
    trajs = []
    for i, (p, r) in enumerate(shapes):
        mask = np.ones(r, dtype=np.uint8)
        if i == 5:
            mask[3:6] = 0  # an environment turn between two model turns
        trajs.append(
            Trajectory(
                traj_id=f"t{i}", group_id=f"g{i // 2}", prompt_id=f"p{i // 2}",
                prompt_tokens=rng.integers(4, 40, size=p), response_tokens=rng.integers(4, 40, size=r),
                behav_logp=np.where(mask, -2.0, 0.0), token_versions=np.where(mask, 0, -1), reward=float(i % 2),
                loss_mask=mask, server_id="server-0",
            )
        )  # fmt: skip
    return trajs


def learner_of(cfg, tmp: Path) -> PPOLearner:
    learner = PPOLearner(cfg, tmp)
    learner.models = load_models(cfg, learner.device)
    return learner


@pytest.mark.parametrize("chunked_head", ["off", "on"])
def test_server_reference_equals_the_learners(tiny_ckpt, other_ckpt, tmp_path, chunked_head: str) -> None:
    """One batch, both placements: the server module's log-probabilities are the learner's reference
    forward's within 1e-5 on every trained token (plain and chunked heads), and 0 on environment tokens."""
    cfg = ppo_config(tiny_ckpt, other_ckpt, tmp_path, "learner", chunked_head=chunked_head)
    learner = learner_of(cfg, tmp_path)
    assert learner.models.reference is not None
    trajs = mixed_trajectories()
    batch = make_batch(trajs, 0)
    _, want, _ = learner.score(batch)  # (B, R), 0 off the mask

    served = load_reference(ppo_config(tiny_ckpt, other_ckpt, tmp_path, "server"))
    assert served is not None and served.temperature == TEMPERATURE
    served.tokens_per_pass = 24  # several passes, rows padded to each pass's longest
    lens = [len(t.prompt_tokens) + len(t.response_tokens) for t in trajs]
    assert len(_passes(sorted(range(len(lens)), key=lambda i: -lens[i]), lens, 24)) > 2
    served.fill(trajs)
    for i, t in enumerate(trajs):
        r = len(t.response_tokens)
        assert t.ref_logp is not None and t.ref_logp.dtype == np.float32 and t.ref_logp.shape == (r,)
        np.testing.assert_allclose(t.ref_logp, want[i, :r].numpy(), atol=1e-5, rtol=0)
        assert np.all(t.ref_logp[~t.generated] == 0) and np.all(t.ref_logp[t.generated] < 0)
    # The learner under `server` trains on exactly these numbers.
    server_learner = PPOLearner(ppo_config(tiny_ckpt, other_ckpt, tmp_path, "server"), tmp_path)
    server_learner.models = learner.models  # the reference it would not load is never read
    _, got, _ = server_learner.score(make_batch(trajs, 0))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_ref_logp_travels_on_the_wire_and_old_records_still_decode() -> None:
    t = mixed_trajectories()[5]
    assert decode_trajectory(encode_trajectory(t)).ref_logp is None  # none scored: the key is absent
    t.ref_logp = np.linspace(-3, -1, len(t.response_tokens)).astype(np.float32)
    back = decode_trajectory(encode_trajectory(t))
    assert back.ref_logp is not None and np.array_equal(back.ref_logp, t.ref_logp)
    t.ref_logp = t.ref_logp[:-1]
    with pytest.raises(ValueError, match="ref_logp: length"):
        decode_trajectory(encode_trajectory(t))


def test_learner_under_server_loads_no_reference_and_refuses_a_batch_without_ref_logp(
    tiny_ckpt, other_ckpt, tmp_path
) -> None:
    cfg = ppo_config(tiny_ckpt, other_ckpt, tmp_path, "server")
    learner = learner_of(cfg, tmp_path)
    assert learner.models.reference is None
    trajs = mixed_trajectories()
    for t in trajs:
        t.ref_logp = np.where(t.generated, -1.5, 0.0)
    trajs[2].ref_logp = None  # from a server that does not score the reference
    batch = make_batch(trajs, 0)
    assert batch.ref_logp is None  # only a batch whose every row has it carries it
    with pytest.raises(
        ValueError, match=r"trajectory t2 \(from server-0\) carries no ref_logp.*placement.reference=server"
    ):
        learner.score(batch)
    with pytest.raises(ValueError, match="trajectory t2"):
        learner.score(batch, actor=False)
    trajs[2].ref_logp = np.full(len(trajs[2].response_tokens), -1.5)
    stats = learner.train(make_batch(trajs, 0))  # the KL paths run on the served numbers
    assert np.isfinite(stats["policy/kl"]) and np.isfinite(stats["loss/kl"])


class TwoTurnEnv(Env):
    """A second model turn after an environment turn: the episode's response holds environment tokens."""

    def reset(self, task: Task) -> None:
        self.turn = 0

    def step(self, action: Action) -> StepResult:
        self.turn += 1
        return StepResult(" ok 7\n", 1.0, self.turn == 2)


@pytest.mark.parametrize("episodes", ["single-turn", "multi-turn"])
def test_rollout_loop_scores_the_reference_next_to_generation(
    redis_server, redis_client, run_id, tiny_ckpt, tmp_path, episodes: str
) -> None:
    """A server with ``placement.reference: server`` appends trajectories carrying ``ref_logp`` of their
    response's length, and logs ``time/reference``. The reference is the actor's initial weights and
    nothing trains, so at temperature 1 with no truncation it equals the engine's own ``behav_logp``: on
    generated tokens the same numbers, on environment tokens 0."""
    env = {"env.path": "tests.test_reference_placement:TwoTurnEnv"} if episodes == "multi-turn" else {}
    cfg = make_cfg(run_id, redis_server.url, tiny_ckpt, tmp_path, **{
        "placement.reference": "server", "algorithm.kl_coef": 0.1, "rollout.temperature": 1.0, **env,
    })  # fmt: skip
    engine = HFEngine(str(tiny_ckpt["actor"]), device="cpu", seed=0)
    v0 = {k: v.clone() for k, v in engine.model.state_dict().items() if k != "lm_head.weight"}
    learner = Learner(cfg, redis_client, v0)
    queue_prompts(learner.buffer, engine, 4)
    with pytest.raises(ValueError, match=r"placement\.reference=server"):  # a server that would not score it
        RolloutLoop(cfg, engine, engine.tokenizer, learner.buffer, None, None, server_index=0,
                    rewards=RewardFunctions(cfg.reward))  # fmt: skip
    from buffer.streams import ReplayBuffer

    loop = RolloutLoop(
        cfg, engine, engine.tokenizer, ReplayBuffer.from_config(redis_client, cfg, consumer="server-0"),
        make_subscriber(cfg, redis_client, "server-0"), Telemetry(cfg, "server-0", redis_client),
        server_index=0, rewards=RewardFunctions(cfg.reward), reference=load_reference(cfg),
    )  # fmt: skip
    errors: list[BaseException] = []
    thread = threading.Thread(target=lambda: _run(loop, errors), daemon=True)
    thread.start()
    try:
        got = learner.take(4)
    finally:
        loop.stop_event.set()
        thread.join(TIMEOUT)
    assert not thread.is_alive() and not errors, errors
    for t in got:
        assert t.ref_logp is not None and t.ref_logp.shape == t.response_tokens.shape
        np.testing.assert_allclose(t.ref_logp, t.behav_logp, atol=1e-4)
    assert any(not t.generated.all() for t in got) == (episodes == "multi-turn")
    stats = redis_client.hgetall(f"{run_id}:stats:server-0")
    assert b"time/reference" in stats


def _run(loop: RolloutLoop, errors: list[BaseException]) -> None:
    try:
        loop.run()
    except BaseException as e:
        errors.append(e)


@pytest.mark.parametrize("path", ["hidden states, 2 tokens of logits at a time", "the model's logits"])
def test_reference_model_scores_rows_without_trajectories(tiny_ckpt, monkeypatch, path: str) -> None:
    """``logprobs`` takes (prompt, response) rows; by hand: one row's log-softmax at temperature 0.5, made
    from the last hidden states a chunk at a time (a plain head) or from the model's own logits."""
    from transformers import AutoModelForCausalLM

    import rollout.reference

    ref = ReferenceModel(str(tiny_ckpt["actor"]), temperature=0.5, device="cpu")
    assert ref.head is not None  # the tiny model's head is a plain Linear
    if path.startswith("hidden"):
        monkeypatch.setattr(rollout.reference, "CHUNK_LOGITS", 2 * ref.head.out_features)
    else:
        ref.head = None
    prompt, response = [5, 9, 12], [7, 30, 4, 4]
    (got,) = ref.logprobs([(prompt, response)])
    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt["actor"])
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1] / 0.5
    want = logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1).numpy()
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.presets  # a launch.py run of a config variant: with the shipped configs (make test-presets)
def test_ppo_runs_end_to_end_with_the_reference_on_the_server(tiny_ckpt, tmp_path) -> None:
    """``launch.py`` with ``placement.reference=server``: the learner trains with a KL term on the servers'
    numbers and logs no reference pass of its own; the server logs ``time/reference``."""
    from tandem.data import write_prompts
    from tests.test_launch import ROOT, launch_cmd, run_dir_of
    from toy.tasks import make_records

    prompts = write_prompts(tmp_path / "echo.jsonl", make_records("echo", 50))
    steps = 3
    cmd = launch_cmd(
        tiny_ckpt, prompts, tmp_path / "runs", f"learner.total_steps={steps}",
        "algorithm.kl_coef=0.05", "placement.reference=server",
    )  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = run_dir_of(tmp_path / "runs")
    rows = read_history(run_dir, "learner")
    trained = [r for r in rows if "reward/mean" in r]
    assert len(trained) == steps and all(np.isfinite(r["policy/kl"]) for r in trained)
    assert not any("time/reference" in r for r in trained)  # no reference forward on the learner
    server = read_history(run_dir, "server-0")
    assert any("time/reference" in r for r in server)
