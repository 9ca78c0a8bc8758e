"""SFT → reward model → PPO in one command: ``python -m stages.pipeline CONFIG [stage.key=value ...]``.

The InstructGPT recipe (docs/stages.md §4). Each stage is an ordinary run of its recipe, started as a child
process, in ``<output_dir>/<name>/<stage>/``; its output, a Hugging Face directory, feeds the next:

- ``sft``: ``learner.train`` with ``recipe: sft`` from ``base.model.actor``, on demonstrations;
- ``rm``: ``learner.train`` with ``recipe: rm`` from the SFT model (``rm_from: base``: from the base model),
  on preference pairs;
- ``ppo``: ``python launch.py`` (rollout servers, buffer, learner) with all four models: actor and
  reference from SFT, the critic initialised from the reward model (``model.critic_init: reward_model``),
  the reward model scoring on the rollout servers (``model.reward_model``).

A stage whose ``done.json`` exists is skipped on a re-run; one that was killed resumes from its checkpoints
(``--resume``). ``schedule: parallel | auto`` runs sft and rm at once on a split of the cores
(stages/schedule.py). With ``task`` set, the toy task's data sets are generated into ``<pipeline dir>/data``.
Every policy (base, SFT, PPO) is then scored on held-out prompts with the task's *rule-based* reward, which
PPO never sees when its reward is the reward model: the summary shows each stage's headline metric and
that score.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from launcher import prepare
from stages.evaluate import task_score
from stages.overoptimization import PPOWatch
from stages.pipeline_config import PipelineConfig, load_pipeline, merge
from stages.report import headline
from stages.schedule import child_env, run_offline_stages
from tandem import plugins
from tandem.config import Config, ConfigError, dump_config, load_config
from tandem.telemetry import read_history, setup_logging

log = logging.getLogger("pipeline")
REPO = Path(__file__).resolve().parents[1]
STAGES = ("sft", "rm", "ppo")
DONE = "done.json"


class Pipeline:
    def __init__(self, pc: PipelineConfig) -> None:
        self.pc = pc
        self.dir = (Path(pc.output_dir) / pc.name).resolve()
        self.data = self.dir / "data"

    @property
    def monitored(self) -> bool:
        return self.pc.monitor is not None and self.pc.score is not None

    @property
    def policy_pairs(self) -> bool:
        return self.pc.pairs.source == "policy" and self.pc.data is not None

    # ---------------------------------------------------------------------------------------- the plan

    def stage_configs(self) -> dict[str, Config]:
        """Every stage's full config, wired to its predecessors' outputs; validated before anything runs."""
        sft_out, rm_out = str(self.dir / "sft" / "final"), str(self.dir / "rm" / "final")
        files = {}
        if self.pc.data is not None:
            files = {
                "sft": {
                    "train_file": str(self.data / "sft.jsonl"),
                    "eval_file": str(self.data / "sft-eval.jsonl"),
                },
                "rm": {
                    "train_file": str(self.data / "prefs.jsonl"),
                    "eval_file": str(self.data / "prefs-eval.jsonl"),
                },
            }
        if self.policy_pairs:
            files["rm"] = {
                "train_file": str(self.dir / "rm" / "pairs.jsonl"),
                "eval_file": str(self.dir / "rm" / "pairs-eval.jsonl"),
            }
        rm_from = sft_out if self.pc.rm_from == "sft" else self.pc.base.get("model", {}).get("actor")
        wiring: dict[str, dict[str, Any]] = {
            "sft": {"algorithm": {"recipe": "sft", **files.get("sft", {})}},
            "rm": {"model": {"actor": rm_from}, "algorithm": {"recipe": "rm", **files.get("rm", {})}},
            "ppo": {
                "model": {"actor": sft_out, "reference": sft_out, "reward_model": rm_out, "critic_init": "reward_model"},
                "run": {"output_dir": str(self.dir / "ppo")},
            },
        }  # fmt: skip
        if self.monitored:
            wiring["ppo"]["learner"] = {"save_hf_interval": self.pc.monitor.interval}
        base = self.pc.base
        if self.pc.data is not None:
            base = merge({"data": {"prompts": str(self.data / "prompts.jsonl")}}, base)
        out = {}
        for stage in STAGES:
            raw = merge(merge(base, getattr(self.pc, stage)), wiring[stage])
            raw = merge(raw, {"run": {"name": f"{self.pc.name}-{stage}"}})
            out[stage] = load_config(None, raw=raw)
        return out

    def make_data(self) -> None:
        d = self.pc.data
        if d is None:
            return
        from tandem.data import write_prompts
        from toy.tasks import make_records, write_demonstrations, write_preferences

        jobs = {
            "sft.jsonl": lambda p: write_demonstrations(d.task, p, d.demonstrations, seed=1),
            "sft-eval.jsonl": lambda p: write_demonstrations(d.task, p, d.held_out, seed=2),
            "prefs.jsonl": lambda p: write_preferences(d.task, p, d.pairs, seed=3),
            "prefs-eval.jsonl": lambda p: write_preferences(d.task, p, d.held_out, seed=4),
            "pair-prompts.jsonl": lambda p: write_prompts(
                p, make_records(d.task, self.pc.pairs.prompts, seed=7)
            ),
            "pair-prompts-eval.jsonl": lambda p: write_prompts(p, make_records(d.task, 200, seed=8)),
            "prompts.jsonl": lambda p: write_prompts(p, make_records(d.task, d.prompts, seed=5)),
            "score-prompts.jsonl": lambda p: write_prompts(p, make_records(d.task, 1000, seed=6)),
            "monitor-prompts.jsonl": lambda p: write_prompts(p, make_records(d.task, 1000, seed=9)),
        }
        for name, write in jobs.items():
            if not (self.data / name).exists():
                write(self.data / name)

    # ---------------------------------------------------------------------------------------- the run

    def run(self) -> dict[str, Any]:
        cfgs = self.stage_configs()  # a config error fails here, before the first stage
        self.dir.mkdir(parents=True, exist_ok=True)
        self.make_data()
        stages = STAGES
        if self.pc.schedule != "serial":  # sft and rm at once (stages/schedule.py), then ppo
            run_offline_stages(self, cfgs)
            stages = ("ppo",)
        for stage in stages:
            stage_dir = self.dir / stage
            if self.done_before(stage, cfgs[stage]):
                print(f"[pipeline] {stage}: done before, skipped ({stage_dir})", flush=True)
                continue
            stage_dir.mkdir(parents=True, exist_ok=True)
            t0 = time.time()
            if stage == "rm" and self.policy_pairs:
                self.make_policy_pairs(cfgs)
            print(f"[pipeline] {stage}: starting in {stage_dir}", flush=True)
            result = self.run_offline(stage, cfgs[stage]) if stage != "ppo" else self.run_ppo(cfgs[stage])
            result["wall_s"] = time.time() - t0 + result.get("wall_s_before", 0.0)
            self.add_scores(stage, cfgs[stage], result)
            (stage_dir / DONE).write_text(json.dumps(result, indent=2))
            print(f"[pipeline] {stage}: {headline(stage, result)}", flush=True)
        return self.summarize()

    def done_before(self, stage: str, cfg: Config) -> bool:
        """Whether the stage finished before (``done.json``), in this seed's run; another seed's is an error."""
        stage_dir = self.dir / stage
        if not (stage_dir / DONE).exists():
            return False
        before = stage_dir / "config.yaml"
        seed = (
            (yaml.safe_load(before.read_text()) or {}).get("run", {}).get("seed") if before.exists() else None
        )
        if seed is not None and seed != cfg.run.seed:
            raise ConfigError(
                f"{stage}: finished in {stage_dir} with run.seed {seed}, not {cfg.run.seed}; give"
                " this seed its own directory (run.output_dir= or run.name=) or remove that one"
            )
        return True

    def make_policy_pairs(self, cfgs: dict[str, Config]) -> None:
        """The rm stage's pairs from the SFT model's samples (stages/preferences.py); once."""
        from stages.preferences import policy_preferences, write_pairs
        from tandem.data import load_prompts

        p, ppo, stage_dir = self.pc.pairs, cfgs["ppo"], self.dir / "rm"
        train, held_out = stage_dir / "pairs.jsonl", stage_dir / "pairs-eval.jsonl"
        if train.exists() and held_out.exists():
            return
        judge = p.judge or (self.pc.score.rule if self.pc.score is not None else None)
        if judge is None:
            raise ConfigError("pairs.source: policy needs a judge (pairs.judge or score.rule)")
        kwargs = dict(
            judge=judge,
            samples=p.samples,
            max_new_tokens=ppo.rollout.max_new_tokens,
            temperature=ppo.rollout.temperature,
            chat_template=ppo.data.chat_template,
            seed=ppo.run.seed,
        )
        sft = self.dir / "sft" / "final"
        eval_records = load_prompts(self.data / "pair-prompts-eval.jsonl")
        eval_pairs, eval_stats = policy_preferences(sft, eval_records, budget=p.held_out, **kwargs)
        write_pairs(held_out, eval_pairs)
        records = load_prompts(self.data / "pair-prompts.jsonl")
        rm = self.probe_rm(cfgs["rm"], sft, records, kwargs) if p.selection == "margin" else None
        half = []  # margin: the probe's random half stays, the margin picks fill the rest of the budget
        if rm is not None:
            half = [
                json.loads(line) for line in (self.dir / "rm-probe" / "pairs.jsonl").read_text().splitlines()
            ]
        pairs, stats = policy_preferences(
            sft, records, budget=p.budget - len(half), selection=p.selection, rm=rm, **kwargs
        )
        if half:
            seen = {(q["prompt"], q["chosen"], q["rejected"]) for q in half}
            pairs = half + [q for q in pairs if (q["prompt"], q["chosen"], q["rejected"]) not in seen]
            stats["pairs"] = len(pairs)
        if not pairs or not eval_pairs:
            raise RuntimeError(
                f"rm: the SFT model's samples gave no pairs with different judge scores ({stats}, {eval_stats})"
            )
        if p.task_pairs:
            import random

            task = [json.loads(line) for line in (self.data / "prefs.jsonl").read_text().splitlines()]
            pairs = pairs + task[: p.task_pairs]
            random.Random(ppo.run.seed).shuffle(pairs)
            stats["task_pairs"] = min(p.task_pairs, len(task))
        write_pairs(train, pairs)
        (stage_dir / "pairs.json").write_text(json.dumps({"train": stats, "held_out": eval_stats}, indent=2))
        print(
            f"[pipeline] rm: {stats['pairs']} pairs ({p.selection}) of {stats['candidates']} candidates from"
            f" {stats['samples']} SFT samples, judge mean {stats['judge_mean']:.3f}",
            flush=True,
        )

    def probe_rm(
        self, rm_cfg: Config, sft: Path, records: list[dict[str, Any]], kwargs: dict[str, Any]
    ) -> Path:
        """For ``pairs.selection: margin``: a reward model trained (the rm stage's recipe) on a random half
        of the budget, which then scores every candidate pair."""
        from stages.preferences import policy_preferences, write_pairs

        probe_dir = self.dir / "rm-probe"
        if not (probe_dir / DONE).exists():
            probe_dir.mkdir(parents=True, exist_ok=True)
            half, _ = policy_preferences(sft, records, budget=max(1, self.pc.pairs.budget // 2), **kwargs)
            write_pairs(probe_dir / "pairs.jsonl", half)
            algo = rm_cfg.algorithm.model_copy(update={"train_file": str(probe_dir / "pairs.jsonl")})
            result = self.run_offline("rm-probe", rm_cfg.model_copy(update={"algorithm": algo}))
            (probe_dir / DONE).write_text(json.dumps(result, indent=2))
        return probe_dir / "final"

    def run_offline(self, stage: str, cfg: Config) -> dict[str, Any]:
        stage_dir = self.dir / stage
        self.child(self.offline_cmd(stage, cfg), stage_dir / "train.log", stage)
        return json.loads((stage_dir / "summary.json").read_text())

    def offline_cmd(self, stage: str, cfg: Config) -> list[str]:
        """Write the stage's config; the command that trains it (or resumes it from its checkpoints)."""
        stage_dir = self.dir / stage
        path = stage_dir / "config.yaml"
        path.write_text(dump_config(cfg))
        return [
            sys.executable,
            "-m",
            "learner.train",
            "--config",
            str(path),
            "--run-dir",
            str(stage_dir),
            "--resume",
        ]

    def run_ppo(self, cfg: Config) -> dict[str, Any]:
        stage_dir = self.dir / "ppo"
        runs = sorted(p for p in stage_dir.glob(f"{cfg.run.name}-*") if (p / "config.public.yaml").exists())
        if runs:  # killed before: launch.py restarts it from its checkpoints and its Redis AOF
            cmd = [sys.executable, str(REPO / "launch.py"), "--resume", str(runs[-1]), "--no-console"]
        else:
            path = stage_dir / "config.yaml"
            path.write_text(dump_config(cfg))
            cmd = [sys.executable, str(REPO / "launch.py"), str(path), "--no-console"]
        watch = self.watch_ppo(cfg) if self.monitored else None
        self.child(cmd, stage_dir / "launch.log", "ppo", watch=watch)
        run_dir = sorted(
            p for p in stage_dir.glob(f"{cfg.run.name}-*") if (p / "config.public.yaml").exists()
        )[-1]
        final = run_dir / "final"
        if not (final / "config.json").exists() and not (watch is not None and watch.signalled):
            raise RuntimeError(
                f"ppo: launch.py finished without a final actor in {final}: see {stage_dir / 'launch.log'}"
            )
        # none when stopped before its first log line
        rows = [r for r in read_history(run_dir, "learner") if "reward/mean" in r]
        k = max(1, len(rows) // 10)
        result: dict[str, Any] = {
            "recipe": "ppo",
            "run_dir": str(run_dir),
            "final": str(final),
            "steps": int(rows[-1]["learner/version"]) if rows else len(trained_versions(run_dir)),
        }
        for key in sorted({key for r in rows for key in r if key.startswith("reward/")}):
            values = [r[key] for r in rows if key in r]
            result[key] = {
                "first": sum(values[:k]) / len(values[:k]),
                "last": sum(values[-k:]) / len(values[-k:]),
            }
        if watch is not None:
            watch.poll(run_dir)  # the snapshots written after the last look
            result.update(watch.result(run_dir))
        return result

    def watch_ppo(self, cfg: Config) -> PPOWatch:
        from stages.overoptimization import GoldMonitor
        from tandem.data import load_prompts

        m, s = self.pc.monitor, self.pc.score
        prompts = self.data / "monitor-prompts.jsonl" if self.pc.data is not None else Path(cfg.data.prompts)
        gold = GoldMonitor(
            cfg.model.reference or cfg.model.actor,
            load_prompts(prompts)[: m.prompts],
            s.rule,
            reward_model=cfg.model.reward_model,
            reward=cfg.reward,
            model_weight=cfg.reward.model_weight,
            samples=m.samples,
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
            chat_template=cfg.data.chat_template,
            seed=cfg.run.seed,
        )
        return PPOWatch(gold, m, self.dir / "ppo", cfg)

    def child(self, cmd: list[str], log_path: Path, stage: str, watch: PPOWatch | None = None) -> None:
        """Run a stage's command; with ``watch``, look at its new snapshots while it runs, and stop it
        (SIGINT: launch.py's clean stop, the learner's final checkpoint and actor) when the watch says so."""
        env = child_env()
        stopped = False
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
            try:
                while proc.poll() is None:
                    if watch is not None and not stopped and watch.poll(watch.run_dir()):
                        print(f"[pipeline] {stage}: early stop: {watch.stop}", flush=True)
                        proc.send_signal(signal.SIGINT)
                        stopped = watch.signalled = True
                    time.sleep(0.5)
            finally:
                if proc.poll() is None:  # the pipeline itself was interrupted
                    proc.send_signal(signal.SIGINT)
                rc = proc.wait()
        if rc != 0 and not stopped:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{stage}: {' '.join(cmd[:4])} ... exited with {rc}; log {log_path}:\n{tail}")

    def add_scores(self, stage: str, cfg: Config, result: dict[str, Any]) -> None:
        """The rule-based task score of the stage's policy (and, once, of the base model)."""
        s = self.pc.score
        if s is None or stage == "rm":
            return
        ppo = self.stage_configs()["ppo"]
        prompts = self.data / "score-prompts.jsonl" if self.pc.data is not None else Path(ppo.data.prompts)
        kwargs = dict(
            n_prompts=s.prompts,
            samples=s.samples,
            max_new_tokens=ppo.rollout.max_new_tokens,
            temperature=ppo.rollout.temperature,
            chat_template=ppo.data.chat_template,
            seed=ppo.run.seed,
        )
        policy = self.dir / "sft" / "final" if stage == "sft" else Path(result["final"])
        if stage == "sft":
            result["task_score_base"] = task_score(cfg.model.actor, prompts, s.rule, **kwargs)
        result["task_score"] = task_score(policy, prompts, s.rule, **kwargs)

    def summarize(self) -> dict[str, Any]:
        summary = {}
        print(f"[pipeline] {self.dir}")
        for stage in STAGES:
            done = self.dir / stage / DONE
            if done.exists():
                summary[stage] = json.loads(done.read_text())
                print(
                    f"[pipeline]   {stage:4s} {summary[stage]['wall_s']:6.0f}s  {headline(stage, summary[stage])}"
                )
        sched = self.dir / "schedule.json"  # schedule: parallel | auto, the sft + rm part
        if sched.exists() and self.pc.schedule != "serial":
            summary["schedule"] = json.loads(sched.read_text())
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary


def trained_versions(run_dir: Path) -> list[int]:
    """The versions the learner recorded as trained (``trained.jsonl``, one line per step)."""
    path = run_dir / "trained.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [int(json.loads(line)["version"]) for line in lines if line.strip()]


# ``run.<key>=`` overrides, as every launch.py command takes them: the pipeline's own name and directory,
# anything else every stage's run section (``base.run``).
RUN_KEYS = {"run.name": "name", "run.output_dir": "output_dir"}


def pipeline_overrides(overrides: list[str]) -> list[str]:
    out = []
    for o in overrides:
        key, eq, value = o.partition("=")
        if eq and key == "run.dir":
            raise ConfigError("run.dir: the pipeline places its stages itself (run.output_dir=, run.name=)")
        if eq and key in RUN_KEYS:
            o = f"{RUN_KEYS[key]}={value}"
        elif eq and key.startswith("run."):
            o = f"base.{key}={value}"
        out.append(o)
    return out


def main(argv: list[str] | None = None, prog: str = "python -m stages.pipeline") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    ap.add_argument("config", help="pipeline YAML (configs/pipeline-tiny.yaml)")
    ap.add_argument(
        "overrides",
        nargs="*",
        help="key.sub=value over the pipeline YAML, e.g. sft.learner.total_steps=5; run.output_dir=DIR and"
        " run.name=NAME place the pipeline (<output_dir>/<name>/), other run.* keys go to every stage",
    )
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="validate every stage, print its command and config, start nothing",
    )
    ap.add_argument(
        "--no-console",
        action="store_true",
        help="plain log lines (the pipeline always logs them; its PPO stage runs launch.py --no-console)",
    )
    args = ap.parse_intermixed_args(argv)
    setup_logging()
    try:
        pipeline = Pipeline(load_pipeline(args.config, pipeline_overrides(args.overrides)))
        cfgs = pipeline.stage_configs()
        stage_plugins = [f"{st}: {e}" for st, c in cfgs.items() for e in plugins.check_plugins(c)]
        plugins.require(plugins.check_pipeline_plugins(pipeline.pc) + stage_plugins)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        for line in prepare.describe(pipeline.pc.prepare):
            print(f"# {line}")
        if pipeline.pc.schedule != "serial":
            how = "at once on split threads" if pipeline.pc.schedule == "parallel" else "as a profile decides"
            print(f"# schedule: {pipeline.pc.schedule}: sft and rm {how} (docs/stages.md §4.5)")
        for stage in STAGES:
            stage_dir = pipeline.dir / stage
            if (stage_dir / DONE).exists():
                print(f"# {stage}: done before, skipped ({stage_dir})")
                continue
            if stage == "ppo":
                cmd = f"python launch.py {stage_dir / 'config.yaml'} --no-console"
            else:
                cmd = f"python -m learner.train --config {stage_dir / 'config.yaml'} --run-dir {stage_dir} --resume"
            print(f"# {stage}: {cmd}\n{dump_config(cfgs[stage])}")
        return 0
    try:
        prepare.run_steps(pipeline.pc.prepare)  # the base model and whatever else the stages read
    except prepare.StepFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        pipeline.run()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
