"""Multi-turn episodes on the real hf engine and tiny checkpoints (docs/environments.md §10.3).

The reference for behaviour logprobs is the learner's own forward pass (``learner.batch`` micro-batches,
``learner.models.policy_logits``) over the whole token sequence, read at generated positions only.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from buffer.schema import decode_trajectory, encode_trajectory
from learner.batch import make_batch, micro_batches, response_view
from learner.losses import logprobs_from_logits
from learner.models import policy_logits
from rollout.engines.base import SamplingParams
from rollout.engines.hf import HFEngine
from rollout.envs.base import Action, Env, StepResult, Task
from rollout.envs.episode import Episode, EpisodeRunner
from toy.tiny import make_tiny
from weightsync.base import Update


class TalkEnv(Env):
    """Answers every model turn with a fixed observation; done after ``turns`` model turns, reward 1."""

    def __init__(self, turns: int = 3, obs: str = "ok, go on\n") -> None:
        self.turns, self.obs, self.seen = turns, obs, 0

    def step(self, action: Action) -> StepResult:
        self.seen += 1
        done = self.seen >= self.turns
        return StepResult("" if done else self.obs, 1.0 if done else 0.25, done)


def as_update(model: torch.nn.Module, version: int) -> Update:
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return Update(version, [], lambda: iter(state.items()))


@pytest.fixture(scope="module")
def models(tiny_ckpt, tmp_path_factory) -> dict[str, object]:
    other = make_tiny(tmp_path_factory.mktemp("other"), seed=7)["actor"]
    a = AutoModelForCausalLM.from_pretrained(tiny_ckpt["actor"]).eval()
    b = AutoModelForCausalLM.from_pretrained(other).eval()
    return {
        "a": a,
        "b": b,
        "tok": AutoTokenizer.from_pretrained(tiny_ckpt["actor"]),
        "path": tiny_ckpt["actor"],
    }


def runner(engine: HFEngine, tok, **kw) -> EpisodeRunner:
    sampling = SamplingParams(
        max_new_tokens=kw.pop("turn_tokens", 6), temperature=1.0, stop=["\n"], seed=None
    )
    return EpisodeRunner(engine, tok, sampling, max_turns=kw.pop("max_turns", 4),
                         max_total_tokens=kw.pop("max_total_tokens", 200),
                         step_timeout_s=kw.pop("timeout", 5.0), vocab_size=len(tok),
                         progression=kw.pop("progression", "rounds"))  # fmt: skip


def episodes(tok, prompts: list[str], env=TalkEnv) -> list[Episode]:
    out = []
    for i, p in enumerate(prompts):
        ids = tok(p)["input_ids"]
        out.append(Episode(Task(p, tuple(ids), {"id": f"p{i}"}), env(), list(ids)))
    return out


def learner_logp(model: torch.nn.Module, trajs) -> torch.Tensor:
    """The learner's forward pass over whole sequences: (B, R) logprobs of every response token."""
    batch = make_batch(trajs, 0)
    out = torch.zeros_like(batch.behav_logp)
    with torch.no_grad():
        for mb in micro_batches(batch, torch.arange(len(trajs)), 8, "pad", torch.device("cpu")):
            out[mb.rows] = logprobs_from_logits(response_view(policy_logits(model, mb, 1.0), mb), mb.targets)
    return out


