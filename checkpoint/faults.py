"""Fault injection for the kill tests: `GRPO_RUN_FAULT=POINT@STEP` hard-kills the node — the
supervisor and the trainer, SIGKILL, no handler, no flush — when the trainer reaches POINT while
working on STEP. `POINT@STEP/trainer` kills the trainer process alone (a crash the supervisor
should restart from), once: a marker file in GRPO_RUN_FAULT_MARKER's folder remembers it fired.

Points: `sample` (mid-generation of step STEP, 0-based), `backward` (after the backward pass of
step STEP, before the optimizer applies it), `upload` (after some files of checkpoint STEP are
in object storage, before its manifest). Unset in normal runs: one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path


def fault_point(point: str, step: int) -> None:
    wanted = os.environ.get("GRPO_RUN_FAULT")
    if not wanted:
        return
    where, _, scope = wanted.partition("/")
    if where != f"{point}@{step}":
        return
    marker = os.environ.get("GRPO_RUN_FAULT_MARKER")
    if marker:
        if Path(marker).exists():
            return
        Path(marker).write_text(wanted)
    if scope != "trainer":
        supervisor = os.environ.get("GRPO_RUN_SUPERVISOR_PID")
        if supervisor and int(supervisor) == os.getppid():
            os.kill(int(supervisor), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
