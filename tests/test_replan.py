"""Re-planning a running ``placement.mode: auto`` run from its own steps (launcher/auto.py, docs/placement.md
§11.3).

The decision tests write a run's histories into a real Redis in the format the processes log them
(``tandem/telemetry.py``), generated from a known cost per phase: generation and training each take
``G / g`` and ``T / g`` seconds on ``g`` cores, a colocated step adds a switch, a separated one overlaps
the two sides. The probes are the same truth at the start; the run's latest steps are the truth after
a drift. The end-to-end test moves a real run (its decision forced, said there).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import redis
import yaml

from launcher import auto
from placement.planner import Decision, Replanner
from placement.plans import Plan
from placement.profile import read_recent
from tandem import fleet
from tandem.config import Config, dump_config, load_config
from tandem.telemetry import history_key, history_path, read_history

ROOT = Path(__file__).resolve().parent.parent
CORES = 2
SEPARATE, COLOCATE = Plan("separate", 1, 1), Plan("colocate", 2, 2)
PROMPT = 192.0  # prompt tokens of a learner batch
GEN_S, TRAIN_S = 0.04 / 234, 0.04 / 426  # seconds a token on one core: 40 ms each at the start
SWITCH_S, SYNC_S = 0.010, 0.001


def config(total_steps: int = 200, replan_every: int = 10) -> Config:
    raw = yaml.safe_load((ROOT / "configs/tiny-auto.yaml").read_text())
    raw["learner"]["total_steps"] = total_steps
    raw["placement"]["replan_every"] = replan_every
    return load_config(None, raw=raw)


def step_s(plan: Plan, generated: float) -> float:
    """The truth's seconds per step of ``plan`` when a batch generates ``generated`` tokens."""
    gen, train = GEN_S * generated, TRAIN_S * (PROMPT + generated)
    if plan.mode == "colocate":
        return gen / 2 + train / 2 + SWITCH_S
    return max(gen, train) + SYNC_S


def histories(plan: Plan, generated: float, steps: int, t0: float = 1000.0) -> tuple[list, list]:
    """Learner and server rows of ``steps`` steps of ``plan`` (one server batch a step, as in tiny-auto)
    when a batch generates ``generated`` tokens."""
    g = 2 if plan.mode == "colocate" else 1
    gen, train = GEN_S * generated / g, TRAIN_S * (PROMPT + generated) / g
    learner, servers = [], []
    for i in range(1, steps + 1):
        end = t0 + i * step_s(plan, generated)
        learner.append({"step": i, "time": end, "batch/tokens": PROMPT + generated, "time/actor_train": train,
                        "time/weight_sync": SYNC_S})  # fmt: skip
        servers.append({"step": i, "time": end - train, "time/generate": gen, "rollout/tokens": generated,
                        "rollout/longest_response": 8.0})  # fmt: skip
    return learner, servers


def resolved(cfg: Config, generated: float = 234.0) -> auto.Resolved:
    """The profile window: both probes under the truth, as ``auto.resolve`` reads them."""
    probes = [
        read_recent(auto.applied(cfg, plan), *histories(plan, generated, 12), CORES, 10)
        for plan in (COLOCATE, SEPARATE)
    ]
    preds = auto.choose(cfg, probes, CORES)
    return auto.Resolved(auto.applied(cfg, preds[0].plan), preds[0], probes, startup_s=1.0)


def publish(client: redis.Redis, run: str, learner: list, servers: list) -> None:
    client.delete(history_key(run, "learner"), history_key(run, "server-0"))
    client.rpush(history_key(run, "learner"), *map(json.dumps, learner))
    client.rpush(history_key(run, "server-0"), *map(json.dumps, servers))
    fleet.beat(client, run, "server-0")


def test_balanced_sides_run_separated_and_stay_so(redis_client, run_id) -> None:
    cfg = config()
    r = resolved(cfg)
    assert r.best.plan == SEPARATE  # max(40, 40) + 1 ms against 20 + 20 + 10 ms: overlap wins
    assert r.best.step_s == pytest.approx(step_s(SEPARATE, 234), rel=0.05)
    mover = auto.Mover(r.cfg, r, CORES)
    publish(redis_client, run_id, *histories(SEPARATE, 234, 30))
    assert mover(30, redis_client, run_id) is None and mover.decision is None


