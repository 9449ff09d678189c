"""Helpers for the child processes grpo-run starts (the trainer, its checkpoint writer, the
grader): each finds this very source tree, and dies with the process that started it."""

from __future__ import annotations

import ctypes
import os
import signal
import site
from pathlib import Path

_PR_SET_PDEATHSIG = 1
PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)


def die_with_parent() -> None:
    """In a child (as `preexec_fn`, or first thing in its main): if the parent dies (node lost,
    SIGKILL), the kernel kills this process too, so nothing trains or writes on unwatched.
    A no-op where prctl is missing (not Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def python_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for `python -m <one of our modules>`: `base` (default os.environ) with
    this package's root first on PYTHONPATH unless it is an installed site-packages folder
    (never put site-packages before the standard library)."""
    env = dict(os.environ if base is None else base)
    installed = {os.path.realpath(p) for p in [*site.getsitepackages(), site.getusersitepackages()]}
    if os.path.realpath(PACKAGE_ROOT) not in installed:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_ROOT, env.get("PYTHONPATH")]))
    return env
