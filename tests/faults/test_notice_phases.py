"""Every source of notices (AWS, GCP, Azure, SIGTERM) in every phase of a run: during sampling,
the backward pass, an upload, the baseline and final evaluations, and a restore; and a second
notice while the first is handled. Each ends Preempted inside the shortest notice window with
no completed step lost (the newest durable checkpoint is the last completed step).

The moment is not left to timing: a `hold:POINT@K` fault (tests/faults/inject/grpo_run_faults.py)
stops the node right there until the notice's stop request reaches that process, so the notice lands in the middle of
it (for the evaluations: once two of their 60 batches are finished).

Four cases run on every edit (all four sources among them); CI (`-m slow`) adds the baseline and
final evaluations, each with a source chosen by a seeded draw (GRPO_RUN_NOTICE_SEED); scripts/reliability runs the whole matrix
(GRPO_RUN_CAMPAIGN=full) and writes its figures into docs/reliability.md."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time

import pytest

from tests.faults.harness import NOTICE_WINDOW_S, SOURCES, marker, notice_source, start_node, wait_until
from tests.campaign import full_campaign_only
from tests.checkpoint.test_corrupt_resume import durable_steps
from tests.runner.supervisor.test_eval_preemption import EVAL_BATCH, EVAL_TASKS, finished_batches, write_eval_heavy_job
from tests.runner.jobs.test_resume import exported_bytes, grpo_run, status, uninterrupted, write_job  # noqa: F401

pytestmark = pytest.mark.fault
PHASES = ("sampling", "backward", "upload", "baseline", "final", "restore", "loading")
# on every edit, one source per phase (all four sources among them); the rest of the matrix in CI
FAST = {("sampling", "aws"), ("backward", "gcp"), ("upload", "azure"), ("restore", "signal")}
HELD_STEP = 5          # the step a hold stops in (0-based: 5 steps completed before it)
SAVE = 2


SEED = int(os.environ.get("GRPO_RUN_NOTICE_SEED", "2026"))


def _sampled() -> set[tuple[str, str]]:
    """CI's seeded sample: one source for each phase that has none among the cases run on every edit."""
    draw = random.Random(SEED)
    covered = {phase for phase, _ in FAST}
    return {(phase, draw.choice(SOURCES)) for phase in PHASES if phase not in covered}


def _cases():
    sampled = _sampled()
    for phase in PHASES:
        for source in SOURCES:
            marks = [] if (phase, source) in FAST else [pytest.mark.slow]
            if (phase, source) not in FAST | sampled:
                marks = full_campaign_only(f"CI runs each phase with one source (seed {SEED})")
            yield pytest.param(phase, source, id=f"{phase}-{source}", marks=marks)


def _noticed(proc: subprocess.Popen, trigger, what: str) -> tuple[float, str]:
    """Send the notice; the node must exit Preempted (3) inside the window. (seconds, stderr)"""
    sent = time.monotonic()
    trigger(proc)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"{what}: still running 60 s after the notice:\n{err[-3000:]}") from None
    exited = time.monotonic() - sent
    assert proc.returncode == 3, f"{what}: status {proc.returncode}\n{err[-3000:]}"
    return exited, err


@pytest.mark.parametrize("phase, source", _cases())
def test_a_notice_in_any_phase_from_any_source_preempts_inside_the_window_losing_nothing(
        tmp_path, s3_env, uninterrupted, figures, phase, source):
    storage, node = s3_env.url, tmp_path / "node-a"
    with notice_source(source) as (env, trigger):
        if phase in ("baseline", "final"):
            job = write_eval_heavy_job(tmp_path, storage)
            proc = start_node(node, "apply", "-f", str(job), fault=f"hold:{phase}@2", **env)
            wait_until(f"two {phase} batches", marker(node).exists, proc)
        elif phase == "loading":
            # the trainer is building its model (which never asks for a stop) when the notice comes
            proc = start_node(node, "apply", "-f", str(write_job(tmp_path, storage)), fault="hold:load@0", **env)
            wait_until("the trainer's model load", marker(node).exists, proc)
        elif phase == "restore":
            # a node dies after checkpoint 4 is durable (or only 2, when the uploader, behind on a
            # loaded machine, let 6 supersede 4); a fresh one is restoring it when the notice comes
            killed = grpo_run(tmp_path / "node-0", "apply", "-f", str(write_job(tmp_path, storage)),
                              fault="upload@6", check=False)
            assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
            restored = durable_steps(s3_env)[0]
            proc = start_node(node, "resume", "resumable", "--storage", storage, fault=f"hold:restore@{restored}",
                              **env)
            wait_until(f"the restore of checkpoint {restored}", marker(node).exists, proc)
        else:
            point = {"sampling": "sample", "backward": "backward", "upload": "upload"}[phase]
            # an upload holds while training goes on: a long run, so the notice finds it training
            steps = 100_000 if phase == "upload" else 40
            job = write_job(tmp_path, storage, maxSteps=steps, saveSteps=SAVE)
            at = 2 * SAVE if phase == "upload" else HELD_STEP
            proc = start_node(node, "apply", "-f", str(job), fault=f"hold:{point}@{at}", **env)
            wait_until(f"the hold in {phase}", marker(node).exists, proc)
        exited, err = _noticed(proc, trigger, f"{phase}/{source}")

    st = status(tmp_path / "node-x", storage)
    durable = st["checkpoints"]["latestDurable"] or 0
    # completed steps the notice cost: past the newest durable one (on a restore, the killed node
    # before had steps of its own past the checkpoint restored; those were the kill's, not the notice's)
    lost = restored - durable if phase == "restore" else st["step"] - durable
    notice = st["lastNotice"]
    figures.add("notice", source=source, phase=phase, exit_seconds=round(exited, 2),
                notice_to_durable_seconds=notice["noticeToDurableSeconds"], steps_lost=lost,
                outcome=st["phase"])
    print(f"\n{phase}/{source}: exited {exited:.2f} s after the notice; durable {durable}; lost {lost}")
    assert st["phase"] == "Preempted" and notice["source"] == source
    assert exited <= NOTICE_WINDOW_S
    assert lost == 0
    # a trainer with nothing of this attempt to save is not waited for (the window is the notice's)
    assert "did not stop within" not in err
    if phase == "sampling":
        assert durable == HELD_STEP                 # the step being sampled is given up, not saved half-done
    elif phase == "backward":
        assert durable == HELD_STEP + 1             # the step being applied completes, then stops
    elif phase == "baseline":
        assert st["step"] == 0 and finished_batches(node, "baseline") >= 2
    elif phase == "loading":
        assert st["step"] == 0 and durable == 0
    elif phase == "final":
        assert durable == st["step"] > 0 and finished_batches(node, "final") >= 2
    elif phase == "restore":
        # the checkpoint being restored stays the newest durable one (4, or 2 when the killed node's
        # uploader let 6 supersede 4): the notice neither loses it nor publishes anything half-restored
        assert restored in (2, 4) and durable == restored and "while restoring" in st["message"]
        # stopped between two of its files: nothing of it is left on the node
        assert not list((node / "runs" / "resumable" / "checkpoints").glob(f"*ckpt-{restored:08d}*"))
        # nothing lost: a third node finishes the run byte for byte as one never interrupted
        grpo_run(tmp_path / "node-b", "resume", "resumable", "--storage", storage)
        assert exported_bytes(tmp_path / "node-c", storage, tmp_path / "export") == uninterrupted
    if phase in ("baseline", "final"):
        assert finished_batches(node, phase) < EVAL_TASKS // EVAL_BATCH   # mid-evaluation, not after it


