"""The Ray backend's checks before anything starts, and the local backend's independence from Ray.

No cluster here: ``check_fits`` is a pure function of the demands and the nodes' resources, the same
call the backend makes on ``ray.nodes()`` before it creates a placement group.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tandem.config import ConfigError, load_config

pytest.importorskip("ray")
from launcher.backends.ray import Demand, check_fits
from launcher.run_plan import server_tp

ROOT = Path(__file__).resolve().parent.parent
GPU_NODE = {"CPU": 96.0, "GPU": 8.0, "memory": 1e12, "node:10.0.0.1": 1.0}


def preset_demands(path: Path) -> list[Demand]:
    cfg = load_config(path)
    c, per_node = cfg.cluster, cfg.learner.num_ranks // cfg.cluster.learner_nodes
    learner = {"CPU": c.learner_cpus * per_node, "GPU": per_node, **c.learner_resources}
    server = {"CPU": c.server_cpus, "GPU": server_tp(cfg), **c.server_resources}
    return [
        Demand("the learner", learner, c.learner_nodes, True),
        Demand(f"{cfg.rollout.num_servers} rollout servers", server, cfg.rollout.num_servers),
    ]


def test_two_node_preset_fits_two_gpu_nodes_with_learner_and_servers_apart() -> None:
    demands = preset_demands(ROOT / "configs/ray-2node-vllm.yaml")
    nodes = {"head": {**GPU_NODE, "learner": 1.0}, "other": {**GPU_NODE, "rollout": 4.0}}
    check_fits(demands, nodes)  # fits
    with pytest.raises(ConfigError, match=r"4 rollout servers needs 4 slots .* room for 0"):
        check_fits(demands, {"head": {**GPU_NODE, "learner": 1.0}})  # the learner's node has no `rollout`
    with pytest.raises(ConfigError, match=r"the learner needs 1 nodes .*'learner': 1.0"):
        check_fits(demands, {"other": {**GPU_NODE, "rollout": 4.0}})


def test_shortfall_names_the_resource_and_what_each_node_has() -> None:
    demands = [Demand("the learner", {"CPU": 1.0, "learner": 1.0}, 2, distinct_nodes=True)]
    nodes = {"a" * 20: {"CPU": 4.0, "learner": 1.0}, "b" * 20: {"CPU": 4.0}}
    with pytest.raises(ConfigError) as e:
        check_fits(demands, nodes)
    msg = str(e.value)
    assert msg.startswith("cluster: the learner needs 2 nodes with {'CPU': 1.0, 'learner': 1.0} each")
    assert "room for 1" in msg and "aaaaaaaaaaaa: CPU 4, learner 1" in msg and "bbbbbbbbbbbb: CPU 4" in msg
    # distinct nodes matter: one node with two `learner` units still hosts one learner bundle
    with pytest.raises(ConfigError, match="room for 1"):
        check_fits(demands, {"c": {"CPU": 8.0, "learner": 2.0}})
    check_fits(demands, {"c": {"CPU": 8.0, "learner": 2.0}, "d": {"CPU": 1.0, "learner": 1.0}})


def test_the_local_backend_never_imports_ray(tiny_ckpt, tmp_path: Path) -> None:
    code = (
        "import sys, launch\n"
        f"assert launch.main(['{ROOT / 'configs/tiny.yaml'}', '--dry-run',"
        f" 'model.actor={tiny_ckpt['actor']}', 'model.critic={tiny_ckpt['critic']}']) == 0\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "learner.train" in proc.stdout  # the dry run printed the plan