def test_behav_logp_equals_the_learners_forward_across_turns_and_a_between_turn_update(models) -> None:
    tok = models["tok"]
    engine = HFEngine(str(models["path"]), device="cpu", seed=3)
    turns_seen = []

    def between_turns() -> None:  # after the first model turn, the learner's v1 arrives
        turns_seen.append(1)
        if len(turns_seen) == 1:
            engine.update_weights(as_update(models["b"], 1))

    eps = episodes(tok, ["12+34=", "say a:", "hello there, how"])
    runner(engine, tok).run(eps, between_turns=between_turns)
    trajs = [e.trajectory(f"p{i}", "g", "server-0") for i, e in enumerate(eps)]
    trajs = [decode_trajectory(encode_trajectory(t)) for t in trajs]  # valid on the wire
    ref = {0: learner_logp(models["a"], trajs), 1: learner_logp(models["b"], trajs)}
    env_tokens = 0
    for i, t in enumerate(trajs):
        assert t.finish_reason == "stop" and t.meta["end_reason"] == "done" and t.reward == 1.5
        kinds = [k for k, _, _ in t.segments()]
        assert kinds == ["model", "env", "model", "env", "model"], kinds
        first, second = t.segments()[0], t.segments()[2]
        assert set(t.token_versions[first[1] : first[2]]) == {0}  # turn 1 by v0
        assert set(t.token_versions[second[1] :][t.generated[second[1] :]]) == {1}  # later turns by v1
        for j in np.flatnonzero(t.generated):
            expected = ref[int(t.token_versions[j])][i, j].item()
            assert t.behav_logp[j] == pytest.approx(expected, abs=2e-4), (i, j)
        # env tokens are exactly the tokeniser's ids of the observation (tokenised once, appended verbatim)
        obs = tok("ok, go on\n", add_special_tokens=False)["input_ids"]
        assert t.response_tokens[~t.generated].tolist() == obs * 2
        env_tokens += int((~t.generated).sum())
        # Per-turn credit: each turn's reward on that turn's last generated token, and so in the batch.
        ends = [end - 1 for kind, _, end in t.segments() if kind == "model"]
        assert t.meta["turn_credit"] == [[e, r] for e, r in zip(ends, [0.25, 0.25, 1.0], strict=True)]
    assert env_tokens > 0
    placed = make_batch(trajs, 0, per_turn=True).turn_rewards
    for i, t in enumerate(trajs):
        row = placed[i, : len(t.response_tokens)]
        assert row.sum().item() == pytest.approx(t.reward) and int(row.ne(0).sum()) == 3
        assert all(t.generated[j] for j in row.nonzero().flatten().tolist())
    assert make_batch(trajs, 0).turn_rewards is None  # episode credit: the sequence reward alone


def test_behav_logp_across_an_inflight_update_inside_a_turn(models) -> None:
    """Weights change after the 2nd decode step of the 2nd turn: tokens before it match v0's forward,
    turn 3 (prefilled again by v1) matches v1's forward, and the rest of turn 2 matches v1 reading the
    KV cache v0 wrote (the hf engine keeps the cache across an in-flight update, docs/design.md §5.6)."""
    tok = models["tok"]
    engine = HFEngine(str(models["path"]), device="cpu", seed=5)
    state = {"turn": 0, "steps": 0}

    def between_turns() -> None:
        state["turn"] += 1

    def between_steps() -> None:
        if state["turn"] == 1:
            state["steps"] += 1
            if state["steps"] == 2:
                engine.update_weights(as_update(models["b"], 1))

    eps = episodes(tok, ["12+34="], env=lambda: TalkEnv(turns=3, obs="yes\n"))
    # stop strings none and EOS ignored is not possible; use long turns and retry seeds until turn 2 is long
    runner(engine, tok, turn_tokens=8).run(eps, between_steps=between_steps, between_turns=between_turns)
    (t,) = [decode_trajectory(encode_trajectory(e.trajectory("p", "g", "s"))) for e in eps]
    segs = [s for s in t.segments() if s[0] == "model"]
    assert len(segs) == 3
    _, s2, e2 = segs[1]
    v2 = t.token_versions[s2:e2].tolist()
    if len(v2) < 3:
        pytest.skip("turn 2 stopped before the in-flight update (a seed-dependent stop)")
    assert v2 == [0, 0] + [1] * (len(v2) - 2)  # the version switches inside the turn
    ref = {0: learner_logp(models["a"], [t])[0], 1: learner_logp(models["b"], [t])[0]}
    for j in np.flatnonzero(t.generated):
        if j < s2 + 2 or j >= segs[2][1]:
            assert t.behav_logp[j] == pytest.approx(ref[int(t.token_versions[j])][j].item(), abs=2e-4), j
    # the stale-KV tail of turn 2: v0 writes the cache up to the switch, v1 continues on it
    seq = torch.tensor(np.concatenate([t.prompt_tokens, t.response_tokens]), dtype=torch.long)[None]
    p, switch = len(t.prompt_tokens), len(t.prompt_tokens) + s2 + 2  # first v1 token's sequence index
    with torch.no_grad():
        cache = DynamicCache(config=models["a"].config)
        models["a"](input_ids=seq[:, : switch - 1], past_key_values=cache, use_cache=True)
        logits = models["b"](
            input_ids=seq[:, switch - 1 : p + e2 - 1], past_key_values=cache, use_cache=True
        ).logits
    tail = logprobs_from_logits(logits, seq[:, switch : p + e2])[0]
    np.testing.assert_allclose(t.behav_logp[s2 + 2 : e2], tail.numpy(), atol=2e-4)


