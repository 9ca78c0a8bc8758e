"""What the user sees: the live progress line during a run and the summary at its end."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import redis

from tandem import fleet
from tandem.config import Config, adapter_run_dir
from tandem.telemetry import history_key, history_path, latest_stats, read_history


class Console:
    """A live progress bar over learner steps with reward, staleness and throughput (rich)."""

    def __init__(self, cfg: Config, enabled: bool) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.enabled = enabled and sys.stdout.isatty()
        self.plain_every, self.last_plain = 10.0, 0.0
        self.total = cfg.learner.total_steps
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[stats]}"),
        )
        self.task = self.progress.add_task("train", total=self.total, stats="starting")
        if self.enabled:
            self.progress.start()

    def update(self, step: int, stats: str) -> None:
        self.progress.update(self.task, completed=min(step, self.total), stats=stats)
        if not self.enabled and time.monotonic() - self.last_plain > self.plain_every:
            self.last_plain = time.monotonic()
            print(f"[launch] step {step}/{self.total} {stats}", flush=True)

    def close(self) -> None:
        if self.enabled:
            self.progress.stop()


def status_line(client: redis.Redis, cfg: Config) -> tuple[int, str]:
    """The learner's step and one line of its latest reward, staleness and throughput."""
    learner = latest_stats(client, cfg.run.name, "learner")
    names = fleet.members(client, cfg.run.name)  # joiners included, servers that left not
    servers = [latest_stats(client, cfg.run.name, name) for name in names]
    # Several adapters (learner.lora.adapters): each adapter's run's loops generate under its own name.
    loops = [
        (run.run.name, n) for run in cfg.adapter_runs().values() for n in fleet.members(client, run.run.name)
    ]
    servers += [latest_stats(client, run, n) for run, n in loops]
    gen = sum(s.get("rollout/tokens_per_s", 0.0) for s in servers)
    step = int(learner.get("learner/version", 0))
    stats = (
        f"reward {learner.get('reward/mean', float('nan')):.3f} | staleness {learner.get('staleness/mean', 0.0):.2f}"
        f" | gen {gen:,.0f} tok/s | train {learner.get('throughput/train_tokens_per_s', 0.0):,.0f} tok/s"
        f" | servers {len(names)}"
    )
    return step, stats


