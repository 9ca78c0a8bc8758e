"""A config's prepare steps: what makes its inputs (data files, models, warm starts, earlier stages).

    python launch.py configs/tiny-calc.yaml            # runs the missing steps first, then the run
    python -m launcher.prepare configs/tiny-calc.yaml  # only the steps (any YAML with a prepare list)
    python -m launcher.prepare configs/tiny-calc.yaml --dry-run

Each step (``tandem.config.PrepareStep``) names a command as an argument list and the paths it produces.
Steps run in order from the working directory, where relative config paths resolve. A step whose paths all
exist is reused. Otherwise its command runs with each produced path swapped for a temporary sibling
(``.partial-PID-NAME``), renamed over the real name only when the command succeeds: a killed or failed
step leaves nothing that a later run would take for finished. A step that fails stops the run, naming its
command and exit code.

``TANDEM_PREPARE=reduced`` appends each step's ``reduced`` arguments (fewer warm-start steps, smaller data
sets): the preset tests run every config this way. A reduced output is marked (``.NAME.reduced`` beside
it), so a later full-size run rebuilds it instead of reusing it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import yaml
from pydantic import TypeAdapter, ValidationError

from tandem.config import Config, ConfigError, PrepareStep, format_validation_error
from tandem.procs import alive
from tandem.timing import timed

ENV = "TANDEM_PREPARE"  # "reduced": every step at its reduced size
PARTIAL = ".partial-"


class StepFailed(RuntimeError):
    """A prepare step's command failed (or did not make what it promised); the run does not start."""


def reduced_from_env() -> bool:
    return os.environ.get(ENV, "") == "reduced"


def shown(step: PrepareStep, reduced: bool = False) -> str:
    """The command as a user would type it."""
    return shlex.join(step.command + (step.reduced if reduced else []))


def _marker(path: Path) -> Path:
    return path.with_name(f".{path.name}.reduced")


def is_done(step: PrepareStep, root: Path, reduced: bool) -> bool:
    """Every produced path exists; at full size, none of them was made at reduced size."""
    paths = [root / p for p in step.produces]
    return all(p.exists() for p in paths) and (reduced or not any(_marker(p).exists() for p in paths))


def config_reads(cfg: Config | dict) -> list[str]:
    """Every string of the config but its prepare list: the paths the run reads are among them."""
    out: list[str] = []

    def walk(v: object) -> None:
        if isinstance(v, str):
            out.append(v)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)

    data = dict(cfg) if isinstance(cfg, dict) else cfg.model_dump(mode="json")
    data.pop("prepare", None)
    walk(data)
    return out


def _yaml_reads(path: Path) -> list[str]:
    """The strings of a YAML config named by a step's argument (a stage reads its inputs through it)."""
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return []
    return config_reads(raw) if isinstance(raw, dict) else []


def _abs(root: Path, p: str) -> Path:
    return Path(os.path.abspath(root / p))


def needed(steps: Sequence[PrepareStep], reads: Sequence[str] | None, root: Path) -> list[bool]:
    """Which steps this run needs: one that makes a path it reads, or an argument of a needed later step
    (the warm start needs the model it starts from) or a path in a YAML config that is one (an earlier
    stage's). ``reads`` None: all of them. A step whose output an override replaced
    (``model.actor=/my/model``) is left out."""
    if reads is None:
        return [True] * len(steps)
    want = {_abs(root, r) for r in reads if r and "\0" not in r}
    keep = [False] * len(steps)
    for i in reversed(range(len(steps))):
        made = [_abs(root, p) for p in steps[i].produces]
        if any(w == m or m in w.parents for w in want for m in made):
            keep[i] = True
            args = [
                v for a in steps[i].command[1:] + steps[i].reduced for v in (a, a.rpartition("=")[2]) if v
            ]
            args += [r for a in args if a.endswith((".yaml", ".yml")) for r in _yaml_reads(root / a)]
            want |= {_abs(root, a) for a in args if "\0" not in a}
    return keep


def describe(
    steps: Sequence[PrepareStep],
    root: Path | None = None,
    reduced: bool | None = None,
    reads: Sequence[str] | None = None,
) -> list[str]:
    """One line per step: reused, not needed, or the command it would run (``--dry-run``)."""
    root = Path.cwd() if root is None else root
    reduced = reduced_from_env() if reduced is None else reduced
    out = []
    for i, (step, need) in enumerate(zip(steps, needed(steps, reads, root), strict=True), 1):
        head = f"prepare {i}/{len(steps)} {step.name}"
        if not need:
            out.append(f"{head}: not needed, the run reads none of {', '.join(step.produces)}")
        elif is_done(step, root, reduced):
            out.append(f"{head}: exists, reused ({', '.join(step.produces)})")
        else:
            out.append(f"{head}: would run {shown(step, reduced)}")
    return out


def made_by(steps: Sequence[PrepareStep], path: str | Path, root: Path | None = None) -> PrepareStep | None:
    """The step whose output is ``path`` or holds it (``assets/tiny`` holds ``assets/tiny/actor``)."""
    root = Path.cwd() if root is None else root
    target = _abs(root, str(path))
    for step in steps:
        for p in step.produces:
            made = _abs(root, p)
            if target == made or made in target.parents:
                return step
    return None


