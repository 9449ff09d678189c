"""What a node checks before and while it spends GPU time on an attempt: the reward sandbox it
runs with (spec.sandbox, the node's GRPO_RUN_SANDBOX), recorded per attempt; and a job whose
attempts keep ending Preempted without a step, failed instead of booted again."""

import json
import signal
import sqlite3
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpo_run.runner.supervisor.supervisor import PREEMPTED_WITHOUT_PROGRESS
from grpo_run.state.phases import Phase
from grpo_run.state.record import RECORD_FILE, Record
from tests.tiny_models import seed_home
from tests.nonamespaces import without_namespaces

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.trust

# Runs grpo-run the way a container under Docker's default seccomp profile would: unshare() is
# refused (EPERM) to it and everything it starts, so no user or network namespace can be made.
WITHOUT_NAMESPACES = without_namespaces('''
    import os, sys
    os.execv(sys.executable, [sys.executable, "-m", "grpo_run.runner.cli", *sys.argv[1:]])
''')


def write_job(folder: Path, **spec_extra) -> Path:
    (folder / "length.py").write_text("def score(completion, task):\n    return float(len(completion))\n")
    (folder / "train.jsonl").write_text("".join(f'{{"prompt": "{a}+{b}="}}\n' for a in range(3) for b in range(3)))
    (folder / "eval.jsonl").write_text('{"prompt": "7+8="}\n{"prompt": "1+2="}\n')
    spec = {"model": "tiny:char", "storage": str(folder / "store"),
            "environment": {"name": "length", "reward": "length.py:score", "tasks": "train.jsonl",
                            "evalTasks": "eval.jsonl"},
            "parameters": {"numGenerations": 2, "promptsPerStep": 2, "maxCompletionLength": 2, "maxSteps": 2,
                           "saveSteps": 2},
            **spec_extra}
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "grpo-run/v1", "kind": "TrainingJob",
                                    "metadata": {"name": "guarded"}, "spec": spec}))
    return path