def test_a_second_notice_while_the_first_is_handled_changes_nothing(tmp_path, s3_env, figures):
    """SIGTERM (a systemd stop) while the trainer is mid-step, then an AWS interruption notice
    and another SIGTERM while that stop is under way: one stop, nothing lost."""
    job = write_job(tmp_path, s3_env.url, maxSteps=40, saveSteps=SAVE)
    node = tmp_path / "node-a"
    with notice_source("aws") as (env, aws_notice):
        proc = start_node(node, "apply", "-f", str(job), fault=f"hold:backward@{HELD_STEP}", **env)
        wait_until("the hold in the backward pass", marker(node).exists, proc)

        def twice(p: subprocess.Popen) -> None:
            p.send_signal(signal.SIGTERM)
            aws_notice(p)
            time.sleep(0.02)        # not a synchronisation: the second SIGTERM comes a little later
            p.send_signal(signal.SIGTERM)

        exited, err = _noticed(proc, twice, "two notices")
    st = status(tmp_path / "node-x", s3_env.url)
    lost = st["step"] - st["checkpoints"]["latestDurable"]
    figures.add("notice", source="signal, then aws and signal again", phase="second notice",
                exit_seconds=round(exited, 2), notice_to_durable_seconds=st["lastNotice"]["noticeToDurableSeconds"],
                steps_lost=lost, outcome=st["phase"])
    assert st["phase"] == "Preempted" and st["lastNotice"]["source"] == "signal"   # the first one counts
    assert st["checkpoints"]["latestDurable"] == HELD_STEP + 1 and lost == 0
    assert exited <= NOTICE_WINDOW_S
    assert [a["reason"] for a in st["attempts"]] == ["Preempted"]
    lines = err.splitlines()
    first = next(i for i, line in enumerate(lines) if "preemption notice from signal" in line)
    again = [i for i, line in enumerate(lines) if "another preemption notice" in line]
    done = next(i for i, line in enumerate(lines) if "preempted (signal)" in line)
    assert again and all(first < i < done for i in again), err[-3000:]


def test_a_notice_while_the_trainer_exits_with_its_final_weights_sealed_ends_the_job_succeeded(
        tmp_path, s3_env, uninterrupted, figures):
    """A notice after the final evaluation, with the final weights sealed and the trainer on its
    way out (the `exit` hold: STOP_SIGNAL default-handled, as while an interpreter shuts down).
    bench/goodput.py found it on 2026-12-07: the supervisor stopped the trainer, which died of the
    signal, and the attempt ended Preempted at the last periodic checkpoint; the next node trained
    the last steps and the final evaluation again. The trainer is left to exit, its final weights go
    up inside the window, and the job is Succeeded."""
    storage, node = s3_env.url, tmp_path / "node-a"
    with notice_source("gcp") as (env, trigger):
        proc = start_node(node, "apply", "-f", str(write_job(tmp_path, storage)), fault="hold:exit@0", **env)
        wait_until("the trainer's exit, its final weights sealed", marker(node).exists, proc)
        sent = time.monotonic()
        trigger(proc)
        out, err = proc.communicate(timeout=60)
    exited = time.monotonic() - sent
    assert proc.returncode == 0, err[-3000:]
    assert "notice (gcp) as the run ended -> its final weights (step 8) in storage" in out, out
    st = status(tmp_path / "node-x", storage)
    figures.add("notice", source="gcp", phase="exit", exit_seconds=round(exited, 2), outcome=st["phase"])
    assert st["phase"] == "Succeeded" and [a["reason"] for a in st["attempts"]] == ["Succeeded"]
    assert exited <= NOTICE_WINDOW_S and "did not exit within" not in err
    assert "the trainer has sealed its final weights" in err
    assert exported_bytes(tmp_path / "node-c", storage, tmp_path / "export") == uninterrupted
