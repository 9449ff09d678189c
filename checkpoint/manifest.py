"""Local checkpoints that survive being killed at any line.

A checkpoint is a folder `ckpt-00000025` holding whatever the trainer wrote (adapter in PEFT
format, optimizer, scheduler, RNG, data position, metrics) plus `manifest.json`: every file's
path, size and sha256, the step, when, and free-form meta. The manifest is written last, and the
folder gets its final name only after that, so:

* a folder named `ckpt-N` without a verifying manifest is damage, never work in progress;
* discovery trusts only folders whose manifest verifies, and skips the rest with a warning;
* leftovers of a kill (staging folders, half-deleted ones) never look like checkpoints.

Layout on disk (the same under a remote prefix, see sync.py):

    root/ckpt-00000025/manifest.json
    root/ckpt-00000025/adapter/adapter_model.safetensors
    root/ckpt-00000025.staging/...      # being written (staging_dir); removed by prune
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Collection

from .storage.fsio import atomic_write_bytes, fsync_dir

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
# A manifest lists each file of a checkpoint with its size and sha256 (~150 bytes a file): 16 MiB is
# a hundred thousand files. One larger was not written by us, and is never read whole.
MAX_MANIFEST_BYTES = 16 << 20
KEEP_CHECKPOINTS = 3     # sealed checkpoints kept, on the node and in storage: the one setting of it
# meta key: true when every floating-point tensor was checked finite when the checkpoint was sealed
# (checkpoint.writer.weights_finite), false when one was not; absent: never checked. Pruning keeps
# the newest checkpoint marked true even beyond `keep`: NaN weights sealed by a run gone wrong
# never push out the last good ones.
FINITE_META = "finite"
MANIFEST_FORMAT = "grpo-run/checkpoint/v1"
_CKPT_RE = re.compile(r"^ckpt-(\d{8,})$")
# Names prune may remove: staging folders, download partials and deletions cut short.
_LEFTOVER_RE = re.compile(r"^(\.partial-ckpt-.*|\.trash-.*|ckpt-\d+\.(staging|tmp).*)$")
_CHUNK = 8 << 20


class CheckpointInvalid(RuntimeError):
    """A checkpoint folder that must not be used. `reason` says why, `path` which one."""

    def __init__(self, reason: str, path: Path | str | None = None) -> None:
        self.reason = reason
        self.path = Path(path) if path is not None else None
        super().__init__(f"{path}: {reason}" if path is not None else reason)


@dataclass(frozen=True)
class ManifestFile:
    path: str        # relative, "/"-separated
    size: int        # bytes
    sha256: str      # hex digest


@dataclass(frozen=True)
class Manifest:
    step: int
    files: tuple[ManifestFile, ...]
    created: str                                  # ISO-8601 UTC
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        doc = {
            "format": MANIFEST_FORMAT,
            "step": self.step,
            "created": self.created,
            "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in self.files],
            "meta": self.meta,
        }
        return (json.dumps(doc, indent=2, sort_keys=True, default=_json_default) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> Manifest:
        """Parse and validate. CheckpointInvalid(reason) if it is not a manifest we wrote."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise CheckpointInvalid(f"manifest is larger than {MAX_MANIFEST_BYTES:,} bytes: not one we wrote")
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise CheckpointInvalid(f"manifest is not valid JSON ({exc})") from None
        try:
            if doc.get("format") != MANIFEST_FORMAT:
                raise ValueError(f"unknown format {doc.get('format')!r}")
            step = doc["step"]
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise ValueError(f"bad step {step!r}")
            files = []
            for entry in doc["files"]:
                path, size, digest = entry["path"], entry["size"], entry["sha256"]
                if not isinstance(path, str) or not _safe_relpath(path):
                    raise ValueError(f"bad file path {path!r}")
                if not isinstance(size, int) or size < 0:
                    raise ValueError(f"bad size for {path}")
                if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
                    raise ValueError(f"bad sha256 for {path}")
                files.append(ManifestFile(path, size, digest))
            meta = doc.get("meta") or {}
            if not isinstance(meta, dict):
                raise ValueError("meta is not an object")
            return cls(step=step, files=tuple(files), created=str(doc["created"]), meta=meta)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise CheckpointInvalid(f"manifest is malformed ({exc})") from None


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:08d}"


def checkpoint_dir(root: Path, step: int) -> Path:
    """Where `finalize_checkpoint` puts step `step` under `root`."""
    return Path(root) / checkpoint_name(step)


def staging_dir(root: Path, step: int) -> Path:
    """A staging folder for step `step` that `prune` recognises as a leftover if never finalized."""
    return Path(root) / f"{checkpoint_name(step)}.staging"


