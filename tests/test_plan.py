"""The run plan's CPU thread split (``launcher/run_plan.py``): the servers first, the learner takes what is left."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.run_plan import plan_run
from placement.configured import thread_split
from tandem.config import load_config

ROOT = Path(__file__).resolve().parent.parent


def config(mode: str, learner_threads: int = 0, **rollout: int):
    raw = {
        "run": {"name": "plan", "mode": mode},
        "model": {"actor": "assets/tiny/actor"},
        "data": {"prompts": str(ROOT / "pyproject.toml")},
        "reward": {"functions": [{"path": "toy.tasks.echo:reward"}]},
        "rollout": rollout,
        "learner": {"threads": learner_threads},
    }
    return load_config(None, raw=raw)


@pytest.mark.parametrize(
    ("mode", "servers", "threads", "cores", "expected"),
    [
        ("async", 1, 0, 2, (1, 1)),  # generation and training at once: one core each
        ("async", 1, 0, 16, (8, 8)),
        ("async", 3, 0, 16, (4, 4)),
        ("async", 1, 3, 16, (3, 13)),  # rollout.threads first, the learner takes what is left
        ("sync", 1, 0, 2, (2, 2)),  # the phases alternate: each has every core
        ("sync", 3, 0, 16, (5, 16)),  # the servers share the cores while generating
        ("sync", 2, 3, 16, (3, 16)),
        ("async", 4, 0, 2, (1, 1)),  # never below one thread
    ],
)
def test_thread_split(mode: str, servers: int, threads: int, cores: int, expected: tuple[int, int]) -> None:
    assert thread_split(config(mode, num_servers=servers, threads=threads), cores) == expected


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_learner_threads_override_the_share(mode: str) -> None:
    assert thread_split(config(mode, learner_threads=1, num_servers=1, threads=1), 16) == (1, 1)


def test_plan_gives_each_role_its_threads(tmp_path: Path) -> None:
    cfg = config("async", num_servers=2, threads=3)
    plan = plan_run(cfg, tmp_path, tmp_path / "config.yaml", resume=False, cores=8)
    assert [r.threads for r in plan.roles] == [2, 3, 3]
    assert "OMP_WAIT_POLICY" not in plan.env  # async processes keep their own cores: spinning is free
    assert "GOMP_SPINCOUNT" not in plan.env


def test_sync_plan_shares_every_core_without_spinning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    cfg = config("sync", num_servers=2)
    plan = plan_run(cfg, tmp_path, tmp_path / "config.yaml", resume=False, cores=8)
    assert [r.threads for r in plan.roles] == [8, 4, 4]
    # Passive, after a short spin (~0.1 ms) that bridges the gaps between one step's ops.
    assert plan.env["OMP_WAIT_POLICY"] == "PASSIVE" and plan.env["GOMP_SPINCOUNT"] == "10000"
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")  # the user's own choices stand
    env = plan_run(cfg, tmp_path, tmp_path / "c.yaml", resume=False, cores=8).env
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in env
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    env = plan_run(cfg, tmp_path, tmp_path / "c.yaml", resume=False, cores=8).env
    assert "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env


def test_children_do_not_inherit_a_rendezvous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """launch.py run from a torchrun or SLURM step (or a test process that ran a learner in-process)."""
    from launcher.backends.local import RENDEZVOUS_VARS, plan_children

    for var in RENDEZVOUS_VARS:
        monkeypatch.setenv(var, "47003" if var == "MASTER_PORT" else "0")
    monkeypatch.setenv("TANDEM_KEEP_ME", "1")
    plan = plan_run(config("async"), tmp_path, tmp_path / "config.yaml", resume=False, cores=2)
    for child in plan_children(plan):
        assert not set(RENDEZVOUS_VARS) & set(child.env), child.name
        assert child.env["TANDEM_KEEP_ME"] == "1"  # the rest of the environment passes through
