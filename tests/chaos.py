"""Chaos: one tiny run under random ``kill -9`` of every role, finishing by itself (docs/design.md §6).

``python -m tests.chaos --kills 24`` runs the long version and prints its tally (the last line is JSON);
``tests/test_chaos.py`` runs a short one in the suite. Roles killed, in a seeded shuffled cycle:

- ``server``: a ready rollout server's process group;
- ``learner``: the learner's process group (it comes back with ``--resume``);
- ``redis``: the embedded redis-server (restarted from its AOF on the same port and password);
- ``startup``: a server killed again while it starts up, after its restart and before it is ready.

After each kill the harness waits (bounded) for the learner's version to move again; the time that takes
is the kill's *time lost*. The audit, after launch.py exits by itself: every version 1..steps in
``trained.jsonl``, the final checkpoint at ``steps``, no stream id in two surviving versions (trained
twice), and every prompt the feeder emitted either answered (a trajectory of it reached the stream) or
still in the prompt stream (lost otherwise). With several adapters (``learner.lora.adapters``) the learner's
version is the lowest of the adapters' runs', and each adapter's run is audited in its own folder.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import redis
import yaml

from tandem.config import Config

ROOT = Path(__file__).resolve().parent.parent
ROLES = ("server", "learner", "redis", "startup")
TINY = ROOT / "configs/tiny.yaml"
RECOVERY_S = 180.0  # longest wait for the learner to move again after a kill


@dataclass
class Tally:
    kills: Counter = field(default_factory=Counter)
    restarts: Counter = field(default_factory=Counter)
    time_lost_s: float = 0.0
    manual_resumes: int = 0
    trained_twice: int = 0
    missing_versions: int = 0
    prompts_emitted: int = 0
    prompts_lost: int = 0
    final_version: int = -1
    batches_logged: int = 0  # by the servers, over every life
    batches_overlapped: int = 0  # of those, logged while the server held another (several in flight)
    wall_s: float = 0.0
    returncode: int | None = None

    @property
    def total_kills(self) -> int:
        return sum(self.kills.values())

    def line(self) -> str:
        return json.dumps({**asdict(self), "kills": dict(self.kills), "restarts": dict(self.restarts)})


def launch_cmd(
    actor: Path, critic: Path | None, prompts: Path, out: Path, steps: int, limit: int,
    overrides: Sequence[str] = (), config: Path = TINY,
) -> list[str]:  # fmt: skip
    critic_arg = [f"model.critic={critic}"] if critic is not None else []
    return [
        sys.executable, str(ROOT / "launch.py"), str(config), f"model.actor={actor}", *critic_arg,
        f"data.prompts={prompts}", f"run.output_dir={out}",
        "rollout.num_servers=2", "rollout.n_samples=4", "rollout.prompts_per_batch=2",
        "rollout.max_new_tokens=6", "algorithm.batch_size=8", "algorithm.minibatch_size=8",
        "learner.micro_batch_size=8", f"learner.total_steps={steps}", "learner.checkpoint_interval=3",
        "logging.wandb_mode=disabled", "redis.claim_idle_ms=2000", "supervision.backoff_s=0.2",
        "supervision.backoff_max_s=2", f"supervision.server_restarts={limit}",
        f"supervision.learner_restarts={limit}", f"supervision.redis_restarts={limit}", *overrides,
        "--no-console",
    ]  # fmt: skip


def cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def find_pid(*needles: str) -> int | None:
    """The process whose command line holds every needle (children of the run under test only)."""
    for pid in os.listdir("/proc"):
        if pid.isdigit() and all(n in (cmd := cmdline(pid)) for n in needles) and cmd:
            return int(pid)
    return None


class Chaos:
    def __init__(self, proc: subprocess.Popen, run_dir: Path, seed: int, log=print) -> None:
        self.proc, self.run_dir, self.log = proc, run_dir, log
        self.rng = random.Random(seed)
        url = yaml.safe_load((run_dir / "config.yaml").read_text())["redis"]["url"]
        self.port = url.rsplit(":", 1)[1].split("/")[0]
        from buffer.retry import connect

        self.client = connect(url, reconnect_s=60, socket_timeout=10)
        self.run = run_dir.name
        self.versioned = [run.run.name for _, run in audited_runs(run_dir)]  # each adapter's run, or the run
        self.tally = Tally()

    # --------------------------------------------------------------------------------------- probes

    def version(self) -> int:
        raw = [self.client.get(f"{run}:version") for run in self.versioned]
        return min(int(v) if v is not None else 0 for v in raw)

    def ready(self, name: str) -> bool:
        return bool(self.client.exists(f"{self.run}:ready:{name}"))

    def pid_of(self, role: str) -> int | None:
        if role == "redis":
            return find_pid("redis-server", f":{self.port}")
        if role == "learner":
            return find_pid("learner.train", str(self.run_dir))
        return find_pid("rollout.server", str(self.run_dir), f"--server-id {role.split('-')[1]}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_for(self, what: str, cond, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.alive() and time.monotonic() < deadline:
            try:
                if cond():
                    return True
            except redis.RedisError:
                pass
            time.sleep(0.1)
        if self.alive():
            self.log(f"[chaos] gave up waiting for {what} after {timeout_s:g}s")
        return False

    # ---------------------------------------------------------------------------------------- kills

    def kill(self, role: str, pid: int) -> None:
        with_group = role != "redis"
        try:
            os.killpg(pid, signal.SIGKILL) if with_group else os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.log(f"[chaos] kill -9 {role} (pid {pid})")

    def strike(self, kind: str) -> bool:
        """One kill of ``kind``; False when there was nothing to kill right now."""
        if kind == "startup":
            name = f"server-{self.rng.randrange(2)}"
            old = self.pid_of(name)
            if old is None or not self.ready(name):
                return False
            self.kill(name, old)
            self.tally.kills["server"] += 1
            # Its successor, once started and before it reports ready (the launcher deleted the key).
            if not self.wait_for(f"{name} to restart", lambda: self.pid_of(name) not in (None, old), 60):
                return True
            time.sleep(self.rng.uniform(0.2, 1.5))
            pid = self.pid_of(name)
            if pid is None or pid == old or self.ready(name):
                return True
            self.kill(name + " (starting)", pid)
            self.tally.kills["startup"] += 1
            return True
        name = f"server-{self.rng.randrange(2)}" if kind == "server" else kind
        pid = self.pid_of(name)
        if pid is None or (kind == "server" and not self.ready(name)):
            return False
        self.kill(name, pid)
        self.tally.kills[kind] += 1
        return True

    def run_kills(self, kills: int) -> None:
        """Kill until ``kills`` kills, in shuffled cycles over every role; after each, wait for progress."""
        self.wait_for("the learner to train", lambda: self.version() >= 2, RECOVERY_S)
        plan: list[str] = []
        while self.tally.total_kills < kills and self.alive():
            if not plan:
                plan = list(ROLES)
                self.rng.shuffle(plan)
            kind = plan.pop()
            before = self.version()
            start = time.monotonic()
            if not self.strike(kind):
                plan.insert(0, kind)
                time.sleep(0.5)
                continue
            if self.wait_for("the learner to move again", lambda b=before: self.version() > b, RECOVERY_S):
                self.tally.time_lost_s += time.monotonic() - start
            time.sleep(self.rng.uniform(0.3, 1.5))


# ------------------------------------------------------------------------------------------------ audit


def audited_runs(run_dir: Path) -> list[tuple[Path, Config]]:
    """(folder, config) of each run to audit: each adapter's (learner.lora.adapters), or the run itself."""
    from tandem.config import adapter_run_dir, load_config

    cfg = load_config(run_dir / "config.yaml", [])
    runs = cfg.adapter_runs()
    return [(adapter_run_dir(run_dir, name), run) for name, run in runs.items()] or [(run_dir, cfg)]


