"""Local writes that survive a kill at any line: temporary name, fsync, rename, fsync folder."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

# Temporary names written here (and by the store on the local side); never listed as keys.
TMP_MARKER = ".grpo-tmp-"
_CHUNK = 8 << 20


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_sibling(path: Path) -> Path:
    """A fresh name beside `path` that holds nothing of `path`'s own name: a kill can leave it
    behind, and readers that pick files by name (TensorBoard reads every file with "tfevents" in
    it, in the folder a user points it at) must not take a half-written copy for the real one."""
    return path.with_name(f"{TMP_MARKER}{uuid.uuid4().hex[:16]}")


def atomic_write_bytes(dest: Path, data: bytes) -> None:
    """`dest` holds either its old content or all of `data`, never a part."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(dest)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(dest.parent)


def atomic_write_text(dest: Path, text: str) -> None:
    """`dest` holds either its old content or all of `text` (UTF-8), never a part."""
    atomic_write_bytes(Path(dest), text.encode("utf-8"))


def atomic_copy(src: Path, dest: Path) -> None:
    """Copy `src` to `dest` so `dest` is never seen half-written."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(dest)
    try:
        with open(src, "rb") as fin, open(tmp, "wb") as fout:
            while chunk := fin.read(_CHUNK):
                fout.write(chunk)
            fout.flush()
            os.fsync(fout.fileno())
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(dest.parent)


# A copy this node no longer trusts (a checkpoint that does not verify, a record that is not
# storage's) is renamed aside, never deleted at once: a person may want to look at it. Only the
# newest few of a kind are kept, so a node that sets one aside on every restart does not fill its disk.
SET_ASIDE_PREFIX = ".set-aside-"
KEEP_SET_ASIDE = 3


def set_aside(path: Path, family: str, keep: int = KEEP_SET_ASIDE) -> Path:
    """Rename `path` (a file or a folder) to `.set-aside-NAME-STAMP-HEX` beside it, so that nothing
    loads it, and remove the set-aside copies of `family` (the start of NAME: "ckpt-", "state.db")
    in that folder beyond the newest `keep`, oldest first. Returns the new name."""
    path = Path(path)
    aside = path.with_name(f"{SET_ASIDE_PREFIX}{path.name}-{time.time_ns():020d}-{uuid.uuid4().hex[:8]}")
    os.replace(path, aside)
    copies = sorted(path.parent.glob(f"{SET_ASIDE_PREFIX}{family}*"), key=_set_aside_when)
    for old in copies[: max(0, len(copies) - keep)]:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
    return aside


def _set_aside_when(path: Path) -> tuple[int, float]:
    """When a copy was set aside: the stamp in its name (set_aside's), else (older names) its ctime,
    which a rename updates."""
    stamp = path.name.rsplit("-", 2)
    if len(stamp) == 3 and len(stamp[1]) == 20 and stamp[1].isdigit():
        return int(stamp[1]), 0.0
    try:
        return 0, path.lstat().st_ctime
    except OSError:
        return 0, 0.0
