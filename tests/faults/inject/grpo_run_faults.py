"""Fault points for the kill and notice tests, armed from outside grpo_run.

A test sets `GRPO_RUN_FAULT=[hold:]POINT@STEP[/trainer|/rankR]` and puts this folder on the
node's PYTHONPATH (tests/faults/harness.py `fault_env`). Every Python process of that node then
imports `sitecustomize` from here at start-up, which calls `install()`: an import hook that
patches the class or function a point lives in right after its module has loaded. grpo_run has
no hook, call, or setting for any of this. The points, and what is patched for each:

    sample@K     between two tokens of step K's sampling (0-based), in the trainer: a built
                 GRPOTrainer's stop request, which the rollout asks between tokens
    backward@K   after step K's backward pass, before the optimizer applies it, in the trainer:
                 a built GRPOTrainer's `optimizer.step`
    upload@K     after the first file of checkpoint K (or of the first one uploaded after it: the
                 uploader skips a checkpoint a newer one supersedes while it waits, which a
                 loaded machine does) is in object storage, before its manifest, in the
                 supervisor (which uploads): FencedStore.put_file (every upload of the
                 supervisor's goes through the job's fenced store)
    restore@K    after the first file of checkpoint K came down from object storage, before the
                 trainer starts, in the supervisor (which restores): FencedStore.get_file
    load@0       as the trainer starts to build its GRPOTrainer (the model's load, the grader's and the
                 engine's start), in the trainer: GRPOTrainer.__init__. A hold here asks no stop
                 request, as a model's load does not: it lasts until the trainer is killed
    baseline@B   once B batches of the baseline evaluation are finished (and reported), in the
    final@B      trainer; likewise the final evaluation: the `on_batch` that GRPOTrainer.evaluate
                 gets while trainer.recipe.evaluate runs an evaluation of that kind
    exit@0       once the trainer has reported its final weights (trainer.recipe.run ended "done"),
                 before its process exits, in the trainer. A hold here is the interpreter's shut
                 down: STOP_SIGNAL has its default action again (as during finalization), for up
                 to EXIT_HOLD_S, then the process exits as it would have

Each hard-kills the node — the supervisor and the trainer, SIGKILL, no handler, no flush (the
trainer and its checkpoint writer die with the supervisor: PR_SET_PDEATHSIG). The supervisor is
found from the process tree: the trainer's parent, or with several processes the parent of the
launcher that started the ranks. `POINT@K/trainer` kills the trainer process alone (a crash the
supervisor should restart from); with several processes every rank's trainer fires, and
`POINT@K/rankR` fires in rank R alone and kills only that rank (a GPU's process lost while its
peers wait in a collective).

`hold:POINT@K` kills nothing: the process stops right there until it is asked to stop (the
trainer's stop request, `Requests.stop`; the supervisor's preemption notice, `Supervisor.preempt`),
then carries on as it would have. A test waits for the marker file, sends its notice, and so
knows the notice landed in the middle of that very moment (during sampling, the backward pass,
an upload or a restore).

A fault fires once: the marker file named by GRPO_RUN_FAULT_MARKER remembers it (for a hold, it
says the hold was reached).

sitecustomize leaves the grader's worker alone (sandboxed, stdlib only): no point fires there.
Everything here is stdlib until a point fires (psutil then, to find the supervisor).
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import time
from typing import Any, Callable, NamedTuple

FAULT_ENV = "GRPO_RUN_FAULT"
MARKER_ENV = "GRPO_RUN_FAULT_MARKER"
POINTS = ("sample", "backward", "upload", "restore", "baseline", "final", "load", "exit")
HOLD_LIMIT_S = 300.0      # a hold nobody releases ends, so a broken test cannot hang CI
EXIT_HOLD_S = 8.0         # exit@0's hold: the shut down a notice can land in

TRAINER = "grpo_run.trainer.trainer"                    # GRPOTrainer
RECIPE = "grpo_run.trainer.recipe"                      # evaluate(trainer, plan, kind, events)
FENCED = "grpo_run.checkpoint.storage.fenced"           # FencedStore
SUPERVISOR = "grpo_run.runner.supervisor"               # Supervisor, in whichever module of the package
TRAINER_PROCESSES = "grpo_run.trainer."                 # `python -m` of the trainer, its launcher


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


def install() -> None:
    """Arm the point GRPO_RUN_FAULT asks for in this process (sitecustomize calls this). A
    malformed one ends the process at once: site would print a warning and run on without it."""
    try:
        fault = wanted()
    except ValueError as e:
        sys.stderr.write(f"tests/faults/inject: {e}\n")
        os._exit(2)
    if fault is None:
        return
    sys.meta_path.insert(0, _PatchOnLoad(functools.partial(_patch_for, fault)))


# --- when the modules load ----------------------------------------------------------------------

class _PatchOnLoad:
    """A meta-path finder that finds nothing itself: a module `watch(name)` returns a patch for
    is found by the finders after this one, and patched as soon as it has run."""

    def __init__(self, watch: Callable[[str], Callable[[Any], None] | None]) -> None:
        self._watch = watch

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        patch = self._watch(name)
        if patch is None:
            return None
        for finder in sys.meta_path[sys.meta_path.index(self) + 1:]:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is not None and hasattr(loader, "exec_module"):
            run = loader.exec_module

            def exec_module(module: Any) -> None:
                run(module)
                patch(module)

            loader.exec_module = exec_module
        return spec


def _patch_for(fault: Fault, name: str) -> Callable[[Any], None] | None:
    if fault.point == "load":
        return (lambda m: _arm_load(m.GRPOTrainer, fault)) if name == TRAINER else None
    if fault.point in ("sample", "backward"):
        return (lambda m: _arm_steps(m.GRPOTrainer, fault)) if name == TRAINER else None
    if fault.point == "exit":
        return (lambda m: _arm_exit(m, fault)) if name == RECIPE else None
    if fault.point in ("baseline", "final"):
        if name == TRAINER:
            return lambda m: _arm_evaluation(m.GRPOTrainer, fault)
        return _follow_evaluations if name == RECIPE else None
    if name == FENCED:
        return lambda m: _arm_transfers(m.FencedStore, fault)
    return _remember_supervisor if name == SUPERVISOR or name.startswith(SUPERVISOR + ".") else None


# --- in the trainer -----------------------------------------------------------------------------

def _arm_steps(cls: type, fault: Fault) -> None:
    """`sample` or `backward`: each GRPOTrainer, once built (before the recipe uses it), has its
    train_step followed and its stop request (sample) or optimizer step (backward) wrapped."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if _this_rank(self, fault):
            _arm_trainer(self, fault)

    cls.__init__ = __init__


