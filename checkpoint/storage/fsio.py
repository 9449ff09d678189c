"""Local writes that survive a kill at any line: temporary name, fsync, rename, fsync folder."""

from __future__ import annotations

import os
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
