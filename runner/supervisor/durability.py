"""What is durable in storage, and making it so: the newest durable checkpoint restored before a
trainer starts, every checkpoint the trainer seals uploaded (its manifest trusted: it was hashed
once, when sealed, and goes up last), each noted durable in the books as its upload ends, and,
inside a notice window, the newest sealed one made durable in what time is left.

Only this run's checkpoints count: they lie under the run's own prefix (checkpoint.sync.run_prefix),
and a checkpoint is trained from only when its manifest names this run, its step is within
maxSteps and its weights were not sealed non-finite (`why_not_ours`). Another run of the same name
keeps its checkpoints: they are never counted durable, pruned or restored here."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Callable

from grpo_run.checkpoint.manifest import (FINITE_META, CheckpointInvalid, Manifest, newest_sealed, read_manifest,
                                          sealed)
from grpo_run.checkpoint.storage.lease import LeaseLost
from grpo_run.checkpoint.storage.store import ObjectStore, StorageConfigError
from grpo_run.checkpoint.sync import (CHECKPOINTS, FINAL, RestoreStopped, Uploader, download_latest, restore_latest,
                                      run_prefix)
from grpo_run.runner.books.books import Books
from grpo_run.runner.supervisor.diskfull import unless_disk_full
from grpo_run.trainer.protocol import CHECKPOINTS_DIR, STEP_METRICS, STEP_SAMPLES, TRAINER_STATE

# trainer_state.json holds the optimizer's layout, the scheduler and the RNG's small parts: kB to
# a few MB for the biggest optimizers; anything past this is not a trainer's and is not parsed.
MAX_TRAINER_STATE_BYTES = 64 << 20

# Under the run's work folder: hard links to the checkpoints being uploaded (see Uploader's `pin`).
UPLOADING_DIR = "uploading"

log = logging.getLogger(__name__)


class Durability:
    """Owns the checkpoint uploads of one supervisor and knows the newest durable step."""

    def __init__(self, store: ObjectStore, work: Path, books: Books, *, job: str, keep: int, max_steps: int,
                 on_lease_lost: Callable[[LeaseLost], None], on_fatal: Callable[[BaseException], None],
                 stop: threading.Event | None = None) -> None:
        self.store = store
        self.local = Path(work) / CHECKPOINTS_DIR
        self.books = books
        self.job = job
        self.max_steps = max_steps
        self.prefix = run_prefix(CHECKPOINTS, books.run_id)   # this run's, and only this run's
        self.stop = stop                           # a notice: a restore ends between two files
        self.durable = 0                           # the newest step durable in storage
        self.fatal: BaseException | None = None    # a storage configuration error from an upload: the run stops
        self._noted: set[int] = set()              # steps noted durable in the books
        self._reported: set[int] = set()           # steps this attempt's trainer sealed (and were submitted)
        self._on_lease_lost, self._on_fatal = on_lease_lost, on_fatal
        self.uploads = Uploader(store, self.prefix, keep=keep, on_upload=self._uploaded, accept=self._whose,
                                pin=Path(work) / UPLOADING_DIR)

    def restore(self, *, verify_local: bool = False) -> int:
        """The newest durable checkpoint into work/checkpoints before the trainer starts (a newer
        one sealed here before a crash is kept and uploaded); its step, 0 for none. Begins an
        attempt: what an earlier trainer reported is forgotten. `verify_local`: after a trainer
        crash, a local checkpoint that does not verify (damaged on this disk: loading it may be
        what crashed) is set aside and storage's copy restored. Raises StorageUnavailable."""
        self._reported = set()
        try:
            got = restore_latest(self.store, self.local, self.prefix, accept=self.why_not_ours, stop=self.stop,
                                 verify_local=verify_local, inspect=self.why_not_its_step)
            if got is None:       # a run begun before run prefixes: its checkpoints lie under checkpoints/ itself
                flat = download_latest(self.store, self.local, CHECKPOINTS, accept=self.why_not_ours, stop=self.stop,
                                       inspect=self.why_not_its_step)
                got = None if flat is None else (*flat, read_manifest(flat[1]), True)
        except RestoreStopped as stopped:    # not fetched, but durable in storage: what a resume continues from
            self._note([stopped.step])
            raise
        if got is None:
            return 0
        step, folder, manifest, durable = got
        self.books.fill_in_steps(_step_metrics(folder), _step_samples(folder))
        if durable:
            self._note([step])
        else:
            log.info("checkpoint %d was sealed here but never uploaded; uploading it", step)
            self.uploads.submit(folder, manifest)
        return step

    def why_not_ours(self, manifest: Manifest) -> str | None:
        """Why a checkpoint is not this run's to continue from (None: it is): another run's (or
        one without a run id: every checkpoint names its run since the record has one), a step
        past maxSteps (no run of this job writes one: a planted or damaged manifest), or weights
        sealed non-finite. Such a checkpoint is skipped in storage and set aside on the node."""
        whose = self._whose(manifest)
        if whose is not None:
            return whose
        if manifest.step > self.max_steps:
            return (f"its step {manifest.step} is past spec.parameters.maxSteps ({self.max_steps}); no run of job "
                    f"{self.job} writes one (a damaged or planted manifest)")
        if manifest.meta.get(FINITE_META) is False:
            return "its weights are not finite numbers (NaN or infinite): nothing is trained from them"
        return None

    @staticmethod
    def why_not_its_step(folder: Path, manifest: Manifest) -> str | None:
        """Why a verified checkpoint's trainer state is not the manifest's step (None: it is).
        The manifest's step is what the maxSteps bound and `durable` judge, while the trainer
        resumes after the step its trainer_state.json says: a planted one could skip training and
        make its weights final. Such a checkpoint is refused as a corrupt one."""
        path = folder / TRAINER_STATE
        try:
            if path.stat().st_size > MAX_TRAINER_STATE_BYTES:
                return f"its {TRAINER_STATE} is {path.stat().st_size} bytes (a trainer writes far less)"
            step = json.loads(path.read_bytes()).get("step")
        except FileNotFoundError:
            return f"it has no {TRAINER_STATE}: no trainer can resume from it"
        except (OSError, ValueError, AttributeError) as e:
            return f"its {TRAINER_STATE} does not read as a trainer's ({type(e).__name__})"
        if type(step) is not int or step != manifest.step:
            return (f"its {TRAINER_STATE} says step {str(step)[:40]}, its manifest step {manifest.step}: the trainer "
                    f"would resume after another step than the one checked (a damaged or planted checkpoint)")
        return None

    def _whose(self, manifest: Manifest) -> str | None:
        """Why a checkpoint is not this run's (None: it is): its manifest names another run, or none."""
        run, ours = manifest.meta.get("run"), self.books.run_id
        if run == ours:
            return None
        if not isinstance(run, str):
            return (f"it carries no run id (this record's run is {ours[:12]}): it was not written by this run of "
                    f"job {self.job}")
        return (f"it was written by another run of job {self.job} (run {run[:12]}; this record's is "
                f"{ours[:12]}): a job submitted again under the name of one whose record was deleted")

    def sealed(self, step: int, folder: Path) -> None:
        """The trainer sealed checkpoint `step` in `folder`: noted, and its upload begins."""
        self.books.note_sealed(step)
        self._reported.add(step)
        try:
            manifest = sealed(folder)                   # hashed once, when sealed: trusted here
        except CheckpointInvalid:
            if folder.exists():
                raise
            # The trainer keeps only its newest few and reported this one before we read it (a
            # busy node): a newer one is sealed, and reported, after it.
            log.info("checkpoint %d was pruned locally before its upload began; a newer one follows", step)
            return
        self.uploads.submit(folder, manifest)

    def wait(self, timeout: float | None = None) -> int:
        """The newest sealed local checkpoint made durable; its step (or the newest durable one
        when that upload fails or outlasts `timeout`: what is reported durable is only what is).
        A checkpoint the trainer sealed but could not report (it was killed) is uploaded too, its
        manifest trusted: nothing is hashed inside a notice window."""
        found = newest_sealed(self.local)
        if found is not None and found[0] > self.durable and found[0] not in self._reported:
            self.uploads.submit(found[1], found[2])
        if not self.uploads.wait(timeout) and timeout is not None:
            log.error("the newest checkpoint was not made durable within %.0f s (a stalled or failing "
                      "store?); step %d is the newest durable one", timeout,
                      max(self.durable, *self.uploads.durable_steps(), 0))
        self._note(self.uploads.durable_steps())
        return self.durable

    def upload_final(self, folder: Path) -> BaseException | None:
        """The final weights into storage (`final/`), waiting until they are there; the error
        when they could not be."""
        with Uploader(self.store, run_prefix(FINAL, self.books.run_id), keep=2, accept=self._whose) as uploader:
            uploader.submit(folder, sealed(folder))
            return None if uploader.wait() else uploader.error

    def close(self) -> None:
        self.uploads.close()

    def _uploaded(self, step: int, durable: list[int], error: BaseException | None) -> None:
        """From the upload thread, after each upload ended."""
        with unless_disk_full(f"checkpoints {durable} as durable", self.local.parent):
            self._note(durable)
        if isinstance(error, LeaseLost):       # refused by the fence before the renewal thread said so
            self._on_lease_lost(error)
        if isinstance(error, StorageConfigError) and self.fatal is None:
            self.fatal = error
            log.error("%s; stopping the trainer", error)
            self._on_fatal(error)

    def _note(self, steps: list[int]) -> None:
        new = [s for s in steps if s not in self._noted]
        if not new:
            return
        self.books.note_durable(new)
        self._noted.update(new)
        self.durable = max(self.durable, *new)


def _step_metrics(folder: Path) -> list[dict]:
    """The metrics so far that a checkpoint holds (none in one written before it held them)."""
    path = folder / STEP_METRICS
    try:
        steps = json.loads(path.read_text()) if path.exists() else []
        return [s for s in steps if isinstance(s, dict) and isinstance(s.get("step"), int)]
    except (OSError, ValueError, TypeError) as e:     # damaged: the record keeps what it has
        log.warning("the metrics in %s cannot be read (%s); the record is not filled in from them", path, e)
        return []


def _step_samples(folder: Path) -> dict[int, list[dict]]:
    """The samples of its newest steps that a checkpoint holds, by step (none in one written before it held them)."""
    path = folder / STEP_SAMPLES
    try:
        kept = json.loads(path.read_text()) if path.exists() else {}
        return {int(s): groups for s, groups in kept.items() if isinstance(groups, list)}
    except (OSError, ValueError, TypeError, AttributeError) as e:     # damaged: the record keeps what it has
        log.warning("the samples in %s cannot be read (%s); the record is not filled in from them", path, e)
        return {}
