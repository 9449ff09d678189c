"""`grpo-run export`: the final (or newest durable) weights of the job's run out of object storage.

Which run is the record's (its runId, in storage): a job submitted again under the name of one
whose record was deleted finds the earlier run's weights in the same storage, and must never
export them. Each run's weights lie under its own prefix (checkpoint.sync.run_prefix), and every
manifest must name the run as well."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from grpo_run.checkpoint.manifest import Manifest
from grpo_run.checkpoint.storage.by_url import open_store
from grpo_run.checkpoint.storage.store import ObjectStore
from grpo_run.checkpoint.sync import CHECKPOINTS, FINAL, download_latest, run_prefix
from grpo_run.runner.books.replica import stored_record
from grpo_run.state import values
from grpo_run.state.phases import Phase
from grpo_run.runner.exits import EXIT_USAGE, Refused
from grpo_run.runner.home import job_store_url


def export_weights(job_url: str, out: Path) -> str:
    """Write the job's adapter (PEFT files) or full model into `out`; says which it wrote.

    Raises LookupError when the job has no record in storage, its run id is not one, or it has
    neither final weights nor a durable checkpoint of its run."""
    store = open_store(job_url)
    with tempfile.TemporaryDirectory(prefix="grpo-run-export.") as tmp:
        tmp = Path(tmp)
        run, succeeded = _run_of(store, job_url)

        def ours(manifest: Manifest) -> str | None:
            return None if manifest.meta.get("run") == run else "written by another run of this job"

        def legacy_final(manifest: Manifest) -> str | None:
            # final weights of a run that finished before they carried a run id: its own only
            # when the record says it succeeded (a new run has its final under its own prefix)
            return None if manifest.meta.get("run") in (run, None) and succeeded else "not this run's"

        # a record older than run ids (run None): its weights lie under the flat prefixes alone
        got = ((run and download_latest(store, tmp / "final", run_prefix(FINAL, run), accept=ours))
               or download_latest(store, tmp / "final-flat", FINAL, accept=legacy_final))
        what = "the final weights"
        if got is not None:
            folder = got[1]
        else:
            got = ((run and download_latest(store, tmp / "checkpoints", run_prefix(CHECKPOINTS, run), accept=ours))
                   or download_latest(store, tmp / "checkpoints-flat", CHECKPOINTS, accept=ours))
            if got is None:
                raise LookupError(f"no final weights and no durable checkpoint of this run of the job at {job_url}")
            step, folder = got
            what = f"the checkpoint at step {step} (the job has not finished)"
        src = folder / "adapter" if (folder / "adapter").exists() else folder / "model"
        out.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            shutil.copy2(f, out / f.name)
    return what


def _run_of(store: ObjectStore, job_url: str) -> tuple[str | None, bool]:
    """(the run id, whether it succeeded) from the job's record in storage; the run id is None
    in a record written before run ids."""
    with stored_record(store) as record:
        if record is None:
            raise LookupError(f"no job record at {job_url}: which run's weights to export is unknown")
        run = values.RUN_ID.get(record)
        job = record.job()
    if run is not None:
        try:
            run_prefix(CHECKPOINTS, run)
        except ValueError as e:      # an edited record: said plainly, never a traceback
            raise LookupError(str(e)) from None
    return run, bool(job) and job["phase"] == Phase.SUCCEEDED


def export_adapter(name: str, storage: str | None, out: Path) -> str:
    """Write job `name`'s final adapter (or the newest durable checkpoint's) as PEFT files into
    `out`; returns what was written ("the final adapter", ...). Without `storage`: where `apply
    --detach` sent it, or where it ran on this machine. Raises Refused (EXIT_USAGE) when there is
    nothing to export."""
    from grpo_run.runner.jobs.find import job_storage

    try:
        return export_weights(job_store_url(job_storage(name, storage), name), out)
    except LookupError as e:
        raise Refused(str(e), EXIT_USAGE) from None
