"""Checkpoints to and from object storage.

Remote layout, under a prefix of the store: one per run of a job (`run_prefix`), so runs of the
same name (a job submitted again after its record was deleted) never share, count or prune each
other's checkpoints, even when they reach the same steps:

    checkpoints/<run id>/ckpt-00000025/adapter/adapter_model.safetensors
    checkpoints/<run id>/ckpt-00000025/manifest.json      # uploaded LAST: its presence means durable
    final/<run id>/ckpt-00000008/...                       # the final weights

(Before run prefixes, checkpoints lay directly under `checkpoints/` and `final/`; those are read,
when their manifest names the run, and never written or pruned.)

A checkpoint is durable only once its manifest.json is in the store; every file goes up before
it, so a kill or outage mid-upload leaves files without a manifest, which nothing trusts. Remote
pruning deletes the manifest FIRST for the same reason. Downloads verify sizes and sha256 against
the manifest before a checkpoint is used.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

from .storage.fsio import KEEP_SET_ASIDE, atomic_write_bytes, fsync_dir, set_aside
from .manifest import (
    FINITE_META,
    KEEP_CHECKPOINTS,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    CheckpointInvalid,
    Manifest,
    checkpoint_name,
    newest_sealed,
    read_manifest,
    remove_tree,
    sealed,
    step_of,
    verify,
)
from .storage.store import ObjectStore, ObjectTooLarge, StorageConfigError, StorageUnavailable

log = logging.getLogger(__name__)

class RestoreStopped(StorageUnavailable):
    """A restore was abandoned between two files because a preemption notice came: nothing more is
    worth downloading on a node that is going away. `step`: the checkpoint it was fetching, durable
    in storage (its manifest was read), so still the one a resume continues from."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


Accept = Callable[[Manifest], "str | None"]    # why a checkpoint is not to be used; None: it is
# ... and, given its verified folder, why its contents are not (a file that contradicts the manifest)
Inspect = Callable[[Path, Manifest], "str | None"]

CHECKPOINTS = "checkpoints"          # the runs' checkpoints, one folder per run under it
FINAL = "final"                      # the runs' final weights, likewise
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def run_prefix(kind: str, run: str) -> str:
    """Where run `run`'s checkpoints (kind CHECKPOINTS) or final weights (FINAL) lie in the job's
    storage. Raises ValueError for a run id that is not one (the record comes from storage,
    which anyone who can write the bucket can edit)."""
    if not isinstance(run, str) or not _RUN_ID_RE.match(run):
        raise ValueError(f"the record's runId {run!r} is not a run id (letters, digits, - and _, at most 64); "
                         "the record in storage was edited: delete the job and submit it again")
    return f"{kind}/{run}"


def remote_discover(store: ObjectStore, prefix: str = "checkpoints") -> list[int]:
    """Steps whose manifest.json exists under `prefix` in the store, newest first.

    Presence only: download_latest checks the manifest and the files."""
    return sorted(_remote_checkpoints(store, prefix)[0], reverse=True)


