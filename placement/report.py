"""``python launch.py plan CONFIG [--devices N]``: every candidate placement, ranked, with its prediction.

With ``--profile RUN_DIR`` (repeatable) the laws are fitted to those runs' measured phase times
(``placement/profile.py``); without, they come from the checkpoints' sizes and nominal device speeds
(``placement/configured.py``: orders of magnitude, labelled as such). The table shows the configured plan's
rank, so a user sees how far the hand-written choice is from the predicted best.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from placement.configured import checkpoint_params, configured_plan, prior_model, roles_of
from placement.cost import CostModel, Prediction, Workload
from placement.planner import rank
from placement.plans import Roles, validate
from placement.profile import profiled_workload, read_run
from tandem.config import Config, ConfigError, load_config

GiB = 2**30


def workload_of(cfg: Config, prompt_len: float) -> Workload:
    """One learner step's work: a batch of ``algorithm.batch_size`` rows of about half-length responses."""
    return Workload(cfg.algorithm.batch_size, prompt_len, cfg.rollout.max_new_tokens / 2)


def format_ranking(preds: list[Prediction], roles: Roles, configured: Prediction, top: int) -> str:
    rows = [
        f"{'#':>4}  {'plan':<58} {'step ms':>9} {'gen ms':>8} {'learn ms':>9} {'GiB/dev':>8} {'host GiB':>8}"
    ]
    for i, p in enumerate(preds[:top]):
        mark = " *" if p.plan == configured.plan else ""
        note = f"  infeasible: {p.infeasible}" if not p.feasible else ""
        rows.append(
            f"{i + 1:>4}  {p.plan.label(roles) + mark:<58} {p.step_s * 1e3:>9.1f} {p.generation_s * 1e3:>8.1f} "
            f"{p.learning_s * 1e3:>9.1f} {p.peak_bytes / GiB:>8.2f} {p.host_bytes / GiB:>8.2f}{note}"
        )
    where = next(i for i, p in enumerate(preds) if p.plan == configured.plan) + 1
    rows.append(
        f"configured (*): rank {where} of {len(preds)}, {configured.step_s * 1e3:.1f} ms/step predicted; "
        f"best {preds[0].step_s * 1e3:.1f} ms ({configured.step_s / preds[0].step_s:.2f}x)"
    )
    return "\n".join(rows)


class Refused(Exception):
    """What ``launch.py plan`` cannot place, said as one ``error:`` line (exit code 2)."""


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        cfg = ppo_config(args)
        devices = args.devices or os.cpu_count() or 1
        if devices < 1:
            raise Refused("--devices must be at least 1")
        cuda = args.cuda or cfg.run.device == "cuda"
        device_bytes, host_bytes = memory_of(args, cuda, devices)
        roles = roles_of(cfg)
        model, work, source = laws_of(args, cfg, cuda)
        preds = rank(roles, devices, model, work, device_bytes=device_bytes, host_bytes=host_bytes)
        mine = configured_prediction(cfg, preds, roles, devices)
    except Refused as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    kind = "GPUs" if cuda else "CPU threads"
    print(
        f"# {len(preds)} plans on {devices} {kind}, {work.samples} samples x ({work.prompt_len:.0f} + "
        f"{work.response_len:.0f}) tokens a step; models: actor"
        + "".join(f", {r}" for r in ("reference", "critic", "reward_model") if getattr(roles, r))
    )
    print(f"# {source}")
    total, active, _ = checkpoint_params(cfg.model.actor)
    if active < total:  # a mixture of experts: memory is priced by the total, compute by the active count
        print(
            f"# actor: {total:,.0f} parameters in memory, {active:,.0f} active per token (mixture of experts)"
        )
    print(format_ranking(preds, roles, mine, args.top))
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="launch.py plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    ap.add_argument(
        "--devices", type=int, default=None, help="devices to place on (CPU: threads; default: cores)"
    )
    ap.add_argument("--cuda", action="store_true", help="price devices as GPUs (default: run.device)")
    ap.add_argument("--device-gb", type=float, default=None, help="memory per device (default 80 on GPU)")
    ap.add_argument(
        "--host-gb", type=float, default=None, help="host memory for offloads (default: this host's)"
    )
    ap.add_argument("--prompt-len", type=float, default=64.0, help="mean prompt tokens of the workload")
    ap.add_argument("--top", type=int, default=20, help="rows to print")
    ap.add_argument(
        "--profile",
        type=Path,
        action="append",
        default=[],
        metavar="RUN_DIR",
        help="fit the laws to this run's measured phase times (repeat: runs on two device counts)",
    )
    return ap.parse_intermixed_args(argv)


def ppo_config(args: argparse.Namespace) -> Config:
    """The config with its overrides; only the online PPO recipe has roles to place."""
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        raise Refused(e) from None
    if cfg.recipe != "ppo":
        raise Refused(
            f"launch.py plan places the online PPO roles; {args.config} is algorithm.recipe={cfg.recipe}"
        )
    return cfg


def memory_of(args: argparse.Namespace, cuda: bool, devices: int) -> tuple[float, float]:
    """Bytes per device and host bytes for offloads: as given, else 80 GiB per GPU, or this host's memory
    shared by the CPU devices."""
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    device_bytes = (args.device_gb or 80.0) * GiB if cuda else host / devices
    if args.device_gb and not cuda:
        device_bytes = args.device_gb * GiB
    host_bytes = (args.host_gb * GiB) if args.host_gb else host
    return device_bytes, host_bytes


def laws_of(args: argparse.Namespace, cfg: Config, cuda: bool) -> tuple[CostModel, Workload, str]:
    """The cost laws, the step's workload and a line saying where they come from: the prior, with the
    phases ``--profile`` runs measured fitted over it."""
    model, work = prior_model(cfg, cuda=cuda), workload_of(cfg, args.prompt_len)
    source = "predicted from checkpoint sizes and nominal device speeds (a prior: orders of magnitude, not a profile)"
    if not args.profile:
        return model, work, source
    try:
        profiles = [read_run(d, os.cpu_count() or 1) for d in args.profile]
    except (OSError, ValueError, KeyError, ConfigError) as e:
        raise Refused(f"--profile: {e}") from None
    measured = CostModel.from_samples([s for p in profiles for s in p.samples])
    model = CostModel({**model.time, **measured.time}, {**model.memory, **measured.memory})
    work = profiled_workload(profiles, cfg.algorithm.batch_size)
    source = (
        f"fitted to the measured phases of {len(profiles)} run(s): {', '.join(sorted(measured.time))}; "
        "other phases from the prior"
    )
    return model, work, source


def configured_prediction(cfg: Config, preds: list[Prediction], roles: Roles, devices: int) -> Prediction:
    """The configured plan's row of the ranking; refused where it cannot run or there is nothing to choose."""
    configured = configured_plan(cfg, devices)
    mine = next((p for p in preds if p.plan == configured), None)
    if devices > 1 and mine is None and (why := validate(configured, roles, devices)):
        raise Refused(
            f"the configured placement ({configured.label(roles)}) cannot run on {devices} device(s): {why}"
        )
    if devices == 1 or mine is None:
        raise Refused(f"{devices} device(s) leave no choice of placement for this config")
    return mine
