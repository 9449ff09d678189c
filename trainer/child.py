"""The trainer as the supervisor's child process: `python -m grpo_run.trainer.child WORK/plan.json`.

It runs one Plan (trainer.recipe) and speaks trainer.protocol: events on the pipe the
supervisor names, and how it ended through its exit status (CHILD_*), which the supervisor
reads to decide between done, restart and give up. STOP_SIGNAL (and SIGINT) ask it to stop at
the last completed step; CHECKPOINT_SIGNAL asks for a checkpoint at the next step boundary.

Under accelerate's launcher (trainer.launch: spec.resources.processes > 1) one of these runs per
rank. The launcher cannot hand the events pipe down (torchrun closes inherited descriptors), so
it names it in EVENTS_PATH_ENV, its own descriptor under /proc; rank 0 reports every event
there, the other ranks only their `Failed`.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import sys
from pathlib import Path

from grpo_run.checkpoint.procs import die_with_parent
from grpo_run.checkpoint.writer import WriterDied
from grpo_run.trainer.checkpointing.checkpointer import CheckpointFailed
from grpo_run.trainer.distributed import NODES_SECRET_ENV, Admission, NodesNotAdmitted, World, WireRefused, admit
from grpo_run.trainer.episodes.host import EnvironmentFailed
from grpo_run.trainer.grader.grader import RewardFunctionError, SandboxUnavailable
from grpo_run.trainer.grader.judge import JudgeError, JudgeUnavailable
from grpo_run.trainer.sampling.engines import EngineRefused, EngineUnavailable
from grpo_run.trainer.logs import REPORTED, trainer_logging
from grpo_run.trainer.model.missing import ModelMissing
from grpo_run.trainer.protocol import (CHECKPOINT_SIGNAL, CHILD_CODE_ERROR, CHILD_CRASHED, CHILD_DONE,
                                       CHILD_INFRA_FAILED, CHILD_STOPPED, CONTROL_FD_ENV, CONTROL_GO, CONTROL_PLAN,
                                       LATE_ENV, PREBUILD_ENV, PREBUILT_FD_ENV,
                                       EVENTS_FD_ENV, EVENTS_PATH_ENV, PARENT_ENV, PROGRESS_ENV, STOP_SIGNAL, Events,
                                       Failed, Plan)
from grpo_run.trainer.recipe import Requests, run
from grpo_run.trainer.startup import clock
from grpo_run.trainer.trainer import NonFiniteStep

log = logging.getLogger(__name__)


def child_main(argv: list[str] | None = None) -> int:
    from grpo_run.trainer.model.policy import fix_mmap_threshold

    startup = clock()
    control = Control.from_environment()
    if control is not None:              # started before its plan existed (runner.supervisor.spawn)
        preload()
        prebuild()
    startup.add("trainer imports", startup.origin)     # the interpreter's start and the imports
    if control is not None and not control.plan():
        return CHILD_STOPPED             # given up before its plan: nothing was done, nothing to say
    fix_mmap_threshold()                 # before the model's allocations: see trainer.policy
    argv = sys.argv[1:] if argv is None else argv
    plan_path = Path(argv[0])
    plan = Plan.from_json(plan_path.read_text())
    work = plan_path.parent
    world = World.from_environment()
    progress = os.environ.get(PROGRESS_ENV) == "1"
    trainer_logging(work, world.rank, progress_lines=not progress)     # no bar: the lines say how it goes
    path = os.environ.get(EVENTS_PATH_ENV)
    stream = open(path, "w", buffering=1) if path else os.fdopen(int(os.environ[EVENTS_FD_ENV]), "w", buffering=1)
    events = Events(stream, only=None if world.main else (Failed,))
    requests = Requests()

    def on_stop(signum, frame):  # noqa: ARG001 - Event.set only; the main thread never waits on it
        requests.stop.set()

    def on_checkpoint(signum, frame):  # noqa: ARG001
        requests.checkpoint = True

    signal.signal(STOP_SIGNAL, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    signal.signal(CHECKPOINT_SIGNAL, on_checkpoint)
    admission = None
    try:
        admission = admit_nodes(world, plan)
        plan = shared_plan(plan, world)
        ready = None if control is None else lambda: control.go(plan_path)
        ending = run(plan, work, events, requests, progress=progress, world=world, ready=ready)
        world.barrier()          # several processes: none ends before rank 0 has sealed and said so
        world.close()
    except RewardFunctionError as e:                   # an episodes environment's failure too (EnvironmentFailed)
        what = "environment" if isinstance(e, EnvironmentFailed) else "reward function"
        events.emit(Failed(message=f"{what} failed: {e}", code=True))
        if world.node > 0:                             # rank 0's supervisor is on another node
            world.tell_failure(f"{what} failed on node {world.node}: {e}", admission)
        log.error("%s failed: %s", what, e, extra=REPORTED)
        return CHILD_CODE_ERROR
    except EngineUnavailable as e:                     # the vLLM server: the attempt ends, restarted as a crash
        events.emit(Failed(message=f"infrastructure failure: {e}", code=False))
        log.error("infrastructure failure: %s", e, extra=REPORTED)
        return CHILD_CRASHED
    except JudgeUnavailable as e:                      # past the judge's own retries: reported, never a score
        events.emit(Failed(message=f"infrastructure failure: {e}", code=False))
        log.error("infrastructure failure: %s", e, extra=REPORTED)
        return CHILD_INFRA_FAILED
    except (SandboxUnavailable, NonFiniteStep, JudgeError, ModelMissing, EngineRefused) as e:   # the node's sandbox, the job's
        # numbers, the judge's refusal or budget, a model not there: a restart cannot get the missing layer or model
        # and replays the same step; each ends the job
        events.emit(Failed(message=str(e), code=True))
        log.error("%s", e, extra=REPORTED)
        if world.node > 0:
            world.tell_failure(f"on node {world.node}: {e}", admission)
        return CHILD_CODE_ERROR
    except (NodesNotAdmitted, WireRefused) as e:       # not (only) the job's nodes in the group: as a lost node
        events.emit(Failed(message=f"infrastructure failure: {e}", code=False))
        log.error("%s", e, extra=REPORTED)
        return CHILD_CRASHED
    except (CheckpointFailed, WriterDied) as e:         # its reason is the whole story: no traceback
        events.emit(Failed(message=str(e), code=False, diskFull=getattr(e, "errno", None) == errno.ENOSPC))
        log.error("%s", e)
        return CHILD_CRASHED
    except Exception as e:
        # a peer on another node failed in the job's own code: believed only with this attempt's signature, since
        # anyone who reaches the store's port can write there (unsigned: a lost rank, restarted)
        told = world.failure_told(admission) if world.main and world.nodes > 1 else None
        if told is not None:
            events.emit(Failed(message=told, code=True))
            log.error("%s", told, extra=REPORTED)
            return CHILD_CODE_ERROR
        events.emit(Failed(message=f"{type(e).__name__}: {e}", code=False))
        log.exception("the trainer crashed")
        return CHILD_CRASHED
    return CHILD_DONE if ending.how == "done" else CHILD_STOPPED


class Control:
    """The supervisor's control pipe (trainer.protocol.CONTROL_FD_ENV): when to read the plan, and
    when to go on past the load (the checkpoint fetched beside it)."""

    def __init__(self, fd: int) -> None:
        self.lines = os.fdopen(fd, "r", encoding="utf-8")

    @classmethod
    def from_environment(cls) -> Control | None:
        fd = os.environ.pop(CONTROL_FD_ENV, None)     # not inherited by what this process starts
        return cls(int(fd)) if fd else None

    def plan(self) -> bool:
        """Block until the plan is written, and take the variables that come with it (LATE_ENV
        only); False when the supervisor closed the pipe instead."""
        word, _, rest = self.lines.readline().partition(" ")
        if word.strip() != CONTROL_PLAN:
            return False
        for key, value in json.loads(rest or "{}").items():
            if key in LATE_ENV:
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = str(value)
        return True

    def go(self, plan_path: Path) -> Plan | None:
        """Wait for CONTROL_GO, then the attempt's plan (plan.json rewritten: its budget counts
        from the attempt's start); None when the supervisor gave this process up."""
        with clock().part("waiting for the checkpoint"):
            going = self.lines.readline().strip() == CONTROL_GO
        self.lines.close()
        return Plan.from_json(plan_path.read_text()) if going else None


