"""The commands the docs give a newcomer to copy run as written: the emulators started with the
flags the tests start them with, and the venv's own programs named by their path (a fresh shell has
no venv active: a bare `python` lacks the emulators' wrappers and `grpo-run` is not on PATH)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.cloud_stores import AZURITE_FLAGS

DOCS = Path(__file__).resolve().parents[1] / "docs"


def bash_blocks(doc: Path) -> list[str]:
    """The ```bash blocks of `doc`, each with its continued lines joined."""
    return [block.replace("\\\n", " ") for block in re.findall(r"```bash\n(.*?)```", doc.read_text(), re.S)]


def test_the_azurite_recipe_starts_it_as_the_tests_do():
    (started,) = [line for block in bash_blocks(DOCS / "storage.md") for line in block.splitlines()
                  if "azurite-blob" in line and not line.lstrip().startswith("#")]
    for flag in AZURITE_FLAGS:
        assert flag in started.split(), flag


@pytest.mark.parametrize("doc", ["storage.md"])
def test_every_storage_recipe_names_the_venvs_programs_by_their_path(doc):
    bare = [line for block in bash_blocks(DOCS / doc) for line in block.splitlines()
            if re.search(r"(^|[\s$(=])(python3?|grpo-run|pip) ", line.split("#")[0])]
    assert bare == []


def test_the_readme_says_where_a_run_keeps_its_files(monkeypatch):
    """A newcomer's first question after the demo: where did it write? The README names the
    default home (the one runner.home uses) and the variable that moves it."""
    from pathlib import Path as P

    from grpo_run.runner.home import grpo_run_home, work_dir

    monkeypatch.delenv("GRPO_RUN_HOME")
    readme = (DOCS.parent / "README.md").read_text()
    shown = "~/" + str(grpo_run_home().relative_to(P.home()))
    assert f"under `{shown}` (set `GRPO_RUN_HOME`" in readme
    assert f"`{work_dir('NAME').relative_to(grpo_run_home())}/` is the job's work folder" in readme