def restore_latest(store: ObjectStore, root: Path, prefix: str = "checkpoints", *, accept: Accept | None = None,
                   stop: threading.Event | None = None, verify_local: bool = False, inspect: Inspect | None = None
                   ) -> tuple[int, Path, Manifest, bool] | None:
    """The newest checkpoint to continue from, in `root` on this node: (step, folder, manifest,
    durable). A sealed local one at least as new as the newest in storage is used (durable False
    when storage lacks it: sealed here before a crash, never uploaded; such a one is verified
    first, as its upload would hash it anyway); else the newest remote one that verifies is
    downloaded (download_latest). One listing of the store; nothing is hashed twice. None when
    there is no checkpoint anywhere.

    `accept(manifest)`: why a checkpoint is not to be continued from (None: it is), e.g. another
    run's. Remote ones it refuses are skipped; local ones it refuses, and local ones that do not
    verify, are set aside (renamed `.set-aside-*`, not deleted) so that nothing loads them.
    `verify_local`: verify the local one even when storage has it too (a trainer crashed: it may
    have failed to load a checkpoint damaged on this disk, which storage's copy replaces).
    `stop`: as download_latest's. `inspect(folder, manifest)`: why a verified checkpoint's
    contents are not to be continued from (None: they are); refused like one that does not verify."""
    durable, partial = _remote_checkpoints(store, prefix)

    def why_not(found: tuple[int, Path, Manifest]) -> str | None:
        if accept is not None and (why := accept(found[2])) is not None:
            return why
        if verify_local or found[0] not in durable:
            try:
                verify(found[1])
            except CheckpointInvalid as exc:
                return f"it does not verify ({exc.reason}): damaged on this node's disk"
        if inspect is not None and (why := inspect(found[1], found[2])) is not None:
            return why
        return None

    local = newest_sealed(root)
    while local is not None and (why := why_not(local)) is not None:
        aside = set_aside(local[1], "ckpt-")
        log.warning("set local checkpoint %s aside (%s; the newest %d set aside are kept): %s", local[1],
                    aside.name, KEEP_SET_ASIDE, why)
        local = newest_sealed(root)
    if local is not None and local[0] >= max(durable, default=-1):
        step, folder, manifest = local
        return step, folder, manifest, step in durable
    got = download_latest(store, root, prefix, listed=(durable, partial), accept=accept, stop=stop,
                          above=local[0] if local is not None else -1, inspect=inspect)
    if got is not None:
        return got[0], got[1], read_manifest(got[1]), True
    if local is not None:
        step, folder, manifest = local
        return step, folder, manifest, step in durable
    return None


def download_latest(store: ObjectStore, dest_root: Path, prefix: str = "checkpoints", *,
                    listed: tuple[set[int], set[int]] | None = None, accept: Accept | None = None,
                    stop: threading.Event | None = None, above: int = -1,
                    inspect: Inspect | None = None) -> tuple[int, Path] | None:
    """Fetch the newest remote checkpoint that downloads and verifies into `dest_root`.

    Returns (step, folder) with folder `dest_root/ckpt-<step>`, or None if no remote checkpoint
    is usable. A local folder that already verifies against the same manifest is reused without
    downloading. Partial or corrupt remote checkpoints (a listed file missing, wrong size or
    sha256, a bad manifest) are skipped with a warning naming them, and the next older one is
    tried. Storage errors (StorageUnavailable, StorageConfigError) propagate: an outage must not
    silently send a run back to an older checkpoint. `listed`: what `_remote_checkpoints`
    returned, when the caller listed the store already. `accept`: as restore_latest's; a
    checkpoint it refuses is skipped with its reason. `stop` (a preemption): checked before every
    file, so a notice ends a long restore between two files with RestoreStopped; what came down
    so far is removed. `above`: only steps past it are looked at (a local checkpoint of that step
    is the fallback: a refused newer one must not send the run back past it). `inspect`: as
    restore_latest's, asked of each checkpoint once it verifies; one it refuses is skipped (and
    what came down removed) like a corrupt one.
    """
    dest_root = Path(dest_root)
    durable, partial = listed if listed is not None else _remote_checkpoints(store, prefix)
    newest_durable = max(durable, default=-1)
    for step in sorted(s for s in partial if s > newest_durable):
        # Files without a manifest: an upload cut off (or a manifest deleted). Never used.
        log.warning("skipping remote checkpoint %s/%s/%s: no manifest.json (a partial upload)",
                    store.url, prefix, checkpoint_name(step))
    for step in sorted((s for s in durable if s > above), reverse=True):
        name = checkpoint_name(step)
        where = f"{store.url}/{prefix}/{name}"
        try:
            try:
                raw = store.get_bytes(f"{prefix}/{name}/{MANIFEST_NAME}", max_bytes=MAX_MANIFEST_BYTES)
            except ObjectTooLarge:
                raise CheckpointInvalid(f"manifest.json is larger than {MAX_MANIFEST_BYTES:,} bytes") from None
            manifest = Manifest.from_json(raw)
            if manifest.step != step:
                raise CheckpointInvalid(f"manifest says step {manifest.step}")
            if accept is not None and (why := accept(manifest)) is not None:
                raise CheckpointInvalid(why)
        except FileNotFoundError:
            log.warning("skipping remote checkpoint %s: manifest.json vanished", where)
            continue
        except CheckpointInvalid as exc:
            log.warning("skipping remote checkpoint %s: %s", where, exc.reason)
            continue

        final = dest_root / name
        if _matches_local(final, manifest):
            if inspect is not None and (why := inspect(final, manifest)) is not None:
                log.warning("skipping remote checkpoint %s: %s", where, why)
                continue
            return step, final

        partial = dest_root / f".partial-{name}-{uuid.uuid4().hex[:8]}"
        try:
            for done, entry in enumerate(manifest.files):
                if stop is not None and stop.is_set():
                    raise RestoreStopped(f"restoring {where} stopped by a notice after {done} of "
                                         f"{len(manifest.files)} files", step)
                store.get_file(f"{prefix}/{name}/{entry.path}", partial / entry.path)
            atomic_write_bytes(partial / MANIFEST_NAME, raw)
            verify(partial)
            if inspect is not None and (why := inspect(partial, manifest)) is not None:
                raise CheckpointInvalid(why)
        except FileNotFoundError as exc:
            remove_tree(partial)
            log.warning("skipping remote checkpoint %s: partial upload (%s)", where, exc)
            continue
        except CheckpointInvalid as exc:
            remove_tree(partial)
            log.warning("skipping remote checkpoint %s: %s", where, exc.reason)
            continue
        except BaseException:
            remove_tree(partial)
            raise

        if final.exists():
            remove_tree(final)
        os.replace(partial, final)
        fsync_dir(dest_root)
        return step, final
    return None


