"""Fault injection for the kill tests: `GRPO_RUN_FAULT=POINT@STEP` hard-kills this process
(SIGKILL: no handler, no flush, no goodbye) when it reaches POINT while working on STEP.

Points: `sample` (mid-generation of step STEP, 0-based), `backward` (after the backward pass of
step STEP, before the optimizer applies it), `upload` (after some files of checkpoint STEP are
in object storage, before its manifest). Unset in normal runs: one dictionary lookup.
"""

from __future__ import annotations

import os
import signal


def fault_point(point: str, step: int) -> None:
    wanted = os.environ.get("GRPO_RUN_FAULT")
    if wanted and wanted == f"{point}@{step}":
        os.kill(os.getpid(), signal.SIGKILL)
