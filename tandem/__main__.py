"""``python -m tandem <command>``: build tiny checkpoints and toy datasets, warm-start, check configs."""

from tandem.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