def summarize(
    cfg: Config, client: redis.Redis, run_dir: Path, placement: dict[str, str] | None = None
) -> dict:
    """Reward curve summary from the learner's history, a PNG plot, where each process ran, and where
    everything lives, and the fleet size over time. Writes ``summary.json``."""
    copy_histories(cfg, client, run_dir)
    if placement:
        print("[launch] placement: " + "; ".join(f"{p} on {node}" for p, node in placement.items()))
    rows = [r for r in read_history(run_dir, "learner") if "reward/mean" in r]
    if not rows:
        print("[launch] no learner steps were logged")
        if placement:
            (run_dir / "summary.json").write_text(json.dumps({"placement": placement}, indent=2))
        return {}
    rewards = [r["reward/mean"] for r in rows]
    k, first, last = first_and_last(rewards)
    t0 = rows[0]["time"]
    summary: dict = {
        "steps": len(rows),
        "reward_first": first,
        "reward_last": last,
        "wall_s": rows[-1]["time"] - t0,
    }
    if placement:
        summary["placement"] = placement
    if changes := fleet_changes(rows):
        summary["fleet"] = changes
        print(
            "[launch] fleet (servers): "
            + "  ".join(f"{c['servers']} from step {c['step']} ({c['time_s']:.0f}s)" for c in changes)
        )
    print(
        f"[launch] reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f} over {len(rows)} steps ({summary['wall_s']:.0f}s)"
    )
    n_marks = min(10, len(rows))
    marks = [rows[round(i * (len(rows) - 1) / max(1, n_marks - 1))] for i in range(n_marks)]
    print("[launch] reward curve: " + "  ".join(f"{int(r['step'])}:{r['reward/mean']:.2f}" for r in marks))
    plot_rewards(cfg, run_dir, [r["time"] - t0 for r in rows], rewards)
    if adapters := summarize_adapters(cfg, client, run_dir):
        summary["adapters"] = adapters
    if evals := summarize_evals(cfg, client, run_dir):
        summary["eval"] = evals
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def first_and_last(rewards: list[float]) -> tuple[int, float, float]:
    """``k`` (a tenth of the steps, at least one) and the mean reward of the first and of the last ``k``."""
    k = max(1, len(rewards) // 10)
    return k, sum(rewards[:k]) / k, sum(rewards[-k:]) / k


def summarize_adapters(cfg: Config, client: redis.Redis, run_dir: Path) -> dict[str, dict[str, float]]:
    """With ``learner.lora.adapters``: each adapter's run's histories into its folder, and its reward over
    the first and last tenth of its steps, printed and returned by adapter name."""
    out = {}
    for name, run in cfg.adapter_runs().items():
        folder = adapter_run_dir(run_dir, name)
        folder.mkdir(parents=True, exist_ok=True)
        copy_histories(run, client, folder)
        rewards = [r["reward/mean"] for r in read_history(folder, "learner") if "reward/mean" in r]
        if not rewards:
            continue
        k, first, last = first_and_last(rewards)
        out[name] = {"steps": len(rewards), "reward_first": first, "reward_last": last}
        print(f"[launch] adapter {name}: reward first {k} steps {first:.3f} -> last {k} steps {last:.3f}")
    return out


def copy_histories(cfg: Config, client: redis.Redis, run_dir: Path) -> None:
    """Every process's metric history, from Redis into the run directory: the learner's, every server's that
    ever joined the fleet, and the own scorers' (rollout/own_scorer.py)."""
    launched = {f"server-{i}" for i in range(cfg.rollout.num_servers)}
    servers = sorted(launched | set(fleet.seen(client, cfg.run.name)), key=lambda s: int(s.split("-")[1]))
    for proc in ["learner", *servers, *cfg.own_scorers]:
        raw = client.lrange(history_key(cfg.run.name, proc), 0, -1)
        history_path(run_dir, proc).write_text("".join(r.decode() + "\n" for r in raw))


def plot_rewards(cfg: Config, run_dir: Path, seconds: list[float], rewards: list[float]) -> None:
    """``reward.png``: the reward over wall time, where matplotlib is installed (it is optional)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(seconds, rewards)
        ax.set_xlabel("wall time (s)")
        ax.set_ylabel("reward/mean")
        ax.set_title(f"{run_dir.name} ({cfg.run.mode})")
        fig.tight_layout()
        fig.savefig(run_dir / "reward.png", dpi=100)
        plt.close(fig)
        print(f"[launch] plot: {run_dir / 'reward.png'}")
    except ImportError:
        pass


def summarize_evals(cfg: Config, client: redis.Redis, run_dir: Path) -> list[dict]:
    """The held-out evaluations (none: an empty list), written to their history file and printed, one
    summary row per evaluated version."""
    evals = eval_history(client, cfg.run.name)
    if not evals:
        return []
    history_path(run_dir, "eval").write_text("".join(json.dumps(r) + "\n" for r in evals))
    k = next(key for key in evals[0] if key.startswith("eval/pass@") and key != "eval/pass@1")
    print(
        "[launch] eval (held-out): "
        + "  ".join(
            f"v{int(r['eval/version'])}:{r['eval/reward_mean']:.2f}/{r['eval/pass@1']:.2f}" for r in evals
        )
        + "  (version:reward/pass@1)"
    )
    return [
        {
            "version": int(r["eval/version"]),
            "reward_mean": r["eval/reward_mean"],
            "pass@1": r["eval/pass@1"],
            k.removeprefix("eval/"): r[k],
        }
        for r in evals
    ]


def fleet_changes(rows: list[dict]) -> list[dict]:
    """Fleet size over time from the learner's rows (``fleet/servers``): one entry per change."""
    out: list[dict] = []
    t0 = rows[0]["time"] if rows else 0.0
    for r in rows:
        if "fleet/servers" in r and (not out or out[-1]["servers"] != int(r["fleet/servers"])):
            out.append(
                {
                    "step": int(r["step"]),
                    "time_s": round(r["time"] - t0, 1),
                    "servers": int(r["fleet/servers"]),
                }
            )
    return out


def eval_history(client: redis.Redis, run: str) -> list[dict]:
    """Every server's held-out evaluations (``eval-server-i``), one row per version, in version order."""
    rows = []
    for key in client.scan_iter(match=history_key(run, "eval-server-*")):
        rows += [json.loads(r) for r in client.lrange(key, 0, -1)]
    return sorted(rows, key=lambda r: r["eval/version"])
