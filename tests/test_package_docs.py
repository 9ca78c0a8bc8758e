"""Every package of the project says, in its ``__init__.py``'s docstring, what it owns."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tandem", "buffer", "weightsync", "placement", "rollout", "learner", "launcher", "stages", "toy")


def package_inits() -> list[Path]:
    return sorted(p for top in PACKAGES for p in (ROOT / top).rglob("__init__.py"))


def test_the_top_level_packages_are_found() -> None:
    found = {p.relative_to(ROOT).parts[0] for p in package_inits()}
    assert found == set(PACKAGES)


@pytest.mark.parametrize("init", package_inits(), ids=lambda p: str(p.parent.relative_to(ROOT)))
def test_package_has_a_docstring(init: Path) -> None:
    doc = ast.get_docstring(ast.parse(init.read_text()))
    assert doc and doc.strip(), f"{init.relative_to(ROOT)}: say in a docstring what the package owns"
