"""The tiny models every node's home needs, built once per test session and copied into each home
before grpo-run starts there.

A fresh GRPO_RUN_HOME builds `tiny:char` on first use, in the supervisor (the estimate reads its
config), which imports torch and transformers for it: about 4 s of a 2-core machine for each
command a test runs on a new node, most of them in the fault and resume tests. The build itself is
the product's (runner.home.ensure_model, then the trainer's from_pretrained): it runs once per
session here, when the first node's home is seeded, is deterministic (seeded, byte-identical on
every machine), and a home given a copy is the home of a node that ran a job before. Tests that are
about a fresh node (test_fresh_node, the wheel's) start from homes this never touches."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from unittest import mock

from tests.once import once

_FACTORY = None                  # the session's tmp_path_factory (conftest's `_tiny_models`)
_BUILT: Path | None = None       # this session's built models (their `models` folder)


def remember(tmp_path_factory) -> None:
    """Where the session builds them, when the first home asks (a run of tests that start no node
    builds nothing)."""
    global _FACTORY
    _FACTORY = tmp_path_factory


def _build(folder: Path) -> str:
    from grpo_run.runner.home import ensure_model

    with mock.patch.dict(os.environ, {"GRPO_RUN_HOME": str(folder)}):
        ensure_model("tiny:char")
    return str(folder / "models")


def seed_home(home: Path) -> Path:
    """`home` with the session's tiny models in its `models` folder (those it lacks); `home`."""
    global _BUILT
    if _FACTORY is None:
        return home
    if _BUILT is None:
        _BUILT = Path(once(_FACTORY, "tiny-models", _build))      # once for all xdist workers
    for model in _BUILT.iterdir():
        target = Path(home) / "models" / model.name
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(model, target)
    return home
