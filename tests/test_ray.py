"""The ``ray`` launcher backend on a real local multi-node Ray cluster (``ray.cluster_utils.Cluster``).

One cluster for the module: a head node with no CPUs (the launcher and Redis live beside it), two learner
nodes (custom resource ``learner``) and three rollout nodes (``rollout``), so the learner and the servers
are on different Ray nodes, each with its own raylet. Every run is ``python launch.py ... --ray ADDRESS``
as a user types it. Weights cross nodes over ``dist`` (gloo on CPU). The fault tests remove Ray nodes
(their raylets and every worker on them die, as when a host goes away) while a run is in flight.
Nothing is mocked; all nodes share this machine's filesystem and cores.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from tandem.telemetry import history_path, read_history  # noqa: E402
from tests.test_launch import attach, inspect_redis, leftover_processes, run_dir_of  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.ray]  # a local Ray cluster per module: make test-ray

LEARNER = {"learner": 1}
ROLLOUT = {"rollout": 1}
KIND: dict[str, dict] = {}  # node id -> the custom resources it was started with


def add_node(c: Cluster, resources: dict) -> None:
    KIND[c.add_node(num_cpus=1, resources=resources).node_id] = resources


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for res in (LEARNER, LEARNER, ROLLOUT, ROLLOUT, ROLLOUT):
        add_node(c, res)
    c.wait_for_nodes()
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tandem.data import write_prompts
    from toy.tasks import make_records

    return write_prompts(tmp_path_factory.mktemp("data") / "echo.jsonl", make_records("echo", 200))


def ray_cmd(cluster: Cluster, tiny_ckpt, prompts: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "launch.py"),
        str(ROOT / "configs/tiny.yaml"),
        f"model.actor={tiny_ckpt['actor']}",
        f"model.critic={tiny_ckpt['critic']}",
        f"data.prompts={prompts}",
        f"run.output_dir={out}",
        "weightsync.transport=dist",
        "logging.wandb_mode=disabled",
        "redis.claim_idle_ms=2000",
        "rollout.threads=1",
        "cluster.learner_resources={learner: 1}",
        "cluster.server_resources={rollout: 1}",
        *extra,
        "--no-console",
        "--ray",
        cluster.address,
    ]


SMALL = [
    "rollout.n_samples=4",
    "rollout.prompts_per_batch=2",
    "rollout.max_new_tokens=6",
    "algorithm.batch_size=8",
    "algorithm.minibatch_size=8",
    "learner.micro_batch_size=8",
]


def placement(run_dir: Path) -> dict[str, str]:
    return json.loads((run_dir / "placement.json").read_text())


def node_of(cluster: Cluster, label: str):
    (node,) = [n for n in cluster.list_all_nodes() if n.node_id.startswith(label.split()[0])]
    return node


def test_unsatisfiable_placement_is_refused_before_anything_starts(
    cluster, tiny_ckpt, prompts: Path, tmp_path: Path
) -> None:
    # Four servers that each need a `rollout` resource: the cluster has three.
    cmd = ray_cmd(cluster, tiny_ckpt, prompts, tmp_path, *SMALL, "rollout.num_servers=4")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith("error: cluster: 4 rollout servers needs 4 slots") and "room for 3" in err
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # no run directory, nothing started


def test_shm_across_nodes_is_refused_before_any_process_runs(
    cluster, tiny_ckpt, prompts: Path, tmp_path: Path
) -> None:
    cmd = ray_cmd(cluster, tiny_ckpt, prompts, tmp_path, *SMALL, "weightsync.transport=shm")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "could not start: weightsync.transport=shm: server-0 is on node" in proc.stdout
    assert "set weightsync.transport=dist" in proc.stdout
    run_dir = run_dir_of(tmp_path)
    assert not list((run_dir / "logs").iterdir())  # no role ever ran: no log was opened
    assert not history_path(run_dir, "learner").read_text()


def test_async_demo_learns_across_nodes_over_dist(cluster, tiny_ckpt, prompts: Path, tmp_path: Path) -> None:
    # 300 steps: the async demo crosses 0.8 between steps 170 and 260 from run to run (nondeterministic).
    cmd = ray_cmd(cluster, tiny_ckpt, prompts, tmp_path, "learner.total_steps=300")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "learner finished at step 300" in proc.stdout
    run_dir = run_dir_of(tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["reward_last"] >= 0.8, summary
    where = summary["placement"]
    learner_node, server_node = where["learner/rank-0"], where["server-0"]
    assert learner_node != server_node  # the weights crossed Ray nodes
    assert KIND[node_of(cluster, learner_node).node_id] == LEARNER
    assert KIND[node_of(cluster, server_node).node_id] == ROLLOUT
    assert "[launch] placement: learner/rank-0 on" in proc.stdout
    # every server version came over dist: the server held the learner's newest weights
    server = read_history(run_dir, "server-0")
    assert max(r.get("rollout/version", 0) for r in server) >= 150
    assert leftover_processes(run_dir) == []


def test_placement_auto_profiles_both_modes_and_runs_its_pick_on_the_cluster(
    cluster, tiny_ckpt, prompts: Path, tmp_path: Path
) -> None:
    """``placement.mode: auto`` on Ray: two probe runs (colocated, separated) on the cluster's nodes, a
    pick among the plans they predict, and the run under that pick (docs/placement.md §11.3)."""
    steps, probe = 16, 6
    extra = (
        *SMALL,
        "placement.mode=auto",
        f"placement.profile_steps={probe}",
        f"learner.total_steps={steps}",
    )
    proc = subprocess.run(
        ray_cmd(cluster, tiny_ckpt, prompts, tmp_path, *extra),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    probes = tmp_path / "tiny-auto-probes"
    for mode in ("sync", "async"):
        (probe_dir,) = [p for p in (probes / mode).iterdir() if p.is_dir()]
        rows = read_history(probe_dir, "learner")
        assert len(rows) == probe, (mode, len(rows))
        where = json.loads((probe_dir / "summary.json").read_text())["placement"]
        assert where["learner/rank-0"] != where["server-0"]  # on the cluster's nodes, not in-process
    choice = json.loads((probes / "choice.json").read_text())
    assert set(choice["probes_step_s"]) == {"colocate 2 serial", "separate 1:1 serial"}
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir() and p != probes]
    saved = yaml.safe_load((run_dir / "config.public.yaml").read_text())
    assert choice["plan"].startswith(saved["placement"]["mode"])  # the run is the plan it chose
    assert saved["run"]["mode"] == ("sync" if saved["placement"]["mode"] == "colocate" else "async")
    assert f"learner finished at step {steps}" in proc.stdout
    assert re.search(r"placement auto: .* after step 0: predicted .* measured", proc.stdout)
    assert leftover_processes(run_dir) == []


def test_the_scoring_workers_run_on_a_node_of_their_own(
    cluster, tiny_ckpt, prompts: Path, tmp_path: Path
) -> None:
    """``placement.reference=own`` and ``placement.reward_model=own`` on Ray: each worker is an actor on a
    node with the resources it asks for, apart from the learner and the server, and the learner trains on
    their numbers (docs/placement.md §11.1)."""
    steps = 6
    extra = (*SMALL, f"learner.total_steps={steps}", "algorithm.kl_coef=0.05", "placement.reference=own",
             f"model.reward_model={tiny_ckpt['critic']}", "placement.reward_model=own",
             "cluster.aux_resources={rollout: 1}")  # fmt: skip
    proc = subprocess.run(
        ray_cmd(cluster, tiny_ckpt, prompts, tmp_path, *extra), cwd=ROOT, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = run_dir_of(tmp_path)
    where = placement(run_dir)
    roles = ("reference", "reward_model")
    assert len({where["learner/rank-0"], where["server-0"], *(where[r] for r in roles)}) >= 3
    assert {where[r] for r in roles}.isdisjoint({where["learner/rank-0"], where["server-0"]})
    assert all(KIND[node_of(cluster, where[r]).node_id] == ROLLOUT for r in roles)
    rows = read_history(run_dir, "learner")
    trained = [r for r in rows if "reward/mean" in r]
    assert len(trained) == steps and all(
        "time/reference_wait" in r and "time/reward_model_wait" in r and math.isfinite(r["policy/kl"])
        for r in trained
    )
    for role in roles:
        worker = read_history(run_dir, role)
        assert sum(r[f"{role}/trajectories"] for r in worker) >= steps * 8
    assert leftover_processes(run_dir) == []


def losses(run_dir: Path) -> list[float]:
    rows = read_history(run_dir, "learner")
    return [r["loss/policy"] for r in rows if "loss/policy" in r]


def test_two_ranks_on_two_nodes_train_like_two_ranks_on_one(
    cluster, tiny_ckpt, prompts: Path, tmp_path: Path
) -> None:
    # Lock-step (sync) with one server is deterministic, so both runs see the same batches.
    same = [*SMALL, "learner.total_steps=4", "learner.num_ranks=2", "--mode", "sync"]
    ray_run = subprocess.run(
        ray_cmd(cluster, tiny_ckpt, prompts, tmp_path / "ray", *same, "cluster.learner_nodes=2"),
        cwd=ROOT, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert ray_run.returncode == 0, ray_run.stdout[-3000:] + ray_run.stderr[-3000:]
    ray_dir = run_dir_of(tmp_path / "ray")
    where = json.loads((ray_dir / "summary.json").read_text())["placement"]
    assert where["learner/rank-0"] != where["learner/rank-1"]  # one rank per node

    local = ray_cmd(cluster, tiny_ckpt, prompts, tmp_path / "local", *same)[:-2]  # no --ray: torchrun
    local_run = subprocess.run(local, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert local_run.returncode == 0, local_run.stdout[-3000:] + local_run.stderr[-3000:]
    a, b = losses(ray_dir), losses(run_dir_of(tmp_path / "local"))
    assert len(a) == len(b) == 4
    assert a == pytest.approx(b, rel=1e-5, abs=1e-7)
    assert len(set(a)) > 1  # the losses moved: a real comparison, not four zeros


def test_killed_server_node_moves_the_server_and_loses_no_prompt(
    cluster, tiny_ckpt, prompts: Path, tmp_path: Path
) -> None:
    steps = 40
    cmd = ray_cmd(
        cluster,
        tiny_ckpt,
        prompts,
        tmp_path,
        *SMALL,
        f"learner.total_steps={steps}",
        "supervision.server_restarts=2",
        # Two servers: with dist a restarted server gets the next version the learner publishes, which
        # needs a batch the other server makes (docs/design.md §5.7). A dead registered peer holds a
        # publish for at most weightsync.timeout_s.
        "rollout.num_servers=2",
        "weightsync.timeout_s=15",
        # The restarted server-0 re-reads server-0's pending prompts by name; no claim is needed, and a
        # short claim_idle_ms would let the two servers claim each other's slow (loaded-machine) prompts
        # and answer them twice (at-least-once, buffer/streams.py), which the exact account below counts.
        "redis.claim_idle_ms=60000",
    )
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        run_dir, client = attach(proc, tmp_path, deadline)
        key = f"{run_dir.name}:ready:server-0"
        while not (client.exists(key) and int(client.get(f"{run_dir.name}:version") or 0) >= 2):
            assert time.monotonic() < deadline and proc.poll() is None, "run did not reach step 2"
            time.sleep(0.05)
        before = placement(run_dir)["server-0"]
        cluster.remove_node(node_of(cluster, before))  # the host goes away: raylet and workers
        killed_at = int(client.get(f"{run_dir.name}:version"))
        assert killed_at < steps - 10, f"the kill landed too late (version {killed_at})"
        held = {
            e["message_id"].decode()
            for e in client.xpending_range(f"{run_dir.name}:prompts", "rollout", "-", "+", 1000, "server-0")
        }
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
        add_node(cluster, ROLLOUT)  # the next test gets the cluster it expects
    assert proc.returncode == 0, out[-4000:]
    assert f"learner finished at step {steps}" in out
    after = placement(run_dir)["server-0"]
    assert after != before and KIND[node_of(cluster, after).node_id] == ROLLOUT
    assert after != placement(run_dir)["server-1"]  # on the third rollout node: the one with room
    assert "server-0 restarted on node" in out
    history = read_history(run_dir, "server-0")
    assert max(r.get("rollout/version", 0) for r in history) > killed_at  # weights reached the new one

    server, client, run = inspect_redis(run_dir)
    try:
        left = {i.decode() for i, _ in client.xrange(f"{run}:prompts")}
        assert not (held & left), "prompts held by the lost server were never answered"
        feeder = client.hgetall(f"{run}:feeder")
        fed = int(feeder[b"epoch"]) * 200 + int(feeder[b"index"])
        counts = {k.decode(): int(v) for k, v in client.hgetall(f"{run}:counts").items()}
        refused = counts.get(f"{run}:traj:stale", 0) + counts.get(f"{run}:traj:dead", 0)
        assert (fed - len(left)) * 4 == steps * 8 + refused + client.xlen(f"{run}:traj")
        assert fed - len(left) > steps * 2  # the account is not vacuous: prompts were answered
    finally:
        client.close()
        server.stop()


def test_killed_learner_node_ends_the_run_and_resume_continues(
    cluster, tiny_ckpt, prompts: Path, tmp_path: Path
) -> None:
    steps = 12
    extra = [*SMALL, f"learner.total_steps={steps}", "learner.checkpoint_interval=3"]
    proc = subprocess.Popen(
        ray_cmd(cluster, tiny_ckpt, prompts, tmp_path, *extra),
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        run_dir, client = attach(proc, tmp_path, deadline)
        while int(client.get(f"{run_dir.name}:version") or 0) < 5:
            assert time.monotonic() < deadline and proc.poll() is None, "run did not reach step 5"
            time.sleep(0.05)
        cluster.remove_node(node_of(cluster, placement(run_dir)["learner/rank-0"]))
        out, _ = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
        add_node(cluster, LEARNER)  # a replacement host joins
    assert proc.returncode == 1, out[-3000:]
    assert "learner: learner/rank-0 on node" in out and "was lost" in out
    assert f"--resume {run_dir}" in out  # the message says how to continue

    resumed = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "--resume", str(run_dir), "--no-console", "--ray", cluster.address],
        cwd=ROOT, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"learner finished at step {steps}" in resumed.stdout
    rows = [json.loads(line) for line in (run_dir / "trained.jsonl").read_text().splitlines()]
    final = {}
    for r in rows:  # a version trained twice (lost with the node, then retrained): the later one counts
        final[r["version"]] = r["ids"]
    assert sorted(final) == list(range(1, steps + 1))
    ids = [i for v in final.values() for i in v]
    assert len(ids) == len(set(ids)) == steps * 8  # every trajectory in the final model trained once


def test_the_two_node_preset_runs_on_its_node_labels(
    cluster, tiny_ckpt, prompts: Path, tmp_path: Path
) -> None:
    """configs/ray-2node-vllm.yaml as shipped, on the cluster, at tiny scale: its learner ranks share the
    node labelled ``learner`` (ZeRO-3 over gloo), its servers take nodes labelled ``rollout``, and the
    weights cross nodes over ``dist``. Only what cannot run here is overridden (tests/test_presets.py)."""
    import yaml

    from tests.test_presets import STEPS, online_overrides

    preset = ROOT / "configs/ray-2node-vllm.yaml"
    raw = yaml.safe_load(preset.read_text())
    cmd = [sys.executable, str(ROOT / "launch.py"), str(preset), "--no-console", "--ray", cluster.address]
    stand_in = {"actor": tiny_ckpt["actor"], "reference": tiny_ckpt["actor"], "critic": tiny_ckpt["critic"]}
    cmd += [f"model.{k}={p}" for k, p in stand_in.items() if raw["model"].get(k) is not None]
    cmd += [*online_overrides(raw, tmp_path / "runs"), f"data.prompts={prompts}"]
    # This cluster's nodes have one CPU each: the preset's 4 CPUs per rank/server become a share of one.
    cmd += ["cluster.learner_cpus=0.5", "cluster.server_cpus=1", "rollout.threads=1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"learner finished at step {STEPS}" in proc.stdout
    run_dir = run_dir_of(tmp_path / "runs")
    where = json.loads((run_dir / "summary.json").read_text())["placement"]
    ranks = [where["learner/rank-0"], where["learner/rank-1"]]
    servers = [where["server-0"], where["server-1"]]
    assert ranks[0] == ranks[1] and KIND[node_of(cluster, ranks[0]).node_id] == LEARNER  # learner_nodes: 1
    assert len(set(servers)) == 2 and all(KIND[node_of(cluster, s).node_id] == ROLLOUT for s in servers)
    rows = read_history(run_dir, "learner")
    assert [int(r["learner/version"]) for r in rows if "reward/mean" in r] == list(range(1, STEPS + 1))
    assert leftover_processes(run_dir) == []


def test_a_process_that_will_not_stop_leaves_its_stacks_in_its_log_before_the_kill(
    cluster, tmp_path: Path
) -> None:
    """``RayBackend.stop``'s last look: a process on a rollout node still running after the grace is asked
    for its threads' stacks by a task placed on its node; they reach its log before its actor is killed."""
    from launcher.backends.ray import Process, RayBackend
    from launcher.run_plan import Role

    ray.init(
        address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}}, log_to_driver=False
    )
    try:
        actor = Process.options(resources=ROLLOUT).remote("server-0")
        where = ray.get(actor.where.remote(), timeout=120)
        assert KIND[where["node_id"]] == ROLLOUT  # another Ray node than this driver's
        log = tmp_path / "server-0.log"
        role = Role("server-0", "tests.stuck_child", (), processes=1, threads=1, gpus=0)
        backend = RayBackend(address=cluster.address)
        config = (ROOT / "configs/tiny.yaml").read_text()  # Process.run loads it before the role runs
        backend.actors, backend.where = {"server-0": actor}, {"server-0": where}
        backend.refs = {
            "server-0": actor.run.remote(role, config, str(tmp_path / "server-0.yaml"), str(log), {})
        }
        deadline = time.monotonic() + 120
        while not log.exists() or "stuck child: ready" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()[-2000:] if log.exists() else "no log"
            time.sleep(0.2)
        backend.stop(1.0)
        text = log.read_text()
        assert "Current thread" in text or "Thread 0x" in text, text[-2000:]
        assert "in stuck_here" in text  # where it hung
        with pytest.raises(ray.exceptions.RayActorError):  # and it was killed after
            ray.get(backend.refs["server-0"], timeout=60)
    finally:
        ray.shutdown()