def _arm_load(cls: type, fault: Fault) -> None:
    """`load`: GRPOTrainer.__init__ fires before it builds anything; a hold waits on an event no
    one sets (a model's load does not listen for a stop), so only a kill ends it early."""
    import threading

    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        _fire(fault, node=True, stop=threading.Event())
        init(self, *args, **kwargs)

    cls.__init__ = __init__


def _arm_trainer(trainer: Any, fault: Fault) -> None:
    current = [-1]
    train_step = trainer.train_step

    def tracked(step: int, *args: Any, **kwargs: Any) -> Any:
        current[0] = step
        return train_step(step, *args, **kwargs)

    trainer.train_step = tracked
    stop = trainer.stop
    if fault.point == "sample":         # the rollout asks the stop between tokens (trainer.rollout)
        trainer.stop = trainer.rollout.stop = _Tripwire(stop, lambda: current[0] == fault.step, fault)
        return
    optimizer_step = trainer.optimizer.step

    def step_then(*args: Any, **kwargs: Any) -> Any:
        if current[0] == fault.step:
            _fire(fault, node=True, stop=stop)
        return optimizer_step(*args, **kwargs)

    trainer.optimizer.step = step_then


class _Tripwire:
    """Stands in for the trainer's stop event: the rollout asks it between tokens."""

    def __init__(self, event: Any, armed: Callable[[], bool], fault: Fault) -> None:
        self._event, self._armed, self._fault = event, armed, fault

    def is_set(self) -> bool:
        if self._armed():
            _fire(self._fault, node=True, stop=self._event)
        return self._event.is_set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._event, name)


def _arm_exit(recipe: Any, fault: Fault) -> None:
    """`exit`: trainer.recipe.run (the trainer's child imports it after this patch) fires once it
    returns "done". A hold gives STOP_SIGNAL back its default action and sleeps EXIT_HOLD_S: a
    stop request there kills the process, as it does an interpreter shutting down."""
    run = recipe.run

    @functools.wraps(run)
    def run_then(*args: Any, **kwargs: Any) -> Any:
        ending = run(*args, **kwargs)
        if ending.how == "done":
            if fault.hold:
                from grpo_run.trainer.protocol import STOP_SIGNAL

                signal.signal(STOP_SIGNAL, signal.SIG_DFL)
                _fire(fault, node=True, stop=_Sleep(EXIT_HOLD_S))
            else:
                _fire(fault, node=True)
        return ending

    recipe.run = run_then


class _Sleep:
    """A stop request nobody sets: a hold that lasts `seconds`."""

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds

    def wait(self, timeout: float | None = None) -> bool:
        time.sleep(self._seconds if timeout is None else min(self._seconds, timeout))
        return False


_evaluating: list[str | None] = [None]      # the kind of the recipe's evaluation under way, if any


def _follow_evaluations(recipe: Any) -> None:
    """trainer.recipe.evaluate(trainer, plan, kind, events) says which evaluation runs (baseline
    or final; the held-out ones while training go straight to GRPOTrainer.evaluate)."""
    import inspect

    evaluate = recipe.evaluate
    signature = inspect.signature(evaluate)

    @functools.wraps(evaluate)
    def evaluate_kind(*args: Any, **kwargs: Any) -> Any:
        _evaluating[0] = signature.bind(*args, **kwargs).arguments["kind"]
        try:
            return evaluate(*args, **kwargs)
        finally:
            _evaluating[0] = None

    recipe.evaluate = evaluate_kind