class Uploader:
    """Uploads finalized checkpoints in a background thread so training never waits on the
    network.

    Every file goes up, then manifest.json last; then the remote is pruned to the newest `keep`
    durable checkpoints. One upload runs at a time and one more waits: a checkpoint submitted
    while another waits replaces it (superseded: the newer one is what a resume wants).

    `pin`: a folder where each submitted checkpoint is hard-linked before it waits, so the
    trainer pruning its own local checkpoints (it keeps only its newest few) never removes a file
    from under an upload. Without it, an upload slower than two save intervals lost its files
    mid-way, again and again, and nothing became durable. A checkpoint already pruned when it
    is submitted is skipped: a newer one follows.

    Retries and their stop event are the store's. A StorageConfigError is kept in `error` and
    re-raised by the next `submit`: a run without durable checkpoints should stop, not train on.
    """

    def __init__(self, store: ObjectStore, remote_prefix: str = "checkpoints", keep: int = KEEP_CHECKPOINTS, *,
                 on_upload: Callable[[int, list[int], BaseException | None], None] | None = None,
                 accept: Accept | None = None, pin: Path | None = None) -> None:
        """`on_upload(step, durable steps newest first, error or None)` is called from the
        upload thread after each upload of a checkpoint ends, well or not. `accept`: as
        restore_latest's; a checkpoint found under the prefix that it refuses (another run's) is
        neither counted durable nor ever deleted. `pin`: see the class; emptied here (what a
        killed process left is stale).

        Pruning keeps the newest `keep` durable checkpoints and, when none of them says its
        weights were checked finite (FINITE_META), the newest that does, whatever its age."""
        if keep < 2:
            raise ValueError(f"keep must be >= 2 (got {keep})")
        self.store = store
        self.prefix = remote_prefix.strip("/")
        self.keep = keep
        self._on_upload = on_upload
        self._accept = accept
        self._pin = None if pin is None else Path(pin)
        if self._pin is not None:
            shutil.rmtree(self._pin, ignore_errors=True)
        # The last upload's error; cleared when a later upload succeeds.
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._waiting: tuple[Path, Manifest | None, bool] | None = None    # (folder, manifest, pinned)
        self._uploading = False
        self._closed = False
        self._last_submitted: int | None = None
        self._durable: list[int] = []
        # What the store holds under the prefix, listed once at the first upload and then kept
        # up to date here: listing after every upload cost more than the upload (one writer per
        # job holds the lease, so nothing else adds checkpoints meanwhile): step -> whether its
        # weights were checked finite when sealed.
        self._remote: dict[int, bool] | None = None
        self._thread = threading.Thread(target=self._run, name="checkpoint-uploader", daemon=True)
        self._thread.start()

    def submit(self, ckpt_dir: Path, manifest: Manifest | None = None) -> None:
        """Queue a finalized checkpoint folder (named ckpt-<step>) for upload; returns at once.

        `manifest`: what `finalize_checkpoint` returned for it, when the caller sealed it just
        now; the files are then uploaded without hashing them again. Without it the folder is
        verified first.

        Raises ValueError for a folder not named like a checkpoint, RuntimeError after close(),
        and the stored StorageConfigError if an earlier upload hit one."""
        ckpt_dir = Path(ckpt_dir)
        step = step_of(ckpt_dir)
        if step is None:
            raise ValueError(f"{ckpt_dir} is not named like a checkpoint (ckpt-<step>)")
        with self._cond:
            if self._closed:
                raise RuntimeError("Uploader is closed")
            if isinstance(self.error, StorageConfigError):
                raise self.error
        folder, pinned = ckpt_dir, False
        if self._pin is not None:
            folder = _pin(ckpt_dir, self._pin)
            if folder is None:
                log.info("checkpoint %s was removed locally (a newer one superseded it) before its upload "
                         "began", ckpt_dir)
                return
            pinned = True
        with self._cond:
            superseded = self._waiting
            self._waiting = (folder, manifest, pinned)
            self._last_submitted = step
            self._cond.notify_all()
        if superseded is not None:
            log.info("checkpoint %s superseded by %s before upload", superseded[0].name, ckpt_dir.name)
            if superseded[2]:
                shutil.rmtree(superseded[0], ignore_errors=True)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until nothing waits or uploads, or `timeout` passes. True when the newest
        submitted checkpoint is durable (older ones it superseded may not be)."""
        with self._cond:
            drained = self._cond.wait_for(lambda: self._waiting is None and not self._uploading, timeout)
            return bool(drained) and (self._last_submitted is None
                                      or self._last_submitted in self._durable)

    def durable_steps(self) -> list[int]:
        """Steps durable in the store as of the last upload, newest first."""
        with self._cond:
            return list(self._durable)

    def close(self, timeout: float | None = None) -> None:
        """Finish what is queued (bounded by the store's retry budget), then stop the thread."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._pin is not None and not self._thread.is_alive():
            shutil.rmtree(self._pin, ignore_errors=True)

    def __enter__(self) -> Uploader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # --- the background thread -----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._waiting is not None or self._closed)
                if self._waiting is None:
                    return                              # closed, nothing left
                (folder, manifest, pinned), self._waiting = self._waiting, None
                self._uploading = True
            error: BaseException | None = None
            try:
                self._upload(folder, manifest)
            except BaseException as exc:  # kept for the trainer; the thread lives on
                log.error("uploading checkpoint %s to %s failed: %s", folder.name, self.store.url, exc)
                error = exc
                with self._cond:
                    self.error = exc
            finally:
                if pinned:
                    shutil.rmtree(folder, ignore_errors=True)
                if self._on_upload is not None:
                    try:
                        self._on_upload(step_of(folder) or 0, self.durable_steps(), error)
                    except Exception:   # the caller's bug must neither stop uploads nor hang wait()
                        log.exception("the upload callback failed for %s", folder)
                with self._cond:
                    self._uploading = False
                    self._cond.notify_all()

    def _upload(self, folder: Path, manifest: Manifest | None) -> None:
        if manifest is None:
            manifest = verify(folder)  # never upload what would not verify after download
        elif manifest.step != step_of(folder):
            raise ValueError(f"{folder}: the manifest given is for step {manifest.step}")
        step = manifest.step
        remote = f"{self.prefix}/{checkpoint_name(step)}"
        for entry in manifest.files:
            self.store.put_file(folder / entry.path, f"{remote}/{entry.path}")
        # the manifest, last
        self.store.put_bytes(f"{remote}/{MANIFEST_NAME}", manifest.to_json())
        log.info("checkpoint %d durable at %s/%s", step, self.store.url, remote)
        with self._cond:
            self._durable = sorted(set(self._durable) | {step}, reverse=True)
            self.error = None
        try:
            durable = self._prune_remote(step, manifest.meta.get(FINITE_META) is True)
        except StorageConfigError:
            raise  # e.g. no delete permission: keep-K cannot hold, say so
        except Exception as exc:  # the upload stands; pruning is tried again after the next one
            log.warning("pruning remote checkpoints under %s/%s failed: %s",
                        self.store.url, self.prefix, exc)
            return
        with self._cond:
            self._durable = durable

    def _prune_remote(self, newest_uploaded: int, finite: bool) -> list[int]:
        if self._remote is None:
            steps, partial = _remote_checkpoints(self.store, self.prefix)
            # uploads cut short before the newest durable one will never be finished
            newest = max(steps | {newest_uploaded})
            for step in partial:
                if step < newest:
                    self.store.delete(f"{self.prefix}/{checkpoint_name(step)}")
            self._remote = self._listed(steps - {newest_uploaded})
        self._remote[newest_uploaded] = finite
        durable = sorted(self._remote, reverse=True)
        kept = durable[: self.keep]
        if not any(self._remote[s] for s in kept):    # the newest good weights stay, however old
            kept += [s for s in durable[self.keep:] if self._remote[s]][:1]
        for old in durable:
            if old in kept:
                continue
            name = checkpoint_name(old)
            # manifest first: from this instant it is not a checkpoint, whatever else remains
            self.store.delete(f"{self.prefix}/{name}/{MANIFEST_NAME}")
            self.store.delete(f"{self.prefix}/{name}")
            del self._remote[old]
        return kept

    def _listed(self, steps: set[int]) -> dict[int, bool]:
        """The durable checkpoints found under the prefix at the first upload, each read once:
        step -> whether its weights were checked finite. Ones `accept` refuses (another run's)
        are left out, so never counted nor deleted."""
        found: dict[int, bool] = {}
        for step in steps:
            try:
                manifest = Manifest.from_json(self.store.get_bytes(
                    f"{self.prefix}/{checkpoint_name(step)}/{MANIFEST_NAME}", max_bytes=MAX_MANIFEST_BYTES))
            except FileNotFoundError:
                continue
            except (CheckpointInvalid, ObjectTooLarge):      # damaged: counted and pruned as before, never a good one
                found[step] = False
                continue
            if self._accept is not None and (why := self._accept(manifest)) is not None:
                log.info("leaving checkpoint %s/%s/%s alone: %s", self.store.url, self.prefix,
                         checkpoint_name(step), why)
                continue
            found[step] = manifest.meta.get(FINITE_META) is True
        return found


def _remote_checkpoints(store: ObjectStore, prefix: str) -> tuple[set[int], set[int]]:
    """({steps with manifest.json}, {steps with files but no manifest}) under prefix."""
    prefix = prefix.strip("/")
    seen: set[int] = set()
    with_manifest: set[int] = set()
    for key in store.list(prefix):
        folder, _, path = (key[len(prefix) + 1:] if prefix else key).partition("/")
        step = step_of(Path(folder))
        if step is None or not path:
            continue
        seen.add(step)
        if path == MANIFEST_NAME:
            with_manifest.add(step)
    return with_manifest, seen - with_manifest


def _matches_local(folder: Path, manifest: Manifest) -> bool:
    """A local folder sealed (or verified when downloaded) with the very same files: trusted
    without hashing it again."""
    if not folder.is_dir():
        return False
    try:
        local = sealed(folder)
    except CheckpointInvalid:
        return False
    return local.files == manifest.files and local.step == manifest.step


def _pin(folder: Path, into: Path) -> Path | None:
    """Hard links to every file of checkpoint `folder` in `into/<its name>` (copies where the
    filesystem has no hard links): the trainer's pruning then removes names, never the data
    an upload reads. None when the folder is already gone, or goes while it is linked (pruned:
    a newer checkpoint superseded it)."""
    pinned = into / folder.name
    shutil.rmtree(pinned, ignore_errors=True)
    try:
        if not folder.is_dir():
            return None
        for dirpath, _, files in os.walk(folder):
            here = pinned / Path(dirpath).relative_to(folder)
            here.mkdir(parents=True, exist_ok=True)
            for name in files:
                try:
                    os.link(Path(dirpath) / name, here / name)
                except OSError as e:
                    if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                        raise
                    shutil.copy2(Path(dirpath) / name, here / name)
        if not folder.is_dir():        # pruned while walked: what was linked may be partial
            raise FileNotFoundError(folder)
    except FileNotFoundError:
        shutil.rmtree(pinned, ignore_errors=True)
        return None
    return pinned


__all__ = ["CHECKPOINTS", "FINAL", "Uploader", "download_latest", "remote_discover", "restore_latest", "run_prefix"]
