"""Runs on Google Cloud Storage (fake-gcs-server) and Azure Blob (Azurite), held to what S3 is
held to (tests/faults/test_store_faults.py, test_split_brain.py, tests/runner/test_resume.py): a
kill and a resume on a fresh node end byte-identical, two nodes resuming at once leave one
training, the server killed or stalled mid-run costs nothing and nothing is called durable while
it is away, revoked credentials and a deleted bucket fail the run clearly with the local
checkpoints whole."""

from __future__ import annotations

import os
import signal
import time

import pytest

from grpo_run.checkpoint.manifest import MANIFEST_NAME, step_of
from grpo_run.checkpoint.storage.store import open_store
from tests.cloud_stores import point_at_azurite, point_at_gcs
from tests.faults.harness import start_node, wait_until
from tests.faults.s3proxy import S3Proxy
from tests.faults.test_store_faults import SAVE, STEPS, _fails_clearly, checkpoints, job, outage, reference  # noqa: F401
from tests.runner.test_resume import STEPS as SHORT_STEPS
from tests.runner.test_resume import exported_bytes, grpo_run, kill_and_resume, status, uninterrupted  # noqa: F401

pytestmark = pytest.mark.fault
NAMES = {"gs": "GCS (fake-gcs-server)", "az": "Azure Blob (Azurite)"}


@pytest.fixture(params=["gs", "az"])
def cloud(request):
    return request.getfixturevalue({"gs": "gcs_env", "az": "az_env"}[request.param])


@pytest.fixture(params=["gs", "az"])
def private_cloud(request, make_gcs_server, make_azurite, monkeypatch):
    """(scheme, a server of this test's own, the job's storage URL): for tests that stop it."""
    if request.param == "gs":
        server = make_gcs_server()
        point_at_gcs(monkeypatch, server)
        return "gs", server, f"gs://{server.create_bucket()}/run"
    server = make_azurite()
    point_at_azurite(monkeypatch, server)
    return "az", server, f"az://{server.create_container()}/run"


def through(proxy: S3Proxy, scheme: str, server) -> dict[str, str]:
    """The environment that sends a node's storage calls through `proxy`."""
    if scheme == "gs":
        return {"STORAGE_EMULATOR_HOST": proxy.endpoint_url}
    return {"AZURE_STORAGE_CONNECTION_STRING":
            server.connection_string().replace(f":{server.port}/", f":{proxy.port}/")}


def stored_steps(url: str) -> set[int]:
    keys = open_store(url).list("resumable/checkpoints")
    return {step_of(k.split("/")[-2]) for k in keys if k.endswith("/" + MANIFEST_NAME)} - {None}


def test_a_run_killed_and_resumed_on_a_fresh_node_ends_byte_identical(tmp_path, cloud, uninterrupted, figures):
    exported, _ = kill_and_resume(tmp_path, cloud.url, "upload@4")
    identical = exported == uninterrupted
    figures.add("cloud", store=NAMES[cloud.scheme], case="killed in an upload, resumed on a fresh node",
                identical=identical)
    assert identical
    st = status(tmp_path / "node-d", cloud.url)
    assert st["phase"] == "Succeeded" and st["step"] == SHORT_STEPS


def test_two_nodes_resuming_one_job_at_once_leave_exactly_one_training(tmp_path, cloud, figures):
    from tests.runner.test_resume import write_job

    path = write_job(tmp_path, cloud.url, maxSteps=300, saveSteps=50)
    grpo_run(tmp_path / "laptop", "apply", "--detach", "-f", str(path))
    procs = [start_node(tmp_path / f"node-{i}", "resume", "resumable", "--storage", cloud.url,
                        GRPO_RUN_NOTICES="none") for i in range(2)]
    ended = [(p.returncode, err) for p in procs for _, err in [p.communicate(timeout=600)]]
    trained = [i for i in range(2) if (tmp_path / f"node-{i}" / "runs" / "resumable" / "checkpoints").exists()]
    figures.add("split", store=NAMES[cloud.scheme], nodes=2, trained=len(trained),
                refused=sorted(c for c, _ in ended).count(5))
    assert sorted(c for c, _ in ended) == [0, 5], [err[-1500:] for _, err in ended]
    assert all("held by" in err for code, err in ended if code == 5)
    assert len(trained) == 1
    assert status(tmp_path / "node-x", cloud.url)["phase"] == "Succeeded"


