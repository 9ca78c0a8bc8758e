"""``algorithm.max_staleness: auto``: the controller (buffer/auto_staleness.py), admission reading the bound
the learner publishes (buffer/admission.py), and the config fields."""

from __future__ import annotations

import math

import pytest

from buffer.admission import Admission
from buffer.auto_staleness import StalenessState, StalenessTarget, next_bound
from tandem.config import ConfigError, load_config

TARGET = StalenessTarget(low=1, high=3, ess_min=0.9, patience=3)


def run(measurements: list[float], start: int = 1) -> list[int]:
    """The bound after each measurement."""
    state, bounds = StalenessState(start), []
    for ess in measurements:
        state, _ = next_bound(state, ess, TARGET)
        bounds.append(state.bound)
    return bounds


def test_the_bound_rises_after_patience_healthy_steps_and_stops_at_high() -> None:
    # worked by hand: +1 at the 3rd and 6th healthy step, then held at high = 3
    assert run([0.95] * 9) == [1, 1, 2, 2, 2, 3, 3, 3, 3]


def test_one_unhealthy_step_lowers_it_at_once_and_restarts_the_count() -> None:
    # 2 -> 1 at the unhealthy step; two healthy steps are not enough after it, the third raises it
    assert run([0.5, 0.95, 0.95, 0.95], start=2) == [1, 1, 1, 2]
    assert run([0.95, 0.95, 0.5, 0.95, 0.95], start=1) == [1, 1, 1, 1, 1]  # the count restarted


def test_the_bound_never_leaves_low_high() -> None:
    assert run([0.1] * 4, start=3) == [2, 1, 1, 1]
    state, reason = next_bound(StalenessState(9), 0.99, TARGET)  # out of range: clamped first
    assert state.bound == 3 and reason is None


def test_each_change_says_why_and_a_hold_says_nothing() -> None:
    _, down = next_bound(StalenessState(2), 0.42, TARGET)
    assert down is not None and "0.420 < 0.9" in down and "2 -> 1" in down
    _, up = next_bound(StalenessState(1, healthy=2), 0.97, TARGET)
    assert up is not None and "3 steps" in up and "1 -> 2" in up
    assert next_bound(StalenessState(1), 0.97, TARGET)[1] is None
    assert next_bound(StalenessState(2, healthy=1), math.nan, TARGET) == (StalenessState(2, 1), None)


def test_a_target_the_controller_cannot_hold_is_refused() -> None:
    with pytest.raises(ValueError, match="low <= high"):
        StalenessTarget(low=3, high=1, ess_min=0.9, patience=1)
    with pytest.raises(ValueError, match="ess_min"):
        StalenessTarget(low=0, high=1, ess_min=1.5, patience=1)


# ------------------------------------------------------------------------------------ admission and config


def test_admission_admits_up_to_the_published_bound_and_never_past_the_hard_limit(
    redis_client, run_id
) -> None:
    """batch 4, groups of 2, hard limit 3: at version 0 the bound is (0 + s + 1)·4 trajectories, worked by
    hand for s = 3 (none published: 8 groups), 1 (4 groups) and a key above the limit (read as 3)."""

    def admitted_groups(bound: int | None, raw: int | None = None) -> int:
        redis_client.delete(f"{run_id}:admitted", f"{run_id}:credits", f"{run_id}:max_staleness")
        adm = Admission(redis_client, run_id, consumer="s0", batch_size=4, max_staleness=3, n_samples=2)
        if bound is not None:
            adm.set_bound(bound)
        if raw is not None:
            redis_client.set(f"{run_id}:max_staleness", raw)
        return adm.try_admit(100)

    assert admitted_groups(None) == 8
    assert admitted_groups(1) == 4
    assert admitted_groups(0) == 2
    assert admitted_groups(None, raw=7) == 8  # capped at the hard limit
    adm = Admission(redis_client, run_id, consumer="s0", batch_size=4, max_staleness=3, n_samples=2)
    adm.set_bound(2)
    assert adm.bound() == 2
    with pytest.raises(ValueError, match=r"outside 0\.\.max_staleness=3"):
        adm.set_bound(4)


def test_lowering_the_bound_stops_admission_until_the_learner_catches_up(redis_client, run_id) -> None:
    adm = Admission(redis_client, run_id, consumer="s0", batch_size=4, max_staleness=3, n_samples=2)
    adm.set_bound(3)
    assert adm.try_admit(100) == 8  # 16 trajectories admitted at version 0
    adm.set_bound(1)
    assert adm.try_admit(1) == 0  # bound (0 + 1 + 1)·4 = 8 < 16
    adm.set_version(2)
    assert adm.try_admit(1) == 0  # (2 + 1 + 1)·4 = 16: full
    adm.set_version(3)
    assert adm.try_admit(100) == 2  # (3 + 1 + 1)·4 = 20: two more groups of 2


def auto_raw(**algorithm) -> dict:
    return {
        "model": {"actor": "a"},
        "data": {"prompts": "p"},
        "reward": {"functions": [{"path": "toy.tasks.echo:reward"}]},
        "rollout": {"n_samples": 2},
        "algorithm": {"batch_size": 4, "minibatch_size": 4, "max_staleness": "auto", **algorithm},
    }


