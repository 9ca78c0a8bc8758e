"""``python -m toy <command>``: the demo kit's tiny checkpoints, toy datasets and supervised warm-start.

The shipped configs run these as prepare steps (docs/design.md §1.5); ``python -m tandem`` keeps the config
commands.
"""

from __future__ import annotations

import argparse


def _make_tiny(args: argparse.Namespace) -> int:
    from toy.tiny import make_tiny

    paths = make_tiny(
        args.out,
        seed=args.seed,
        hidden=args.hidden,
        layers=args.layers,
        head_dim=args.head_dim,
        vocab_size=args.vocab_size,
        tokenizer=args.tokenizer,
        arch=args.arch,
    )
    for name, p in paths.items():
        print(f"{name}: {p}")
    return 0


def _make_data(args: argparse.Namespace) -> int:
    from toy.tasks import write_demonstrations, write_preferences, write_prompt_file

    if args.task == "colour" and args.kind != "prompts":
        raise SystemExit("make-data colour: only --kind prompts (its records carry images)")
    if args.inline_images and args.task != "colour":
        raise SystemExit("make-data --inline-images: only the colour task has images")
    if args.kind == "sft":
        p = write_demonstrations(args.task, args.out, args.n, seed=args.seed)
    elif args.kind == "prefs":
        p = write_preferences(args.task, args.out, args.n, seed=args.seed)
    elif args.inline_images:
        from toy.tasks import colour

        p = colour.write(args.out, args.n, seed=args.seed, inline=True)
    else:
        p = write_prompt_file(args.task, args.out, args.n, seed=args.seed)
    print(f"{args.n} {args.task} {args.kind} records: {p}")
    return 0


def _warmstart(args: argparse.Namespace) -> int:
    from toy.warmstart import warmstart  # the learner (torch, DeepSpeed) only for this command

    warmstart(args.task, args.model, args.out, steps=args.steps, seed=args.seed, demos=args.demos)
    return 0


def _add_make_tiny(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "make-tiny",
        help="build a tiny Qwen2 (or Qwen3-MoE) actor + scalar-head critic/reward model with a tokenizer "
        "(qwen2-vl: a vision-language actor with its image processor)",
    )
    p.add_argument("out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument(
        "--head-dim",
        type=int,
        default=None,
        help="attention head size (default hidden/4; vLLM's CPU build needs >= 32)",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="pad embedding and head to this many rows (e.g. 151936, Qwen2's); the tokenizer is unchanged",
    )
    p.add_argument(
        "--tokenizer",
        choices=["chars", "bytes"],
        default="chars",
        help="chars: the toy tasks' alphabet; bytes: every byte, with a chat template that renders tools",
    )
    p.add_argument(
        "--arch",
        choices=["qwen2", "qwen3-moe", "qwen2-vl"],
        default="qwen2",
        help="qwen2: dense; qwen3-moe: mixture of experts, 8 experts, top-2; qwen2-vl: vision-language, "
        "byte-level tokenizer, 56x56 images, actor only (head_dim 32 unless given, for both)",
    )
    p.set_defaults(fn=_make_tiny)


def _add_make_data(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "make-data", help="write a toy task's prompts, demonstrations or preference pairs as JSONL"
    )
    p.add_argument(
        "task",
        choices=["echo", "reverse", "calc", "calc-agent", "colour"],
        help="colour: an image per prompt, PNGs written to OUT-images/ beside OUT",
    )
    p.add_argument("out")
    p.add_argument(
        "--kind",
        choices=["prompts", "sft", "prefs"],
        default="prompts",
        help="prompts (ppo), demonstrations (sft) or preference pairs (rm, dpo); docs/stages.md §2",
    )
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--inline-images",
        action="store_true",
        help="colour: each image inside its record as a data:image/png;base64 URL, no folder beside OUT",
    )
    p.set_defaults(fn=_make_data)


def _add_warmstart(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("warmstart", help="supervised warm-start of a checkpoint on a task's demonstrations")
    p.add_argument(
        "task", help="echo, reverse, calc or calc-agent (demonstrations made here), or any name with --demos"
    )
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--demos", default=None, help='a {"prompt", "response"} JSONL file to train on instead')
    p.set_defaults(fn=_warmstart)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m toy", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    _add_make_tiny(sub)
    _add_make_data(sub)
    _add_warmstart(sub)
    args = ap.parse_args(argv)
    return args.fn(args)
