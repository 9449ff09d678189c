"""The trainer's CPU threads, as the supervisor sets them in its environment (the node-wide share
they are taken from, with the measurements: trainer/threads.py)."""

from __future__ import annotations

from typing import Mapping

from grpo_run.trainer.protocol import SHARE_ENV

# Rounds an idle OpenMP thread spins before it sleeps: long enough to catch the next operation of a
# step (microseconds apart), short enough to give the core back while the trainer waits for its
# grader. libgomp's default (300,000 here) is an order longer.
SPIN_ROUNDS = 10_000


def trainer_threads(cores: int, user: Mapping[str, str], *, kept: int | None = None) -> dict[str, str]:
    """The trainer's CPU threads (environment variables to add to `user`, the environment it would
    inherit). A run's first attempt gets a pool to share with the node's other trainers
    (trainer.threads, with the measurements): all cores on a node of up to 3, where every core
    counts (2 threads alone: demo 16.3 s against 18.0 s with one, a 4 x 256 model 0.189 against
    0.246 s per step), one left to the grader, the checkpoint writer and the uploads on a bigger
    one. Later attempts run with the count the first one took (`kept`): another count would round
    the arithmetic differently. Waits spin briefly, then sleep (GOMP_SPINCOUNT). A user's own
    OMP_NUM_THREADS is kept, and then nothing is shared."""
    if "OMP_NUM_THREADS" in user:
        return {}
    if kept is not None:
        env = {"OMP_NUM_THREADS": str(kept)}
    else:
        pool = max(1, cores if cores <= 3 else cores - 1)
        env = {"OMP_NUM_THREADS": str(pool), SHARE_ENV: str(pool)}
    if int(env["OMP_NUM_THREADS"]) > 1 and "OMP_WAIT_POLICY" not in user and "GOMP_SPINCOUNT" not in user:
        env["GOMP_SPINCOUNT"] = str(SPIN_ROUNDS)
    return env
