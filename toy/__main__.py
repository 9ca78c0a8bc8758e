"""``python -m toy <command>``: build tiny checkpoints and toy datasets, warm-start a checkpoint."""

from toy.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
