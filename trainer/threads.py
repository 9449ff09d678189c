"""CPU threads shared among the trainers of one node.

The supervisor gives its trainer a pool of threads (all cores on a node of up to 3, all but one on
a bigger node) and names it in GRPO_RUN_CPU_SHARE (protocol.SHARE_ENV). Each trainer registers in a node-wide folder
as it starts and, once its model is loaded, takes pool // (trainers on the node) threads, at
least one: alone it uses the whole pool, two runs started side by side split it instead of
fighting over it. Measured on 2 cores (wall time of the demo job, 300 steps; seconds per step of
a 4 x 256 model with 64-token completions):

    threads per trainer                 demo alone   two demos side by side   4 x 256 alone
    1                                   18.0 s       18.7 s                   0.246
    2, spinning 10,000 rounds (each)    16.3 s       171.9 s                  0.189
    2, sleeping waits (PASSIVE)         -            -                        0.779

Two threads that spin on two cores already taken by another run wait for a descheduled peer at
every barrier; sleeping waits (PASSIVE) cost a wake-up per operation, which on small models is
most of its time. So: short spins (GOMP_SPINCOUNT, set by the supervisor) and never more threads
than the node's share.

The count is decided once per run and kept: CPU reductions (a gradient norm, a large sum) round
differently with another number of threads, so a run that changed it midway, or a resume that
took another share, would no longer end where an uninterrupted run ends. The trainer reports
its count (the `Started` event), the supervisor records it, and later attempts run with it,
whoever else is on the node then. Trainers that start later see the earlier ones; programs other
than grpo-run are not counted: where they compete for the cores, set OMP_NUM_THREADS yourself (a
user's setting is kept and nothing is shared).

Registration survives any death: a trainer holds an exclusive flock on its file for as long as it
lives; a file whose lock can be taken belongs to a process that is gone and is removed.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from pathlib import Path

from grpo_run.trainer.protocol import SHARE_ENV

log = logging.getLogger(__name__)


def node_folder() -> Path:
    """Where this node's trainers register: one folder per user in the temporary directory."""
    return Path(tempfile.gettempdir()) / f"grpo-run-{os.getuid()}" / "trainers"


class CpuShare:
    """This trainer's share of the node's threads (see the module's docstring)."""

    def __init__(self, pool: int, folder: Path | None = None) -> None:
        self.pool, self.folder = max(1, pool), folder or node_folder()
        self.folder.mkdir(parents=True, exist_ok=True)
        # locked before it is visible under its name, so nobody takes it for a dead trainer's
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".new-")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self.path = self.folder / f"{os.getpid()}-{os.path.basename(tmp)[5:]}.lock"
            os.rename(tmp, self.path)
        except BaseException:
            os.close(fd)
            Path(tmp).unlink(missing_ok=True)
            raise
        self._fd, self.threads = fd, None

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

    def take(self) -> int:
        """This trainer's threads: pool // (trainers on the node now), set in torch on the first
        call and the same on every later one. Call it from the thread that runs the model
        (OpenMP's thread count is per calling thread)."""
        if self.threads is None:
            trainers = self.trainers()
            self.threads = max(1, self.pool // trainers)
            import torch

            torch.set_num_threads(self.threads)
            log.info("CPU threads: %d (%d trainer%s on this node share %d)", self.threads, trainers,
                     "s" if trainers > 1 else "", self.pool)
        return self.threads

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
