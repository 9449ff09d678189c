"""Helpers for the child processes grpo-run starts (the trainer, its checkpoint writer, the
grader): each imports grpo-run as installed, never a look-alike from the folder it was started
in, and dies with the process that started it."""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child (as `preexec_fn`, or first thing in its main): if the parent dies (node lost,
    SIGKILL), the kernel kills this process too, so nothing trains or writes on unwatched.
    A no-op where prctl is missing (not Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def python_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for `python -m grpo_run.<module>`: `base` (default os.environ) with
    PYTHONSAFEPATH=1, so that (Python 3.11+) the child's own folder is not put first on
    sys.path, and a `trainer/` or `state.py` of the user's cannot stand in for ours. Every caller
    also starts the child in a folder of ours (`cwd=`), which covers Python 3.10 as well."""
    env = dict(os.environ if base is None else base)
    env["PYTHONSAFEPATH"] = "1"
    return env
