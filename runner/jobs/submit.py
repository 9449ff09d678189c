"""Submitting a job without training here (`grpo-run apply -f JOB --detach`).

The job's spec and its record (phase Pending) go into its storage folder, with the environment's
own files (their sha256 in the spec: runner/jobs/envfiles.py), and nothing starts on this machine. Whichever node then runs `grpo-run resume NAME
--storage URI` (a boot unit, a Kubernetes Job, a SkyPilot managed job), or `grpo-run apply -f` of
the same file, trains it. This machine keeps only a pointer ($GRPO_RUN_HOME/submitted/NAME: the
storage URI), so `grpo-run get tj NAME` here follows the job in storage.

Submitting is idempotent: the same file again changes nothing. A changed file replaces the spec
of a job no node has taken yet (still Pending) and of a job that Failed (its own code, fixed: a
resume would replay the stored copy; the next `resume` continues it with the new files); a job a
node is running, or one that has ended otherwise, keeps its spec (apply the change where it runs,
or give the job another name).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from typing import Any
from pathlib import Path

from grpo_run.checkpoint.storage.by_url import open_store
from grpo_run.checkpoint.storage.lease import LeaseHeld, held
from grpo_run.checkpoint.storage.store import ObjectStore
from grpo_run.runner.books.books import Books
from grpo_run.runner.books.replica import fetch_record
from grpo_run.runner.jobs.envfiles import environment_uploads, upload_environment
from grpo_run.runner.spec.job import TrainingJob
from grpo_run.runner.supervisor.runspec import usd_per_hour
from grpo_run.runner.deploy.wheel import Wheel, publish
from grpo_run.state.phases import Phase
from grpo_run.state.record import Record



class SubmitRefused(RuntimeError):
    """The job is in storage already and cannot take this file's spec (message says why and what to do)."""


@dataclass(frozen=True)
class Submitted:
    outcome: str             # "submitted" | "unchanged" | "updated"
    phase: str               # the job's phase in storage after this
    url: str                 # the job's storage folder


def submit(job: TrainingJob, url: str, *, holder: str, wheel: Wheel | None = None,
           estimate: dict[str, Any] | None = None) -> Submitted:
    """Write `job` into its storage folder `url` (Pending) without starting it; with `wheel` (the
    grpo-run installed here) also that, under the storage URL's _dist/ (runner/deploy/wheel.py), for the
    nodes to install: put like the environment's files, under the lease, only when the job is
    written (submitted or its Pending spec replaced). Raises SubmitRefused when storage holds the
    job with another spec that cannot change now; StorageConfigError / StorageUnavailable for
    storage that cannot be used."""
    store = open_store(url)
    store.check()                                   # a bad bucket or credentials fail before anything is written
    manifest = job.to_dict()
    try:
        # held: no node may start it while it is being written
        with held(url, holder), tempfile.TemporaryDirectory(prefix="grpo-run-submit-") as tmp:
            work = Path(tmp)
            existing = fetch_record(store, work)     # read under the lease: no node writes it meanwhile
            if existing is not None:
                with Record(existing) as record:
                    stored = record.job()
                if stored["spec"] == manifest:
                    return Submitted("unchanged", stored["phase"], url)
                if stored["phase"] not in (Phase.PENDING, Phase.FAILED):   # Failed: under our lease, no node has it
                    raise SubmitRefused(
                        f"job {job.name!r} is already in {url} (phase {stored['phase']}) with another spec; a job "
                        f"a node has taken keeps its spec: apply the changed file on the node that runs it "
                        f"(grpo-run apply -f FILE), or give this job another metadata.name")
            upload_environment(environment_uploads(job), store)     # under the lease, a Pending job only
            if wheel is not None:
                publish(wheel, url.removesuffix(f"/{job.name}"))      # the storage URL: job_store_url's parent
            books = Books(store, work, name=job.name, manifest=manifest, usd_per_hour=usd_per_hour(job),
                          max_cost_usd=job.maxCostUSD, estimate=estimate)
            try:
                books.sync(wait=True)
            finally:
                books.close()
    except LeaseHeld:                               # a node runs it: only reading is safe
        stored = _stored(store)
        if stored is not None and stored["spec"] == manifest:
            return Submitted("unchanged", stored["phase"], url)
        raise SubmitRefused(f"job {job.name!r} is running on another node with another spec; a job a node has "
                            f"taken keeps its spec: apply the changed file on that node (grpo-run apply -f FILE), "
                            f"or give this job another metadata.name") from None
    return Submitted("updated" if existing is not None else "submitted",
                     str(stored["phase"]) if existing is not None else str(Phase.PENDING), url)


def _stored(store: ObjectStore) -> dict | None:
    """The job as stored (its record's job row), read into a scratch folder; None when there is none."""
    with tempfile.TemporaryDirectory(prefix="grpo-run-submit-") as tmp:
        local = fetch_record(store, Path(tmp))
        if local is None:
            return None
        with Record(local) as record:
            return record.job()