def how_to_make(cfg: Config, path: str | Path) -> str:
    """The end of a missing-input error: which command makes ``path``, or that none of the config's does."""
    step = made_by(cfg.prepare, path)
    if step is not None:
        return f"`{shown(step)}` makes it (its prepare step '{step.name}'; `python launch.py CONFIG` runs it)"
    return "no prepare step of this config makes it: point the field at an existing path"


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _clear_stale_partials(dest: Path) -> None:
    """Temporary outputs of a prepare that was killed (its process is gone)."""
    for old in dest.parent.glob(f"{PARTIAL}*-{dest.name}"):
        pid = old.name[len(PARTIAL) :].split("-", 1)[0]
        if pid.isdigit() and not alive(int(pid)):
            _remove(old)


def _argv(step: PrepareStep, temp: dict[str, str], reduced: bool) -> list[str]:
    def swap(arg: str) -> str:
        if arg in temp:
            return temp[arg]
        key, eq, value = arg.rpartition("=")
        return f"{key}={temp[value]}" if eq and value in temp else arg

    head = step.command[0]
    exe = sys.executable if head == "python" else head  # the venv's interpreter, whatever `python` is
    return [exe, *(swap(a) for a in step.command[1:]), *(step.reduced if reduced else [])]


def run_step(step: PrepareStep, root: Path, reduced: bool, label: str) -> None:
    dests = [root / p for p in step.produces]
    temp = {}
    for p, dest in zip(step.produces, dests, strict=True):
        dest.parent.mkdir(parents=True, exist_ok=True)
        _clear_stale_partials(dest)
        tmp = dest.with_name(f"{PARTIAL}{os.getpid()}-{dest.name}")
        _remove(tmp)
        temp[p] = str(Path(p).with_name(tmp.name))
    existed = {d for d in dests if d.exists()}  # stale (reduced) or an incomplete set: replaced below
    try:
        rc = subprocess.run(_argv(step, temp, reduced), cwd=root).returncode
        if rc != 0:
            raise StepFailed(f"{label} failed with exit code {rc}: {shown(step, reduced)}")
        for p, dest in zip(step.produces, dests, strict=True):
            tmp = root / temp[p]
            if not tmp.exists():
                raise StepFailed(f"{label}: `{shown(step, reduced)}` exited 0 but did not make {p}")
            if dest.exists() and dest not in existed:
                _remove(tmp)  # another launch made it meanwhile: keep theirs
                continue
            if dest in existed:
                _remove(dest)
            os.replace(tmp, dest)
            marker = _marker(dest)
            if reduced and step.reduced:  # a step without reduced arguments makes the full thing
                marker.touch()
            elif marker.exists():
                marker.unlink()
    finally:
        for p in step.produces:
            _remove(root / temp[p])


def run_steps(
    steps: Sequence[PrepareStep],
    root: Path | None = None,
    reduced: bool | None = None,
    say: Callable[[str], None] = lambda line: print(line, flush=True),
    reads: Sequence[str] | None = None,
) -> int:
    """Run the needed steps whose outputs are missing, in order; returns how many ran. Raises StepFailed.
    ``reads``: the strings of the run's config (:func:`config_reads`); None runs every step."""
    root = Path.cwd() if root is None else root
    reduced = reduced_from_env() if reduced is None else reduced
    ran = 0
    for i, (step, need) in enumerate(zip(steps, needed(steps, reads, root), strict=True), 1):
        label = f"prepare {i}/{len(steps)} {step.name}"
        if not need:
            say(f"[{label}] not needed, the run reads none of {', '.join(step.produces)}")
            continue
        if is_done(step, root, reduced):
            say(f"[{label}] exists, reused ({', '.join(step.produces)})")
            continue
        size = " (reduced size)" if reduced and step.reduced else ""
        say(f"[{label}] running{size}: {shown(step, reduced)}")
        with timed() as span:
            run_step(step, root, reduced, label)
        say(f"[{label}] done in {span.seconds:.1f} s: {', '.join(step.produces)}")
        ran += 1
    return ran


def load_steps(path: str | Path) -> list[PrepareStep]:
    """The ``prepare`` list of any YAML config: a run's or a pipeline's."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p}: not found")
    raw = yaml.safe_load(p.read_text()) or {}
    try:
        return TypeAdapter(list[PrepareStep]).validate_python(raw.get("prepare") or [])
    except ValidationError as e:
        head, *lines = format_validation_error(e, str(p)).splitlines()
        raise ConfigError("\n".join([head, *(f"  prepare.{ln.strip()}" for ln in lines)])) from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launcher.prepare", description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="a YAML config with a prepare list")
    ap.add_argument("--dry-run", action="store_true", help="list the steps: reused, or what would run")
    args = ap.parse_args(argv)
    try:
        steps = load_steps(args.config)
        if args.dry_run:
            print("\n".join(describe(steps)) or f"{args.config}: no prepare steps")
            return 0
        run_steps(steps)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except StepFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
