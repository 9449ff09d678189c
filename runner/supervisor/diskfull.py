"""A full local disk: the one failure a restart on the same node cannot help, told apart from the
others and said with its fix."""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)


# Less room than this left where the record is, and SQLite's "disk I/O error" is the disk being full:
# SQLite says "database or disk is full" only when the write it was doing reported ENOSPC itself,
# and "disk I/O error" when that write was its journal's (seen in a clean-clone run of test_disk_full).
_NEARLY_FULL_BYTES = 1 << 20


def disk_full(e: BaseException, where: Path | None = None) -> bool:
    """The local disk (or the record's SQLite file on it) has no room left. `where`: a folder on
    that disk, to tell SQLite's "disk I/O error" on a full disk from one on a failing disk."""
    if isinstance(e, OSError):
        return e.errno == errno.ENOSPC
    if not isinstance(e, sqlite3.OperationalError):
        return False
    if "disk is full" in str(e):
        return True
    return "disk I/O error" in str(e) and where is not None and free_bytes(where) < _NEARLY_FULL_BYTES


def free_bytes(where: Path) -> int:
    """The bytes an unprivileged write could still use on `where`'s file system (large when it
    cannot be told)."""
    try:
        found = os.statvfs(where)
    except OSError:
        return 1 << 62
    return found.f_bavail * found.f_frsize


@contextmanager
def unless_disk_full(what: str, where: Path | None = None) -> Iterator[None]:
    """A full local disk while recording `what` is logged in one line; any other error propagates.
    `where`: a folder on the record's disk (see disk_full)."""
    try:
        yield
    except (OSError, sqlite3.OperationalError) as e:
        if not disk_full(e, where):
            raise
        log.error("could not record %s: the local disk is full (%s)", what, e)


def disk_full_message(work: Path, detail: str, durable: int) -> str:
    return (f"the local disk is full ({detail}) under {work}: free space there, or set GRPO_RUN_HOME to a "
            f"bigger disk, then `grpo-run resume`; checkpoint {durable} is durable in storage and stays so")
