"""The node's local disk fills up mid-run (a 64 MB tmpfs the test mounts as the node's
GRPO_RUN_HOME, then fills): a clear error that says what to do, the previous checkpoint intact
(durable in storage, whole on the disk), and the run resumable on another node, ending byte for
byte as one never interrupted."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from grpo_run.checkpoint.manifest import newest_sealed, verify
from tests.faults.harness import start_node, wait_until
from tests.faults.test_store_faults import checkpoints
from tests.checkpoint.test_corrupt_resume import durable_steps
from tests.runner.jobs.test_resume import exported_bytes, grpo_run, status, write_job

pytestmark = [pytest.mark.fault, pytest.mark.slow]
STEPS, SAVE = 120, 4


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MB tmpfs mounted for this test (root, as CI runs; skipped where mounting is refused)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): run the tests as root")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path) -> int:
    """Write zeros into a file on `disk` until nothing more fits; the bytes written."""
    written = 0
    block = b"\0" * (1 << 20)
    with open(disk / "filler", "wb", buffering=0) as f:
        while True:
            try:
                written += f.write(block)
            except OSError:
                break
        for size in (1 << 16, 1 << 12, 1):          # the last scraps too
            while True:
                try:
                    written += f.write(block[:size])
                except OSError:
                    break
    return written


def test_a_full_local_disk_is_a_clear_error_and_the_run_resumes_elsewhere(tmp_path, s3_env, small_disk, figures):
    reference_home = tmp_path / "reference"
    reference_home.mkdir()
    grpo_run(reference_home / "home", "apply", "-f", str(write_job(reference_home, None, maxSteps=STEPS, saveSteps=SAVE)))
    reference = exported_bytes(reference_home / "home", None, reference_home / "export")

    node = small_disk / "node-a"
    proc = start_node(node, "apply", "-f", str(write_job(tmp_path, s3_env.url, maxSteps=STEPS, saveSteps=SAVE)),
                      GRPO_RUN_NOTICES="none")
    wait_until("a durable checkpoint", lambda: checkpoints(node)[1] >= SAVE, proc)
    filled = fill(small_disk)
    out, err = proc.communicate(timeout=300)
    print(f"\nfilled {filled / 1e6:.1f} MB; exit {proc.returncode}; last lines:\n" + "\n".join(err.splitlines()[-6:]))
    assert proc.returncode == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    said = [line for line in err.splitlines() if "No space left on device" in line or "disk is full" in line]
    assert said, err[-3000:]
    local = newest_sealed(node / "runs" / "resumable" / "checkpoints")
    intact = local is not None and verify(local[1]) is not None
    # durable in storage (the record there may lag: its last upload needed room for a snapshot)
    durable = max(durable_steps(s3_env), default=0)
    assert intact and durable >= SAVE

    os.remove(small_disk / "filler")
    grpo_run(tmp_path / "node-b", "resume", "resumable", "--storage", s3_env.url)
    assert status(tmp_path / "node-x", s3_env.url)["phase"] == "Succeeded"
    identical = exported_bytes(tmp_path / "node-c", s3_env.url, tmp_path / "export") == reference
    figures.add("disk", case="local disk (64 MB tmpfs) filled mid-run", outcome=f"exit 1: {said[-1].strip()[:140]}",
                previous_intact=intact, resumed_elsewhere=f"from {durable}, identical {identical}", identical=identical)
    assert identical