class RaisingEnv(TalkEnv):
    def step(self, action: Action) -> StepResult:
        raise RuntimeError("tool crashed")


class HangingEnv(TalkEnv):
    def step(self, action: Action) -> StepResult:
        time.sleep(60)
        return StepResult("", 1.0, True)


class GarbageEnv(TalkEnv):
    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def step(self, action: Action):
        return {
            "type": "not a StepResult",
            "nan": StepResult("x", float("nan"), False),
            "ids": StepResult([5, 10**9], 0.0, False),
            "obs": StepResult(3.5, 0.0, False),  # type: ignore[arg-type]
        }[self.what]


class AsyncTalkEnv(TalkEnv):
    async def step(self, action: Action) -> StepResult:
        await asyncio.sleep(0.01)
        return super().step(action)


class RaisingResetEnv(TalkEnv):
    def reset(self, task: Task) -> str:
        raise ValueError("no such task")


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (RaisingEnv, "env_error: step raised RuntimeError: tool crashed"),
        (HangingEnv, "env_timeout: step took longer than env.step_timeout_s=1s"),
        (lambda: GarbageEnv("type"), "env_garbage: step returned str"),
        (lambda: GarbageEnv("nan"), "env_garbage: reward nan"),
        (lambda: GarbageEnv("ids"), "env_garbage: step observation has token ids outside"),
        (lambda: GarbageEnv("obs"), "env_garbage: step observation is float"),
        (RaisingResetEnv, "env_error: reset raised ValueError: no such task"),
    ],
    ids=["raises", "hangs", "not-a-result", "nan-reward", "bad-ids", "bad-observation", "reset-raises"],
)
def test_a_failing_env_ends_its_episode_with_a_reason_and_the_others_go_on(models, make, reason) -> None:
    tok = models["tok"]
    engine = HFEngine(str(models["path"]), device="cpu", seed=1)
    eps = episodes(tok, ["12+34="], env=make) + episodes(tok, ["say a:"], env=AsyncTalkEnv)
    start = time.monotonic()
    runner(engine, tok, timeout=1.0).run(eps)
    assert time.monotonic() - start < 30  # the hanging one was cut off, not waited for
    bad, good = eps
    assert bad.finish_reason == "abort" and bad.end_reason.startswith(reason), bad.end_reason
    assert good.finish_reason == "stop" and good.end_reason == "done" and good.turns == 3
    t = decode_trajectory(encode_trajectory(bad.trajectory("p", "g", "s")))
    assert t.finish_reason == "abort" and make_batch([t], 0).mask.sum() == 0  # never trained on


def test_budgets_end_episodes_as_length(models) -> None:
    tok = models["tok"]
    engine = HFEngine(str(models["path"]), device="cpu", seed=2)
    forever = lambda: TalkEnv(turns=100)  # noqa: E731
    eps = episodes(tok, ["12+34="], env=forever)
    runner(engine, tok, max_turns=2).run(eps)
    assert (eps[0].finish_reason, eps[0].end_reason, eps[0].turns) == ("length", "max_turns", 2)
    eps = episodes(tok, ["12+34="], env=forever)
    runner(engine, tok, max_total_tokens=20).run(eps)
    assert (eps[0].finish_reason, eps[0].end_reason) == ("length", "max_total_tokens")
    assert len(eps[0].context) <= 20


def test_a_stage_that_outlives_its_bound_raises_instead_of_waiting_forever() -> None:
    from rollout.envs.episode import parallel

    done: list[int] = []
    parallel([lambda: done.append(1), lambda: done.append(2)], 5.0, "step")
    assert sorted(done) == [1, 2]
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"episode step: 1 of 2 calls still running after 0\.2s"):
        parallel([lambda: None, lambda: time.sleep(30)], 0.2, "step")
    assert time.monotonic() - t0 < 10