def grpo_run(folder: Path, *args: str, without_namespaces: bool = False, **env_extra: str
             ) -> subprocess.CompletedProcess:
    env = {**os.environ, "GRPO_RUN_HOME": str(folder / "home"), **env_extra}
    seed_home(Path(env["GRPO_RUN_HOME"]))
    command = [sys.executable, "-c", WITHOUT_NAMESPACES] if without_namespaces else \
        [sys.executable, "-m", "grpo_run.runner.cli"]
    return subprocess.run([*command, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def stored(folder: Path) -> dict:
    done = grpo_run(folder, "get", "tj", "guarded", "--storage", str(folder / "store"), "-o", "json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["status"]


@pytest.mark.slow
def test_a_node_set_to_strict_refuses_to_run_rewards_without_namespaces_whatever_the_job_says(tmp_path, figures):
    """The job asks for best-effort, as a planted spec in storage could; the node says strict,
    and strict wins: the job fails at once, naming the missing layer and its fix, and is not
    restarted as a crash."""
    job = write_job(tmp_path, sandbox="best-effort")
    done = grpo_run(tmp_path, "apply", "-f", str(job), without_namespaces=True, GRPO_RUN_SANDBOX="strict")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "allow user namespaces" in done.stderr and "Traceback" not in done.stderr
    status = stored(tmp_path)
    assert status["phase"] == "Failed" and "spec.sandbox: strict" in status["message"]
    assert [a["reason"] for a in status["attempts"]] == ["Failed"]          # refused once, never restarted
    figures.add("trust", actor="bucket writer", tried="a stored spec with sandbox: best-effort, resumed on a "
                "node set to strict that cannot make namespaces", protection="the node's GRPO_RUN_SANDBOX=strict wins",
                outcome="job Failed once, the missing layer named; no reward ran", held=True)


@pytest.mark.slow
def test_each_attempt_records_the_sandbox_it_ran_with(tmp_path):
    """Best-effort on a node without namespaces runs the rewards with what the node allows, and
    the attempt says so; a node with every layer records them all."""
    degraded = tmp_path / "degraded"
    degraded.mkdir()
    done = grpo_run(degraded, "apply", "-f", str(write_job(degraded)), without_namespaces=True)
    assert done.returncode == 0, done.stderr[-3000:]
    mode = stored(degraded)["attempts"][0]["sandbox"]
    assert mode["network"] == "python" and mode["seccomp"] == "on", mode

    full = tmp_path / "full"
    full.mkdir()
    done = grpo_run(full, "apply", "-f", str(write_job(full, sandbox="strict")))
    assert done.returncode == 0, done.stderr[-3000:]
    mode = stored(full)["attempts"][0]["sandbox"]
    assert {k: mode[k] for k in ("network", "filesystem", "seccomp")} == {"network": "netns", "filesystem": "landlock",
                                                                          "seccomp": "on"}
    assert mode["signals"] in ("landlock", "pidns"), mode


def test_a_bad_node_sandbox_setting_is_refused_naming_it(tmp_path):
    done = grpo_run(tmp_path, "apply", "-f", str(write_job(tmp_path)), GRPO_RUN_SANDBOX="paranoid")
    assert done.returncode != 0 and "GRPO_RUN_SANDBOX='paranoid'" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_attempts_that_keep_ending_preempted_without_a_step_fail_the_job_until_resumed_by_hand(tmp_path, figures):
    """Something on the node that sends the supervisor SIGTERM before the first step looks like a
    spot notice every time; a restarting Job or unit would boot paid GPUs for it forever. After
    PREEMPTED_WITHOUT_PROGRESS such attempts the next node fails the job instead of training;
    a `resume` by hand afterwards counts afresh and trains."""
    job = write_job(tmp_path)
    submitted = grpo_run(tmp_path, "apply", "-f", str(job), "--detach")
    assert submitted.returncode == 0, submitted.stderr
    record_path = tmp_path / "store" / "guarded" / RECORD_FILE
    with Record(record_path) as record:       # the attempts such nodes leave behind
        for _ in range(PREEMPTED_WITHOUT_PROGRESS):
            attempt = record.start_attempt("spot-node", from_step=0)
            record.end_attempt(attempt, "Preempted", "notice from signal", notice="signal")
        record.set_phase(Phase.PREEMPTED)

    stuck = grpo_run(tmp_path, "resume", "guarded", "--storage", str(tmp_path / "store"))
    assert stuck.returncode == 1, stuck.stderr[-3000:]
    assert f"the last {PREEMPTED_WITHOUT_PROGRESS} attempts all ended Preempted" in stuck.stderr
    status = stored(tmp_path)
    assert status["phase"] == "Failed" and status["step"] == 0
    assert [a["reason"] for a in status["attempts"]][-2:] == ["Preempted", "Failed"]

    again = grpo_run(tmp_path, "resume", "guarded", "--storage", str(tmp_path / "store"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert stored(tmp_path)["phase"] == "Succeeded"
    figures.add("trust", actor="reward author", tried=f"{PREEMPTED_WITHOUT_PROGRESS} fake notices in a row before "
                "the first step (a restarting Job would boot GPUs forever)",
                protection=f"fail after {PREEMPTED_WITHOUT_PROGRESS} Preempted attempts without progress",
                outcome="job Failed, no trainer started; a resume by hand trains", held=True)


def test_a_phase_the_record_cannot_move_to_ends_the_attempt_failed_with_the_reason_and_no_traceback(tmp_path, caplog):
    """N8: a trainer that reports a phase the record cannot move to (Pending -> FinalEval: a
    record replayed or edited in storage under a run that got further) is killed at that event,
    nothing more of it is recorded, and the attempt ends Failed with the reason, the record
    consistent (no attempt left open) and no traceback anywhere, as the supervisor ends it."""
    import logging
    import threading

    from grpo_run.checkpoint.storage.store import Store
    from grpo_run.runner.books.books import Books
    from grpo_run.runner.supervisor.attempt import CheckpointRequest, TrainerProcess
    from grpo_run.trainer.protocol import PhaseStarted, Step, TrainerPhase

    store = Store(str(tmp_path / "store"))
    books = Books(store, tmp_path / "node", name="guarded", manifest={"kind": "TrainingJob",
                  "metadata": {"name": "guarded"}}, usd_per_hour=None, max_cost_usd=None)
    books.start_attempt("node", from_step=0)
    from types import SimpleNamespace

    from grpo_run.trainer.config import GRPOParams

    spec = SimpleNamespace(params=GRPOParams(), env=SimpleNamespace(rewards=[], episodes=None))    # what the watchdog's bound reads
    trainer = TrainerProcess(spec, tmp_path / "node", books, None, checkpoints=CheckpointRequest(),
                             wake=threading.Event())
    trainer._proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])   # a live trainer
    read_fd, write_fd = os.pipe()
    lines = [PhaseStarted(phase=TrainerPhase.FINAL_EVAL), Step(step=5, metrics={"loss": 0.0})]
    os.write(write_fd, "".join(e.model_dump_json() + "\n" for e in lines).encode())
    os.close(write_fd)
    with caplog.at_level(logging.INFO):
        trainer._read_events(read_fd)
    assert trainer._proc.returncode == -signal.SIGKILL                        # killed at the event
    out = trainer.outcome()
    assert out.how == "broken"
    assert "disagree on where the run is (job 'guarded': Pending -> FinalEval is not allowed" in out.message
    assert books.record.steps() == []                                         # nothing after it recorded
    assert not any(r.exc_info for r in caplog.records)                        # no traceback in the log

    # the supervisor then ends the attempt as it ends any other failure; where even Failed is not a
    # phase the record may take, Books.abandon still closes the attempt
    books.abandon(out.message)
    (attempt,) = books.record.attempts()
    assert attempt["reason"] == "Failed" and attempt["ended"] is not None and "disagree" in attempt["message"]
    assert books.record.job()["phase"] == "Failed"
    books.close()


def test_an_older_record_put_back_into_storage_is_refused_by_a_node_that_knew_a_newer_one(tmp_path):
    """N6: a finished job's record replaced in storage by its Pending copy from the submit (a
    replay). The node that ran it knows a newer upload of the same job: it keeps that one, puts it
    back, and the job stays Succeeded with its history, for this node and for a fresh one after it.
    (A node that never saw the job cannot tell: docs/security.md says so.)"""
    import shutil

    job = write_job(tmp_path)
    store, record = tmp_path / "store", tmp_path / "store" / "guarded" / RECORD_FILE
    assert grpo_run(tmp_path, "apply", "-f", str(job), "--detach").returncode == 0
    shutil.copyfile(record, tmp_path / "pending.db")              # what a bucket writer kept
    done = grpo_run(tmp_path, "resume", "guarded", "--storage", str(store))
    assert done.returncode == 0, done.stderr[-3000:]
    finished = stored(tmp_path)
    assert finished["phase"] == "Succeeded"

    shutil.copyfile(tmp_path / "pending.db", record)             # the replay
    again = grpo_run(tmp_path, "resume", "guarded", "--storage", str(store))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "older than upload" in again.stderr and "keeping this node's and putting it back" in again.stderr
    assert "already succeeded; nothing to do" in again.stderr + again.stdout
    assert stored(tmp_path)["attempts"] == finished["attempts"]  # its history, not a new run's
    fresh = grpo_run(tmp_path, "resume", "guarded", "--storage", str(store), GRPO_RUN_HOME=str(tmp_path / "node-b"))
    assert fresh.returncode == 0 and "already succeeded; nothing to do" in fresh.stderr + fresh.stdout
