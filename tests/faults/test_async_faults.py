"""An asynchronous run (spec.parameters.staleness: 1, trainer.ahead) killed, or noticed, while its
producer draws a later step; resumed on a fresh node from object storage alone, it ends at the
uninterrupted asynchronous run's adapter bytes: what was in flight (the policy version drawing the
next step) was in the checkpoint. `sample@K` fires in the producer's draw during step K (the
main thread samples nothing in an asynchronous run): tests/faults/inject wraps `trainer.stop`,
which the producer looks up between two tokens."""

from __future__ import annotations

import signal
import time

import pytest

from tests.faults.harness import NOTICE_WINDOW_S, marker, start_node, wait_until
from tests.once import once
from tests.runner.jobs.test_resume import STEPS, exported_bytes, grpo_run, status, write_job

pytestmark = pytest.mark.fault
STALENESS = 1


@pytest.fixture(scope="session")
def uninterrupted_async(tmp_path_factory):
    def build(folder):
        grpo_run(folder / "home", "apply", "-f", str(write_job(folder, staleness=STALENESS)))
        return exported_bytes(folder / "home", None, folder / "export")

    return once(tmp_path_factory, "async-resume-reference", build)


@pytest.mark.parametrize("fault", ["sample@5", "backward@4", "upload@4"])
def test_an_asynchronous_run_killed_and_resumed_on_a_fresh_node_ends_byte_identical(
        tmp_path, s3_env, uninterrupted_async, fault):
    storage = s3_env.url
    job = write_job(tmp_path, storage, staleness=STALENESS)
    killed = grpo_run(tmp_path / "node-a", "apply", "-f", str(job), fault=fault, check=False)
    assert killed.returncode == -signal.SIGKILL, (fault, killed.stderr[-2000:])
    job.unlink()
    grpo_run(tmp_path / "node-b", "resume", "resumable", "--storage", storage)
    assert exported_bytes(tmp_path / "node-c", storage, tmp_path / "export") == uninterrupted_async
    st = status(tmp_path / "node-d", storage)
    assert st["phase"] == "Succeeded" and st["step"] == STEPS and st["sampler"]["staleness"] == STALENESS
    if fault.startswith("upload"):      # killed uploading checkpoint 4: checkpoint 2 was durable, and resumed
        assert st["attempts"][-1]["fromStep"] == 2, st["attempts"]


def test_a_notice_while_the_producer_draws_stops_it_and_the_resume_ends_byte_identical(
        tmp_path, s3_env, uninterrupted_async):
    storage, node = s3_env.url, tmp_path / "node-a"
    job = write_job(tmp_path, storage, staleness=STALENESS, saveSteps=100)   # no checkpoint but the notice's
    proc = start_node(node, "apply", "-f", str(job), fault="hold:sample@3", GRPO_RUN_NOTICES="none")
    wait_until("the hold in the producer's draw", marker(node).exists, proc)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err[-3000:]
    assert time.monotonic() - sent <= NOTICE_WINDOW_S       # the in-flight draw is abandoned, not finished
    st = status(tmp_path / "node-x", storage)
    durable = st["checkpoints"]["latestDurable"]
    # the step being trained when the producer was held completes or is given up; none is lost
    assert st["phase"] == "Preempted" and durable == st["step"] and durable in (3, 4)
    job.unlink()
    grpo_run(tmp_path / "node-b", "resume", "resumable", "--storage", storage)
    assert exported_bytes(tmp_path / "node-c", storage, tmp_path / "export") == uninterrupted_async
