"""The packages are the architecture (STYLE.md, SPEC §5b): arrows point down. `trainer` imports
neither `runner` nor `state` (it knows nothing of storage, budgets or the record); `checkpoint`
and `state` import neither `runner` nor `trainer`. Every import counts, at any depth."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FORBIDDEN = {"trainer": {"runner", "state"}, "checkpoint": {"runner", "trainer"}, "state": {"runner", "trainer"}}


def imported_packages(path: Path) -> set[tuple[str, int]]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {(alias.name.split(".")[0], node.lineno) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add((node.module.split(".")[0], node.lineno))
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_imports_nothing_above_it(package):
    wrong = [f"{path.relative_to(REPO)}:{line} imports {name}"
             for path in sorted((REPO / package).rglob("*.py"))
             for name, line in sorted(imported_packages(path)) if name in FORBIDDEN[package]]
    assert not wrong, "\n".join(wrong)
    assert list((REPO / package).rglob("*.py"))          # the package is where it is said to be
