"""Fault injection for the kill and notice tests, armed from the processes' entry points only
when `GRPO_RUN_FAULT=[hold:]POINT@STEP[/trainer]` is set: production code has no calls to skip.

    sample@K     between two tokens of step K's sampling (0-based), in the trainer
    backward@K   after step K's backward pass, before the optimizer applies it, in the trainer
    upload@K     after the first file of checkpoint K is in object storage, before its manifest,
                 in the supervisor (which uploads)
    restore@K    after the first file of checkpoint K came down from object storage, before the
                 trainer starts, in the supervisor (which restores)
    baseline@B   once B batches of the baseline evaluation are finished (and reported), in the
    final@B      trainer; likewise the final evaluation

Each hard-kills the node — the supervisor and the trainer, SIGKILL, no handler, no flush (the
trainer and its checkpoint writer die with the supervisor: PR_SET_PDEATHSIG). `POINT@K/trainer`
kills the trainer process alone (a crash the supervisor should restart from); with several
processes every rank's trainer fires, and `POINT@K/rankR` fires in rank R alone and kills only
that rank (a GPU's process lost while its peers wait in a collective).

`hold:POINT@K` kills nothing: the process stops right there until it is asked to stop (the
trainer's stop request, the supervisor's preemption notice), then carries on as it would have.
A test waits for the marker file, sends its notice, and so knows the notice landed in the middle
of that very moment (during sampling, the backward pass, an upload or a restore).

A fault fires once: the marker file named by GRPO_RUN_FAULT_MARKER remembers it (for a hold, it
says the hold was reached).
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any, NamedTuple

from grpo_run.checkpoint.manifest import MANIFEST_NAME, checkpoint_name

FAULT_ENV = "GRPO_RUN_FAULT"
MARKER_ENV = "GRPO_RUN_FAULT_MARKER"
NODE_PID_ENV = "GRPO_RUN_NODE_PID"      # several processes: the supervisor's pid (the ranks' parent is the launcher)
POINTS = ("sample", "backward", "upload", "restore", "baseline", "final")
_TRAINER_POINTS = ("sample", "backward", "baseline", "final")
HOLD_LIMIT_S = 300.0      # a hold nobody releases ends, so a broken test cannot hang CI


class Fault(NamedTuple):
    point: str        # one of POINTS
    step: int
    trainer_only: bool
    hold: bool = False
    rank: int | None = None   # POINT@K/rankR: that rank alone (of several processes)


def wanted() -> Fault | None:
    """The fault GRPO_RUN_FAULT asks for, if any. ValueError for a malformed one."""
    raw = os.environ.get(FAULT_ENV)
    if not raw:
        return None
    hold = raw.startswith("hold:")
    where, _, scope = raw.removeprefix("hold:").partition("/")
    point, _, step = where.partition("@")
    rank = int(scope[4:]) if scope.startswith("rank") and scope[4:].isdigit() else None
    if point not in POINTS or not step.isdigit() or (scope not in ("", "trainer") and rank is None) or (hold and scope):
        raise ValueError(f"{FAULT_ENV}={raw!r}: expected [hold:]POINT@STEP[/trainer|/rankR], POINT one of "
                         f"{', '.join(POINTS)}")
    return Fault(point, int(step), scope == "trainer" or rank is not None, hold, rank)


def arm_trainer(trainer: Any) -> None:
    """Wrap a GRPOTrainer's methods so the wanted `sample`, `backward`, `baseline` or `final`
    fault fires in it."""
    fault = wanted()
    if fault is None or fault.point not in _TRAINER_POINTS:
        return
    if fault.rank is not None and fault.rank != getattr(getattr(trainer, "world", None), "rank", 0):
        return
    current = [-1]
    train_step = trainer.train_step

    def tracked(step: int, *args: Any, **kwargs: Any) -> Any:
        current[0] = step
        return train_step(step, *args, **kwargs)

    trainer.train_step = tracked
    stop = trainer.stop
    if fault.point == "sample":
        trainer.stop = _Tripwire(stop, lambda: current[0] == fault.step, fault)
    elif fault.point in ("baseline", "final"):
        evaluate = trainer.evaluate

        def evaluate_then(tasks: Any, *args: Any, on_batch: Any = None, **kwargs: Any) -> Any:
            kind = "baseline" if current[0] < 0 else "final"    # held-out evaluations pass no on_batch
            if on_batch is None or kind != fault.point:
                return evaluate(tasks, *args, on_batch=on_batch, **kwargs)

            def on_batch_then(i: int, rewards: Any) -> None:
                on_batch(i, rewards)
                if i + 1 >= fault.step:
                    _fire(fault, parent_is_supervisor=True, stop=stop)

            return evaluate(tasks, *args, on_batch=on_batch_then, **kwargs)

        trainer.evaluate = evaluate_then
    else:
        optimizer_step = trainer.optimizer.step

        def step_then(*args: Any, **kwargs: Any) -> Any:
            if current[0] == fault.step:
                _fire(fault, parent_is_supervisor=True, stop=stop)
            return optimizer_step(*args, **kwargs)

        trainer.optimizer.step = step_then


def arm_uploads(store: Any, stop: threading.Event | None = None) -> None:
    """Wrap a Store's put_file (`upload`: after the first file of that checkpoint went up) or
    get_file (`restore`: after the first file of it came down) so the wanted fault fires in the
    supervisor; a hold there waits for `stop` (the preemption notice)."""
    fault = wanted()
    if fault is None or fault.point not in ("upload", "restore"):
        return
    prefix = f"checkpoints/{checkpoint_name(fault.step)}/"
    name = "put_file" if fault.point == "upload" else "get_file"
    transfer = getattr(store, name)

    def transfer_then(*args: Any, **kwargs: Any) -> Any:
        result = transfer(*args, **kwargs)
        key = args[1] if fault.point == "upload" else args[0]
        if key.startswith(prefix) and not key.endswith(MANIFEST_NAME):
            _fire(fault, parent_is_supervisor=False, stop=stop)
        return result

    setattr(store, name, transfer_then)


class _Tripwire:
    """Stands in for the trainer's stop event: the sampler asks it between tokens."""

    def __init__(self, event: Any, armed: Any, fault: Fault) -> None:
        self._event, self._armed, self._fault = event, armed, fault

    def is_set(self) -> bool:
        if self._armed():
            _fire(self._fault, parent_is_supervisor=True, stop=self._event)
        return self._event.is_set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._event, name)


def _fire(fault: Fault, *, parent_is_supervisor: bool, stop: Any = None) -> None:
    marker = os.environ.get(MARKER_ENV)
    if marker:
        if Path(marker).exists():
            return
        Path(marker).write_text(os.environ.get(FAULT_ENV, ""))
    if fault.hold:
        if stop is None:
            raise RuntimeError(f"{FAULT_ENV}: a hold at {fault.point} has no stop request to wait for")
        stop.wait(HOLD_LIMIT_S)       # the notice arrived in the middle of this moment: carry on
        return
    if parent_is_supervisor and not fault.trainer_only:
        os.kill(int(os.environ.get(NODE_PID_ENV) or os.getppid()), signal.SIGKILL)   # the node: the supervisor first
    os.kill(os.getpid(), signal.SIGKILL)
