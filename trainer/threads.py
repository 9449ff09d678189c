"""CPU threads shared among the trainers of one node.

The supervisor gives its trainer a pool of threads (all cores on a node of up to 3, all but one on
a bigger node) and names it in GRPO_RUN_CPU_SHARE. Each trainer registers in a node-wide folder
and, at step and evaluation-batch boundaries, runs pool // (trainers on the node) threads, at
least one: alone it uses the whole pool, two runs side by side split it instead of fighting over
it. Measured on 2 cores (wall time of the demo job, 300 steps; seconds per step of a 4 x 256
model with 64-token completions):

    threads per trainer                 demo alone   two demos side by side   4 x 256 alone
    1                                   18.0 s       18.7 s                   0.246
    2, spinning 10,000 rounds (each)    16.3 s       171.9 s                  0.189
    2, sleeping waits (PASSIVE)         -            -                        0.779

Two threads that spin on two cores already taken by another run wait for a descheduled peer at
every barrier; sleeping waits (PASSIVE) cost a wake-up per operation, which on small models is
most of its time. So: short spins (GOMP_SPINCOUNT, set by the supervisor) and never more threads
than the node's share. Other programs on the node are not counted: where they compete for the
cores, set OMP_NUM_THREADS yourself (a user's setting is kept and nothing is shared).

While this job's checkpoint writer process is writing, the trainer runs one thread fewer, so the
writer's core is not also spun on (2 cores, a checkpoint after every 16 ms step: 7 ms each with
both threads, see README).

Registration survives any death: a trainer holds an exclusive flock on its file for as long as it
lives; a file whose lock can be taken belongs to a process that is gone and is removed.
"""

from __future__ import annotations

import fcntl
import logging
import math
import os
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

SHARE_ENV = "GRPO_RUN_CPU_SHARE"       # the trainer's pool of threads; absent: torch's threads are left alone
CHECK_SECONDS = 1.0                    # how often the node's trainers are counted


def node_folder() -> Path:
    """Where this node's trainers register: one folder per user in the temporary directory."""
    return Path(tempfile.gettempdir()) / f"grpo-run-{os.getuid()}" / "trainers"


class CpuShare:
    """This trainer's share of the node's threads (see the module's docstring)."""

    def __init__(self, pool: int, folder: Path | None = None, *, clock=time.monotonic) -> None:
        self.pool, self.folder, self._clock = max(1, pool), folder or node_folder(), clock
        self.folder.mkdir(parents=True, exist_ok=True)
        # locked before it is visible under its name, so nobody takes it for a dead trainer's
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".new-")
        fcntl.flock(fd, fcntl.LOCK_EX)
        self.path = self.folder / f"{os.getpid()}-{os.path.basename(tmp)[5:]}.lock"
        os.rename(tmp, self.path)
        self._fd, self._checked, self.share, self.threads = fd, -math.inf, None, None

    @classmethod
    def from_environment(cls) -> CpuShare | None:
        pool = os.environ.get(SHARE_ENV)
        return cls(int(pool)) if pool else None

    def trainers(self) -> int:
        """Trainers alive on this node, this one included; removes the files of dead ones."""
        alive = 1
        for path in self.folder.glob("*.lock"):
            if path == self.path:
                continue
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue                                   # removed meanwhile
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                alive += 1                                 # its trainer holds it
            else:
                path.unlink(missing_ok=True)               # nobody holds it: that trainer is gone
            finally:
                os.close(fd)
        return alive

    def adjust(self, *, writer_busy: bool = False) -> int:
        """Set torch's threads to this trainer's share, counting the trainers at most every
        CHECK_SECONDS; one fewer (at least one) while `writer_busy`, this job's checkpoint writer
        being at work on a core of the pool. Call it from the thread that runs the model
        (OpenMP's thread count is per calling thread), between steps or evaluation batches."""
        now = self._clock()
        if self.share is None or now - self._checked >= CHECK_SECONDS:
            self._checked = now
            trainers = self.trainers()
            share = max(1, self.pool // trainers)
            if share != self.share:
                log.info("CPU threads: %d (%d trainer%s on this node share %d)", share, trainers,
                         "s" if trainers > 1 else "", self.pool)
                self.share = share
        threads = max(1, self.share - 1) if writer_busy else self.share
        if threads != self.threads:
            import torch

            torch.set_num_threads(threads)
            self.threads = threads
        return threads

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
