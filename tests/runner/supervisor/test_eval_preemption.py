"""A notice during the baseline or the final evaluation ends the attempt as Preempted inside the
notice window, and the resume on a fresh node continues the evaluation from the batches that
had finished instead of computing them again.

The job evaluates 120 held-out tasks in batches of 2 (60 batches); a `hold:KIND@2` fault holds
the trainer once two are finished, so the SIGTERM to the supervisor lands mid-evaluation."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import yaml

from tests.runner.jobs.test_resume import grpo_run, status
from tests.faults.harness import fault_env, wait_until
from tests.runner.supervisor.test_supervisor import start_apply

STEPS = 2
EVAL_TASKS, EVAL_BATCH = 120, 2


def write_eval_heavy_job(folder: Path, storage: str) -> Path:
    (folder / "length.py").write_text("def score(completion, task):\n    return float(len(completion))\n")
    (folder / "train.jsonl").write_text("".join(f'{{"prompt": "{a}+{b}="}}\n' for a in range(5) for b in range(5)))
    (folder / "eval.jsonl").write_text("".join(f'{{"prompt": "{i % 10}+{i // 10 % 10}="}}\n' for i in range(EVAL_TASKS)))
    spec = {"model": "tiny:char", "storage": storage,
            "environment": {"name": "length", "reward": "length.py:score", "tasks": "train.jsonl",
                            "evalTasks": "eval.jsonl"},
            "parameters": {"numGenerations": 2, "promptsPerStep": 2, "maxCompletionLength": 48, "maxSteps": STEPS,
                           "saveSteps": 1000, "evalBatchSize": EVAL_BATCH, "learningRate": 0.002}}
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "grpo-run/v1", "kind": "TrainingJob",
                                    "metadata": {"name": "resumable"}, "spec": spec}))
    return path


def finished_batches(home: Path, kind: str) -> int:
    from grpo_run.state.record import Record

    db = home / "runs" / "resumable" / "state.db"
    if not db.exists():
        return 0
    with Record(db) as record:
        return len((record.value(f"evalBatches.{kind}") or {}).get("batches", {}))


def wait_for_batches(home: Path, proc, kind: str, at_least: int = 2, timeout: float = 180) -> None:
    """Until the node's record has `at_least` finished batches of `kind` (polled, bounded)."""
    deadline = time.monotonic() + timeout
    while finished_batches(home, kind) < at_least:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"no {kind} evaluation batches in time"
        time.sleep(0.05)


def notice_during(tmp_path, s3_env, kind: str) -> tuple[dict, dict]:
    """SIGTERM the supervisor while evaluation `kind` runs, then resume on a fresh node. Returns
    (status after the notice, status after the resume)."""
    job = write_eval_heavy_job(tmp_path, s3_env.url)
    held = tmp_path / "held"          # the trainer holds once two batches are finished, until the notice
    proc = start_apply(tmp_path / "node-a", job, GRPO_RUN_NOTICES="none", **fault_env(f"hold:{kind}@2", held))
    wait_for_batches(tmp_path / "node-a", proc, kind)
    wait_until("the hold", held.exists, proc)
    noticed = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    exited = time.monotonic() - noticed
    assert proc.returncode == 3, err[-3000:]
    assert exited <= 25, exited        # inside the shortest (GCP/Azure, ~30 s) notice window
    stopped = status(tmp_path / "node-x", s3_env.url)
    assert stopped["phase"] == "Preempted" and stopped["attempts"][-1]["reason"] == "Preempted"
    print(f"\n{kind} evaluation: process exited {exited:.2f} s after SIGTERM; "
          f"notice -> durable {stopped['lastNotice']['noticeToDurableSeconds']:.2f} s")
    (tmp_path / "job.yaml").unlink()
    grpo_run(tmp_path / "node-b", "resume", "resumable", "--storage", s3_env.url)
    return stopped, status(tmp_path / "node-b", s3_env.url)


def test_a_notice_during_the_baseline_evaluation_preempts_and_the_resume_reuses_its_finished_batches(
        tmp_path, s3_env):
    stopped, done = notice_during(tmp_path, s3_env, "baseline")
    assert "baseline" not in stopped and stopped["step"] == 0
    assert done["phase"] == "Succeeded" and done["step"] == STEPS
    reused = done["baseline"]["reusedBatches"]
    print(f"baseline batches reused on resume: {reused} of {done['baseline']['batches']}")
    assert 2 <= reused < EVAL_TASKS // EVAL_BATCH and done["baseline"]["batches"] == EVAL_TASKS // EVAL_BATCH
    assert done["baseline"]["runs"] == 1 and done["baseline"]["tasks"] == EVAL_TASKS
    assert [a["reason"] for a in done["attempts"]] == ["Preempted", "Succeeded"]


def test_a_notice_during_the_final_evaluation_preempts_and_the_resume_reuses_its_finished_batches(
        tmp_path, s3_env):
    stopped, done = notice_during(tmp_path, s3_env, "final")
    assert stopped["step"] == STEPS and stopped["checkpoints"]["latestDurable"] == STEPS   # training kept
    assert done["phase"] == "Succeeded" and done["step"] == STEPS
    reused = done["final"]["reusedBatches"]
    print(f"final batches reused on resume: {reused} of {done['final']['batches']}")
    assert 2 <= reused < EVAL_TASKS // EVAL_BATCH
    assert done["baseline"]["runs"] == 1 and done["final"]["runs"] == 1
    assert [a["reason"] for a in done["attempts"]] == ["Preempted", "Succeeded"]
