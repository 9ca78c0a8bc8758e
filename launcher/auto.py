"""``placement.mode: auto``: profile, fit, pick a placement, then run it (docs/design.md §11.3).

1. **Profile window.** Two short probe runs of ``placement.profile_steps`` learner steps each, under
   ``<output_dir>/<name>-auto-probes/``: colocated (``run.mode: sync``, every core to each phase in turn)
   and separated (``run.mode: async``, the cores split). Between them every phase is timed on two device
   counts, which is what the planner's laws need.
2. **Fit and pick.** The laws are fitted to both probes' phase times (``placement/profile.py``) and every
   plan the processes can run on this machine's cores is predicted; the fastest feasible one wins.
3. **Run.** The run starts under the chosen plan, its config saying it concretely (a resumed run keeps
   it). At the end, predicted and measured step time are printed side by side.

The probes' training is thrown away: the profile costs ``2 x profile_steps`` steps and two start-ups.
Re-planning during a run is done in simulation only (``placement/sim_auto.py``); see docs/design.md §11.4.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from launcher import driver
from launcher.backends import Backend
from launcher.feeder import PromptSet
from placement.cost import CostModel, Prediction
from placement.local import roles_of
from placement.plan import Plan, candidates
from placement.planner import rank
from placement.profile import RunProfile, profiled_workload, read_run
from tandem.config import RUNNABLE_PLACEMENT, Config, load_config

ROOT = Path(__file__).resolve().parent.parent


class ProbeFailed(RuntimeError):
    """A profile-window probe run did not finish; its run directory holds the reason."""


def runnable(plan: Plan) -> bool:
    """Plans the processes run today (the planner predicts more; docs/design.md §11.1)."""
    return plan.aux == 0 and all(getattr(plan, k) in v for k, v in RUNNABLE_PLACEMENT.items())


def applied(cfg: Config, plan: Plan) -> Config:
    """``cfg`` running ``plan``: colocated takes turns (sync), separated overlaps (async) at its share."""
    colocate = plan.mode == "colocate"
    placement = cfg.placement.model_copy(
        update={
            "mode": plan.mode,
            "generation_share": None if colocate else plan.generation / plan.devices,
            "reference": plan.reference,
        }
    )
    run = cfg.run.model_copy(update={"mode": "sync" if colocate else "async"})
    return cfg.model_copy(update={"placement": placement, "run": run})


def probe(cfg: Config, mode: str, out: Path) -> Config:
    """A probe of ``profile_steps`` steps, written under ``out``, saving no checkpoint."""
    plan = Plan("colocate", 2, 2) if mode == "sync" else Plan("separate", 1, 1)
    c = applied(cfg, plan)
    if mode == "async":
        c = c.model_copy(update={"placement": c.placement.model_copy(update={"generation_share": None})})
    learner = c.learner.model_copy(
        update={"total_steps": cfg.placement.profile_steps, "checkpoint_interval": 0, "save_hf_final": False}
    )
    run = c.run.model_copy(
        update={"output_dir": str(out), "dir": None, "name": f"{cfg.run.name}-probe-{mode}"}
    )
    logging = c.logging.model_copy(update={"wandb_mode": "disabled", "console": False})
    return c.model_copy(update={"learner": learner, "run": run, "logging": logging})


def choose(cfg: Config, profiles: list[RunProfile], cores: int) -> list[Prediction]:
    """Every runnable plan on ``cores`` predicted from the probes' phase times, fastest first."""
    model = CostModel.from_samples([s for p in profiles for s in p.samples])
    work = profiled_workload(profiles, cfg.algorithm.batch_size)
    roles = roles_of(cfg)
    plans = [p for p in candidates(roles, cores) if runnable(p)]
    return rank(roles, cores, model, work, plans=plans)


def resolve(
    cfg: Config, prompts: PromptSet, make_backend: Callable[[], Backend]
) -> tuple[Config, Prediction]:
    """Run both probes through the driver (each on a fresh backend), and apply the best plan."""
    cores = os.cpu_count() or 1
    out = (ROOT / cfg.run.output_dir / f"{cfg.run.name}-auto-probes").resolve()
    profiles = []
    for mode in ("sync", "async"):
        c = probe(cfg, mode, out / mode)
        print(f"[launch] placement auto: profiling {cfg.placement.profile_steps} steps {mode}", flush=True)
        if (code := driver.run(c, prompts, make_backend(), resume=None, console_enabled=False)) != 0:
            raise ProbeFailed(
                f"placement auto: the {mode} probe run failed (exit {code}); its logs: {out / mode}"
            )
        (run_dir,) = sorted(p for p in (out / mode).iterdir() if p.is_dir())[-1:]
        # The first steps warm up (allocator, first optimizer step): the window is the steps after them.
        skip = max(2, cfg.placement.profile_steps // 3)
        profiles.append(read_run(run_dir, cores, skip=skip, window=cfg.placement.profile_steps))
    ranked = choose(cfg, profiles, cores)
    roles = roles_of(cfg)
    for p in ranked:
        print(f"[launch] placement auto:   {p.plan.label(roles):<50} {p.step_s * 1e3:8.1f} ms/step predicted")
    best = ranked[0]
    print(f"[launch] placement auto: chose {best.plan.label(roles)}", flush=True)
    choice = {
        "plan": best.plan.label(roles),
        "predicted_step_s": best.step_s,
        "probes_step_s": {p.plan.label(roles): p.window_step_s for p in profiles},
    }
    (out / "choice.json").write_text(json.dumps(choice) + "\n")
    return applied(cfg, best.plan), best


def adopt(cfg: Config, run_dir: Path) -> Config:
    """A resumed auto run keeps the placement it chose when it started (its saved config says it)."""
    saved = load_config(run_dir / "config.public.yaml")
    return cfg.model_copy(
        update={"placement": saved.placement, "run": cfg.run.model_copy(update={"mode": saved.run.mode})}
    )


def latest_run_dir(cfg: Config) -> Path:
    """The run directory the last run of ``cfg`` wrote (its fixed ``run.dir``, or the newest of its name)."""
    if cfg.run.dir:
        return (ROOT / cfg.run.dir).resolve()
    parent = (ROOT / cfg.run.output_dir).resolve()
    return max(parent.glob(f"{cfg.run.name}-*/learner_history.jsonl"), key=lambda p: p.stat().st_mtime).parent


def report(run_dir: Path, predicted: Prediction, skip: int = 2) -> str:
    """Predicted against measured seconds per step of the finished run."""
    rows = [json.loads(line) for line in (run_dir / "learner_history.jsonl").read_text().splitlines() if line]
    rows = rows[skip:]
    if len(rows) < 2:
        return f"placement auto: predicted {predicted.step_s * 1e3:.1f} ms/step; too few steps to measure"
    measured = (rows[-1]["time"] - rows[0]["time"]) / (len(rows) - 1)
    return (
        f"placement auto: predicted {predicted.step_s * 1e3:.1f} ms/step, measured {measured * 1e3:.1f} "
        f"({measured / predicted.step_s:.2f}x)"
    )
