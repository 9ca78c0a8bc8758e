"""The ``ray`` backend: the run plan as Ray actors on a cluster (docs/ray.md, docs/design.md §1.7).

- **Learner**: its ranks are actors in one placement group of ``cluster.learner_nodes`` bundles, one per
  node (the node's ranks packed into it: ``STRICT_PACK`` for one node, ``STRICT_SPREAD`` across several).
  Each rank runs ``learner.train.main`` in its actor process with the torch.distributed rendezvous taken
  from Ray: ``MASTER_ADDR`` = rank 0's node address, a free port there, ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK`` (NCCL on GPU, gloo on CPU, as the learner chooses). No restarts: a lost rank ends the
  run, and ``--resume`` continues from the last checkpoint.
- **Rollout servers**: one actor each (``cluster.server_cpus``, GPUs = tensor-parallel degree,
  ``cluster.server_resources``), restarted by Ray where there is room (``max_restarts=-1``) and counted
  against the server restart policy (``launcher/supervision.py``): when a server's process or node dies,
  also before it was ready, the launcher runs the server again under the same consumer name, so the
  prompts the dead one held are re-delivered (docs/design.md §6.1).
- **The scoring workers** (``placement.reference`` or ``reward_model: own``): one actor each
  (``cluster.aux_cpus``, a GPU on GPUs, ``cluster.aux_resources``), restarted the same way; each reads the
  trajectories under one consumer name, so what the dead one read is scored by the next (docs/placement.md
  §11.1).
- **Nothing shared on disk**: every actor writes its own copy of the per-process config (0600) and its
  log under the run directory's path on its node.
- **Stop**: after ``{run}:stop`` and its grace, a process still running writes its threads' stacks to its
  log (``STACKS_SIGNAL``, sent by a task on its node), then every actor is killed.
- **Checks before anything runs**: the plan must fit the cluster's resources (the shortfall is named);
  with ``weightsync.transport=shm`` every server must sit on the learner's node.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import json
import logging
import math
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray
import redis
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from launcher.backends import Outcome, StartError
from launcher.run_plan import Role, RunPlan, server_tp
from launcher.supervision import RestartPolicy, Restarts
from tandem.config import Config, ConfigError, dump_config, load_config, write_private
from tandem.net import free_port
from tandem.procs import STACKS_SIGNAL, STACKS_WAIT_S
from tandem.telemetry import ready_key

log = logging.getLogger("launch")
ROOT = Path(__file__).resolve().parents[2]


@ray.remote(num_cpus=0)
class Process:
    """One tandem process — a learner rank or a rollout server — inside a Ray actor."""

    def __init__(self, name: str) -> None:
        self.name = name

    def where(self) -> dict:
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "gpus": [str(g) for g in ray.get_gpu_ids()],
        }

    def free_port(self) -> int:
        return free_port("")  # on this actor's node, any interface: the learner's rendezvous port

    def run(self, role: Role, config_text: str, config_path: str, log_path: str, env: dict) -> int:
        """Write this node's copy of the config and run the role's ``main`` here, output to its log."""
        path = Path(config_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_private(path, config_text)
        cfg = load_config(path)
        if cfg.weightsync.transport == "shm" and role.is_server:  # the worker's model is frozen: no weights
            learner = cfg.cluster.placement.get("learner/rank-0", "")
            here = ray.get_runtime_context().get_node_id()
            if learner and not learner.startswith(here[:12]):
                raise RuntimeError(shm_refusal(self.name, here, learner))
        os.environ.update(env)
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(fd, f"\n=== {time.strftime('%H:%M:%S')} start on {socket.gethostname()}\n".encode())
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        faulthandler.register(STACKS_SIGNAL, all_threads=True)  # asked for by stop before the kill
        code = importlib.import_module(role.module).main(list(role.argv))
        return int(code or 0)


@ray.remote(num_cpus=0)
def send_signal(pid: int, sig: int) -> bool:
    """``kill(pid, sig)`` on the node this task is placed on; False when the process is gone."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def shm_refusal(name: str, node: str, learner: str) -> str:
    return (
        f"weightsync.transport=shm: {name} is on node {node[:12]} but the learner is on {learner}; shared"
        " memory works within one node only: set weightsync.transport=dist (or place them together)"
    )


def _node_label(where: dict) -> str:
    return f"{where['node_id'][:12]} ({where['ip']})"


@dataclass
class Demand:
    """What one learner node's bundle or one server asks of a node."""

    what: str
    resources: dict[str, float]
    count: int
    distinct_nodes: bool = False

    def fits(self, free: dict[str, float]) -> bool:
        return all(free.get(k, 0.0) >= v - 1e-9 for k, v in self.resources.items() if v > 0)


