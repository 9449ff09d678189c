"""Fault injection for the kill tests, armed from the processes' entry points only when
`GRPO_RUN_FAULT=POINT@STEP` is set: production code has no calls to skip.

    sample@K     between two tokens of step K's sampling (0-based), in the trainer
    backward@K   after step K's backward pass, before the optimizer applies it, in the trainer
    upload@K     after the first file of checkpoint K is in object storage, before its manifest,
                 in the supervisor (which uploads)

Each hard-kills the node — the supervisor and the trainer, SIGKILL, no handler, no flush (the
trainer and its checkpoint writer die with the supervisor: PR_SET_PDEATHSIG). `POINT@K/trainer`
kills the trainer process alone (a crash the supervisor should restart from). A fault fires
once: a marker file named by GRPO_RUN_FAULT_MARKER remembers it.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any, NamedTuple

from checkpoint.manifest import MANIFEST_NAME, checkpoint_name

FAULT_ENV = "GRPO_RUN_FAULT"
MARKER_ENV = "GRPO_RUN_FAULT_MARKER"


class Fault(NamedTuple):
    point: str        # sample | backward | upload
    step: int
    trainer_only: bool


def wanted() -> Fault | None:
    """The fault GRPO_RUN_FAULT asks for, if any. ValueError for a malformed one."""
    raw = os.environ.get(FAULT_ENV)
    if not raw:
        return None
    where, _, scope = raw.partition("/")
    point, _, step = where.partition("@")
    if point not in ("sample", "backward", "upload") or not step.isdigit() or scope not in ("", "trainer"):
        raise ValueError(f"{FAULT_ENV}={raw!r}: expected POINT@STEP[/trainer], POINT one of sample, backward, upload")
    return Fault(point, int(step), scope == "trainer")


def arm_trainer(trainer: Any) -> None:
    """Wrap a GRPOTrainer's methods so the wanted `sample` or `backward` fault fires in it."""
    fault = wanted()
    if fault is None or fault.point not in ("sample", "backward"):
        return
    current = [-1]
    train_step = trainer.train_step

    def tracked(step: int, *args: Any, **kwargs: Any) -> Any:
        current[0] = step
        return train_step(step, *args, **kwargs)

    trainer.train_step = tracked
    if fault.point == "sample":
        trainer.stop = _Tripwire(trainer.stop, lambda: current[0] == fault.step, fault)
    else:
        optimizer_step = trainer.optimizer.step

        def step_then(*args: Any, **kwargs: Any) -> Any:
            if current[0] == fault.step:
                _fire(fault, parent_is_supervisor=True)
            return optimizer_step(*args, **kwargs)

        trainer.optimizer.step = step_then


def arm_uploads(store: Any) -> None:
    """Wrap a Store's put_file so the wanted `upload` fault fires after the first file of that
    checkpoint went up (in the supervisor: the node dies with it)."""
    fault = wanted()
    if fault is None or fault.point != "upload":
        return
    put_file = store.put_file
    prefix = f"checkpoints/{checkpoint_name(fault.step)}/"

    def put_then(local: Any, key: str, *args: Any, **kwargs: Any) -> Any:
        result = put_file(local, key, *args, **kwargs)
        if key.startswith(prefix) and not key.endswith(MANIFEST_NAME):
            _fire(fault, parent_is_supervisor=False)
        return result

    store.put_file = put_then


class _Tripwire:
    """Stands in for the trainer's stop event: the sampler asks it between tokens."""

    def __init__(self, event: Any, armed: Any, fault: Fault) -> None:
        self._event, self._armed, self._fault = event, armed, fault

    def is_set(self) -> bool:
        if self._armed():
            _fire(self._fault, parent_is_supervisor=True)
        return self._event.is_set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._event, name)


def _fire(fault: Fault, *, parent_is_supervisor: bool) -> None:
    marker = os.environ.get(MARKER_ENV)
    if marker:
        if Path(marker).exists():
            return
        Path(marker).write_text(os.environ.get(FAULT_ENV, ""))
    if parent_is_supervisor and not fault.trainer_only:
        os.kill(os.getppid(), signal.SIGKILL)         # the node: the supervisor first
    os.kill(os.getpid(), signal.SIGKILL)
