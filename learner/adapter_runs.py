"""Several LoRA adapters trained at once in one learner process (``learner.lora.adapters``, docs/stages.md §5.1).

Each adapter's run (``Config.adapter_runs``: run ``<run.name>.<name>``) is a ppo learner of its own
(learner/ppo.py on learner/online.py) with everything a run has: its stream and admission, its weight
publisher and versions, its checkpoints and ``trained.jsonl`` under ``<run dir>/adapters/<name>``, and its
wandb run. Its exactly-once guarantees are those of any run, since nothing is shared but the process.

1. **start** every adapter's learner (models, resume, version 0 published), then mark the run as a whole
   ready;
2. **round**: each adapter's learner takes one step in turn, waiting for its own batch; the servers fill
   every adapter's stream at once, so no adapter waits long on another's;
3. **log** the round under the run's own name: the step every adapter has reached, the mean of their
   rewards, and each adapter's reward as ``<name>/reward/mean`` (what the console and the summary show);
4. **stop** after ``learner.total_steps`` each, or on SIGTERM/SIGINT or the run's stop key: every adapter's
   current step finishes, then each writes its final checkpoint (and final model).

Each learner loads the base model, then every learner's frozen base weights are pointed at the first's
(:func:`share_frozen_base`), so the base is held once and each adapter adds only its adapter, gradients and
optimizer state (not under ZeRO-3, whose partitioned weights are not shared).
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import torch
from torch import nn

from learner.batch import Layout
from learner.online import OnlineRuntime, connect
from tandem.config import Config, adapter_run_dir
from tandem.telemetry import Telemetry, latest_stats, without_wandb

log = logging.getLogger("learner")


def share_frozen_base(modules: list[nn.Module]) -> int:
    """Point each module's frozen parameters at the first module's parameter of the same name, where the
    two are equal (the same base model loaded twice); returns the bytes no longer held twice. Trained
    parameters (the adapters) stay each module's own."""
    first = dict(modules[0].named_parameters())
    freed = 0
    for module in modules[1:]:
        for name, p in module.named_parameters():
            base = first.get(name)
            if p.requires_grad or base is None or base.requires_grad or p.data_ptr() == base.data_ptr():
                continue
            if p.shape == base.shape and p.dtype == base.dtype and torch.equal(p.data, base.data):
                p.data = base.data
                freed += p.numel() * p.element_size()
    return freed


def round_stats(stats: dict[str, dict[str, float]]) -> dict[str, float]:
    """One round's line for the run as a whole, from each adapter's latest learner stats (by name)."""
    rewards = {name: s["reward/mean"] for name, s in stats.items() if "reward/mean" in s}
    out = {
        "learner/version": float(min(s.get("learner/version", 0.0) for s in stats.values())),
        **{f"{name}/reward/mean": r for name, r in rewards.items()},
        "throughput/train_tokens_per_s": sum(
            s.get("throughput/train_tokens_per_s", 0.0) for s in stats.values()
        ),
    }
    if rewards:
        out["reward/mean"] = sum(rewards.values()) / len(rewards)
    staleness = [s["staleness/mean"] for s in stats.values() if "staleness/mean" in s]
    if staleness:
        out["staleness/mean"] = sum(staleness) / len(staleness)
    return out


def train_adapters(cfg: Config, run_dir: str | Path, *, resume: bool = False, layout: Layout = "pad") -> None:
    """Train every adapter of ``learner.lora.adapters``, a step each in turn (module docs)."""
    from learner.ppo import PPOLearner

    runs = cfg.adapter_runs()
    for name in runs:
        adapter_run_dir(run_dir, name).mkdir(parents=True, exist_ok=True)
    learners: dict[str, OnlineRuntime] = {
        name: PPOLearner(run, adapter_run_dir(run_dir, name), resume=resume, layout=layout)
        for name, run in runs.items()
    }
    client = connect(cfg)
    telemetry = Telemetry(without_wandb(cfg), "learner", client, run_dir=str(run_dir))

    def stop_all(*_: object) -> None:
        for learner in learners.values():
            learner.request_stop()

    try:
        shared = 0
        for learner in learners.values():  # 1. start (each installs its own signal handlers: replaced below)
            learner.start()
            if cfg.learner.zero_stage < 3:  # at once, so no more than two copies of the base are ever held
                first = next(iter(learners.values()))
                shared += share_frozen_base([first.models.actor.module, learner.models.actor.module])
        log.info("frozen base weights shared by the adapters' learners: %.1f MB saved", shared / 1e6)
        previous = {sig: signal.signal(sig, stop_all) for sig in (signal.SIGTERM, signal.SIGINT)}
        telemetry.mark_ready(adapters=list(learners))
        log.info("training adapters %s", ", ".join(learners))
        active, logged = dict(learners), min(learner.version for learner in learners.values())
        while active:  # 2. one round
            if telemetry.stop_requested():
                stop_all()
            for name, learner in list(active.items()):
                if learner.version >= learner.cfg.learner.total_steps or not learner.step():
                    del active[name]
            step = min(learner.version for learner in learners.values())
            if step > logged:  # 3. the run as a whole, once per step every adapter has taken
                stats = {name: latest_stats(client, run.run.name, "learner") for name, run in runs.items()}
                telemetry.log(round_stats(stats), step=step)
                logged = step
        for learner in learners.values():  # 4. stop
            learner.finish()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    finally:
        last_first = reversed(
            learners.values()
        )  # each restores the handlers it found: the first, the original
        for learner in last_first:
            learner.close()
        telemetry.close()
        client.close()
