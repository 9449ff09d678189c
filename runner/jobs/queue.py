"""A node that serves a queue: `grpo-run resume --storage URI --all [--wait]`.

`apply --detach` puts each job in a folder of its own under the storage prefix (URI/NAME). A node
serving the queue trains them one after another, so N spot nodes drain a sweep of M jobs without
anyone assigning jobs to nodes:

- Which jobs: every folder under URI that holds a job's record, listed again after each job (a
  job submitted meanwhile is served too), in name order.
- Skipped, by the phase storage's record says: Succeeded (done), Failed (it would fail again: a
  person looks, then `grpo-run resume NAME` tries it again), BudgetExceeded (its maxCostUSD is
  spent: it continues only when its file is applied with a larger one). Pending, Preempted and a
  job left running by a node that died are served; one whose last 5 attempts each lost their node
  before completing a step (it takes nodes down: memory, a hang) is failed by the supervisor
  with that reason instead of run again (LOST_WITHOUT_PROGRESS), so the jobs behind it run.
- Not here: a job with an LLM judge on a node without GRPO_RUN_ALLOW_JUDGES=1 (runner.spec.judge):
  said once, left Pending for a node that allows judges, not counted as failed.
- Who trains a job: its lease (checkpoint.storage.lease), as for one job. A job whose lease is
  fresh is skipped, not waited for; two nodes that pick the same job at once are settled by the
  supervisor's own acquire (the loser is told "held" and goes on).
- Before ending, a node makes sure that each job it skipped as held has a live holder: it has
  seen the lease renewed (a holder renews every ttl/3, 20 s) or released. A lease that nobody
  renews runs out after its ttl (60 s), and its job is then taken over here. Without that, the
  replacement of a node that died (a Kubernetes Job's next pod, a SkyPilot relaunch) could find
  the dead node's lease still fresh, skip the job and end with the sweep unfinished.
- A job that does not succeed is reported and the node goes on with the next. This process does
  not run a job again once it has run it to an end: its phase says how it ended, and one that
  failed before its record could say so (storage refused its files, the disk filled) would
  otherwise be retried in a loop. A job deleted and submitted again under the same name is a new
  job (its record's creation time is new) and is served.
- A notice stops the node: the supervisor's (the job it trains is checkpointed, exit 3), or
  SIGTERM/SIGINT between jobs; no job is started after it.

Exit status (without --wait, which ends only on a notice or a storage error): EXIT_OK when every
job this node started succeeded (also when there was nothing to do), EXIT_FAILED when at least
one did not (failed, stopped at its budget) or could not be read from storage, or storage refused
this node; EXIT_PREEMPTED on a notice. A job cancelled while it ran here (grpo-run cancel) counts as
neither: its owner stopped it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from grpo_run.checkpoint.storage.by_url import open_store
from grpo_run.checkpoint.storage.lease import describe_holder, read_lease
from grpo_run.checkpoint.storage.store import ObjectStore, StorageConfigError, StorageUnavailable
from grpo_run.runner.text import error, printable
from grpo_run.runner.exits import EXIT_BUDGET, EXIT_CANCELLED, EXIT_FAILED, EXIT_HELD, EXIT_OK, EXIT_PREEMPTED
from grpo_run.runner.home import job_store_url
from grpo_run.runner.notices.monitor import install_signal_handlers, wait_awake
from grpo_run.state.phases import Phase

# The phases a queue leaves alone, and what the node says about each (once per job).
SKIPPED = {
    Phase.SUCCEEDED: "done",
    Phase.FAILED: ("it failed (why: grpo-run get tj {name} --storage {storage}); a fault in the job's own files (a "
                   "reward, its tasks) is fixed by applying the fixed job file again (`grpo-run apply -f JOB "
                   "--detach`, which replaces its stored files); a cause outside it (the node, storage), by "
                   "`grpo-run resume {name} --storage {storage}` once it is mended"),
    Phase.BUDGET_EXCEEDED: "its maxCostUSD is spent; apply its file with a larger one to continue it",
    Phase.CANCELLED: "it was cancelled (grpo-run cancel); `grpo-run delete {name} --yes` frees its name",
}
HOW_IT_ENDED = {EXIT_FAILED: "failed", EXIT_BUDGET: "stopped at its maxCostUSD"}

# (job, its checked store) -> the exit status of one supervised run of it (runner.cli's resume)
RunJob = Callable[[Any, ObjectStore], int]


@dataclass
class _Held:
    """A job another node held when this node looked: its lease as first seen, and whether this
    node has seen that lease change since (renewed or taken: someone alive writes it)."""
    first: dict
    alive: bool = False


@dataclass
class Tally:
    """What this node did with the queue, for the closing line."""
    succeeded: list[str] = field(default_factory=list)
    unsuccessful: dict[str, str] = field(default_factory=dict)     # name -> how it ended
    not_here: set[str] = field(default_factory=set)                # jobs with LLM judges this node does not allow


class Queue:
    """The queue under one storage prefix, as this node serves it; owns what this process has
    learned of it: the jobs it gave up on, the held jobs it watches, what it has said."""

    def __init__(self, storage: str, *, run: RunJob, stop: threading.Event, wait: bool, poll_s: float,
                 say: Callable[[str], None] = print, warn: Callable[[str], None] = error) -> None:
        self.storage = storage
        self.run = run                  # trains one job (the CLI's resume, with the node's settings)
        self.stop = stop                # the node's notice Event: the supervisor's, and the signals between jobs
        self.wait = wait
        self.poll_s = poll_s
        self.say, self.warn = say, warn
        self.tally = Tally()
        self._ended: set[tuple[str, str]] = set()   # (name, record created) run to an end by this process
        self._held: dict[str, _Held] = {}           # held by another node at the last look
        self._look_again = False                    # a job's holder changed under us: do not end before looking
        self._said: set[tuple[str, str]] = set()

    def serve(self) -> int:
        """Train every unfinished job under the prefix that no other node holds, one after
        another; with `wait`, then wait for more. Returns the exit status (module docstring)."""
        # Between jobs nothing else hears SIGTERM: it must stop the node, not kill it mid-write.
        # The supervisor installs its own while it runs a job and puts these back after.
        restore = install_signal_handlers(self.stop) \
            if threading.current_thread() is threading.main_thread() else (lambda: None)
        try:
            return self._serve()
        finally:
            restore()

    def _serve(self) -> int:
        storage_down = False
        while True:
            self._look_again = False
            try:
                ran = self._pass()
                storage_down = False
            except StorageConfigError as e:          # no job under this prefix can run here
                self.warn(str(e))
                return EXIT_FAILED
            except StorageUnavailable as e:
                if not self.wait:
                    self.warn(str(e))
                    return EXIT_FAILED
                if not storage_down:                 # a node's network may come up late: keep asking
                    self.warn(f"{e}; asking again every {self.poll_s:g} s")
                storage_down, ran = True, False
            if self.stop.is_set():
                return self._end(EXIT_PREEMPTED)
            if ran:
                continue                             # a job ended: new ones may be there, held ones free
            if not self.wait and not storage_down and not self._look_again \
                    and all(h.alive for h in self._held.values()):
                return self._end(EXIT_FAILED if self.tally.unsuccessful else EXIT_OK)
            if self.wait:
                self._once("waiting", "", f"queue {self.storage}: waiting for jobs (`grpo-run apply -f JOB "
                                          f"--detach` with spec.storage {self.storage} submits one)")
            if wait_awake(self.stop, self.poll_s):   # a notice ends the wait at once
                return self._end(EXIT_PREEMPTED)

    def _pass(self) -> bool:
        """Look at every job once, training each one that is this node's to train; True when a
        job was run to an end here (storage has changed: look again at once)."""
        from grpo_run.runner.jobs.find import jobs_in

        ran = False
        held: dict[str, _Held] = {}
        for name in jobs_in(self.storage):
            if self.stop.is_set():
                return ran
            url = job_store_url(self.storage, name)
            looked = _look(open_store(url, stop=self.stop))
            if looked is None:                       # its record went away meanwhile (deleted)
                continue
            phase, created = looked
            if (name, created) in self._ended:
                continue
            if phase in SKIPPED:
                self._once(name, str(phase), f"{name}: {phase}; skipped: "
                           + SKIPPED[phase].format(name=name, storage=self.storage))
                continue
            lease = read_lease(url)
            if lease is not None and lease.get("expired") is False:    # fresh: another node trains it
                held[name] = self._watch(name, lease)
                continue
            if self._train(name, phase):
                self._ended.add((name, created))
                ran = True
            if self.stop.is_set():
                return ran
        self._held = held
        return ran

    def _train(self, name: str, phase: Phase) -> bool:
        """Run the job here; True when it was run to an end (whichever), False when another node
        took it first or it went away."""
        from grpo_run.runner.jobs.find import find_job
        from grpo_run.runner.spec.job import JobError
        from grpo_run.runner.spec.judge import judges_refused

        try:
            found = find_job(name, self.storage, stop=self.stop)
        except (JobError, ValueError) as e:          # a stored spec that no longer parses, a copied record
            self.say(f"queue {self.storage}: {name} ({phase}): starting it on this node")
            self.warn("\n".join(printable(line) for line in str(e).split("\n")))
            self._did_not_succeed(name, "could not be read from storage")
            return True
        if found is None:
            return False
        job, store = found
        refused = judges_refused(job.environment)
        if refused:                                  # not this node's to train: one that allows judges serves it
            self.tally.not_here.add(name)
            self._once(name, "judges", f"{name}: {phase}; skipped: {printable(refused[0])}; a node that allows "
                                       "them serves it")
            return False
        self.say(f"queue {self.storage}: {name} ({phase}): starting it on this node")
        before = _attempts(store)
        code = self.run(job, store)
        if code == EXIT_OK and _attempts(store) == before:   # it ended on another node before this one got its lease
            self.say(f"queue {self.storage}: {name} succeeded on another node meanwhile")
        elif code == EXIT_OK:
            self.tally.succeeded.append(name)
        elif code == EXIT_HELD:                      # another node took it between our look and the lease
            self._look_again = True
            return False
        elif code == EXIT_PREEMPTED:                 # the node is going away: start nothing more
            self.stop.set()
        elif code == EXIT_CANCELLED:                 # its owner stopped it (grpo-run cancel): not a failure here
            self.say(f"queue {self.storage}: {name} was cancelled; going on with the next job")
        else:
            self._did_not_succeed(name, HOW_IT_ENDED.get(code, f"exit status {code}"))
        return True

    def _did_not_succeed(self, name: str, how: str) -> None:
        self.tally.unsuccessful[name] = how
        self.say(f"queue {self.storage}: {name} {how}; going on with the next job")

    def _watch(self, name: str, lease: dict) -> _Held:
        now = {k: v for k, v in lease.items() if k not in ("age_s", "expired")}
        seen = self._held.get(name)
        if seen is None:
            self._once(name, "held", f"{name}: held by {printable(describe_holder(lease))}; skipped "
                                     f"(that node trains it)")
            return _Held(now)
        return _Held(seen.first, alive=seen.alive or now != seen.first)

    def _once(self, name: str, what: str, line: str) -> None:
        if (name, what) not in self._said:
            self._said.add((name, what))
            self.say(line)

    def _end(self, code: int) -> int:
        t = self.tally
        parts = [f"{len(t.succeeded)} succeeded here" + (f" ({', '.join(t.succeeded)})" if t.succeeded else "")]
        if t.unsuccessful:
            parts.append(f"{len(t.unsuccessful)} did not succeed ("
                         + ", ".join(f"{name}: {how}" for name, how in t.unsuccessful.items()) + ")")
        if self._held:
            parts.append(f"held by other nodes: {', '.join(sorted(self._held))}")
        if t.not_here:
            parts.append(f"left for nodes that allow LLM judges: {', '.join(sorted(t.not_here))}")
        if code == EXIT_PREEMPTED:
            self.say(f"queue {self.storage}: stopped by a notice; no other job is started here. "
                     + "; ".join(parts))
        else:
            self.say(f"queue {self.storage}: nothing left for this node: " + "; ".join(parts))
        return code


def _attempts(store: ObjectStore) -> int:
    """How many attempts storage's record holds: a run that adds none trained nothing here."""
    from grpo_run.runner.books.replica import stored_record

    with stored_record(store) as record:
        return len(record.attempts()) if record is not None else 0


def _look(store: ObjectStore) -> tuple[Phase, str] | None:
    """(The job's phase, when its record was created) as storage's record says; None when there
    is no record."""
    from grpo_run.runner.books.replica import stored_record

    with stored_record(store) as record:
        job = record.job() if record is not None else None
    return (job["phase"], job["created"]) if job is not None else None