def test_responses_grown_four_times_move_the_run_to_colocate(redis_client, run_id, capsys) -> None:
    """Responses 4x longer: separated 1:1, generation on one core takes 160 ms a batch against training's
    106 ms, so 161 ms a step; colocated, each has both cores: 80 + 53 + 10 = 143 ms. 18 ms a step over
    170 steps left is more than twice the 1 s a move costs."""
    cfg = config()
    r = resolved(cfg)
    mover = auto.Mover(r.cfg, r, CORES)
    publish(redis_client, run_id, *histories(SEPARATE, 4 * 234, 30))
    why = mover(30, redis_client, run_id)
    assert why is not None and mover.decision is not None and mover.decision.plan == COLOCATE
    assert mover.decision.predicted_s == pytest.approx(step_s(COLOCATE, 4 * 234), rel=0.05)
    assert "step 30: 161.0 ms/step measured under separate 1:1" in capsys.readouterr().out
    # Not judged again before replan_every more steps of the new plan (and a warm-up step).
    mover.start(30, COLOCATE)
    assert mover.plan == COLOCATE and mover.decision is None and mover.next_at == 41


def test_a_move_that_would_not_pay_back_is_not_made(redis_client, run_id, capsys) -> None:
    """The same drift with 40 steps left: 40 x 18 ms saves 0.7 s, under twice a 1 s move."""
    cfg = config(total_steps=70)
    r = resolved(cfg)
    mover = auto.Mover(r.cfg, r, CORES)
    publish(redis_client, run_id, *histories(SEPARATE, 4 * 234, 30))
    assert mover(30, redis_client, run_id) is None
    assert "stay (saves 0.7" in capsys.readouterr().out


def write_history(run_dir: Path, cfg: Config, learner: list, servers: list) -> None:
    """A run directory as the driver leaves it: its public config and the histories it writes at the end."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.public.yaml").write_text(dump_config(cfg))
    history_path(run_dir, "learner").write_text("".join(json.dumps(r) + "\n" for r in learner))
    history_path(run_dir, "server-0").write_text("".join(json.dumps(r) + "\n" for r in servers))


def test_a_resumed_run_re_plans_from_its_probes_without_profiling_again(
    tmp_path, monkeypatch, capsys
) -> None:
    """An auto run's directory is made before it starts, marked with where its probes are, so that
    ``launch.py --resume`` of it (whose saved config names the plan, not auto) comes back here. The probes
    are read again from the directories the choice names, the run goes on under the plan its saved config
    says, and the re-planner judges it from the step it stopped at. Without the probes it goes on, said
    so, under its plan, with no re-planner."""
    cfg = config()
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"output_dir": str(tmp_path)})})
    probes = auto.probes_dir(cfg)
    for mode, plan in (("sync", COLOCATE), ("async", SEPARATE)):
        write_history(probes / mode / "run", auto.probe(cfg, mode, probes / mode), *histories(plan, 234, 12))
    choice = {"probes": {m: str(probes / m / "run") for m in ("sync", "async")}, "startup_s": [1.0, 1.2]}
    (probes / "choice.json").write_text(json.dumps(choice))
    calls = []

    def driver_run(c, prompts, backend, *, resume, watch=None, **kw) -> int:
        """Stands in for the driver: a fresh run leaves its saved config, 40 steps and their checkpoint."""
        calls.append((c, resume, watch))
        if resume is None:
            (Path(c.run.dir) / "checkpoints").mkdir()
            (Path(c.run.dir) / "checkpoints/latest.json").write_text('{"version": 40}')
            (Path(c.run.dir) / "config.public.yaml").write_text(dump_config(c))
            learner, _ = histories(SEPARATE, 234, 40)
            history_path(c.run.dir, "learner").write_text("".join(json.dumps(r) + "\n" for r in learner))
        return 0

    monkeypatch.setattr(auto.driver, "run", driver_run)
    monkeypatch.setattr(auto, "latest_run_dir", lambda c: Path(c.run.dir))
    monkeypatch.setattr(auto, "resolve", lambda c, *a: resolved(c))
    assert auto.run(cfg, None, lambda: None, console_enabled=False) == 0  # a fresh run
    ((c, resume, _),) = calls
    run_dir = Path(c.run.dir)
    assert resume is None and run_dir.parent == tmp_path and auto.started_by_auto(run_dir)
    assert json.loads((run_dir / auto.MARKER).read_text()) == {"probes": str(probes)}

    # What launch.py --resume loads names the plan, not auto.
    history_path(run_dir, "learner").unlink()  # killed: the driver never wrote its history
    saved = load_config(run_dir / "config.public.yaml")
    assert saved.placement.mode == "separate"
    calls.clear()
    monkeypatch.setattr(auto, "resolve", lambda *a: pytest.fail("a resumed run profiles again"))
    assert auto.run(saved, None, lambda: None, console_enabled=False, resume=run_dir) == 0
    ((c, resume, mover),) = calls
    assert resume == run_dir and c.placement.mode == "separate" and c.run.mode == "async"
    assert isinstance(mover, auto.Mover) and mover.plan == SEPARATE
    assert mover.next_at == 40 + 1 + cfg.placement.replan_every  # judged from its checkpoint's step
    assert mover.move_s == pytest.approx(1.1)  # the probes' start-up, until a move is measured
    assert "after step 40: predicted 41.0 ms/step" in capsys.readouterr().out  # max(40, 40) + 1 ms

    (probes / "choice.json").unlink()
    calls.clear()
    assert auto.run(saved, None, lambda: None, console_enabled=False, resume=run_dir) == 0
    ((c, _, mover),) = calls
    assert mover is None and c.placement.mode == "separate"
    assert "keeps its plan without re-planning" in capsys.readouterr().out


class ForcedOnce(Replanner):
    """Forced in this test: the first judgement moves to the next plan in the ranking, whatever the figures
    say (the decision itself is tested above and in simulation); the rest are the real Replanner's."""

    moved = False

    def decide(self, current, ranked, remaining_steps, switch_s, noise=0.0) -> Decision:
        if self.moved:
            return super().decide(current, ranked, remaining_steps, switch_s, noise)
        self.moved = True
        other = next(p for p in ranked if p.plan != current)
        return Decision(other.plan, True, other.step_s, "forced by the test")


