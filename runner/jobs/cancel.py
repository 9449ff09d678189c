"""Ending a job for good: `grpo-run cancel` and `grpo-run delete` (docs/lifecycle.md).

Cancel is a request, not a kill. `cancel` writes a small object, `cancel.json`, into the job's
storage folder (for a job without spec.storage, this machine's default store, where a local
foreground run keeps its folder too). Then:

* no node holds the job's lease (submitted and waiting, or stopped and resumable): `cancel` takes
  the lease itself and moves the record to Cancelled; no `resume` starts it again;
* a node holds it: that node's supervisor finds the request the next time it talks to storage
  anyway (a record upload, a lease renewal: no poll loop of its own), stops the trainer at the
  last completed step as a spot notice does, makes that checkpoint durable, records Cancelled and
  exits EXIT_CANCELLED. A supervisor that takes the lease later finds the request before it
  starts anything.

Anyone who can write the job's storage can cancel it; they could delete it as well, so the
request gives a bucket writer nothing new (docs/security.md's threat model).

Delete removes the job's storage folder (everything under it, the checkpoints of every run under
that name included) and this machine's work folder and pointers for it. While a node holds the
lease it is refused (that node would go on writing into the emptied folder); `--force` skips the
lease, for a node known to be gone."""

from __future__ import annotations

import shutil
import socket
import tempfile
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from grpo_run.checkpoint.storage.by_url import open_store
from grpo_run.checkpoint.storage.lease import LEASE_KEY, LeaseHeld, held
from grpo_run.runner.home import home, job_store_url, work_dir
from grpo_run.state.phases import FINISHED
from grpo_run.runner.supervisor.cancel import CANCEL_KEY, cancel_requested, request_cancel  # noqa: F401
from grpo_run.runner.supervisor.endings import ENDINGS, End


class NoSuchJob(LookupError):
    """Storage holds no record of the job (message names the job and the storage)."""


class StillHeld(RuntimeError):
    """A node holds the job's lease (message names it and the way out)."""


@dataclass(frozen=True)
class Cancelled:
    outcome: str            # "cancelled" (nothing ran it: Cancelled now) | "requested" (a node stops it)
                            # | "finished" (it had ended already: nothing changed)
    phase: str              # the job's phase in storage after this
    holder: str = ""        # "requested": the node holding it, as the lease names it
    was: str = ""           # "cancelled": the phase it had (Pending, Preempted, ...)


def cancel_job(name: str, storage: str | None) -> Cancelled:
    """Cancel job `name` in `storage` (None: this machine's default store). Raises NoSuchJob,
    StorageConfigError / StorageUnavailable."""
    from grpo_run.runner.books.books import Books
    from grpo_run.runner.books.replica import stored_record

    url = job_store_url(storage, name)
    store = open_store(url)
    with stored_record(store) as record:
        stored = record.job() if record is not None else None
    if stored is None:
        raise NoSuchJob(f"no job {name!r} in {url.rsplit('/', 1)[0]}")
    if stored["phase"] in FINISHED:
        return Cancelled("finished", str(stored["phase"]))
    by = f"cancel@{socket.gethostname()}"
    request_cancel(store, by)        # first: a node taking the lease from here on finds it
    try:
        with held(url, by), tempfile.TemporaryDirectory(prefix="grpo-run-cancel-") as tmp:
            books = Books(store, Path(tmp), name=name, manifest=stored["spec"], usd_per_hour=None,
                          max_cost_usd=None)
            try:       # read again under the lease: the node that held it may have finished meanwhile
                was = books.record.job()["phase"]
                if was in FINISHED:
                    return Cancelled("finished", str(was))
                ending = ENDINGS[End.CANCELLED]        # as a supervisor ends a cancelled run
                books.finish(ending.phase, ending.attempt, f"cancelled by {by} while {was}; no node runs it again")
            finally:
                books.close()
    except LeaseHeld as taken:       # a node runs it: it stops at its next step boundary
        from grpo_run.checkpoint.storage.lease import describe_holder

        return Cancelled("requested", str(stored["phase"]), holder=describe_holder(taken.holder))
    return Cancelled("cancelled", str(ENDINGS[End.CANCELLED].phase), was=str(was))


def delete_job(name: str, storage: str | None, *, force: bool) -> list[str]:
    """Remove job `name`'s storage folder and this machine's folders for it; returns what was
    removed (for the message). Raises NoSuchJob when there is nothing to remove, StillHeld while
    a node holds the lease (unless `force`), StorageConfigError / StorageUnavailable."""
    from grpo_run.runner.jobs.find import SUBMITTED

    url = job_store_url(storage, name)
    job_store = open_store(url)
    keys = job_store.list("")
    local = [p for p in (work_dir(name), home() / SUBMITTED / name, home() / "cache" / "records" / f"{name}.db")
             if p.exists()]
    if not keys and not local:
        raise NoSuchJob(f"no job {name!r} in {url.rsplit('/', 1)[0]} and nothing of it on this machine")
    removed: list[str] = []
    if keys:
        # held by us, no node starts it while its folder is emptied (the lease goes with the folder)
        guard = held(url, f"delete@{socket.gethostname()}") if not force and LEASE_KEY in keys else nullcontext()
        try:
            with guard:
                parent, _, folder = url.rpartition("/")
                open_store(parent).delete(folder)     # the whole folder, whole path components: never NAME-2
        except LeaseHeld as taken:
            raise StillHeld(f"{taken}; delete refuses a job a node is running: `grpo-run cancel {name}` "
                            f"stops it, or add --force if that node is gone") from None
        removed.append(f"{len(keys)} object(s) under {url}")
    for path in local:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
        removed.append(str(path))
    return removed
