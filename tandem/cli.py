"""Command-line helpers around the core: config checks and the config reference (``python -m tandem``).

The demo kit's commands (tiny checkpoints, toy datasets, the warm-start) are ``python -m toy``.
"""

from __future__ import annotations

import argparse
import sys

from tandem.config import ConfigError, describe_fields, load_config, markdown_table


def _check_config(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from tandem.plugins import check_plugins  # imports user code: only here, not on every config load

    errors = check_plugins(cfg)
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    if errors:
        return 2
    print(
        f"{args.config}: ok (run {cfg.run.name}, recipe {cfg.recipe}, engine {cfg.rollout.engine}"
        f"{', advantage ' + cfg.algorithm.advantage if cfg.recipe == 'ppo' else ''})"
    )
    return 0


def _config_doc(args: argparse.Namespace) -> int:
    print(markdown_table(describe_fields()))
    print(
        "\nA pipeline of stages (configs/pipeline-*.yaml) has fields of its own: "
        "python -m stages.pipeline_config prints them."
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tandem", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("check-config", help="validate a config with overrides")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(fn=_check_config)

    p = sub.add_parser("config-doc", help="print every config field as a Markdown table")
    p.set_defaults(fn=_config_doc)

    args = ap.parse_args(argv)
    return args.fn(args)