def _arm_evaluation(cls: type, fault: Fault) -> None:
    """`baseline` or `final`: GRPOTrainer.evaluate, during the recipe's evaluation of that kind,
    fires once batch B-1 is reported (batches are numbered from 0)."""
    evaluate = cls.evaluate

    @functools.wraps(evaluate)
    def evaluate_then(self: Any, tasks: Any, *args: Any, on_batch: Any = None, **kwargs: Any) -> Any:
        if on_batch is None or _evaluating[0] != fault.point or not _this_rank(self, fault):
            return evaluate(self, tasks, *args, on_batch=on_batch, **kwargs)
        stop = self.stop

        def on_batch_then(i: int, rewards: Any) -> None:
            on_batch(i, rewards)
            if i + 1 >= fault.step:
                _fire(fault, node=True, stop=stop)

        return evaluate(self, tasks, *args, on_batch=on_batch_then, **kwargs)

    cls.evaluate = evaluate_then


def _this_rank(trainer: Any, fault: Fault) -> bool:
    return fault.rank is None or fault.rank == getattr(getattr(trainer, "world", None), "rank", 0)


# --- in the supervisor --------------------------------------------------------------------------

_supervisor: list[Any] = [None]             # the process's Supervisor: a hold waits for its notice


def _remember_supervisor(module: Any) -> None:
    cls = vars(module).get("Supervisor")
    if not isinstance(cls, type) or cls.__module__ != module.__name__:
        return                                # not defined here (a re-export, another module)
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _supervisor[0] = self

    cls.__init__ = __init__


def _arm_transfers(cls: type, fault: Fault) -> None:
    """`upload`: FencedStore.put_file, after the first file of checkpoint K went up; `restore`:
    its get_file (a read it passes through to the wrapped store), after the first file of it
    came down. A hold waits for the supervisor's preemption notice."""
    upload = fault.point == "upload"
    name = "put_file" if upload else "get_file"
    own = vars(cls).get(name)

    def transfer_then(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = own(self, *args, **kwargs) if own is not None else getattr(self.store, name)(*args, **kwargs)
        key = kwargs["key"] if "key" in kwargs else args[1 if upload else 0]
        if _of_checkpoint(key, fault.step, or_later=upload):
            supervisor = _supervisor[0]
            _fire(fault, node=False, stop=getattr(supervisor, "preempt", None))
        return result

    setattr(cls, name, functools.wraps(own)(transfer_then) if own is not None else transfer_then)


def _of_checkpoint(key: str, step: int, *, or_later: bool = False) -> bool:
    """A file of checkpoint `step` (`or_later`: of any checkpoint from `step` on) other than its
    manifest (written last)."""
    from grpo_run.checkpoint.manifest import MANIFEST_NAME, checkpoint_name

    # checkpoints/<run id>/ckpt-N/... (checkpoints/ckpt-N/... before run prefixes)
    parts = key.split("/")
    if parts[0] != "checkpoints" or key.endswith(MANIFEST_NAME):
        return False
    if not or_later:
        return checkpoint_name(step) in parts[1:3]
    return any(part.startswith("ckpt-") and part[5:].isdigit() and int(part[5:]) >= step for part in parts[1:3])


# --- firing -------------------------------------------------------------------------------------

def _fire(fault: Fault, *, node: bool, stop: Any = None) -> None:
    """Hold until `stop` is set, or kill: this process, and first the node's supervisor when
    `node` (a trainer's point) unless the fault is the trainer's alone."""
    marker = os.environ.get(MARKER_ENV)
    if marker:
        if os.path.exists(marker):
            return
        with open(marker, "w") as f:
            f.write(os.environ.get(FAULT_ENV, ""))
    if fault.hold:
        if stop is None:
            raise RuntimeError(f"{FAULT_ENV}: a hold at {fault.point} has no stop request to wait for")
        stop.wait(HOLD_LIMIT_S)       # the notice arrived in the middle of this moment: carry on
        return
    if node and not fault.trainer_only:
        os.kill(_supervisor_pid(), signal.SIGKILL)      # the node: the supervisor first
    os.kill(os.getpid(), signal.SIGKILL)


def _supervisor_pid() -> int:
    """From a trainer: the nearest ancestor that is not a trainer process (`python -m
    grpo_run.trainer.child`, or `python -m grpo_run.trainer.launch` above several ranks)."""
    import psutil

    proc = psutil.Process().parent()
    while proc is not None and any(arg.startswith(TRAINER_PROCESSES) for arg in proc.cmdline()):
        proc = proc.parent()
    return proc.pid if proc is not None else os.getppid()
