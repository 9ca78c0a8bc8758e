"""Every import runs downward: a package may import only from the layers below it.

    launch.py
    stages                   (the SFT -> RM -> PPO pipeline: runs of the launcher, one after another)
    launcher | toy           (toy, the demo kit: implements an environment and runs the learner's SFT)
    rollout | learner        (neither imports the other)
    buffer | weightsync | placement
    tandem

Read from the source with ``ast`` (top-level and function-level imports alike), so a new upward import
fails here before it becomes a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYER = {
    "tandem": 0,
    "buffer": 1,
    "weightsync": 1,
    "placement": 1,
    "rollout": 2,
    "learner": 2,
    "launcher": 3,
    "toy": 3,
    "stages": 4,
    "launch": 5,
}
# Known upward imports, (file, "package.module"): each one to be removed. None remain.
KNOWN: set[tuple[str, str]] = set()


def imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module)
    return found


def package_of(rel: Path) -> str:
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def edges() -> list[tuple[str, str, str]]:
    """(file, its package, the package it imports) for every cross-package import in the layers."""
    out = []
    for path in [ROOT / "launch.py", *(p for pkg in LAYER for p in (ROOT / pkg).rglob("*.py"))]:
        rel = path.relative_to(ROOT)
        src = package_of(rel)
        for module in imports(path):
            dst = module.split(".")[0]
            if dst in LAYER and dst != src:
                out.append((rel.as_posix(), src, module))
    return out


def test_every_import_runs_downward() -> None:
    upward = [
        f"{f} ({src}) imports {module}"
        for f, src, module in edges()
        if LAYER[module.split(".")[0]] >= LAYER[src] and (f, ".".join(module.split(".")[:2])) not in KNOWN
    ]
    assert not upward, "imports that do not run downward:\n" + "\n".join(upward)


def test_the_known_exceptions_still_exist() -> None:
    """An exception that was fixed comes off the list, so the list never hides a new one."""
    present = {(f, ".".join(m.split(".")[:2])) for f, _, m in edges()}
    assert present >= KNOWN, f"fixed, remove from KNOWN: {KNOWN - present}"


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    bad = tmp_path / "x.py"
    bad.write_text("def f():\n    from launcher.driver import run\n    import rollout.loop\n")
    assert imports(bad) == ["launcher.driver", "rollout.loop"]
