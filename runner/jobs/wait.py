"""`resume NAME --wait`: a node that boots before its job exists, or while another node holds it.

The node asks storage for the job every WAIT_POLL_S, and tries the lease again every HELD_POLL_S
while a live node holds it, for at most `limit_s` in all: a node booted for a job that is never
submitted (a launch file whose submit failed) or that a live node keeps idles on a paid GPU, so it
gives up and exits (2 never submitted, 5 still held, 1 storage never answered) and its pod, task
or unit ends. Without --wait the first look decides.

Nothing here prints: what the node waits for is said once through `tell`, every ending is raised
as Refused in the words the CLI prints (runner/exits.py).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from grpo_run.checkpoint.storage.retry import StorageConfigError, StorageUnavailable
from grpo_run.runner.exits import EXIT_FAILED, EXIT_HELD, EXIT_USAGE, Refused
from grpo_run.runner.jobs.find import find_job
from grpo_run.runner.text import printable

__all__ = ["HELD_POLL_S", "WAIT_LIMIT_ENV", "WAIT_LIMIT_S", "WAIT_POLL_ENV", "WAIT_POLL_S", "poll_s",
           "resume_when_ready", "wait_limit"]

WAIT_POLL_S = 15.0      # how often storage is asked for the job
HELD_POLL_S = 60.0      # how often the lease is tried again while another node holds it (its expiry)
WAIT_POLL_ENV = "GRPO_RUN_WAIT_POLL_S"   # the node's own setting for both (docs/deploy.md)
# ... and for how long, in all, before the node gives up: 30 min is well past a lost node's lease
# (60 s) and the boot-time submit (seconds), short against a day of idle GPU.
WAIT_LIMIT_S = 1800.0
WAIT_LIMIT_ENV = "GRPO_RUN_WAIT_LIMIT_S"


def poll_s(default: float) -> float:
    """How long a waiting node waits between looks: WAIT_POLL_ENV, else `default`."""
    return float(os.environ.get(WAIT_POLL_ENV, default))


def wait_limit(given: float | None) -> float:
    """--wait-limit, else WAIT_LIMIT_ENV, else WAIT_LIMIT_S; 0 waits forever."""
    if given is not None:
        return given
    try:
        return float(os.environ.get(WAIT_LIMIT_ENV, WAIT_LIMIT_S))
    except ValueError:
        raise Refused(f"{WAIT_LIMIT_ENV}={os.environ.get(WAIT_LIMIT_ENV)!r}: expected seconds "
                      f"(a number; 0 waits forever)", EXIT_USAGE) from None


def resume_when_ready(name: str | None, storage: str, *, wait: bool, limit_s: float, stop: threading.Event,
                      run: Callable[..., int], tell: Callable[[str], None]) -> int:
    """Find job `name` in `storage` and `run(job, store)` it; with `wait`, until it is submitted and
    no other node holds it, for at most `limit_s` (0: forever). Returns run's exit status."""
    from grpo_run.runner.spec.job import JobError

    give_up = time.monotonic() + limit_s if limit_s > 0 else float("inf")
    told = False
    while True:
        missing = f"no job {name!r} in {storage}" if name else f"no jobs in {storage}"
        down = False
        try:
            found = find_job(name, storage, stop=stop)     # read again after each wait: the holder may change it
        except StorageConfigError as e:
            raise Refused(str(e), EXIT_FAILED) from None
        except StorageUnavailable as e:
            if not wait:
                raise Refused(str(e), EXIT_FAILED) from None
            found, missing, down = None, str(e), True     # a node's network may come up late
        except (JobError, ValueError) as e:                # several jobs; a spec that no longer parses
            raise Refused("\n".join(printable(line) for line in str(e).split("\n")), EXIT_USAGE,
                          prefixed=False) from None       # from storage
        if found is not None:
            job, store = found
            code = run(job, store)
            if not (wait and code == EXIT_HELD):   # --wait: a node that still holds the job is waited for too
                return code
            if time.monotonic() >= give_up:
                raise Refused(f"{job.name}: another node still holds it after {limit_s:g} s of waiting "
                              f"(--wait-limit); this node stops: `grpo-run get tj {job.name} --storage {storage}` "
                              f"shows who runs it", EXIT_HELD)
            _pause(HELD_POLL_S, give_up)
            continue
        if not wait:
            raise Refused(f"{missing}; submit it first (grpo-run apply -f JOB --detach, with spec.storage "
                          f"{storage}), or wait for it with --wait", EXIT_USAGE)
        if time.monotonic() >= give_up:
            if down:
                raise Refused(f"{missing}: still after {limit_s:g} s of waiting (--wait-limit); this node stops "
                              f"rather than idle", EXIT_FAILED)
            raise Refused(f"{missing} after {limit_s:g} s of waiting (--wait-limit); this node stops rather than "
                          f"idle: submit it (grpo-run apply -f JOB --detach, with spec.storage {storage}), then "
                          f"start a node", EXIT_USAGE)
        if not told:
            until = f" (at most {limit_s:g} s, --wait-limit)" if limit_s > 0 else ""
            tell(f"waiting: {missing}; `grpo-run apply -f JOB --detach` submits it{until}")
            told = True
        _pause(WAIT_POLL_S, give_up)


def _pause(default_s: float, give_up: float) -> None:
    time.sleep(min(poll_s(default_s), max(0.0, give_up - time.monotonic())))
