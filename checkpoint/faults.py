"""Fault injection for the kill tests: `GRPO_RUN_FAULT=POINT@STEP` hard-kills the node — the
supervisor and the trainer, SIGKILL, no handler, no flush — when the trainer reaches POINT while
working on STEP. `POINT@STEP/trainer` kills the trainer process alone (a crash the supervisor
should restart from), once: a marker file in GRPO_RUN_FAULT_MARKER's folder remembers it fired.

Points: `sample` (mid-generation of step STEP, 0-based), `backward` (after the backward pass of
step STEP, before the optimizer applies it), `upload` (after some files of checkpoint STEP are
in object storage, before its manifest; in the checkpoint writer, the trainer's own process).
Unset in normal runs: one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

WRITER_ENV = "GRPO_RUN_WRITER_PARENT"   # set for the checkpoint writer: its trainer's pid


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
    # In the checkpoint writer the trainer is the parent; either way it dies, and the writer with it.
    trainer = os.getppid() if os.environ.get(WRITER_ENV) == str(os.getppid()) else os.getpid()
    if scope != "trainer":
        supervisor = os.environ.get("GRPO_RUN_SUPERVISOR_PID")
        if supervisor and int(supervisor) == _parent_of(trainer):
            os.kill(int(supervisor), signal.SIGKILL)
    os.kill(trainer, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _parent_of(pid: int) -> int:
    if pid == os.getpid():
        return os.getppid()
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])      # after "(comm)": state, ppid
