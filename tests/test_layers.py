"""The packages are the architecture (STYLE.md, SPEC §5b): arrows point down. `trainer` imports
neither `runner` nor `state` (it knows nothing of storage, budgets or the record); `checkpoint`
and `state` import neither `runner` nor `trainer`. Every import counts, at any depth."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {"runner", "trainer", "checkpoint", "state"}
FORBIDDEN = {"trainer": {"runner", "state"}, "checkpoint": {"runner", "trainer"}, "state": {"runner", "trainer"}}


def imported_packages(path: Path) -> set[tuple[str, int]]:
    """(package, line) for each import of ours in `path`: `grpo_run.runner.x` counts as `runner`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {(_package(alias.name), node.lineno) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "grpo_run":          # from grpo_run import runner
                found |= {(alias.name, node.lineno) for alias in node.names}
            else:
                found.add((_package(node.module), node.lineno))
    return found


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if parts[0] == "grpo_run" and len(parts) > 1 else parts[0]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_imports_nothing_above_it(package):
    wrong = [f"{path.relative_to(REPO)}:{line} imports {name}"
             for path in sorted((REPO / package).rglob("*.py"))
             for name, line in sorted(imported_packages(path)) if name in FORBIDDEN[package]]
    assert not wrong, "\n".join(wrong)
    assert list((REPO / package).rglob("*.py"))          # the package is where it is said to be


def test_every_import_of_ours_goes_through_grpo_run():
    """The folders are installed as grpo_run.runner, ...: a bare `import trainer` would find a
    user's own `trainer/` (or nothing, from a wheel)."""
    wrong = [f"{path.relative_to(REPO)}:{node.lineno}"
             for folder in ("runner", "trainer", "checkpoint", "state", "tests", "bench", "scripts", "examples")
             for path in sorted((REPO / folder).rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text(), str(path)))
             if (isinstance(node, ast.Import) and any(a.name.split(".")[0] in PACKAGES for a in node.names))
             or (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                 and node.module.split(".")[0] in PACKAGES)]
    assert not wrong, "\n".join(wrong)


def test_no_production_module_imports_fault_injection():
    """The fault points are armed from outside (tests/faults/inject, on the children's PYTHONPATH):
    production code imports nothing named faults, at any depth, and calls no hook for them."""
    wrong = [f"{path.relative_to(REPO)}:{node.lineno} imports {name}"
             for package in sorted(PACKAGES)
             for path in sorted((REPO / package).rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text(), str(path)))
             for name in _imported_names(node) if "faults" in name]
    assert not wrong, "\n".join(wrong)


def _imported_names(node: ast.AST) -> list[str]:
    """`import a.b` -> a.b; `from a import b` -> a.b (b may be a module); anything else -> none."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        return [f"{'.' * node.level}{node.module or ''}.{alias.name}" for alias in node.names]
    return []


def test_the_public_face_is_imported_by_no_package_below_it():
    """grpo_run's own modules (api/: apply, get, the Job handle) call the library; the library never
    calls them: `import grpo_run` or `from grpo_run import X` (X not one of the folders) in runner/,
    trainer/, checkpoint/ or state/ would put the face below the house it fronts."""
    folders = PACKAGES | {"deploy"}
    wrong = [f"{path.relative_to(REPO)}:{node.lineno}"
             for package in sorted(PACKAGES)
             for path in sorted((REPO / package).rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text(), str(path)))
             if (isinstance(node, ast.Import) and any(a.name == "grpo_run" or a.name.split(".")[:2] == ["grpo_run", "handle"]
                                                       for a in node.names))
             or (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                 and (node.module.split(".")[0] == "grpo_run" and len(node.module.split(".")) > 1
                      and node.module.split(".")[1] not in folders
                      or node.module == "grpo_run" and any(a.name not in folders for a in node.names)))]
    assert not wrong, "\n".join(wrong)


# The seam between the node's side and one trainer process (SPEC §5b, LAYOUT): the supervisor
# starts trainers and reads what they report; of trainer/ it knows the plan, the events and the exit
# statuses (protocol), the job's parameters (config), the environments it hands over (envs), which
# engine a run samples with (sampling.choice), the tool calls a reply may make (grader.tools: its hang
# watchdog counts them), and how to leave a delegated cgroup root before it starts any (grader.cgroup), and
# the clock both processes time their start with (startup: the parts the trainer's Started event carries).
# Never the recipe, the rollout, the engines or the model: those live and die with the trainer process.
SUPERVISOR_SEES = ("trainer.protocol", "trainer.config", "trainer.envs", "trainer.sampling.choice",
                   "trainer.grader.tools.MAX_TOOL_CALLS", "trainer.grader.cgroup", "trainer.startup")


def test_the_supervisor_sees_of_the_trainer_only_its_seam():
    wrong = [f"{path.relative_to(REPO)}:{node.lineno} imports {name}"
             for path in sorted((REPO / "runner" / "supervisor").rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text(), str(path)))
             for name in _imported_names(node)
             if name.removeprefix("grpo_run.").startswith("trainer")
             and not any(name.removeprefix("grpo_run.") == allowed or
                         name.removeprefix("grpo_run.").startswith(allowed + ".") for allowed in SUPERVISOR_SEES)]
    assert not wrong, "\n".join(wrong)
    assert any("trainer.protocol" in n for path in (REPO / "runner" / "supervisor").rglob("*.py")
               for node in ast.walk(ast.parse(path.read_text())) for n in _imported_names(node))


def test_the_tests_mirror_the_packages():
    """STYLE: tests mirror the packages. tests/runner/ has no flat test file, and each folder of
    tests/runner/ and tests/trainer/ that holds tests is a sub-package of runner/ or trainer/."""
    assert not sorted(p.name for p in (REPO / "tests" / "runner").glob("test_*.py"))
    for top in ("runner", "trainer"):
        for folder in sorted((REPO / "tests" / top).iterdir()):
            if folder.is_dir() and any(folder.glob("test_*.py")):
                assert (REPO / top / folder.name / "__init__.py").exists(), f"tests/{top}/{folder.name}"


def test_no_package_s_rooms_import_each_other_in_a_circle():
    """scripts/house draws each package's rooms and arrows: a circle (episodes -> grader -> episodes)
    means two rooms that cannot be read, tested or moved apart."""
    import subprocess
    import sys

    table = subprocess.run([sys.executable, str(REPO / "scripts" / "house")], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    start = table[0].index("circles")          # the column's text: 0, or the circle drawn
    rows = [line for line in table[1:] if line.strip() and not line.startswith("files over")]
    assert len(rows) > 10
    circles = [line for line in rows if line[start:].strip() != "0"]
    assert not circles, "\n".join(circles)