def test_config_auto_reads_the_hard_limit_and_checks_the_range() -> None:
    cfg = load_config(None, raw=auto_raw(staleness_min=1, staleness_max=3))
    assert cfg.auto_staleness and cfg.max_staleness == 3
    assert load_config(None, raw=auto_raw(max_staleness=2)).auto_staleness is False
    sync = auto_raw()
    sync["run"] = {"mode": "sync"}
    assert load_config(None, raw=sync).max_staleness == 0
    with pytest.raises(ConfigError, match="staleness_min"):
        load_config(None, raw=auto_raw(staleness_min=3, staleness_max=1))
    with pytest.raises(ConfigError, match="sync_interval"):  # admission may sit at staleness_min = 0
        load_config(None, raw=auto_raw(staleness_min=0, staleness_max=4, sync_interval=3))


@pytest.mark.parametrize(
    ("settings", "first"),
    [
        ({}, 1),  # [0, 4]: asynchronous from the first step
        ({"staleness_min": 2, "staleness_max": 3}, 2),  # 1 is below the range
        ({"staleness_min": 0, "staleness_max": 0}, 0),  # above it
        ({"staleness_start": 0}, 0),
        ({"staleness_start": 4}, 4),
    ],
)
def test_the_first_bound_is_staleness_start_else_one_within_the_range(settings: dict, first: int) -> None:
    assert load_config(None, raw=auto_raw(**settings)).algorithm.first_staleness_bound == first


def test_a_start_outside_the_range_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"staleness_start \(5\) must lie in .*\[0, 4\]"):
        load_config(None, raw=auto_raw(staleness_start=5))
    with pytest.raises(ConfigError, match=r"staleness_start \(0\)"):
        load_config(None, raw=auto_raw(staleness_min=1, staleness_max=3, staleness_start=0))


def test_the_learner_publishes_each_steps_bound(tiny_ckpt, redis_client, run_id, tmp_path) -> None:
    """PPOLearner.steer_staleness after a step: policy/ess moves the bound (patience 2, [1, 3], starting at
    2), rank 0 publishes it where admission reads it, and staleness/bound reports it."""
    from learner.ppo import PPOLearner
    from tests.test_learner import raw_config

    raw = raw_config(tiny_ckpt, "redis://unused", run_id, tmp_path)
    raw["algorithm"].update(
        max_staleness="auto", staleness_min=1, staleness_max=3, staleness_start=2, staleness_patience=2,
        staleness_ess_target=0.8,
    )  # fmt: skip
    cfg = load_config(None, raw=raw)
    learner = PPOLearner(cfg, tmp_path)
    learner.client = redis_client
    learner.admission = Admission.from_config(redis_client, cfg, "learner")
    learner.publish_bound()
    assert learner.admission.bound() == 2  # staleness_start
    seen = [learner.steer_staleness({"policy/ess": ess})["staleness/bound"] for ess in (0.9, 0.95, 0.9, 0.5)]
    assert seen == [2.0, 3.0, 3.0, 2.0]
    assert learner.admission.bound() == 2
    plain = PPOLearner(
        load_config(None, raw=raw_config(tiny_ckpt, "redis://unused", run_id, tmp_path)), tmp_path
    )
    assert plain.steer_staleness({"policy/ess": 0.1}) == {}


def test_a_resumed_learner_goes_on_from_the_checkpoints_bound_and_kl_coefficient(
    tiny_ckpt, redis_client, run_id, tmp_path
) -> None:
    """The bound auto staleness reached (and its count of healthy steps), and the adaptive KL coefficient,
    travel in the checkpoint's recipe state: a resumed learner starts from them, not from staleness_min and
    kl_coef. A fixed coefficient is not carried (the config's own, which a resume may change)."""
    from learner.checkpoint import LearnerState, load, save
    from learner.ppo import PPOLearner
    from tests.test_checkpoint_async import engine
    from tests.test_learner import raw_config

    raw = raw_config(tiny_ckpt, "redis://unused", run_id, tmp_path)
    raw["algorithm"].update(
        max_staleness="auto", staleness_min=1, staleness_max=3, staleness_patience=2, staleness_ess_target=0.8,
        kl_coef=0.1, kl_target=0.01,
    )  # fmt: skip
    cfg = load_config(None, raw=raw)
    first = PPOLearner(cfg, tmp_path)
    first.client = redis_client
    first.admission = Admission.from_config(redis_client, cfg, "learner")
    for ess in (0.9, 0.95, 0.9):  # up to 2 after two healthy steps, then one more healthy step at 2
        first.steer_staleness({"policy/ess": ess})
    first.kl_ctl.update(current_kl=0.05, n_steps=64)  # far above target: beta grows
    assert (first.staleness.bound, first.staleness.healthy) == (2, 1) and first.kl_ctl.value > 0.1

    save(tmp_path / "ckpt", {"actor": engine(0)}, LearnerState(7, [], first.recipe_state()))
    resumed = PPOLearner(cfg, tmp_path)
    resumed.admission = first.admission
    resumed.restore_recipe_state(load(tmp_path / "ckpt", {"actor": engine(0)}).extra)
    assert resumed.staleness == first.staleness and resumed.kl_ctl.value == first.kl_ctl.value
    assert resumed.steer_staleness({"policy/ess": 0.9})["staleness/bound"] == 3.0  # the count went on

    fixed = load_config(None, raw=raw_config(tiny_ckpt, "redis://unused", run_id, tmp_path))
    assert PPOLearner(fixed, tmp_path).recipe_state() == {}
