"""The pipeline's config (``configs/pipeline-*.yaml``): its toy data, scoring, preference pairs, the PPO
monitor, the stages' config sections and their schedule (docs/stages.md §4).

``python -m stages.pipeline_config`` prints its fields as a table, as ``python -m tandem config-doc`` does a
run's."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from stages.schedule import Split, check_schedule
from tandem.config import (
    ConfigError,
    PrepareStep,
    Section,
    apply_overrides,
    describe_fields,
    format_validation_error,
    markdown_table,
)


class TaskData(Section):
    task: Literal["echo", "reverse"] = Field(
        ..., description="Toy task whose data sets are generated (toy/tasks)."
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


class Pairs(Section):
    """The reward model's preference pairs (stages/preferences.py, docs/stages.md §4.2)."""

    source: Literal["policy", "task"] = Field(
        "policy",
        description="policy: pairs of the SFT model's own samples labelled by the judge; task: the task's"
        " (ideal answer, near miss) pairs from data.",
    )
    judge: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="module:function(prompt, completion, record) -> float | dict that labels a pair (the"
        " higher is chosen); null: score.rule.",
    )
    prompts: int = Field(400, ge=1, description="Prompts sampled (from data's PPO prompt generator).")
    samples: int = Field(8, ge=2, description="Completions sampled per prompt.")
    budget: int = Field(2000, ge=1, description="Pairs labelled for training (at most).")
    held_out: int = Field(200, ge=1, description="Held-out pairs (other prompts, random selection).")
    task_pairs: int = Field(
        0,
        ge=0,
        description="Also train on this many of the task's (ideal answer, near miss) pairs (data.pairs of"
        " them are made): they show the reward model wrong letters the SFT model seldom samples.",
    )
    selection: Literal["random", "margin"] = Field(
        "random",
        description="Which candidate pairs are labelled: random, or margin (a probe reward model trained on a"
        " random half of the budget; the other half, the candidates with the smallest |margin| under it).",
    )


class Monitor(Section):
    """Gold against proxy during PPO, and the stop (stages/overoptimization.py, docs/stages.md §4.3)."""

    interval: int = Field(
        5, ge=1, description="PPO versions between evaluations (the actor is snapshotted at each)."
    )
    prompts: int = Field(64, ge=1, description="Held-out prompts of each evaluation (not score.prompts').")
    samples: int = Field(4, ge=1, description="Completions per prompt.")
    patience: int = Field(
        3, ge=0, description="Stop PPO after this many evaluations without a better gold score; 0 never."
    )
    max_drop: float = Field(
        0.2,
        gt=0,
        le=1,
        description="Stop PPO at once when gold falls below (1 - max_drop) x its best; 1 never.",
    )
    keep_best: bool = Field(
        True, description="The PPO stage's policy is the best-gold snapshot (SFT's own when none beat it)."
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
    pairs: Pairs = Field(
        default_factory=Pairs, description="Where the reward model's preference pairs come from."
    )
    monitor: Monitor | None = Field(
        default_factory=Monitor,
        description="With score.rule as the gold scorer: gold vs proxy vs KL every monitor.interval PPO"
        " versions, early stop, best-gold policy; null disables.",
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
    rm_from: Literal["sft", "base"] = Field(
        "sft",
        description="The reward model's starting point: sft (InstructGPT: the SFT model, so rm waits for"
        " sft) or base (base.model.actor, so the two can train at once).",
    )
    schedule: Literal["serial", "parallel", "auto"] = Field(
        "serial",
        description="sft and rm one after the other; at once on a split of the cores; or as a planner picks"
        " from their measured step times (stages/schedule.py, docs/stages.md §4.5).",
    )
    split: Split = Field(default_factory=Split, description="The cores schedule: parallel|auto divides.")

    @model_validator(mode="after")
    def _schedule_needs_independent_stages(self) -> PipelineConfig:
        check_schedule(self.schedule, self.rm_from, self.pairs.source if self.data is not None else None)
        return self


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_pipeline(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> PipelineConfig:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"pipeline config {p}: not found")
    raw = apply_overrides(yaml.safe_load(p.read_text()) or {}, list(overrides))
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, str(p))) from None


if __name__ == "__main__":
    print(markdown_table(describe_fields(PipelineConfig)))
