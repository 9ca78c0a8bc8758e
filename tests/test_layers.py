"""Every import runs downward: a package may import only from the layers below it.

    launch.py
    stages                   (the SFT -> RM -> PPO pipeline: runs of the launcher, one after another)
    launcher | toy           (toy, the demo kit: implements an environment and runs the learner's SFT)
    rollout | learner        (neither imports the other)
    buffer | weightsync | placement
    tandem

Read from the source with ``ast`` (top-level and function-level imports alike), so a new upward import
fails here before it becomes a cycle. Within a package, no two modules import each other, directly or
through others: the module graph has no cycle. And the placement simulator (``placement/sim/``) serves
bench/ and tests only: no module a run loads imports it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
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


# Import cycles between modules, each as "a -> b -> a": each one to be removed. None remain.
KNOWN_CYCLES: set[str] = set()


def module_name(rel: Path) -> str:
    parts = rel.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node but the bodies of ``if TYPE_CHECKING:``, whose imports never run and so make no cycle."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
            continue
        yield node
        todo += ast.iter_child_nodes(node)


def module_imports(path: Path, module: str, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``module`` imports: ``from a import b`` is ``a.b`` when that is a module."""

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str | None] = set()
    for node in runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {resolve(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                up = package
                for _ in range(node.level - 1):
                    up = up.rpartition(".")[0]
                base = f"{up}.{base}".strip(".")
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else resolve(base))
    return {m for m in found if m is not None and m != module}


def module_graph(root: Path, packages: list[str]) -> dict[str, set[str]]:
    """Each module of ``packages`` (and ``launch.py`` beside them) to the modules of theirs it imports."""
    paths = [p for pkg in packages for p in (root / pkg).rglob("*.py")]
    paths += [p for p in [root / "launch.py"] if p.exists()]
    files = {module_name(p.relative_to(root)): p for p in paths}
    return {m: module_imports(p, m, set(files)) for m, p in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[str]:
    """Every cycle a depth-first search closes, as "a -> b -> a"."""
    state: dict[str, str] = {}  # "open" while on the path, then "done"
    path: list[str] = []
    found = []

    def visit(m: str) -> None:
        state[m] = "open"
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == "open":
                found.append(" -> ".join([*path[path.index(d) :], d]))
            elif d not in state:
                visit(d)
        path.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def test_no_import_cycle_between_modules() -> None:
    found = [
        c for c in cycles(module_graph(ROOT, [p for p in LAYER if p != "launch"])) if c not in KNOWN_CYCLES
    ]
    assert not found, "import cycles:\n" + "\n".join(found)


def test_the_check_sees_an_import_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n"
    )
    (pkg / "c.py").write_text("def f():\n    from . import d\n")
    (pkg / "d.py").write_text("import pkg.c\n")
    graph = module_graph(tmp_path, ["pkg"])
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == set()  # a type-only import runs never
    assert cycles(graph) == ["pkg.c -> pkg.d -> pkg.c"]


SIMULATOR = "placement.sim"  # the simulator of bench/ and tests: no module a run loads imports it


def simulator_imports(path: Path, module: str) -> list[str]:
    """The imports of ``path`` that name the simulator or a module of it, type-only ones included."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package
                for _ in range(node.level - 1):
                    up = up.rpartition(".")[0]
                base = f"{up}.{base}".strip(".")
            names += [base, *(f"{base}.{a.name}" for a in node.names)]
    return sorted({n for n in names if n == SIMULATOR or n.startswith(SIMULATOR + ".")})


def test_the_runtime_never_imports_the_simulator() -> None:
    runtime = [p for pkg in LAYER if pkg != "launch" for p in (ROOT / pkg).rglob("*.py")] + [
        ROOT / "launch.py"
    ]
    sim_dir = ROOT / Path(*SIMULATOR.split("."))
    found = [
        f"{rel} imports {name}"
        for path in runtime
        if not path.is_relative_to(sim_dir)
        for rel in [path.relative_to(ROOT)]
        for name in simulator_imports(path, module_name(rel))
    ]
    assert not found, "runtime modules that import the simulator:\n" + "\n".join(found)


def test_the_check_sees_an_import_of_the_simulator(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text(
        "from placement import sim\ndef f():\n    from .sim.auto import run_auto\n"
    )
    assert simulator_imports(tmp_path / "a.py", "placement.a") == [
        "placement.sim",
        "placement.sim.auto",
        "placement.sim.auto.run_auto",
    ]


MAX_FUNCTION_LINES = 80


def long_functions(paths: list[Path], root: Path = ROOT) -> list[str]:
    """``file:function (N lines)`` for every function longer than MAX_FUNCTION_LINES, docstring included."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(root)}:{node.name} ({lines} lines)")
    return found


def test_no_core_function_is_over_80_lines() -> None:
    """A driver reads as a list of steps; past 80 lines a function holds more than one (tests and bench
    are not core)."""
    core = [ROOT / "launch.py", *(p for pkg in LAYER if pkg != "launch" for p in (ROOT / pkg).rglob("*.py"))]
    assert long_functions(core) == []


def test_the_length_check_sees_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"def long():\n{body}\n")
    found = long_functions([tmp_path / "m.py"], root=tmp_path)
    assert found == [f"m.py:long ({MAX_FUNCTION_LINES + 1} lines)"]
