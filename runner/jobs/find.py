"""Finding a job, as the CLI does: in this node's work folders and store (runner/home.py), a
storage URL, or the storage a job was submitted to from here; what storage's record says of it
before a node takes its lease; the job as `get tj` shows it; and where this machine remembers
submitting jobs to (`apply --detach`). The verbs (cancel, export, report, submit, run) sit on it.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from grpo_run.runner.views.status import job_document
from grpo_run.runner.home import default_storage, home, job_store_url, work_dir
from grpo_run.state.phases import Phase
from grpo_run.state.record import RECORD_FILE, Record
from grpo_run.trainer.startup import clock


def find_job(name: str | None, storage: str, *, stop: threading.Event | None = None):
    """(job, its checked store) from storage; None when it is not there (yet). Raises ValueError
    when storage holds several jobs and none is named, or a job whose stored name is not its
    folder's (runner.jobs.stored), JobError for a stored spec that no longer parses,
    StorageConfigError / StorageUnavailable. `stop`: the job's stop Event, for its store."""
    from grpo_run.checkpoint.storage.by_url import open_store
    from grpo_run.runner.books.replica import stored_record
    from grpo_run.runner.spec.job import parse_job
    from grpo_run.runner.jobs.stored import check_folder_name, check_stored_name

    names = [name] if name else jobs_in(storage)
    if not names:
        return None
    if len(names) > 1:
        raise ValueError(f"error: {storage} holds several jobs ({', '.join(names)}); name one: "
                         f"grpo-run resume NAME --storage {storage}, or train them all, one after another: "
                         f"grpo-run resume --storage {storage} --all")
    name = names[0]
    check_folder_name(name, storage)            # a folder from storage becomes a work folder here
    with clock().part("job fetch"):           # the node's path to its first step (runner.supervisor.startup)
        store = open_store(job_store_url(storage, name), stop=stop)   # a notice stops its retries
        store.check()
        with stored_record(store) as record:      # storage's, never this node's copy (it may be stale)
            job_doc = record.job() if record is not None else None
    if job_doc is None:
        return None
    job = parse_job(job_doc["spec"], source=f"{name} (from {storage})", check_files=False)
    check_stored_name(job, name, storage)
    return job, store


def before_the_lease(job, store) -> tuple[tuple[Phase, dict[str, Any]] | None, str | None, int | None]:
    """What storage's record says before a node takes the job's lease, in one read of it (never
    this node's copy, which may be older; the supervisor asks again once it holds the lease):
    (already_finished's answer, engine_missing's, the thread count the job's first trainer took:
    a trainer started before the lease gets the threads the attempt will give it; None: none yet)."""
    from grpo_run.runner.books.replica import stored_record
    from grpo_run.state import values

    with stored_record(store) as record:
        threads = values.CPU_THREADS.get(record) if record is not None else None
        return already_finished(job, record), engine_missing(job, record), threads


def already_finished(job, record) -> tuple[Phase, dict[str, Any]] | None:
    """(the phase, the job as `get tj` shows it) when the record (storage's; None: none there)
    says the job is over: it succeeded with this very spec, or it was cancelled (with any spec:
    `grpo-run delete` clears the name); None otherwise."""
    done = record.job() if record is not None else None
    if done and (done["phase"] == Phase.CANCELLED
                 or (done["phase"] == Phase.SUCCEEDED and done["spec"] == job.to_dict())):
        return done["phase"], job_document(record)
    return None


def engine_missing(job, record) -> str | None:
    """Why this node cannot sample the run (its first start chose vLLM, colocated, and this node
    has none), from the record (storage's; None: none there); None when it can."""
    from grpo_run.state import values
    from grpo_run.trainer.sampling.choice import missing_engine

    chosen = (values.SAMPLER.get(record) or {}).get("engine") if record is not None else None
    missing = missing_engine(chosen, job.parameters)
    return None if missing is None else f"{job.name}: {missing}; the job is left as it was"


def jobs_in(storage: str) -> list[str]:
    from grpo_run.checkpoint.storage.by_url import open_store

    store = open_store(storage)
    return sorted({k.split("/")[0] for k in store.list("") if k.endswith(f"/{RECORD_FILE}") and k.count("/") == 1})


def open_record(name: str, storage: str | None):
    """The job's record: the local work folder's when no storage is named, else the store's."""
    from grpo_run.checkpoint.storage.by_url import open_store
    from grpo_run.state.record import Record, check_fetched

    local = work_dir(name) / RECORD_FILE
    if storage is None and local.exists():
        return Record(local)
    if storage is None:                  # submitted from here (apply --detach): follow it in storage
        storage = submitted_storage(home(), name)
    store = open_store(job_store_url(storage, name))
    # A read-only copy, refreshed on every call (get_file replaces it atomically).
    copy = home() / "cache" / "records" / f"{name}.db"
    for leftover in (copy.with_name(copy.name + "-wal"), copy.with_name(copy.name + "-shm")):
        leftover.unlink(missing_ok=True)    # an old copy's journal must never meet the new copy
    try:
        store.get_file(RECORD_FILE, copy)
    except FileNotFoundError:
        raise LookupError(f"no job {name!r} in {storage or default_storage()}") from None
    check_fetched(copy, f"{store.url}/{RECORD_FILE}")     # RecordDamaged: refused, never shown as the job
    return Record(copy)


def get_job(name: str, storage: str | None) -> dict[str, Any]:
    """The job as {apiVersion, kind, metadata, spec, status}."""
    with open_record(name, storage) as record:
        return job_document(record)


def job_doc(path: Path) -> dict[str, Any]:
    """The job as `get tj` shows it, from a record on this node."""
    from grpo_run.state.record import Record

    with Record(path) as record:
        return job_document(record)


def local_jobs() -> list[str]:
    """Jobs run on this node, and jobs submitted from it."""
    runs = home() / "runs"
    here = {p.name for p in runs.iterdir() if (p / RECORD_FILE).exists()} if runs.exists() else set()
    return sorted(here | set(submitted_jobs(home())))


def job_storage(name: str, storage: str | None) -> str | None:
    """The storage the CLI means for job `name`: `--storage` when given, else the one `apply
    --detach` remembered on this machine, else the spec.storage of a run on this machine, else
    None (this machine's default store)."""
    if storage:
        return storage
    remembered = submitted_storage(home(), name)
    if remembered:
        return remembered
    local = work_dir(name) / RECORD_FILE
    if local.exists():
        with Record(local) as record:
            job = record.job()
        return ((job or {}).get("spec") or {}).get("spec", {}).get("storage") or None
    return None


SUBMITTED = "submitted"      # under GRPO_RUN_HOME: one file per submitted job, holding its storage URI


def remember(home: Path, name: str, storage: str) -> None:
    """Note on this machine where job `name` was submitted, for `get tj NAME`."""
    folder = home / SUBMITTED
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(storage + "\n")


def submitted_storage(home: Path, name: str) -> str | None:
    """The storage a job was submitted to from this machine (None: it was not)."""
    path = home / SUBMITTED / name
    return path.read_text().strip() if path.exists() else None


def submitted_jobs(home: Path) -> list[str]:
    folder = home / SUBMITTED
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []
