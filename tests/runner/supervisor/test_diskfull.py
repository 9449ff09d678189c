"""Telling a full local disk from other failures (runner/supervisor/diskfull.py): SQLite says
"disk I/O error", not "database or disk is full", when the write that met ENOSPC was its journal's."""

from __future__ import annotations

import errno
import sqlite3
import subprocess

import pytest

from grpo_run.runner.supervisor.diskfull import disk_full, unless_disk_full


@pytest.fixture
def full_disk(tmp_path):
    """A 1 MB tmpfs, filled (root, as CI runs; skipped where mounting is refused)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): run the tests as root")
    with open(mount / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_sqlites_disk_io_error_on_a_full_disk_is_a_full_disk(full_disk, tmp_path):
    io_error = sqlite3.OperationalError("disk I/O error")
    assert disk_full(io_error, full_disk)
    assert not disk_full(io_error, tmp_path)          # room there: a failing disk, not a full one
    assert not disk_full(io_error)                    # nowhere to look: not taken for a full disk
    with unless_disk_full("a step", full_disk):       # logged in one line, not raised
        raise io_error
    with pytest.raises(sqlite3.OperationalError), unless_disk_full("a step", tmp_path):
        raise io_error


def test_the_other_signs_of_a_full_disk_need_no_folder():
    assert disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert disk_full(sqlite3.OperationalError("database or disk is full"))
    assert not disk_full(OSError(errno.EIO, "Input/output error"))
    assert not disk_full(sqlite3.OperationalError("database is locked"))
