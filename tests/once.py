"""A fixture's result made once per test session, whichever xdist worker asks first.

Reference runs (an uninterrupted job that several modules' tests compare their bytes with) take
tens of seconds on these two cores; a module-scoped fixture runs once per worker that runs one of
the module's tests, and xdist deals a module's tests to both. `once` makes the result in the
session's shared temporary folder (the workers' base folders' parent) under a file lock: the
first worker builds it, the other waits on the lock and reads it back.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Callable, TypeVar

from filelock import FileLock

T = TypeVar("T")


def once(tmp_path_factory, name: str, build: Callable[[Path], T]) -> T:
    """`build(folder)`'s result (picklable), made in `folder` once for the session."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder, result = root / f"once-{name}", root / f"once-{name}.pickle"
    with FileLock(str(root / f"once-{name}.lock")):
        if result.exists():
            return pickle.loads(result.read_bytes())
        folder.mkdir(exist_ok=True)
        value = build(folder)
        result.write_bytes(pickle.dumps(value))
        return value