def check_fits(demands: list[Demand], nodes: dict[str, dict[str, float]]) -> None:
    """First-fit the demands onto the nodes' total resources; ConfigError naming the first shortfall."""
    free = {n: dict(r) for n, r in nodes.items()}
    for d in demands:
        used: set[str] = set()
        placed = 0
        for _ in range(d.count):
            candidates = [n for n in free if d.fits(free[n]) and not (d.distinct_nodes and n in used)]
            if not candidates:
                break
            node = max(candidates, key=lambda n: free[n].get("CPU", 0.0))
            for k, v in d.resources.items():
                free[node][k] = free[node].get(k, 0.0) - v
            used.add(node)
            placed += 1
        if placed < d.count:
            shown = {k: round(v, 3) for k, v in d.resources.items() if v > 0}
            have = "; ".join(
                f"{n[:12]}: "
                + ", ".join(
                    f"{k} {v:g}"
                    for k, v in sorted(r.items())
                    if not k.startswith(("node:", "object_", "memory"))
                )
                for n, r in nodes.items()
            )
            raise ConfigError(
                f"cluster: {d.what} needs {d.count} {'nodes' if d.distinct_nodes else 'slots'} with {shown}"
                f" each, the cluster has room for {placed} (nodes: {have or 'none'})"
            )


