"""``python -m tandem <command>``: check a config, print the config reference."""

from tandem.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
