"""The trainer as the supervisor's child process: `python -m trainer.child WORK/plan.json`.

It runs one Plan (trainer.run) and reports what happens as events on the file descriptor named
by GRPO_RUN_EVENTS_FD, and how it ended through its exit status, which runner.supervisor reads
to decide between done, restart and give up. SIGTERM/SIGINT ask it to stop at the last
completed step; SIGUSR1 asks for a checkpoint at the next step boundary.

Under accelerate's launcher (trainer.launch: spec.resources.processes > 1) one of these runs per
rank. The launcher cannot hand the events pipe down (torchrun closes inherited descriptors), so
it names it in GRPO_RUN_EVENTS_PATH, its own descriptor under /proc; rank 0 reports every event
there, the other ranks only their `failed`.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import sys
from pathlib import Path

from grpo_run.checkpoint.procs import die_with_parent
from grpo_run.checkpoint.writer import WriterDied
from grpo_run.trainer.checkpointing.checkpointer import CheckpointFailed
from grpo_run.trainer.distributed import World
from grpo_run.trainer.grader.grader import RewardFunctionError
from grpo_run.trainer.logs import trainer_logging
from grpo_run.trainer.recipe import Events, Plan, Requests, run

log = logging.getLogger(__name__)

EVENTS_FD_ENV = "GRPO_RUN_EVENTS_FD"
EVENTS_PATH_ENV = "GRPO_RUN_EVENTS_PATH"   # the pipe by path (under accelerate's launcher)
PARENT_ENV = "GRPO_RUN_PARENT_PID"      # the supervisor's pid: the trainer dies with it
PLAN_FILE = "plan.json"

# Exit statuses, read by runner.supervisor (the trainer's own protocol, not the CLI's):
CHILD_DONE = 0             # every phase the plan asked for is done; the final weights are sealed
CHILD_CRASHED = 1          # an unexpected exception: the supervisor restarts it (crash limit)
CHILD_STOPPED = 3          # stopped on request or at the plan's deadline, the last completed step sealed
CHILD_CODE_ERROR = 10      # the user's code (reward function) failed on every try: restarting cannot help


def child_main(argv: list[str] | None = None) -> int:
    from grpo_run.trainer.model.policy import fix_mmap_threshold

    fix_mmap_threshold()                 # before the model's allocations: see trainer.policy
    argv = sys.argv[1:] if argv is None else argv
    plan_path = Path(argv[0])
    plan = Plan.from_json(plan_path.read_text())
    work = plan_path.parent
    world = World.from_environment()
    trainer_logging(work, world.rank)
    path = os.environ.get(EVENTS_PATH_ENV)
    stream = open(path, "w", buffering=1) if path else os.fdopen(int(os.environ[EVENTS_FD_ENV]), "w", buffering=1)
    events = Events(stream, only=None if world.main else ("failed",))
    requests = Requests()

    def on_stop(signum, frame):  # noqa: ARG001 - Event.set only; the main thread never waits on it
        requests.stop.set()

    def on_checkpoint(signum, frame):  # noqa: ARG001
        requests.checkpoint = True

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    signal.signal(signal.SIGUSR1, on_checkpoint)
    progress = os.environ.get("GRPO_RUN_PROGRESS") == "1"
    try:
        ending = run(plan, work, events, requests, progress=progress, world=world)
        world.barrier()          # several processes: none ends before rank 0 has sealed and said so
        world.close()
    except RewardFunctionError as e:
        events.emit("failed", message=f"reward function failed: {e}", code=True)
        log.error("reward function failed: %s", e)
        return CHILD_CODE_ERROR
    except (CheckpointFailed, WriterDied) as e:         # its reason is the whole story: no traceback
        events.emit("failed", message=str(e), code=False, diskFull=getattr(e, "errno", None) == errno.ENOSPC)
        log.error("%s", e)
        return CHILD_CRASHED
    except Exception as e:
        events.emit("failed", message=f"{type(e).__name__}: {e}", code=False)
        log.exception("the trainer crashed")
        return CHILD_CRASHED
    return CHILD_DONE if ending.how == "done" else CHILD_STOPPED


if __name__ == "__main__":
    die_with_parent()
    if os.environ.get(PARENT_ENV) and os.getppid() != int(os.environ[PARENT_ENV]):
        sys.exit(CHILD_CRASHED)          # the supervisor died before the line above
    sys.exit(child_main())
