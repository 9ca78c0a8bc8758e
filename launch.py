"""launch.py — one command for a whole run: Redis, K rollout servers, the learner, progress, shutdown.

    python launch.py configs/tiny.yaml [key.sub=value ...] [--mode sync|async] [--dry-run]
    python launch.py --resume runs/tiny-20261122-101500
    python launch.py configs/tiny.yaml run.dir=runs/exp1 [--fresh]   # again: resumes runs/exp1/
    python launch.py --attach runs/tiny-20261122-101500 --servers +2   # grow a running run's fleet
    python launch.py configs/tiny.yaml --ray [auto|local|ADDRESS]     # on a Ray cluster
    python launch.py pipeline configs/pipeline-tiny.yaml               # SFT -> RM -> PPO (stages/pipeline.py)
    python launch.py plan configs/tiny-ppo.yaml --devices 8            # candidate placements, ranked

A thin command line over the ``launcher`` package (docs/design.md §1.5): make what the config's prepare
steps produce and is missing (data, models, warm starts: ``launcher/prepare.py``), validate the config and
the prompts, pick a backend (``local`` subprocesses by default; ``--ray`` or ``--backend NAME``), and run.
``local`` needs no Ray: nothing here imports it unless asked. ``--ray`` runs the learner's ranks in one
placement group and the servers as restartable actors (docs/design.md §1.7, docs/ray.md).

``--attach RUN_DIR --servers +K`` starts K more rollout servers against a running run, under the same
restart policy, until the run ends (``launcher/attach.py``, docs/design.md §1.8).

``--mode sync`` runs the same components in lock-step: ``Config.max_staleness`` is 0, so admission
lets the servers generate exactly one batch per learner version (generate with v, train, publish v+1).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from launcher import driver, prepare
from launcher.backends import available, get_backend
from launcher.feeder import PromptSet
from tandem import plugins
from tandem.config import ConfigError, dump_public_config, load_config
from tandem.procs import exit_now
from tandem.telemetry import setup_logging

__all__ = ["main"]


COMMANDS = """other commands (each with its own --help):
  launch.py pipeline CONFIG [key=value ...] [--dry-run] [--no-console]
      SFT -> reward model -> PPO in one command (stages/pipeline.py, docs/stages.md §4); run.output_dir=
      and run.name= place it, other run.* keys go to every stage
  launch.py plan CONFIG [--devices N ...]
      every candidate placement of a run, ranked by predicted step time (placement/report.py)"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=COMMANDS,
    )
    ap.add_argument("config", nargs="?", help="YAML config (not needed with --resume)")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    ap.add_argument("--mode", choices=["async", "sync"], help="override run.mode")
    ap.add_argument(
        "--resume", type=Path, metavar="RUN_DIR", help="continue a run from its directory and checkpoints"
    )
    ap.add_argument(
        "--attach", type=Path, metavar="RUN_DIR", help="add rollout servers to a running run (with --servers)"
    )
    ap.add_argument(
        "--fresh",
        action="store_true",
        help="with a fixed run.dir that holds an earlier run: move it aside and start over (default: resume it)",
    )
    ap.add_argument("--servers", metavar="+K", help="--attach: how many servers to add, e.g. +2")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="print the prepare steps it would run, the commands and per-process config; start nothing",
    )
    ap.add_argument(
        "--no-console", action="store_true", help="plain log lines instead of the live progress view"
    )
    ap.add_argument(
        "--backend",
        default="local",
        help=f"what runs the processes: {', '.join(available())} (default local)",
    )
    ap.add_argument(
        "--ray",
        nargs="?",
        const="auto",
        metavar="ADDRESS",
        help="run on Ray: auto (the cluster this host belongs to, or the job's), local (a simulated"
        " multi-node cluster on this machine), or a cluster address; same as --backend ray",
    )
    args = ap.parse_intermixed_args(argv)  # overrides may come before or after any flag
    if args.resume and args.config is not None:
        # The run directory holds the config, so the first positional is an override, not a config file.
        if "=" not in args.config:
            ap.error(f"--resume reads the run directory's config; {args.config} is not a key=value override")
        args.overrides, args.config = [args.config, *args.overrides], None
    if args.ray is not None:
        if args.backend not in ("local", "ray"):
            ap.error("--ray and --backend disagree")
        args.backend = "ray"
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plan"]:  # candidate placements ranked by predicted step time (docs/placement.md §11)
        from placement.report import main as plan

        return plan(argv[1:])
    if argv[:1] == ["pipeline"]:  # the training stages in one command (docs/stages.md §4)
        from stages.pipeline import main as pipeline

        return pipeline(argv[1:], prog="launch.py pipeline")
    args = parse_args(argv)
    setup_logging()
    if args.attach or args.servers:
        return attach_main(args)
    overrides = list(args.overrides) + ([f"run.mode={args.mode}"] if args.mode else [])
    try:
        if args.resume:
            # The public copy: same config, without the embedded Redis URL (restarted on the run's AOF).
            cfg = load_config(args.resume / "config.public.yaml", overrides)
        elif args.config:
            cfg = load_config(args.config, overrides)
        else:
            print("error: a config file (or --resume RUN_DIR) is required", file=sys.stderr)
            return 2
        if args.fresh and args.resume:
            raise ConfigError("--fresh starts over, --resume continues: not both")
        resume = args.resume
        fixed = driver.fixed_run_dir(cfg)
        if resume is None and driver.started_before(fixed) and not args.fresh:
            resume = fixed  # the same command again: continue the run in run.dir
        plugins.require(plugins.check_plugins(cfg))  # every module:function it names, before anything starts
        backend = get_backend(args.backend, args.ray)
        if resume is None and args.dry_run:  # what the config's prepare steps would make first
            for line in prepare.describe(cfg.prepare, reads=prepare.config_reads(cfg)):
                print(f"# {line}")
        elif resume is None:  # data, models, warm starts: the missing ones this run reads
            prepare.run_steps(cfg.prepare, reads=prepare.config_reads(cfg))
        if not args.dry_run:
            driver.check_inputs(cfg)
            prompts = PromptSet.load(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except prepare.StepFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1

    if cfg.recipe != "ppo":  # sft, rm, dpo read no rollouts: the learner alone (launcher/offline.py)
        from launcher import offline

        return offline.run(cfg, resume=resume, fresh=args.fresh, dry_run=args.dry_run)
    console = cfg.logging.console and not args.no_console
    if cfg.placement.mode == "auto" or resume is not None:
        from launcher import auto
    # Profile both placements and run the best; a resumed auto run goes on under its plan and re-plans.
    if cfg.placement.mode == "auto" or (resume is not None and auto.started_by_auto(resume)):
        if not args.dry_run:
            try:
                return auto.run(
                    cfg,
                    prompts,
                    lambda: get_backend(args.backend, args.ray),
                    console_enabled=console,
                    fresh=args.fresh,
                    resume=resume,
                )
            except auto.ProbeFailed as e:
                print(f"error: {e}", file=sys.stderr)
                return 1
        if resume is not None:
            cfg = auto.adopt(cfg, resume)  # a resumed auto run keeps the plan it last ran
    if args.dry_run:
        plan = driver.dry_run_plan(cfg, resume=resume is not None)
        for block in backend.describe(plan):
            print(block)
        # Secrets redacted: config.yaml itself (mode 0600) holds them.
        print("# per-process config (config.yaml)\n" + dump_public_config(cfg))
        return 0
    driver.print_resume_note(cfg, resume)  # a new run beside an interrupted one of the same name
    return driver.run(cfg, prompts, backend, resume=resume, console_enabled=console, fresh=args.fresh)


def attach_main(args: argparse.Namespace) -> int:
    from launcher.attach import attach, parse_count

    try:
        if not (args.attach and args.servers) or args.config or args.resume:
            raise ConfigError("--attach RUN_DIR and --servers +K go together, without a config or --resume")
        if not (args.attach / "config.yaml").is_file():
            raise ConfigError(f"--attach: {args.attach / 'config.yaml'} not found (not a run directory?)")
        return attach(args.attach, parse_count(args.servers))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    exit_now(main())  # everything the command started is stopped: skip the interpreter's teardown
