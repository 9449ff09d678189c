"""The fresh node's path to its first new step (issue 52 item 2): a resume records it in parts, the
trainer starts before the node has taken the lease (its imports beside the supervisor's work) and
loads its model beside the checkpoint's fetch, reads the checkpoint only once the fetch has ended,
and the run still ends at the uninterrupted run's bytes. Orders of events, never timings."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from grpo_run.runner.supervisor.spawn import PrewarmedTrainer, trainer_env
from grpo_run.runner.supervisor.startup import PARTS
from grpo_run.trainer.protocol import CHILD_STOPPED, SHARE_ENV
from tests.runner.jobs.test_resume import exported_bytes, grpo_run, status, uninterrupted, write_job  # noqa: F401


def spans(path: dict) -> dict[str, tuple[float, float]]:
    """{part: (start, end)} of the record's path (the first of a name that comes twice)."""
    out: dict[str, tuple[float, float]] = {}
    for p in path["parts"]:
        out.setdefault(p["part"], (p["startSeconds"], p["startSeconds"] + p["seconds"]))
    return out


def test_a_fresh_node_starts_its_trainer_before_the_lease_and_loads_it_beside_the_checkpoint_fetch(
        tmp_path, s3_env, uninterrupted):  # noqa: F811
    job = write_job(tmp_path, s3_env.url)
    killed = grpo_run(tmp_path / "node-a", "apply", "-f", str(job), fault="backward@5", check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = grpo_run(tmp_path / "node-b", "resume", "resumable", "--storage", s3_env.url)
    assert "first new step" in resumed.stderr                  # the path, said in the node's log

    st = status(tmp_path / "node-c", s3_env.url)
    path = st["startup"]
    assert path["attempt"] == len(st["attempts"]) == 2         # the fresh node's, not the first node's
    assert {p["part"] for p in path["parts"]} <= set(PARTS)
    at = spans(path)
    # the trainer process (its interpreter and imports) began before the lease was taken ...
    assert at["trainer imports"][0] < at["lease"][0]
    # ... was handed its plan before the checkpoint fetch began, so its model, graders and engine load beside it
    assert at["trainer spawn"][0] < at["checkpoint fetch"][0]
    assert at["engine start"][0] > at["trainer spawn"][0] and "waiting for the checkpoint" in at
    # ... and read the checkpoint only once it was fetched
    assert at["checkpoint load"][0] >= at["checkpoint fetch"][1]
    assert at["first step"][0] >= at["checkpoint load"][1]
    assert path["totalSeconds"] == pytest.approx(max(end for _, end in at.values()), abs=0.002)   # rounded to ms
    assert max(at, key=lambda part: at[part][1]) == "first step"
    # the overlap changes nothing the run computes
    assert st["phase"] == "Succeeded" and st["baseline"]["runs"] == 1
    assert exported_bytes(tmp_path / "node-c", s3_env.url, tmp_path / "export") == uninterrupted


def test_a_trainer_started_early_is_taken_only_with_the_environment_the_attempt_gives(tmp_path):
    work = tmp_path / "runs" / "job"
    env = trainer_env(None, progress=False, kept_threads=None)

    fits = PrewarmedTrainer(work, progress=False)
    # a resume keeps its first trainer's threads and shares no pool (the first attempt's share varies too)
    late, given = {**env}, None if SHARE_ENV in env else "1"
    late.pop(SHARE_ENV) if given is None else late.update({SHARE_ENV: given})
    taken = fits.take(late, work)
    assert taken is not None and taken.proc.poll() is None
    assert taken.late == {SHARE_ENV: given}   # given with its plan, before anything reads it
    taken.give_up()                          # it was waiting for its plan: it ends without a word
    assert taken.proc.wait(timeout=120) == CHILD_STOPPED and not (work / "logs").exists()
    os.close(taken.events_fd)
    fits.close()                             # taken: not ended twice

    other = PrewarmedTrainer(work, progress=False)
    proc = other._spawned.proc
    assert other.take({**env, "OMP_NUM_THREADS": "7"}, work) is None    # read at torch's import: not this one
    assert proc.poll() is not None            # ended, for a trainer started afresh


def test_a_trainer_started_early_and_never_taken_is_ended_with_the_run(tmp_path):
    """A job already finished, or held by another node: the process started early goes with the run."""
    work = tmp_path / "runs" / "job"
    done = subprocess.run([sys.executable, "-c", (
        "import pathlib, sys; from grpo_run.runner.supervisor.spawn import prewarmed_trainer\n"
        f"with prewarmed_trainer(pathlib.Path({str(work)!r}), alone=True, progress=False) as p:\n"
        "    print(p._spawned.proc.pid)\n")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
