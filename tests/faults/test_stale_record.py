"""Two nodes race for one job (the boot unit, a Kubernetes Job and a SkyPilot task all run
`grpo-run resume --wait`): one holds it and trains it to the end; the other reads the job's record
while the first trains, is told the job is held, waits, and tries again after the first finished.
Storage must still say Succeeded with every step, attempt and dollar: the waiting node decides
from storage's record, not from the copy it read while the other node trained. (The finished run's
checkpoints are looked at too: each carries the metrics so far.)"""

from __future__ import annotations

import json
import os
import signal
import uuid

import pytest
import yaml

from grpo_run.checkpoint.storage.by_url import open_store
from grpo_run.checkpoint.storage.store import ObjectStore
from grpo_run.checkpoint.sync import CHECKPOINTS, run_prefix
from grpo_run.state import values
from grpo_run.state.record import Record
from tests.campaign import stores
from tests.faults.harness import start_node, wait_until
from tests.runner.jobs.test_resume import grpo_run, write_job

pytestmark = pytest.mark.fault

STEPS = 30          # long enough for the second node to start and read the record while the first trains


def history(record: Record) -> dict:
    """What a finished job's record must keep: its phase, steps, attempts and spend."""
    return {"phase": record.job()["phase"], "steps": [s["step"] for s in record.steps()],
            "attempts": [(a["id"], a["reason"], a["from_step"], a["to_step"]) for a in record.attempts()],
            "ledger": record.value("ledger")}


def in_storage(store: ObjectStore, scratch) -> Record:
    """Storage's record, read from a fresh copy."""
    copy = scratch / f"state-{uuid.uuid4().hex[:8]}.db"
    store.get_file("state.db", copy)
    return Record(copy)


@pytest.mark.trust
@pytest.mark.parametrize("store_env", stores("s3", "az"), indirect=True)
def test_a_node_that_waited_for_the_holder_leaves_the_finished_job_as_it_was(tmp_path, store_env, figures):
    job = write_job(tmp_path, store_env.url, maxSteps=STEPS, saveSteps=10)
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["pricing"] = {"usdPerHour": 36.0}          # dollars in the ledger, on any machine
    job.write_text(yaml.safe_dump(doc))
    grpo_run(tmp_path / "laptop", "apply", "--detach", "-f", str(job))
    store = open_store(f"{store_env.url}/resumable")

    a = start_node(tmp_path / "node-a", "resume", "resumable", "--storage", store_env.url, GRPO_RUN_NOTICES="none")

    scratch = tmp_path / "scratch"

    def a_is_training() -> bool:
        if not store.exists("state.db"):
            return False
        with in_storage(store, scratch) as record:
            return bool(record.attempts())

    wait_until("node A's attempt is in storage", a_is_training, a)
    # Node A's supervisor is paused (SIGSTOP; its lease stays fresh for its 60 s) until node B has
    # read the record and been told the job is held: on a loaded machine A could otherwise finish
    # its steps before B has started, and there would be no race to test.
    b_log = tmp_path / "node-b.log"
    os.kill(a.pid, signal.SIGSTOP)
    try:
        b = start_node(tmp_path / "node-b", "resume", "resumable", "--storage", store_env.url, "--wait",
                       GRPO_RUN_NOTICES="none", GRPO_RUN_WAIT_POLL_S="0.3", log=b_log)
        wait_until("node B is told the job is held",
                   lambda: b_log.exists() and "another node holds the job" in b_log.read_text(), b, timeout=45)
    finally:
        os.kill(a.pid, signal.SIGCONT)
    a_out, a_err = a.communicate(timeout=600)
    b.communicate(timeout=600)
    b_said = b_log.read_text()
    assert a.returncode == 0, a_err[-3000:]
    assert b.returncode == 0, b_said[-3000:]

    with Record(tmp_path / "node-a" / "runs" / "resumable" / "state.db") as record:
        finished = history(record)                                # what node A left when it finished
        reported = {s["step"]: s for s in record.steps()}
        run = values.RUN_ID.get(record)
    # each checkpoint carries the metrics so far, as the trainer reported them (SPEC §4)
    held = json.loads(store.get_bytes(f"{run_prefix(CHECKPOINTS, run)}/ckpt-00000020/metrics.json"))
    assert [s["step"] for s in held] == list(range(1, 21))
    assert all(s == {k: v for k, v in reported[s["step"]].items() if k != "costUSD"} for s in held)
    with in_storage(store, scratch) as record:
        now = history(record)
    assert finished["phase"] == "Succeeded" and finished["steps"] == list(range(1, STEPS + 1))
    assert [reason for _, reason, _, _ in finished["attempts"]] == ["Succeeded"]
    assert finished["ledger"]["1"]["usd"] > 0
    assert now == finished
    assert "already succeeded" in b_said
    figures.add("trust", actor='ordinary failure', tried='resume --wait downloads the record, is told held, and resumes after the holder succeeded',
                protection="decided from storage's record under the lease; generations on every upload", outcome='storage still Succeeded with every step, attempt and dollar', held=True)