@pytest.mark.slow
def test_the_server_killed_mid_run_and_started_later_costs_nothing(tmp_path, private_cloud, reference, figures):
    scheme, server, storage = private_cloud
    node = tmp_path / "node-a"
    proc = start_node(node, "apply", "-f", str(job(tmp_path, storage)), GRPO_RUN_NOTICES="none")

    def kill():
        server.process.kill()
        server.process.wait()

    seconds, durable = outage(node, proc, kill, server.start)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    st = status(tmp_path / "node-x", storage)
    identical = exported_bytes(tmp_path / "node-y", storage, tmp_path / "export") == reference
    figures.add("store", store=NAMES[scheme], fault="server SIGKILLed mid-run, started again",
                outage_seconds=round(seconds, 1), outcome=st["phase"],
                detail=f"durable stayed {durable} while down; identical: {identical}", identical=identical)
    assert st["phase"] == "Succeeded" and st["step"] == STEPS
    assert identical


@pytest.mark.slow
def test_a_slow_link_and_a_stalled_server_cost_nothing(tmp_path, private_cloud, reference, figures):
    scheme, server, storage = private_cloud
    node = tmp_path / "node-a"
    with S3Proxy(server.port) as proxy:
        proxy.set("delay", 0.01)
        proc = start_node(node, "apply", "-f", str(job(tmp_path, storage)), GRPO_RUN_NOTICES="none",
                          **through(proxy, scheme, server))
        seconds, durable = outage(node, proc, lambda: proxy.set("stall"), lambda: proxy.set("delay", 0.01))
        out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    st = status(tmp_path / "node-x", storage)
    identical = exported_bytes(tmp_path / "node-y", storage, tmp_path / "export") == reference
    figures.add("store", store=NAMES[scheme], fault="slow link (10 ms a chunk), then the server stalled",
                outage_seconds=round(seconds, 1), outcome=st["phase"],
                detail=f"durable stayed {durable} while stalled; identical: {identical}", identical=identical)
    assert st["phase"] == "Succeeded" and st["step"] == STEPS
    assert identical


@pytest.mark.slow
def test_revoked_credentials_fail_the_run_clearly_and_it_resumes_once_they_are_back(
        tmp_path, private_cloud, reference, figures):
    scheme, server, storage = private_cloud
    node = tmp_path / "node-a"
    with S3Proxy(server.port) as proxy:
        env = through(proxy, scheme, server)
        proc = start_node(node, "apply", "-f", str(job(tmp_path, storage)), GRPO_RUN_NOTICES="none", **env)
        wait_until("a durable checkpoint", lambda: checkpoints(node)[1] >= SAVE, proc)
        proxy.set("deny")                                  # every request: 403
        line, local = _fails_clearly(proc, node, "access denied", "refused the credentials")
        proxy.set("pass")
        again = start_node(node, "resume", "resumable", "--storage", storage, GRPO_RUN_NOTICES="none", **env)
        out, err = again.communicate(timeout=600)
    assert again.returncode == 0, err[-3000:]
    identical = exported_bytes(tmp_path / "node-y", storage, tmp_path / "export") == reference
    figures.add("store", store=NAMES[scheme], fault="credentials revoked mid-run (every request 403)",
                outcome="Failed, clearly", identical=identical,
                detail=f"said: {line.strip()[:160]}; local checkpoint {local} intact; resumed after: identical {identical}")
    assert identical


@pytest.mark.slow
def test_a_stalled_server_held_for_a_minute_then_a_notice_still_ends_inside_the_window(
        tmp_path, private_cloud, figures):
    """SIGSTOP the server itself (connections accepted by the kernel, nothing answered), then a
    notice: the node ends Preempted inside the window, and nothing sealed during the stall is
    called durable."""
    from tests.faults.harness import NOTICE_WINDOW_S, notice_source
    from tests.runner.test_resume import write_job

    scheme, server, storage = private_cloud
    node = tmp_path / "node-a"
    with notice_source("signal") as (env, notice):
        proc = start_node(node, "apply", "-f", str(write_job(tmp_path, storage, maxSteps=100_000, saveSteps=SAVE)),
                          **env)
        wait_until("a durable checkpoint", lambda: checkpoints(node)[1] >= SAVE, proc)
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            before, _ = checkpoints(node)
            wait_until("checkpoints sealed while the store stalls", lambda: checkpoints(node)[0] >= before + SAVE, proc)
            noticed = time.monotonic()
            notice(proc)
            out, err = proc.communicate(timeout=180)
            exited = time.monotonic() - noticed
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
    assert proc.returncode == 3, err[-3000:]
    assert exited <= NOTICE_WINDOW_S, f"exited {exited:.1f} s after the notice"
    claimed = checkpoints(node)[1]
    assert claimed <= before and claimed in stored_steps(storage)
    figures.add("store", store=NAMES[scheme], fault="the server stopped (SIGSTOP), then a notice (SIGTERM)",
                outage_seconds=0.0, outcome="Preempted",
                detail=f"exited {exited:.1f} s after the notice (window {NOTICE_WINDOW_S:.0f} s); durable stayed {claimed}")
