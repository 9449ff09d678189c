"""The run's record as storage holds it, and this node's copy of it: which one is the record.

    fetch_record(store, work)   under the lease, before the record is opened here: storage's copy
                                into work/state.db, unless this node's carries the same upload
                                (or a newer upload of the same job that storage lost: put back)
    stored_record(store)        a read-only look at storage's copy, this node's left alone
    StaleRecord                 storage holds a newer upload than this node's: never uploaded over

A copy fetched from storage is checked before it is opened for use (`state.record.check_fetched`:
SQLite's quick_check, no trigger or view): a damaged one is refused (RecordDamaged), never used.

Every upload carries a generation (state.values.GENERATION: a number that only grows, and who
wrote it), which is how two copies are compared.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from grpo_run.checkpoint.storage.fsio import set_aside
from grpo_run.checkpoint.storage.lease import LeaseLost
from grpo_run.checkpoint.storage.store import ObjectStore
from grpo_run.state import values
from grpo_run.state.record import RECORD_FILE, Record, RecordDamaged, check_fetched

log = logging.getLogger(__name__)

__all__ = ["StaleRecord", "fetch_record", "generation_of", "stored_record", "upload_number"]


def fetch_record(store: ObjectStore, work: Path) -> Path | None:
    """The job's record at work/state.db, as storage has it. Only for a holder of the job's lease
    (storage's copy cannot change meanwhile), before the record is opened here.

    This node's own copy is kept when it carries the generation of storage's copy: nobody uploaded
    since this node's last upload, so it is storage's plus what this node noted after. Any other
    copy (a node back with its old disk, a copy read before another node ran the job) is set aside
    and storage's taken: a stale copy uploaded later would roll the job back. None when storage
    has no record (a new job; this node's copy, if any, is set aside too)."""
    work = Path(work)
    local = work / RECORD_FILE
    fetched: Path | None = work / f".{RECORD_FILE}.from-storage"
    try:
        store.get_file(RECORD_FILE, fetched)
    except FileNotFoundError:
        fetched = None
    if fetched is not None:
        try:
            check_fetched(fetched, f"{store.url}/{RECORD_FILE}")
        except RecordDamaged:
            fetched.unlink(missing_ok=True)
            raise
    stored = generation_of(fetched) if fetched is not None else None
    if local.exists():
        try:
            mine = generation_of(local)
        except sqlite3.DatabaseError:       # a damaged copy: storage's is the record
            mine = None
        if fetched is not None and stored is not None and mine == stored:
            fetched.unlink()
            return local
        if fetched is not None and _older_copy_of_the_same_job(fetched, stored, local, mine):
            # Storage's copy is an older upload of this very job than one this node made or took:
            # generations only grow, so it was put back (a replay, a restore from a backup). The
            # newer one this node knows is the record, and goes back into storage (under the lease).
            log.warning("storage's record of this job is upload %s, older than upload %s, which this node "
                        "already had: it was replaced by an older copy (replayed or restored); keeping this "
                        "node's and putting it back into storage", upload_number(stored), upload_number(mine))
            fetched.unlink()
            store.put_file(local, RECORD_FILE)
            return local
        aside = set_aside(local, RECORD_FILE)       # the newest KEEP_SET_ASIDE copies are kept
        for journal in ("-wal", "-shm"):    # an old copy's journal must never meet the new copy
            local.with_name(RECORD_FILE + journal).unlink(missing_ok=True)
        # (neither carrying a generation: a record from before them, most likely the same one)
        log.log(logging.INFO if mine is None and stored is None else logging.WARNING,
                "this node's copy of the record (upload %s) is not storage's (upload %s); continuing from "
                "storage's, this node's set aside as %s", upload_number(mine), upload_number(stored) if fetched else "none",
                aside.name)
    if fetched is None:
        return None
    os.replace(fetched, local)
    return local


def _older_copy_of_the_same_job(fetched: Path, stored: values.Generation | None, local: Path,
                                mine: values.Generation | None) -> bool:
    """Whether storage's copy (`fetched`, upload `stored`) is an older upload of the same job as this
    node's (`local`, upload `mine`): same name and creation time (a job deleted and submitted
    again under its name is created anew: its record is storage's), lower upload number."""
    if mine is None:
        return False
    if stored is not None and stored["number"] >= mine["number"]:
        return False
    try:
        with Record(fetched) as theirs, Record(local) as ours:
            a, b = theirs.job(), ours.job()
    except (sqlite3.DatabaseError, ValueError):
        return False
    return a is not None and b is not None and (a["name"], a["created"]) == (b["name"], b["created"])


@contextmanager
def stored_record(store: ObjectStore) -> Iterator[Record | None]:
    """Storage's record, read from a scratch copy; None when storage has none. This node's copy is
    left alone: only a holder of the lease replaces it (fetch_record), and it may be in use."""
    with tempfile.TemporaryDirectory(prefix="grpo-run-record-") as tmp:
        local = Path(tmp) / RECORD_FILE
        try:
            store.get_file(RECORD_FILE, local)
        except FileNotFoundError:
            local = None
        if local is None:
            yield None
            return
        check_fetched(local, f"{store.url}/{RECORD_FILE}")
        with Record(local) as record:
            yield record


def generation_of(path: Path) -> values.Generation | None:
    """The generation a record file carries (None: never uploaded, or written before generations)."""
    with Record(path) as record:
        return values.GENERATION.get(record)


def upload_number(generation: values.Generation | None) -> int:
    return generation["number"] if generation else 0


class StaleRecord(LeaseLost):
    """Storage holds a newer record of the job than this node's, uploaded by another node: this
    node's is not uploaded (it would roll the job back), and it stops as a holder that lost its
    lease does."""
