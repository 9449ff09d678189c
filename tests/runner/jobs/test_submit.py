"""Submit from a laptop, train on a node: `apply --detach` writes the job Pending into its storage
and starts nothing; a node's `resume` (waiting when it booted first) trains it."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests.tiny_models import seed_home
from tests.runner.jobs.test_resume import REPO, exported_bytes, grpo_run, write_job


def get(home: Path, *extra) -> dict:
    return json.loads(grpo_run(home, "get", "tj", "resumable", "-o", "json", *extra).stdout)


def test_detach_writes_the_job_pending_and_a_node_trains_it(tmp_path):
    laptop, node = tmp_path / "laptop", tmp_path / "node"
    storage = str(tmp_path / "bucket")
    job = write_job(tmp_path, storage)

    out = grpo_run(laptop, "apply", "-f", str(job), "--detach").stdout
    assert "resumable: submitted to" in out and "grpo-run resume resumable --storage" in out
    assert not (laptop / "runs").exists()                          # nothing ran, nothing trained here
    assert get(laptop)["status"]["phase"] == "Pending"            # followed in storage, no --storage needed
    assert get(laptop, "--storage", storage)["status"]["step"] == 0
    estimated = get(laptop)["status"]["estimate"]                  # what apply said, before anything was spent
    assert estimated["steps"] == 8 and estimated["startTime"] and "memory" not in estimated

    again = grpo_run(laptop, "apply", "-f", str(job), "--detach").stdout
    assert "already submitted with this spec" in again             # idempotent

    grpo_run(node, "resume", "resumable", "--storage", storage)     # a node with nothing but the URI
    st = get(laptop)["status"]
    assert st["phase"] == "Succeeded" and st["baseline"]["runs"] == 1 and st["step"] == 8
    assert st["estimate"] == estimated                            # the node's resume keeps apply's estimate
    done = grpo_run(laptop, "apply", "-f", str(job), "--detach").stdout
    assert "already submitted with this spec" in done and "(phase Succeeded)" in done


def test_a_changed_file_replaces_a_pending_spec_but_not_a_taken_one(tmp_path):
    laptop, node = tmp_path / "laptop", tmp_path / "node"
    storage = str(tmp_path / "bucket")
    grpo_run(laptop, "apply", "-f", str(write_job(tmp_path, storage)), "--detach")
    changed = write_job(tmp_path, storage, learningRate=0.001)
    assert "submitted again with the changed spec" in grpo_run(laptop, "apply", "-f", str(changed), "--detach").stdout
    assert get(laptop)["spec"]["parameters"]["learningRate"] == 0.001

    grpo_run(node, "resume", "resumable", "--storage", storage)
    refused = grpo_run(laptop, "apply", "-f", str(write_job(tmp_path, storage, learningRate=0.003)), "--detach",
                       check=False)
    assert refused.returncode == 2 and "keeps its spec" in refused.stderr
    assert get(laptop)["spec"]["parameters"]["learningRate"] == 0.001      # storage untouched


def test_a_job_that_failed_in_its_reward_takes_the_fixed_file_and_a_node_finishes_it(tmp_path):
    laptop, node = tmp_path / "laptop", tmp_path / "node"
    storage = str(tmp_path / "bucket")
    job = write_job(tmp_path, storage)
    (tmp_path / "length.py").write_text("def score(completion, task):\n    return float(int(''))\n")
    grpo_run(laptop, "apply", "-f", str(job), "--detach")
    failed = grpo_run(node, "resume", "resumable", "--storage", storage, check=False)
    assert failed.returncode == 1 and "then grpo-run apply -f JOB" in failed.stdout

    (tmp_path / "length.py").write_text("def score(completion, task):\n    return float(len(completion))\n")
    again = grpo_run(laptop, "apply", "-f", str(job), "--detach").stdout
    assert "submitted again with the changed spec" in again and "(phase Failed)" in again
    grpo_run(node, "resume", "resumable", "--storage", storage)
    assert get(laptop)["status"]["phase"] == "Succeeded"


def test_a_node_that_boots_before_the_job_waits_for_it(tmp_path):
    laptop, node = tmp_path / "laptop", tmp_path / "node"
    storage = str(tmp_path / "bucket")
    waiting = subprocess.Popen([sys.executable, "-m", "grpo_run.runner.cli", "resume", "resumable", "--storage", storage,
                                "--wait"], cwd=REPO, env={**os.environ, "GRPO_RUN_HOME": str(seed_home(node)),
                                                          "GRPO_RUN_WAIT_POLL_S": "0.2"},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = waiting.stderr.readline()
        assert "waiting: no job 'resumable' in" in line
        time.sleep(0.5)
        assert waiting.poll() is None                                  # still waiting, not failed
        grpo_run(laptop, "apply", "-f", str(write_job(tmp_path, storage)), "--detach")
        out, err = waiting.communicate(timeout=300)
    finally:
        if waiting.poll() is None:
            waiting.kill()
    assert waiting.returncode == 0, err[-2000:]
    assert get(laptop)["status"]["phase"] == "Succeeded"
    assert exported_bytes(tmp_path / "reader", storage, tmp_path / "adapter")


def test_a_node_waiting_for_a_job_that_never_comes_gives_up_at_its_limit(tmp_path):
    """resume --wait is bounded: a node booted for a job whose submit failed ends (exit 2, saying
    what to do) instead of idling on a paid GPU."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "grpo_run.runner.cli", "resume", "resumable", "--storage",
                           str(tmp_path / "empty"), "--wait", "--wait-limit", "1"], cwd=REPO,
                          env={**os.environ, "GRPO_RUN_HOME": str(tmp_path / "node"), "GRPO_RUN_WAIT_POLL_S": "0.2"},
                          capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    assert proc.returncode == 2, proc.stderr
    assert "waiting: no job 'resumable' in" in proc.stderr and "(at most 1 s, --wait-limit)" in proc.stderr
    assert "no job 'resumable' in" in proc.stderr.splitlines()[-1]
    assert "after 1 s of waiting (--wait-limit); this node stops rather than idle: submit it" in proc.stderr
    assert took < 60
    # the default comes from the node's environment (the unit's env file can set it)
    proc = subprocess.run([sys.executable, "-m", "grpo_run.runner.cli", "resume", "resumable", "--storage",
                           str(tmp_path / "empty"), "--wait"], cwd=REPO,
                          env={**os.environ, "GRPO_RUN_HOME": str(tmp_path / "node"), "GRPO_RUN_WAIT_POLL_S": "0.2",
                               "GRPO_RUN_WAIT_LIMIT_S": "0.5"}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "after 0.5 s of waiting" in proc.stderr


def test_without_wait_a_missing_job_is_a_usage_error(tmp_path):
    proc = grpo_run(tmp_path / "node", "resume", "resumable", "--storage", str(tmp_path / "empty"), check=False)
    assert proc.returncode == 2 and "no job 'resumable'" in proc.stderr


def test_detach_refuses_a_bad_job_file_and_writes_nothing(tmp_path):
    storage = tmp_path / "bucket"
    job = write_job(tmp_path, str(storage))
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["parameters"]["numGenerations"] = 1
    job.write_text(yaml.safe_dump(doc))
    proc = grpo_run(tmp_path / "laptop", "apply", "-f", str(job), "--detach", check=False)
    assert proc.returncode == 2 and "numGenerations" in proc.stderr
    assert not storage.exists() or not any(storage.rglob("*"))


def test_detach_refuses_a_job_without_storage_a_node_could_reach(tmp_path):
    job = write_job(tmp_path)                                   # no spec.storage: this machine's own store
    proc = grpo_run(tmp_path / "laptop", "apply", "-f", str(job), "--detach", check=False)
    assert proc.returncode == 2 and "spec.storage is not set" in proc.stderr
    assert not (tmp_path / "laptop" / "store").exists() and not (tmp_path / "laptop" / "submitted").exists()
