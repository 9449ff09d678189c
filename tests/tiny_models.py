"""The tiny models every node's home needs, built once per test session and copied into each home
before grpo-run starts there.

A fresh GRPO_RUN_HOME builds `tiny:char` on first use, in the supervisor (the estimate reads its
config), which imports torch and transformers for it: about 4 s of a 2-core machine for each
command a test runs on a new node, most of them in the fault and resume tests. The build itself is
the product's (runner.home.ensure_model, then the trainer's from_pretrained): it runs once per
session here, is deterministic (seeded, byte-identical on every machine), and a home given a copy
is the home of a node that ran a job before. Tests that are about a fresh node (test_fresh_node,
the wheel's) start from homes this never touches."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tests.once import once

_BUILT: Path | None = None       # this session's built models (their `models` folder)


def build_once(tmp_path_factory) -> None:
    """Build the session's copy of tiny:char (once for all xdist workers)."""
    global _BUILT
    if _BUILT is None:
        _BUILT = Path(once(tmp_path_factory, "tiny-models", _build))


def _build(folder: Path) -> str:
    from grpo_run.runner.home import ensure_model

    previous = os.environ.get("GRPO_RUN_HOME")
    os.environ["GRPO_RUN_HOME"] = str(folder)
    try:
        ensure_model("tiny:char")
    finally:
        if previous is None:
            os.environ.pop("GRPO_RUN_HOME")
        else:
            os.environ["GRPO_RUN_HOME"] = previous
    return str(folder / "models")


def seed_home(home: Path) -> Path:
    """`home` with the session's tiny models in its `models` folder (those it lacks); `home`."""
    if _BUILT is None:
        return home
    for model in _BUILT.iterdir():
        target = Path(home) / "models" / model.name
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(model, target)
    return home
