"""Runs on Google Cloud Storage (fake-gcs-server) and Azure Blob (Azurite), held to what S3 is
held to in test_split_brain.py and tests/runner/jobs/test_resume.py: a kill and a resume on a fresh
node end byte-identical, two nodes resuming at once leave one training. (The store faults and the
kill campaign run on every store, in test_store_faults.py and test_kill_campaign.py.)"""

from __future__ import annotations

import pytest

from tests.cloud_stores import STORE_NAMES
from tests.faults.harness import start_node
from tests.runner.jobs.test_resume import STEPS as SHORT_STEPS
from tests.runner.jobs.test_resume import grpo_run, kill_and_resume, status, uninterrupted  # noqa: F401

pytestmark = pytest.mark.fault


@pytest.fixture(params=["gs", "az"])
def cloud(request):
    return request.getfixturevalue({"gs": "gcs_env", "az": "az_env"}[request.param])


def test_a_run_killed_and_resumed_on_a_fresh_node_ends_byte_identical(tmp_path, cloud, uninterrupted, figures):
    exported, _ = kill_and_resume(tmp_path, cloud.url, "upload@4")
    identical = exported == uninterrupted
    figures.add("cloud", store=STORE_NAMES[cloud.scheme], case="killed in an upload, resumed on a fresh node",
                identical=identical)
    assert identical
    st = status(tmp_path / "node-d", cloud.url)
    assert st["phase"] == "Succeeded" and st["step"] == SHORT_STEPS


def test_two_nodes_resuming_one_job_at_once_leave_exactly_one_training(tmp_path, cloud, figures):
    from tests.runner.jobs.test_resume import write_job

    path = write_job(tmp_path, cloud.url, maxSteps=300, saveSteps=50)
    grpo_run(tmp_path / "laptop", "apply", "--detach", "-f", str(path))
    procs = [start_node(tmp_path / f"node-{i}", "resume", "resumable", "--storage", cloud.url,
                        GRPO_RUN_NOTICES="none") for i in range(2)]
    ended = [(p.returncode, err) for p in procs for _, err in [p.communicate(timeout=600)]]
    trained = [i for i in range(2) if (tmp_path / f"node-{i}" / "runs" / "resumable" / "checkpoints").exists()]
    figures.add("split", store=STORE_NAMES[cloud.scheme], nodes=2, trained=len(trained),
                refused=sorted(c for c, _ in ended).count(5))
    assert sorted(c for c, _ in ended) == [0, 5], [err[-1500:] for _, err in ended]
    assert all("held by" in err for code, err in ended if code == 5)
    assert len(trained) == 1
    assert status(tmp_path / "node-x", cloud.url)["phase"] == "Succeeded"
