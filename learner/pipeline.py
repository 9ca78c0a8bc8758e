"""SFT → reward model → PPO in one command: ``python -m learner.pipeline CONFIG [stage.key=value ...]``.

The InstructGPT recipe (docs/stages.md §4). Each stage is an ordinary run of its recipe, started as a child
process, in ``<output_dir>/<name>/<stage>/``; its output, a Hugging Face directory, feeds the next:

- ``sft``: ``learner.train`` with ``recipe: sft`` from ``base.model.actor``, on demonstrations;
- ``rm``: ``learner.train`` with ``recipe: rm`` from the SFT model, on preference pairs;
- ``ppo``: ``python launch.py`` (rollout servers, buffer, learner) with all four models: actor and
  reference from SFT, the critic initialised from the reward model (``model.critic_init: reward_model``),
  the reward model scoring on the rollout servers (``model.reward_model``).

A stage whose ``done.json`` exists is skipped on a re-run; one that was killed resumes from its checkpoints
(``--resume``). With ``task`` set, the toy task's data sets are generated into ``<pipeline dir>/data``.
Every policy (base, SFT, PPO) is then scored on held-out prompts with the task's *rule-based* reward, which
PPO never sees when its reward is the reward model: the summary shows each stage's headline metric and
that score.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError

from launcher import prepare
from learner.evaluate import task_score
from tandem.config import (
    Config,
    ConfigError,
    PrepareStep,
    Section,
    _format_validation_error,
    apply_overrides,
    dump_config,
    load_config,
)
from tandem.telemetry import setup_logging

log = logging.getLogger("pipeline")
REPO = Path(__file__).resolve().parents[1]
STAGES = ("sft", "rm", "ppo")
DONE = "done.json"


class TaskData(Section):
    task: Literal["echo", "reverse"] = Field(
        ..., description="Toy task whose data sets are generated (tandem/tasks)."
    )
    demonstrations: int = Field(2000, ge=16, description="SFT training demonstrations.")
    pairs: int = Field(2000, ge=16, description="Preference pairs for the reward model.")
    held_out: int = Field(200, ge=8, description="Held-out demonstrations and pairs each.")
    prompts: int = Field(2000, ge=8, description="PPO prompts.")


class Scoring(Section):
    rule: str = Field(
        ..., pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", description="Rule-based task reward module:function."
    )
    prompts: int = Field(64, ge=1, description="Held-out prompts each policy is scored on.")
    samples: int = Field(
        4, ge=1, description="Completions sampled per prompt (at the PPO rollout temperature)."
    )


class PipelineConfig(Section):
    name: str = Field(
        ..., pattern=r"^[A-Za-z0-9_.-]+$", description="Pipeline directory name under output_dir."
    )
    output_dir: str = Field("runs", description="Parent of the pipeline directory.")
    data: TaskData | None = Field(
        None, description="Generate a toy task's data sets; null: the stages name theirs."
    )
    score: Scoring | None = Field(
        None, description="Score every policy with a rule-based reward on held-out prompts."
    )
    base: dict[str, Any] = Field(..., description="Config sections every stage starts from.")
    sft: dict[str, Any] = Field(
        ..., description="Sections the sft stage sets over base (algorithm.recipe: sft)."
    )
    rm: dict[str, Any] = Field(
        ..., description="Sections the rm stage sets over base (algorithm.recipe: rm)."
    )
    ppo: dict[str, Any] = Field(..., description="Sections the ppo stage sets over base (a launch.py run).")
    prepare: list[PrepareStep] = Field(
        default_factory=list,
        description="Steps that make the stages' inputs first (launcher/prepare.py), as in a run config.",
    )


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_pipeline(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> PipelineConfig:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"pipeline config {p}: not found")
    raw = apply_overrides(yaml.safe_load(p.read_text()) or {}, list(overrides))
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, str(p))) from None


class Pipeline:
    def __init__(self, pc: PipelineConfig) -> None:
        self.pc = pc
        self.dir = (Path(pc.output_dir) / pc.name).resolve()
        self.data = self.dir / "data"

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
        wiring: dict[str, dict[str, Any]] = {
            "sft": {"algorithm": {"recipe": "sft", **files.get("sft", {})}},
            "rm": {"model": {"actor": sft_out}, "algorithm": {"recipe": "rm", **files.get("rm", {})}},
            "ppo": {
                "model": {"actor": sft_out, "reference": sft_out, "reward_model": rm_out, "critic_init": "reward_model"},
                "run": {"output_dir": str(self.dir / "ppo")},
            },
        }  # fmt: skip
        base = self.pc.base
        if self.pc.data is not None:
            base = _merge({"data": {"prompts": str(self.data / "prompts.jsonl")}}, base)
        out = {}
        for stage in STAGES:
            raw = _merge(_merge(base, getattr(self.pc, stage)), wiring[stage])
            raw = _merge(raw, {"run": {"name": f"{self.pc.name}-{stage}"}})
            out[stage] = load_config(None, raw=raw)
        return out

    def make_data(self) -> None:
        d = self.pc.data
        if d is None:
            return
        from tandem.data import write_prompts
        from tandem.tasks import make_records, write_demonstrations, write_preferences

        jobs = {
            "sft.jsonl": lambda p: write_demonstrations(d.task, p, d.demonstrations, seed=1),
            "sft-eval.jsonl": lambda p: write_demonstrations(d.task, p, d.held_out, seed=2),
            "prefs.jsonl": lambda p: write_preferences(d.task, p, d.pairs, seed=3),
            "prefs-eval.jsonl": lambda p: write_preferences(d.task, p, d.held_out, seed=4),
            "prompts.jsonl": lambda p: write_prompts(p, make_records(d.task, d.prompts, seed=5)),
            "score-prompts.jsonl": lambda p: write_prompts(p, make_records(d.task, 1000, seed=6)),
        }
        for name, write in jobs.items():
            if not (self.data / name).exists():
                write(self.data / name)

    # ---------------------------------------------------------------------------------------- the run

    def run(self) -> dict[str, Any]:
        cfgs = self.stage_configs()  # a config error fails here, before the first stage
        self.dir.mkdir(parents=True, exist_ok=True)
        self.make_data()
        for stage in STAGES:
            stage_dir = self.dir / stage
            if (stage_dir / DONE).exists():
                print(f"[pipeline] {stage}: done before, skipped ({stage_dir})", flush=True)
                continue
            stage_dir.mkdir(parents=True, exist_ok=True)
            t0 = time.time()
            print(f"[pipeline] {stage}: starting in {stage_dir}", flush=True)
            result = self.run_offline(stage, cfgs[stage]) if stage != "ppo" else self.run_ppo(cfgs[stage])
            result["wall_s"] = time.time() - t0 + result.get("wall_s_before", 0.0)
            self.add_scores(stage, cfgs[stage], result)
            (stage_dir / DONE).write_text(json.dumps(result, indent=2))
            print(f"[pipeline] {stage}: {headline(stage, result)}", flush=True)
        return self.summarize()

    def run_offline(self, stage: str, cfg: Config) -> dict[str, Any]:
        stage_dir = self.dir / stage
        path = stage_dir / "config.yaml"
        path.write_text(dump_config(cfg))
        cmd = [
            sys.executable,
            "-m",
            "learner.train",
            "--config",
            str(path),
            "--run-dir",
            str(stage_dir),
            "--resume",
        ]
        self.child(cmd, stage_dir / "train.log", stage)
        return json.loads((stage_dir / "summary.json").read_text())

    def run_ppo(self, cfg: Config) -> dict[str, Any]:
        stage_dir = self.dir / "ppo"
        runs = sorted(p for p in stage_dir.glob(f"{cfg.run.name}-*") if (p / "config.public.yaml").exists())
        if runs:  # killed before: launch.py restarts it from its checkpoints and its Redis AOF
            cmd = [sys.executable, str(REPO / "launch.py"), "--resume", str(runs[-1]), "--no-console"]
        else:
            path = stage_dir / "config.yaml"
            path.write_text(dump_config(cfg))
            cmd = [sys.executable, str(REPO / "launch.py"), str(path), "--no-console"]
        self.child(cmd, stage_dir / "launch.log", "ppo")
        run_dir = sorted(
            p for p in stage_dir.glob(f"{cfg.run.name}-*") if (p / "config.public.yaml").exists()
        )[-1]
        final = run_dir / "final"
        if not (final / "config.json").exists():
            raise RuntimeError(
                f"ppo: launch.py finished without a final actor in {final}: see {stage_dir / 'launch.log'}"
            )
        rows = [json.loads(line) for line in (run_dir / "learner_history.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "reward/mean" in r]
        k = max(1, len(rows) // 10)
        result: dict[str, Any] = {
            "recipe": "ppo",
            "run_dir": str(run_dir),
            "final": str(final),
            "steps": int(rows[-1]["learner/version"]) if rows else 0,
        }
        for key in sorted({key for r in rows for key in r if key.startswith("reward/")}):
            values = [r[key] for r in rows if key in r]
            result[key] = {
                "first": sum(values[:k]) / len(values[:k]),
                "last": sum(values[-k:]) / len(values[-k:]),
            }
        return result

    def child(self, cmd: list[str], log_path: Path, stage: str) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            env.pop(var, None)  # a child learner makes its own rendezvous
        with open(log_path, "ab") as out:
            rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
        if rc != 0:
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
            n_prompts=s.prompts, samples=s.samples, max_new_tokens=ppo.rollout.max_new_tokens,
            temperature=ppo.rollout.temperature, chat_template=ppo.data.chat_template, seed=ppo.run.seed,
        )  # fmt: skip
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
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary


def headline(stage: str, r: dict[str, Any]) -> str:
    if stage == "ppo":
        parts = [f"{r['steps']} steps"]
        if "reward/reward_model" in r:
            rm = r["reward/reward_model"]
            parts.append(f"reward-model score {rm['first']:.3f} -> {rm['last']:.3f}")
        rule = [k for k in r if k.startswith("reward/") and k not in ("reward/mean", "reward/reward_model")]
        for key in rule:
            parts.append(f"{key} (never trained on) {r[key]['first']:.3f} -> {r[key]['last']:.3f}")
        if "task_score" in r:
            parts.append(f"task score {r['task_score']:.3f}")
        return "; ".join(parts)
    key = r["headline"]
    before, after = r["before"].get(key), r["after"].get(key)
    text = f"{key} {before:.3f} -> {after:.3f}" if before is not None else f"{key} {after:.3f}"
    text += f" in {r['steps']} steps" + (" (early stop)" if r.get("stopped_early") else "")
    if "task_score" in r:
        text += f"; task score {r['task_score_base']:.3f} (base) -> {r['task_score']:.3f}"
    return text


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


def main(argv: list[str] | None = None, prog: str = "python -m learner.pipeline") -> int:
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
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        for line in prepare.describe(pipeline.pc.prepare):
            print(f"# {line}")
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
    pipeline.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