def test_the_learner_logs_batch_means_of_episode_metrics() -> None:
    from learner.ppo import episode_metric_means

    def traj(turns: int, metrics: dict[str, float]):
        e = Episode(Task("p", (1,), {}), TalkEnv(), [1], turns=turns, metrics=metrics)
        e.add([5, 6], [-0.1, -0.2], [0, 0], generated=True)
        e.rewarded(1.0)
        e.end("stop", "done")
        return e.trajectory("p", "g", "s")

    trajs = [traj(1, {"tool_used": 0.0}), traj(3, {"tool_used": 1.0, "correct": 1.0}), traj(2, {})]
    got = episode_metric_means(trajs)
    # each metric over the episodes that report it; turns over all three
    assert got == {"env/tool_used": 0.5, "env/correct": 1.0, "env/turns": 2.0}


class WaitForOthers(Env):
    """Episode 0's first step waits until every other episode has taken its last step (``turns``); the
    others answer at once. ``order`` records who got there: each other episode at its last step, then 0."""

    def __init__(
        self, index: int, order: list[int], others_done: threading.Event, total: int, turns: int
    ) -> None:
        self.index, self.order, self.others_done, self.total, self.turns = (
            index,
            order,
            others_done,
            total,
            turns,
        )
        self.steps = 0

    def step(self, action: Action) -> StepResult:
        self.steps += 1
        if self.index == 0 and self.steps == 1:
            if not self.others_done.wait(timeout=20):
                raise TimeoutError("the other episodes never finished")
            self.order.append(0)
        elif self.index and self.steps == self.turns:
            self.order.append(self.index)
            if len(self.order) == self.total - 1:
                self.others_done.set()
        return StepResult("ok\n", 1.0, False)


@pytest.mark.parametrize("direct", [False, True], ids=["engine-front", "continuous-engine"])
def test_independent_progression_lets_episodes_finish_while_one_waits_on_its_environment(
    models, direct
) -> None:
    """Episode 0's environment answers only once every other episode has ended. Independent progression
    finishes the others meanwhile (their turns go to the engine without waiting for episode 0's step);
    turn-synchronous rounds cannot, so there episode 0's step times out. ``direct``: the hf engine as it is,
    whose running batch takes each episode's turn as its own call (the between-turns hook runs before each
    call, one at a time); else it is treated as an engine that decodes each call on its own, and the engine
    front gathers the turns that are ready into one call."""
    tok = models["tok"]
    engine = HFEngine(str(models["path"]), device="cpu", seed=11)
    engine.continuous_batching = direct
    hooks, inside = [], []

    def between_turns() -> None:  # never two at once
        inside.append(1)
        assert len(inside) == 1
        hooks.append(time.monotonic())
        inside.pop()

    for progression in ("independent", "rounds"):
        order: list[int] = []
        done = threading.Event()
        n = 4
        eps = [
            Episode(Task(p, tuple(ids), {"id": str(i)}), WaitForOthers(i, order, done, n, 3), list(ids))
            for i, (p, ids) in enumerate((p, tok(p)["input_ids"]) for p in ["1+2=", "say a:", "hi", "12+3="])
        ]
        timeout = 30.0 if progression == "independent" else 3.0
        runner(engine, tok, max_turns=3, timeout=timeout, progression=progression).run(
            eps, between_turns=between_turns
        )
        if progression == "independent":
            assert sorted(order[:-1]) == list(range(1, n)) and order[-1] == 0  # the others ended first
            assert all(e.end_reason == "max_turns" and e.turns == 3 for e in eps), [e.end_reason for e in eps]
            trajs = [
                decode_trajectory(encode_trajectory(e.trajectory(f"p{i}", "g", "s")))
                for i, e in enumerate(eps)
            ]
            ref = learner_logp(models["a"], trajs)
            for i, t in enumerate(trajs):
                assert [k for k, _, _ in t.segments()] == ["model", "env"] * 3
                gen = np.flatnonzero(t.generated)
                np.testing.assert_allclose(t.behav_logp[gen], ref[i, gen].numpy(), atol=2e-4)
            assert len(hooks) >= 2  # weight updates get their chance between turns
        else:
            assert eps[0].finish_reason == "abort" and eps[0].end_reason.startswith("env_timeout")
    engine.close()