def preload() -> None:
    """What every trainer imports before its model loads (transformers' auto classes, peft), for a
    process started before its plan: these imports then run while the supervisor still prepares."""
    import peft  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401


def prebuild() -> None:
    """The tiny demo model the supervisor asked this process to build (PREBUILD_ENV) while it
    waits for its plan: built here, where torch and transformers are imported already, the
    supervisor is spared importing them. Said on PREBUILT_FD_ENV: "ok", or "error ..." (the
    supervisor then builds it itself, and says what fails)."""
    asked, fd = os.environ.pop(PREBUILD_ENV, None), os.environ.pop(PREBUILT_FD_ENV, None)
    if not asked or not fd:
        return
    said = "ok"
    try:
        from grpo_run.trainer.model.tinymodel import build_named

        what = json.loads(asked)
        if not (Path(what["path"]) / "config.json").exists():
            with clock().part("model build"):
                build_named(what["name"], Path(what["path"]))
    except Exception as e:               # said to the supervisor, which builds it itself
        said = f"error {type(e).__name__}: {e}"
    try:
        with os.fdopen(int(fd), "w") as out:
            out.write(said.replace("\n", " ") + "\n")
    except OSError:                      # the supervisor no longer listens: it gave this process up
        pass


def admit_nodes(world: World, plan: Plan) -> Admission | None:
    """Several nodes: every rank proves it holds the job's node secret (NODES_SECRET_ENV, from the
    node's launcher, never from the job file or storage) before rank 0 sends the plan or a
    checkpoint (trainer.distributed.admit). Raises NodesNotAdmitted. The secret leaves this
    process's environment here, so nothing it starts inherits it."""
    secret = os.environ.pop(NODES_SECRET_ENV, None)
    if world.nodes <= 1:
        return None
    return admit(world, plan.name, secret)


def shared_plan(plan: Plan, world: World) -> Plan:
    """Several nodes: rank 0's plan on every rank, less what each node resolves for itself (the
    model's folder, the environment's files). Only rank 0's supervisor holds the job's record, so
    what the record decides (the cached baseline, the evaluation batches done, the budget, the
    engine and micro-batch size the run chose, the run's id) comes from its plan."""
    if world.nodes <= 1:
        return plan
    own = {"model": plan.model, "env": plan.env, "model_name": plan.model_name}
    theirs = world.broadcast(plan.model_dump(mode="json", exclude=set(own)) if world.main else None)
    return Plan.model_validate({**theirs, **own})


if __name__ == "__main__":
    die_with_parent()
    if os.environ.get(PARENT_ENV) and os.getppid() != int(os.environ[PARENT_ENV]):
        sys.exit(CHILD_CRASHED)          # the supervisor died before the line above
    sys.exit(child_main())