def step_of(path: Path) -> int | None:
    """The step a folder is named for, or None if it is not named like a checkpoint."""
    match = _CKPT_RE.match(Path(path).name)
    return int(match.group(1)) if match else None


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def finalize_checkpoint(staging: Path, final: Path, *, step: int,
                        meta: dict | None = None) -> Manifest:
    """Seal a staging folder the trainer has filled into the durable checkpoint `final`.

    fsyncs every file and folder, writes manifest.json last (temp name, fsync, rename, fsync
    folder), then renames staging -> final and fsyncs the parent. A kill at any line leaves
    either the staging folder (ignored, later pruned) or a complete checkpoint.

    If `final` already exists (the same step reached again after resuming from an older one) it
    is moved aside and removed only once the new one is in place.

    Raises ValueError if `final` is not named `ckpt-<step, 8 digits>`, if staging holds a
    top-level manifest.json or a symlink; FileNotFoundError if staging is not a folder.
    """
    staging, final = Path(staging), Path(final)
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int (got {step!r})")
    if final.name != checkpoint_name(step):
        raise ValueError(f"final folder must be named {checkpoint_name(step)} (got {final.name})")
    if not staging.is_dir():
        raise FileNotFoundError(f"staging folder {staging} does not exist")
    if (staging / MANIFEST_NAME).exists():
        raise ValueError(f"{staging / MANIFEST_NAME}: the name is reserved for the manifest")

    # fsync and checksum every file
    entries = []
    for path in sorted(staging.rglob("*")):
        if path.is_symlink():
            raise ValueError(f"{path}: symlinks are not allowed in a checkpoint")
        if path.is_dir():
            continue
        size, digest = _hash_file(path, fsync=True)
        entries.append(ManifestFile(path.relative_to(staging).as_posix(), size, digest))
    for folder in sorted((p for p in staging.rglob("*") if p.is_dir()), reverse=True):
        fsync_dir(folder)         # staging itself once, below, when the manifest is in it
    manifest = Manifest(step=step, files=tuple(entries), created=utc_now(), meta=dict(meta or {}))

    # the manifest, last (temporary name, fsync, rename, fsync the folder)
    atomic_write_bytes(staging / MANIFEST_NAME, manifest.to_json())

    # publish under the final name
    final.parent.mkdir(parents=True, exist_ok=True)
    displaced = None
    if final.exists():
        displaced = final.with_name(f".trash-{final.name}-{uuid.uuid4().hex[:8]}")
        os.replace(final, displaced)
    os.replace(staging, final)
    fsync_dir(final.parent)
    if staging.parent != final.parent:
        fsync_dir(staging.parent)
    if displaced is not None:
        shutil.rmtree(displaced, ignore_errors=True)
    return manifest


def read_manifest(folder: Path) -> Manifest:
    """The folder's manifest, parsed; CheckpointInvalid if missing or unparseable."""
    folder = Path(folder)
    try:
        with open(folder / MANIFEST_NAME, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)       # one larger is refused by from_json, unread
    except FileNotFoundError:
        raise CheckpointInvalid("manifest.json is missing", folder) from None
    except OSError as exc:
        raise CheckpointInvalid(f"manifest.json cannot be read ({exc})", folder) from None
    try:
        return Manifest.from_json(data)
    except CheckpointInvalid as exc:
        raise CheckpointInvalid(exc.reason, folder) from None


def verify(dir: Path) -> Manifest:
    """The manifest of checkpoint folder `dir` once every file it lists matches it.

    Raises CheckpointInvalid(reason) if the manifest is missing or unparseable, names another
    step than the folder, or a file is missing or differs in size or sha256. Files not in the
    manifest are ignored."""
    folder = Path(dir)
    manifest = read_manifest(folder)
    named = step_of(folder)
    if named is not None and named != manifest.step:
        raise CheckpointInvalid(f"manifest says step {manifest.step}, folder is named "
                                f"for step {named}", folder)
    for entry in manifest.files:
        path = folder / entry.path
        if not path.is_file():
            raise CheckpointInvalid(f"{entry.path} is missing", folder)
        size = path.stat().st_size
        if size != entry.size:
            raise CheckpointInvalid(f"{entry.path} is {size} bytes, manifest says {entry.size}",
                                    folder)
        _, digest = _hash_file(path, fsync=False)
        if digest != entry.sha256:
            raise CheckpointInvalid(f"{entry.path} sha256 mismatch (file {digest[:12]}..., "
                                    f"manifest {entry.sha256[:12]}...)", folder)
    return manifest