def emitted_prompts(cfg: Config, client: redis.Redis) -> set[str]:
    """Every prompt id the feeder put on the stream: its position in Redis, replayed over the data."""
    from tandem.data import load_prompts

    records = load_prompts(cfg.data.prompts, cfg.data.prompt_field)
    epoch, index = (int(x) for x in client.hmget(f"{cfg.run.name}:feeder", "epoch", "index"))
    out = set()
    for e in range(epoch + 1):
        order = list(range(len(records)))
        if cfg.data.shuffle:
            random.Random(cfg.run.seed * 100_003 + e).shuffle(order)
        out |= {f"{records[i]['id']}@{e}" for i in (order if e < epoch else order[:index])}
    return out


def stream_prompt_ids(client: redis.Redis, key: str, decode) -> set[str]:
    ids = set()
    for _, fields in client.xrange(key):
        data = fields.get(b"d") or fields.get(b"data")
        try:
            ids.add(decode(data).prompt_id)
        except Exception:  # a dead letter that is not a record at all
            continue
    return ids


def audit(run_dir: Path, steps: int, tally: Tally) -> None:
    """The tally's audit of the run (each adapter's run, summed; the lowest final version)."""
    from buffer.redis_server import EmbeddedRedis

    server = EmbeddedRedis(run_dir / "redis").start()
    try:
        client = server.client()
        finals = [audit_one(folder, cfg, steps, tally, client) for folder, cfg in audited_runs(run_dir)]
    finally:
        server.stop()
    tally.final_version = min(finals)