@dataclass
class RayBackend:
    address: str
    name: str = "ray"
    cfg: Config | None = None
    client: redis.Redis | None = None
    cluster: object | None = None  # ray.cluster_utils.Cluster for --ray local
    pg: object | None = None
    ranks: list = field(default_factory=list)
    actors: dict = field(default_factory=dict)  # every server's and worker's actor, by role name
    refs: dict = field(default_factory=dict)  # process name -> ObjectRef of its run()
    roles: dict = field(default_factory=dict)
    restarts: dict = field(default_factory=dict)
    where: dict = field(default_factory=dict)  # process name -> where()
    plan: RunPlan | None = None
    config_text: str = ""
    redis_bind: str | None = None

    # ------------------------------------------------------------------------------------ before a run

    def prepare(self, cfg: Config) -> Config:
        c, ranks = cfg.cluster, cfg.learner.num_ranks
        if ranks % c.learner_nodes:
            raise ConfigError(
                f"cluster.learner_nodes ({c.learner_nodes}) must divide learner.num_ranks ({ranks})"
            )
        self.redis_bind = c.redis_host
        self._connect(cfg)
        gpu = cfg.run.device != "cpu"
        per_node = ranks // c.learner_nodes
        nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
        check_fits(
            [
                Demand("the learner", self._learner_bundle(cfg, per_node, gpu), c.learner_nodes, True),
                Demand(
                    f"{cfg.rollout.num_servers} rollout servers",
                    {"CPU": c.server_cpus, "GPU": server_tp(cfg) if gpu else 0, **c.server_resources},
                    cfg.rollout.num_servers,
                ),
                *(Demand(f"the {role} worker", self._aux_demand(cfg, gpu), 1) for role in cfg.own_scorers),
            ],
            nodes,
        )
        # A server's torch threads: what it reserved, not the whole node's cores.
        threads = cfg.rollout.threads or max(1, int(c.server_cpus))
        return cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"threads": threads})})

    def _learner_bundle(self, cfg: Config, per_node: int, gpu: bool) -> dict[str, float]:
        c = cfg.cluster
        return {"CPU": c.learner_cpus * per_node, "GPU": per_node if gpu else 0, **c.learner_resources}

    @staticmethod
    def _aux_demand(cfg: Config, gpu: bool) -> dict[str, float]:
        c = cfg.cluster
        return {"CPU": c.aux_cpus, "GPU": 1 if gpu else 0, **c.aux_resources}

    def _demand(self, cfg: Config, role: Role) -> dict[str, float]:
        """What a server's or the worker's actor reserves: CPUs, GPUs and custom resources."""
        c = cfg.cluster
        if role.is_server:
            return {"CPU": c.server_cpus, "GPU": role.gpus, **c.server_resources}
        return self._aux_demand(cfg, role.gpus > 0)

    def _connect(self, cfg: Config) -> None:
        env = {"env_vars": {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}}
        kwargs = {"runtime_env": env, "log_to_driver": False, "namespace": "tandem"}
        if self.address == "local":
            self.cluster = start_local_cluster(cfg)
            ray.init(address=self.cluster.address, **kwargs)
        else:
            ray.init(address=self.address, **kwargs)

    def redis_host(self) -> str:
        """The head node's address on the cluster's network (what Ray itself uses), unless
        ``cluster.redis_host`` says otherwise; never every interface by default."""
        return self.redis_bind or ray.util.get_node_ip_address()

    def describe(self, plan: RunPlan) -> list[str]:
        c = plan.cfg.cluster
        per_node = plan.learner.processes // c.learner_nodes
        strategy = "STRICT_PACK" if c.learner_nodes == 1 else "STRICT_SPREAD"
        blocks = [
            f"# learner: {plan.learner.processes} rank actors in a placement group of {c.learner_nodes} bundle(s)"
            f" {self._learner_bundle(plan.cfg, per_node, plan.cfg.run.device != 'cpu')} ({strategy});"
            f" each runs {plan.learner.module}.main({list(plan.learner.argv)})"
        ]
        for r in [*plan.servers, *plan.workers]:
            res = self._demand(plan.cfg, r)
            blocks.append(
                f"# {r.name}: actor {res}, restarts: {RestartPolicy.for_role(plan.cfg, r.name).describe()}; runs {r.module}.main({list(r.argv)})"
            )
        return blocks

    # ------------------------------------------------------------------------------------------ start

    def start(self, plan: RunPlan, client: redis.Redis, config_text: str) -> None:
        cfg, c = plan.cfg, plan.cfg.cluster
        self.cfg, self.client, self.plan = cfg, client, plan
        self.roles = {r.name: r for r in plan.roles}
        per_node = plan.learner.processes // c.learner_nodes
        gpu = cfg.run.device != "cpu"
        self._reserve_learner_nodes(per_node, gpu)
        self._create_actors(per_node, gpu)
        self._locate_actors()
        self.config_text = dump_config(self._placed_config())
        self._run_learner_ranks(per_node, gpu)
        for s in [*plan.servers, *plan.workers]:
            self._run_server(s.name)
        self._record_placement()
        print(
            "[launch] placement: " + "; ".join(f"{p} on {n}" for p, n in self.placement().items()), flush=True
        )

    def _reserve_learner_nodes(self, per_node: int, gpu: bool) -> None:
        """Reserve the learner's placement group first: without its nodes nothing else is worth starting."""
        cfg, c = self.cfg, self.cfg.cluster
        timeout = c.start_timeout_s
        strategy = "STRICT_PACK" if c.learner_nodes == 1 else "STRICT_SPREAD"
        bundle = {k: v for k, v in self._learner_bundle(cfg, per_node, gpu).items() if v > 0}
        self.pg = placement_group(
            [bundle] * c.learner_nodes, strategy=strategy, name=f"{cfg.run.name}-learner"
        )
        try:
            ray.get(self.pg.ready(), timeout=timeout)
        except GetTimeoutError:
            raise StartError(
                f"the learner's placement group ({c.learner_nodes} x {bundle}, {strategy}) was not scheduled"
                f" within cluster.start_timeout_s={timeout:g}s: the cluster is busy or too small"
            ) from None

    def _create_actors(self, per_node: int, gpu: bool) -> None:
        """One actor per learner rank (in the placement group, never restarted) and per server or worker
        (restarted by Ray, counted against the role's restart policy); none runs anything yet."""
        cfg, c, plan = self.cfg, self.cfg.cluster, self.plan
        self.ranks = [
            Process.options(
                num_cpus=c.learner_cpus,
                num_gpus=1 if gpu else 0,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=r // per_node
                ),
            ).remote(f"learner/rank-{r}")
            for r in range(plan.learner.processes)
        ]
        for s in [*plan.servers, *plan.workers]:
            demand = self._demand(cfg, s)
            self.actors[s.name] = Process.options(
                num_cpus=demand["CPU"],
                num_gpus=s.gpus,
                resources={k: v for k, v in demand.items() if k not in ("CPU", "GPU")},
                max_restarts=-1,  # the role's restart policy decides when to give up
            ).remote(s.name)
            self.restarts[s.name] = Restarts(s.name, RestartPolicy.for_role(cfg, s.name))

    def _locate_actors(self) -> None:
        """Wait until every actor is scheduled and record its node, address and GPUs (the ranks' rendezvous
        and ``CUDA_VISIBLE_DEVICES`` come from them); refuse shm weights to a server off the learner's node."""
        timeout = self.cfg.cluster.start_timeout_s
        names = [f"learner/rank-{r}" for r in range(self.plan.learner.processes)] + list(self.actors)
        actors = self.ranks + list(self.actors.values())
        try:
            wheres = ray.get([a.where.remote() for a in actors], timeout=timeout)
        except GetTimeoutError:
            raise StartError(
                f"the actors were not scheduled within cluster.start_timeout_s={timeout:g}s"
            ) from None
        self.where = dict(zip(names, wheres, strict=True))
        learner_node = self.where["learner/rank-0"]["node_id"]
        if self.cfg.weightsync.transport == "shm":
            for s in self.plan.servers:
                if self.where[s.name]["node_id"] != learner_node:
                    raise StartError(
                        shm_refusal(
                            s.name, self.where[s.name]["node_id"], _node_label(self.where["learner/rank-0"])
                        )
                    )

    def _placed_config(self) -> Config:
        """What every process reads, now with the placement in it (wandb records it with the config)."""
        cfg, c = self.cfg, self.cfg.cluster
        update = {"cluster": c.model_copy(update={"placement": self.placement()})}
        if c.learner_nodes > 1:  # every node writes the checkpoint files it will read back (docs/ray.md §4)
            ds = {**cfg.learner.deepspeed}
            ds["checkpoint"] = {**ds.get("checkpoint", {}), "use_node_local_storage": True}
            update["learner"] = cfg.learner.model_copy(update={"deepspeed": ds})
        return cfg.model_copy(update=update)

    def _run_learner_ranks(self, per_node: int, gpu: bool) -> None:
        """Run ``learner.train`` in every rank's actor, with the torch.distributed rendezvous taken from Ray:
        rank 0's node address and a free port there."""
        plan, learner = self.plan, self.plan.learner
        master = self.where["learner/rank-0"]["ip"]
        port = ray.get(self.ranks[0].free_port.remote(), timeout=self.cfg.cluster.start_timeout_s)
        for r, actor in enumerate(self.ranks):
            env = {
                **plan.env,
                **self._rank_env(r, learner.processes, per_node, gpu),
                "MASTER_ADDR": master,
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": str(max(1, int(self.cfg.cluster.learner_cpus))),
            }
            self.refs[f"learner/rank-{r}"] = actor.run.remote(
                learner,
                self.config_text,
                str(plan.config_path),
                self._log(f"learner-rank{r}" if r else "learner"),
                env,
            )

    def _rank_env(self, rank: int, world: int, per_node: int, gpu: bool) -> dict[str, str]:
        env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(per_node)}
        env["LOCAL_RANK"] = str(rank % per_node)
        if gpu:
            # Ray gives each rank one GPU; the node's ranks see all of theirs, indexed by LOCAL_RANK.
            first = rank - rank % per_node
            ids = [self.where[f"learner/rank-{i}"]["gpus"][0] for i in range(first, first + per_node)]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
            env["LOCAL_RANK"] = str(ids.index(self.where[f"learner/rank-{rank}"]["gpus"][0]))
        return env

    def _log(self, name: str) -> str:
        return str(self.plan.run_dir / "logs" / f"{name}.log")

    def _run_server(self, name: str) -> None:
        """Run a server's or the worker's ``main`` in its actor, with the threads its CPUs reserve."""
        role = self.roles[name]
        env = {**self.plan.env, "OMP_NUM_THREADS": str(max(1, int(self._demand(self.cfg, role)["CPU"])))}
        actor = self.actors[name]
        self.refs[name] = actor.run.remote(
            role, self.config_text, str(self.plan.config_path), self._log(name), env
        )

    # ------------------------------------------------------------------------------------- supervision

    def _failure(self, name: str) -> str | None:
        """Why process ``name``'s run ended (None: it returned 0)."""
        try:
            code = ray.get(self.refs[name], timeout=0)
        except RayActorError as e:
            where = self.where.get(name)
            node = f" on node {_node_label(where)}" if where else ""
            return f"{name}{node} was lost (its process or node died): {str(e).splitlines()[0]}"
        except RayError as e:
            return f"{name} failed: {str(e)[-3000:]}"
        return None if code == 0 else f"{name} exited with code {code}"

    def _finished(self) -> list[str]:
        refs = list(self.refs.values())
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        done = set(done)
        return [n for n, r in self.refs.items() if r in done]

    def poll(self, stopping: bool) -> Outcome | None:
        finished = self._finished()
        ranks = [n for n in self.refs if n.startswith("learner/")]
        for n in (n for n in finished if n.startswith("learner/")):
            why = self._failure(n)
            if why is not None:
                return Outcome(
                    False,
                    f"learner: {why}; the run stopped. Continue it from its last checkpoint with"
                    f" `python launch.py --resume {self.plan.run_dir} --ray {self.address}`",
                )
        if all(n in finished for n in ranks):
            return Outcome(True, "learner finished")
        for name in (n for n in finished if not n.startswith("learner/")):
            if stopping:
                continue
            why = self._failure(name) or f"{name} exited"
            restarts = self.restarts[name]
            step = restarts.tend(time.monotonic(), why)  # the same backoff as under every backend
            if step == "refused":
                return Outcome(False, f"{restarts.refusal()}: {why}")
            if step == "wait":
                continue
            log.warning("%s: %s; restart %d (%s)", name, why, restarts.total, restarts.policy.describe())
            if not isinstance(self._error(name), RayActorError):
                ray.kill(self.actors[name], no_restart=False)  # a fresh process, as after a crash
            self.client.delete(ready_key(self.cfg.run.name, name))
            try:
                self.where[name] = self._await_restart(name)
            except RayError as e:
                return Outcome(False, f"{name} could not be restarted: {str(e).splitlines()[0]}")
            self._run_server(name)
            self._record_placement()
            log.warning("%s restarted on node %s", name, _node_label(self.where[name]))
        return None

    def _await_restart(self, name: str) -> dict:
        """Where the restarted actor runs, once Ray has it back (calls fail while it is restarting)."""
        deadline = time.monotonic() + self.cfg.cluster.start_timeout_s
        while True:
            try:
                return ray.get(self.actors[name].where.remote(), timeout=self.cfg.cluster.start_timeout_s)
            except ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def _error(self, name: str) -> Exception | None:
        try:
            ray.get(self.refs[name], timeout=0)
        except Exception as e:
            return e
        return None

    def _record_placement(self) -> None:
        """``<run dir>/placement.json``: where each process runs now (rewritten when a server moves)."""
        path = self.plan.run_dir / "placement.json"
        path.with_suffix(".tmp").write_text(json.dumps(self.placement(), indent=2))
        path.with_suffix(".tmp").rename(path)

    def placement(self) -> dict[str, str]:
        return {n: _node_label(w) for n, w in self.where.items()}

    # ------------------------------------------------------------------------------------------- stop

    def stop(self, grace_s: float) -> None:
        """``{run}:stop`` is set: the learner checkpoints and servers exit; then every actor is killed."""
        refs = list(self.refs.values())
        if refs:
            _, running = ray.wait(refs, num_returns=len(refs), timeout=grace_s)
            still = set(running)
            self.dump_stacks([n for n, r in self.refs.items() if r in still])
        for actor in [*self.ranks, *self.actors.values()]:
            with contextlib.suppress(RayError):
                ray.kill(actor, no_restart=True)
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None

    def dump_stacks(self, names: list[str]) -> None:
        """Before the kill: each process still running writes its threads' stacks to its log (tandem/procs.py
        ``STACKS_SIGNAL``). The signal is sent by a task placed on the process's node, so a process on
        another host is reached too."""
        stuck = [n for n in names if n in self.where]
        if not stuck:
            return
        log.warning("%s did not stop: their stacks go to their logs", ", ".join(stuck))
        sent = [
            send_signal.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(self.where[n]["node_id"], soft=False)
            ).remote(self.where[n]["pid"], STACKS_SIGNAL)
            for n in stuck
        ]
        with contextlib.suppress(RayError):  # a node gone meanwhile: nothing to ask there
            ray.get(sent, timeout=STACKS_WAIT_S * 10)
        time.sleep(STACKS_WAIT_S)

    def close(self) -> None:
        if ray.is_initialized():
            ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None


def start_local_cluster(cfg: Config):
    """``--ray local``: a head node plus the learner's node(s) and one node per server on this machine,
    each with exactly the resources the plan reserves there, so the placement is what a real cluster's
    would be (processes on different Ray nodes)."""
    from ray.cluster_utils import Cluster

    c = cfg.cluster
    per_node = cfg.learner.num_ranks // c.learner_nodes
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(c.learner_nodes):
        cluster.add_node(num_cpus=math.ceil(c.learner_cpus * per_node), resources=dict(c.learner_resources))
    for _ in range(cfg.rollout.num_servers):
        cluster.add_node(num_cpus=math.ceil(c.server_cpus), resources=dict(c.server_resources))
    if n := len(cfg.own_scorers):  # one node for the scoring workers, room for each
        cluster.add_node(
            num_cpus=math.ceil(c.aux_cpus * n), resources={k: v * n for k, v in c.aux_resources.items()}
        )
    cluster.wait_for_nodes()
    return cluster


def make(address: str | None) -> RayBackend:
    return RayBackend(address=address or "auto")