def sealed(folder: Path) -> Manifest:
    """The manifest of a checkpoint this node sealed (or downloaded and verified), trusted
    without hashing: every file is hashed once, when it is sealed. Checks what costs nothing —
    the manifest parses, names the folder's step, and every file it lists has its size.
    Raises CheckpointInvalid saying what is off."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    named = step_of(folder)
    if named is not None and named != manifest.step:
        raise CheckpointInvalid(f"manifest says step {manifest.step}, folder is named for step {named}", folder)
    for entry in manifest.files:
        try:
            size = (folder / entry.path).stat().st_size
        except FileNotFoundError:
            raise CheckpointInvalid(f"{entry.path} is missing", folder) from None
        if size != entry.size:
            raise CheckpointInvalid(f"{entry.path} is {size} bytes, manifest says {entry.size}", folder)
    return manifest


def newest_sealed(root: Path) -> tuple[int, Path, Manifest] | None:
    """The newest checkpoint under `root` that `sealed` accepts (older ones are not looked at
    once one is found); the ones skipped on the way get a warning naming them and why."""
    for step, folder in _named(Path(root)):
        try:
            return step, folder, sealed(folder)
        except CheckpointInvalid as exc:
            log.warning("skipping checkpoint %s: %s", folder, exc.reason)
    return None


def discover(root: Path) -> list[tuple[int, Path]]:
    """Verified checkpoints under `root`, newest step first.

    Each folder named like a checkpoint that does not verify is skipped with a warning naming
    it and why. A missing root has none."""
    return [(step, folder) for step, folder in _named(Path(root)) if _verifies(folder)]


def prune(root: Path, keep: int = KEEP_CHECKPOINTS, *, trusted: Collection[int] = ()) -> list[int]:
    """Keep the newest `keep` verified checkpoints under `root`, and the newest one whose manifest
    says its weights were checked finite (FINITE_META) when none of those does; remove the rest.
    Returns the steps kept, newest first.

    Removes older verified checkpoints, checkpoint-named folders that do not verify, and
    leftovers (staging folders, download partials, interrupted deletions). The newest verified
    checkpoint is never removed. `trusted` names steps the caller sealed or verified itself in
    this process (pass back what the last call returned, plus the step just sealed): they count
    as verified without hashing every file again, which after every checkpoint cost more than
    writing one. Call it from the thread that writes checkpoints: a staging folder being
    filled elsewhere would count as a leftover.

    Raises ValueError if keep < 2 (one bad disk write must not leave a run with nothing)."""
    if keep < 2:
        raise ValueError(f"keep must be >= 2 (got {keep}): one checkpoint is one corruption "
                         f"away from none")
    root = Path(root)
    if not root.is_dir():
        return []
    kept: list[tuple[int, Path]] = []
    finite_kept = False
    for step, folder in _named(root):      # newest first; stop hashing once `keep` are found
        if len(kept) >= keep and finite_kept:
            break
        if len(kept) >= keep:              # beyond keep: only the newest with finite weights, looked up
            manifest = _manifest_or_none(folder)     # by its manifest first, hashed only if it is that one
            if manifest is None or manifest.meta.get(FINITE_META) is not True:
                continue
            if step in trusted or _verifies(folder):
                kept.append((step, folder))
                finite_kept = True
            continue
        if step in trusted or _verifies(folder):
            kept.append((step, folder))
            manifest = _manifest_or_none(folder)
            finite_kept = finite_kept or (manifest is not None and manifest.meta.get(FINITE_META) is True)
    keep_paths = {folder for _, folder in kept}
    for folder in sorted(root.iterdir()):
        if folder in keep_paths:
            continue
        if step_of(folder) is not None or _LEFTOVER_RE.match(folder.name):
            remove_tree(folder)
    return [step for step, _ in kept]


def _named(root: Path) -> list[tuple[int, Path]]:
    """Folders under `root` named like checkpoints, newest step first (none if no root)."""
    if not root.is_dir():
        return []
    return sorted(((step_of(f), f) for f in root.iterdir() if step_of(f) is not None and f.is_dir()),
                  reverse=True)


def _manifest_or_none(folder: Path) -> Manifest | None:
    try:
        return read_manifest(folder)
    except CheckpointInvalid:
        return None


def _verifies(folder: Path) -> bool:
    """Whether `verify` passes; if not, a warning names the folder and why."""
    try:
        verify(folder)
    except CheckpointInvalid as exc:
        log.warning("skipping checkpoint %s: %s", folder, exc.reason)
        return False
    return True


def remove_tree(folder: Path) -> None:
    """Remove a folder so a kill part-way never leaves a half-deleted `ckpt-N` behind: first
    renamed to a `.trash-` name (which prune clears), then deleted."""
    folder = Path(folder)
    if not folder.exists():
        return
    if not folder.name.startswith(".trash-"):
        trash = folder.with_name(f".trash-{folder.name}-{uuid.uuid4().hex[:8]}")
        os.replace(folder, trash)
        fsync_dir(folder.parent)
        folder = trash
    if folder.is_dir() and not folder.is_symlink():
        shutil.rmtree(folder, ignore_errors=True)
    else:
        folder.unlink(missing_ok=True)


def _hash_file(path: Path, *, fsync: bool) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        if fsync:
            os.fsync(f.fileno())  # the trainer may not have; a checksum of unsynced data is moot
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def _json_default(obj: Any) -> Any:
    """numpy / torch scalars and arrays in meta (e.g. metrics) become plain numbers and lists."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"{type(obj).__name__} in checkpoint meta is not JSON serializable")


def _safe_relpath(path: str) -> bool:
    parts = path.split("/")
    return bool(path) and not path.startswith("/") and all(p not in ("", ".", "..") for p in parts)
