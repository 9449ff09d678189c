"""A full local disk: the one failure a restart on the same node cannot help, told apart from the
others and said with its fix."""

from __future__ import annotations

import errno
import logging
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)


def disk_full(e: BaseException) -> bool:
    """The local disk (or the record's SQLite file on it) has no room left."""
    return (isinstance(e, OSError) and e.errno == errno.ENOSPC) or \
        (isinstance(e, sqlite3.OperationalError) and "disk is full" in str(e))


@contextmanager
def unless_disk_full(what: str) -> Iterator[None]:
    """A full local disk while recording `what` is logged in one line; any other error propagates."""
    try:
        yield
    except (OSError, sqlite3.OperationalError) as e:
        if not disk_full(e):
            raise
        log.error("could not record %s: the local disk is full (%s)", what, e)


def disk_full_message(work: Path, detail: str, durable: int) -> str:
    return (f"the local disk is full ({detail}) under {work}: free space there, or set GRPO_RUN_HOME to a "
            f"bigger disk, then `grpo-run resume`; checkpoint {durable} is durable in storage and stays so")