def audit_one(folder: Path, cfg: Config, steps: int, tally: Tally, client: redis.Redis) -> int:
    """Add one run's audit to ``tally`` (``folder``: its trained.jsonl, checkpoints and histories); returns
    its final checkpointed version."""
    from buffer.schema import decode_prompt, decode_trajectory
    from tandem.telemetry import history_procs, read_history

    lines = [json.loads(x) for x in (folder / "trained.jsonl").read_text().splitlines() if x.strip()]
    surviving = {line["version"]: line for line in lines}  # the last line of a version is what survived
    tally.missing_versions += sum(v not in surviving for v in range(1, steps + 1))
    ids = Counter(i for v, line in surviving.items() if v <= steps for i in line["ids"])
    tally.trained_twice += sum(c - 1 for c in ids.values() if c > 1)
    answered = {p for line in lines for p in line.get("prompts", [])}
    held = [r.get("rollout/inflight_batches", 0) for p in history_procs(folder, "server-*")
            for r in read_history(folder, p)]  # fmt: skip
    tally.batches_logged += len(held)
    tally.batches_overlapped += sum(h >= 1 for h in held)
    run = cfg.run.name
    emitted = emitted_prompts(cfg, client)
    for suffix in ("", ":stale", ":dead"):
        answered |= stream_prompt_ids(client, f"{run}:traj{suffix}", decode_trajectory)
    pending = stream_prompt_ids(client, f"{run}:prompts", decode_prompt)
    tally.prompts_emitted += len(emitted)
    tally.prompts_lost += len(emitted - answered - pending)
    latest = folder / "checkpoints" / "latest.json"
    return json.loads(latest.read_text())["version"] if latest.exists() else -1


def chaos_run(
    actor: Path, critic: Path | None, prompts: Path, out: Path, *, kills: int, steps: int, seed: int = 0,
    timeout_s: float = 900.0, overrides: Sequence[str] = (), config: Path = TINY, log=print,
) -> tuple[Tally, str]:  # fmt: skip
    """One run of ``config`` (the tiny one by default) under ``kills`` kills, with the harness's tiny sizes
    and ``overrides`` (``key=value``) on top; returns the audited tally and launch.py's output."""
    start = time.monotonic()
    launch_log = out / "launch.out"
    out.mkdir(parents=True, exist_ok=True)
    with open(launch_log, "w") as sink:
        proc = subprocess.Popen(
            launch_cmd(actor, critic, prompts, out, steps, kills + 5, overrides, config), cwd=ROOT, stdout=sink,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while not list(out.glob("*/config.yaml")):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"launch.py did not start a run:\n{launch_log.read_text()[-3000:]}")
                time.sleep(0.2)
            run_dir = next(p.parent for p in out.glob("*/config.yaml"))
            chaos = Chaos(proc, run_dir, seed, log=log)
            chaos.run_kills(kills)
            proc.wait(timeout=max(1.0, timeout_s - (time.monotonic() - start)))
        finally:
            if proc.poll() is None:  # past the deadline: stop it (and its children) and report
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=90)
    tally = chaos.tally
    tally.returncode = proc.returncode
    tally.wall_s = time.monotonic() - start
    output = launch_log.read_text()
    for line in output.splitlines():
        if line.startswith("[launch] restarted "):
            role = line.split()[2]
            tally.restarts["server" if role.startswith("server") else role] += 1
    audit(run_dir, steps, tally)
    return tally, output


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=24, help="kill -9s over the run (every role in turn)")
    ap.add_argument("--steps", type=int, default=0, help="learner steps (0: 40 + 100 per kill)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="where the run goes (default: a temporary directory)")
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
        help="a config override on top of the tiny run's, e.g. rollout.max_inflight_batches=2 (repeatable)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    from tandem.data import write_prompts
    from toy.tasks import make_records
    from toy.tiny import make_tiny

    out = Path(args.out or tempfile.mkdtemp(prefix="tandem-chaos-"))
    ckpt = make_tiny(out / "tiny")
    prompts = write_prompts(out / "echo.jsonl", make_records("echo", 200))
    steps = args.steps or 40 + 100 * args.kills  # 12 per kill ended before the 10th kill, idle
    tally, _ = chaos_run(
        ckpt["actor"], ckpt["critic"], prompts, out / "runs", kills=args.kills, steps=steps, seed=args.seed,
        timeout_s=max(900.0, 60.0 * args.kills), overrides=args.overrides,
    )  # fmt: skip
    print(tally.line())
    ok = (
        tally.returncode == 0 and tally.trained_twice == 0 and tally.prompts_lost == 0
        and tally.missing_versions == 0 and tally.final_version == steps and tally.total_kills >= args.kills
    )  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