@pytest.mark.presets
@pytest.mark.timeout(600)
def test_a_moved_run_resumes_under_its_new_plan_and_trains_every_trajectory_once(
    tiny_ckpt, tmp_path, capsys
) -> None:
    """A real auto run on this machine's cores: probes, the chosen plan, a move at the first judgement (a
    clean stop, then a resume in the same run directory under the other plan), to the last step."""
    from launcher.backends import get_backend
    from launcher.feeder import PromptSet
    from tandem.data import write_prompts
    from toy.tasks import make_records

    prompts = write_prompts(tmp_path / "echo.jsonl", make_records("echo", 400))
    raw = yaml.safe_load((ROOT / "configs/tiny-auto.yaml").read_text())
    raw["model"]["actor"], raw["data"]["prompts"] = str(tiny_ckpt["actor"]), str(prompts)
    raw["run"]["output_dir"], raw["prepare"] = str(tmp_path / "runs"), []
    raw["learner"].update(total_steps=30, checkpoint_interval=0)
    raw["placement"].update(profile_steps=4, replan_every=6)
    cfg = load_config(None, raw=raw)

    def mover(c: Config, r: auto.Resolved, cores: int) -> auto.Mover:
        m = auto.Mover(c, r, cores)
        m.replanner = ForcedOnce()
        return m

    code = auto.run(
        cfg, PromptSet.load(cfg), lambda: get_backend("local"), console_enabled=False, make_mover=mover
    )
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    first = re.search(r"placement auto: chose (\w+)", out).group(1)
    second = "colocate" if first == "separate" else "separate"
    moved = re.search(rf"placement auto: step (\d+): .* move to {second} .*\(forced by the test\)", out)
    assert moved, out[-3000:]
    run_dir = auto.latest_run_dir(cfg)
    saved = load_config(run_dir / "config.public.yaml")
    assert saved.placement.mode == second and saved.run.mode == ("sync" if second == "colocate" else "async")
    # Both stretches reported, predicted against measured, the second after the step the first stopped at.
    assert re.search(rf"placement auto: {first} [^\n]* after step 0: predicted", out)
    stopped = int(re.search(rf"placement auto: {second} [^\n]* after step (\d+): predicted", out).group(1))
    assert stopped >= int(moved.group(1))
    rows = read_history(run_dir, "learner")
    steps = [r["step"] for r in rows if "batch/tokens" in r]
    assert steps == list(range(1, 31))  # every step once, none lost at the move
    trained = [json.loads(x) for x in (run_dir / "trained.jsonl").read_text().splitlines() if x.strip()]
    ids = [i for t in trained for i in t["ids"]]
    assert len(ids) == len(set(ids)) == 30 * cfg.algorithm.batch_size  # exactly once, across the move
    assert sorted(t["version"] for t in trained) == list(range(1, 31))
    after = [r for r in rows if "batch/tokens" in r and r["step"] > stopped]
    if second == "colocate":  # sync: every batch generated by the version it trains
        assert max(r["staleness/max"] for r in after) == 0
    # The resumed servers took the resumed learner's weights; none refused the version the move stopped at
    # (its folder had gone with the clean stop), which stalled sync runs until a timeout.
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("server-*.log"))
    assert "rejected weights" not in logs, logs[-2000:]
