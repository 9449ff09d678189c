"""Finding a job, as the CLI does: in this node's work folders and store (runner/home.py), a
storage URL, or the storage a job was submitted to from here; what storage's record says of it
before a node takes its lease; and the job as `get tj` shows it, its report and its weights.

Refusals are raised as Refused (runner/exits.py) in the words the CLI prints, with its exit status.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from grpo_run.runner.exits import EXIT_USAGE, Refused
from grpo_run.runner.views.status import job_document
from grpo_run.runner.home import default_storage, home, job_store_url, work_dir
from grpo_run.state.phases import Phase
from grpo_run.state.record import RECORD_FILE
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


def before_the_lease(job, store) -> tuple[tuple[Phase, dict[str, Any]] | None, str | None]:
    """What storage's record says before a node takes the job's lease, in one read of it (never
    this node's copy, which may be older; the supervisor asks again once it holds the lease):
    (already_finished's answer, engine_missing's)."""
    from grpo_run.runner.books.replica import stored_record

    with stored_record(store) as record:
        return already_finished(job, record), engine_missing(job, record)


def stored_cpu_threads(store) -> int | None:
    """The thread count the job's first trainer took, as storage's record says (None: none yet),
    for a trainer started before the lease with the threads the attempt will give it."""
    from grpo_run.runner.books.replica import stored_record
    from grpo_run.state import values

    with stored_record(store) as record:
        return values.CPU_THREADS.get(record) if record is not None else None


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
        from grpo_run.runner.jobs.submit import submitted_storage

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
    from grpo_run.runner.jobs.submit import submitted_jobs

    runs = home() / "runs"
    here = {p.name for p in runs.iterdir() if (p / RECORD_FILE).exists()} if runs.exists() else set()
    return sorted(here | set(submitted_jobs(home())))


def write_report(name: str, storage: str | None, path: Path) -> tuple[dict[str, Any], dict[str, Any], Path]:
    """Draw job `name`'s run into the PNG `path` and its Markdown summary beside it (.md); returns
    (the run as gathered, what was drawn, the summary's path). Raises Refused (EXIT_USAGE) for a
    path that is not a .png or a job that is not found."""
    from grpo_run.runner.views.report import gather, render, summary

    if path.suffix.lower() != ".png":
        raise Refused(f"--out {path}: the picture is a PNG; name it FILE.png", EXIT_USAGE)
    try:
        with open_record(name, storage) as record:
            run = gather(record)
    except LookupError as e:
        raise Refused(str(e), EXIT_USAGE) from None
    drawn = render(run, path)
    md = path.with_suffix(".md")
    md.write_text(summary(run, path.name), encoding="utf-8")
    return run, drawn, md


def export_adapter(name: str, storage: str | None, out: Path) -> str:
    """Write job `name`'s final adapter (or the newest durable checkpoint's) as PEFT files into
    `out`; returns what was written ("the final adapter", ...). Without `storage`: where `apply
    --detach` sent it, or where it ran on this machine. Raises Refused (EXIT_USAGE) when there is
    nothing to export."""
    from grpo_run.runner.jobs.export import export_weights
    from grpo_run.runner.jobs.cancel import job_storage

    try:
        return export_weights(job_store_url(job_storage(name, storage), name), out)
    except LookupError as e:
        raise Refused(str(e), EXIT_USAGE) from None
