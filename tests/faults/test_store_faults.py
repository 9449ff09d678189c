"""Object storage misbehaving under a run, on each store (S3 on SeaweedFS, GCS on
fake-gcs-server, Azure Blob on Azurite, each a real server on 127.0.0.1): the server killed
mid-upload and started again later, a slow link and a stalled server (a proxy in between),
credentials revoked (every request 403) and the bucket deleted mid-run; a stall and then a notice.

Outages and slowness: training goes on, nothing is reported durable that is not, the uploads
catch up, the run ends byte for byte as one never disturbed. Configuration faults: a clear
failure naming the cause, the local checkpoints intact, and the run resumable once fixed."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from grpo_run.checkpoint.manifest import MANIFEST_NAME, newest_sealed, step_of, verify
from grpo_run.checkpoint.storage.by_url import open_store
from grpo_run.state.record import Record
from tests.campaign import stores
from tests.cloud_stores import STORE_NAMES, delete_bucket, through
from tests.faults.harness import NOTICE_WINDOW_S, notice_source, start_node, wait_until
from tests.faults.s3proxy import S3Proxy
from tests.once import once
from tests.runner.jobs.test_resume import exported_bytes, grpo_run, status, write_job

pytestmark = [pytest.mark.fault, pytest.mark.slow]
STEPS, SAVE = 500, 4
OUTAGE_S = 6.0             # at least this long, and until several checkpoints were sealed meanwhile


def job(folder: Path, storage: str | None) -> Path:
    return write_job(folder, storage, maxSteps=STEPS, saveSteps=SAVE)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    def build(folder: Path) -> dict[str, bytes]:
        grpo_run(folder / "home", "apply", "-f", str(job(folder, None)))
        return exported_bytes(folder / "home", None, folder / "export")

    return once(tmp_path_factory, "store-faults-reference", build)


def checkpoints(home: Path) -> tuple[int, int]:
    """(newest sealed, newest durable) as the node's own record says."""
    db = home / "runs" / "resumable" / "state.db"
    if not db.exists():
        return 0, 0
    with Record(db) as record:
        rows = record.checkpoints()
    return max((r["step"] for r in rows), default=0), max((r["step"] for r in rows if r["durable"]), default=0)


def stored_steps(env) -> set[int]:
    """The checkpoint steps whose manifests are in the test's bucket (a checkpoint's manifest goes
    up last: one there is a whole checkpoint)."""
    keys = open_store(env.url).list("resumable/checkpoints")
    return {step_of(k.split("/")[-2]) for k in keys if k.endswith("/" + MANIFEST_NAME)} - {None}


def outage(home: Path, proc, start, end) -> tuple[float, int]:
    """Bring the store down (`start()`), keep it down while training goes on for OUTAGE_S and at
    least three more checkpoints, check none of them is called durable, bring it back (`end()`).
    Returns (seconds down, newest durable step throughout)."""
    wait_until("a durable checkpoint", lambda: checkpoints(home)[1] >= SAVE, proc)
    start()
    down = time.monotonic()
    before, durable = checkpoints(home)     # an upload that got through just before may be noted later
    wait_until("training on while storage is down",
               lambda: checkpoints(home)[0] >= before + 3 * SAVE and time.monotonic() - down >= OUTAGE_S, proc)
    sealed, still = checkpoints(home)
    assert durable <= still <= before, f"checkpoint {still} reported durable while the store was down"
    assert sealed > still
    durable = still
    end()
    return time.monotonic() - down, durable


@pytest.mark.parametrize("private_store", stores("gs"), indirect=True)
def test_the_server_killed_mid_run_and_started_later_costs_nothing(tmp_path, private_store, reference, figures):
    env = private_store
    node = tmp_path / "node-a"
    proc = start_node(node, "apply", "-f", str(job(tmp_path, env.url)), GRPO_RUN_NOTICES="none")

    def kill():
        env.server.process.kill()        # SIGKILL, mid-whatever it was doing
        env.server.process.wait()

    seconds, durable = outage(node, proc, kill, env.server.start)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    st = status(tmp_path / "node-x", env.url)
    identical = exported_bytes(tmp_path / "node-y", env.url, tmp_path / "export") == reference
    figures.add("store", store=STORE_NAMES[env.scheme], fault="server SIGKILLed mid-run, started again",
                outage_seconds=round(seconds, 1), outcome=st["phase"],
                detail=f"durable stayed {durable} while down; identical: {identical}", identical=identical)
    assert st["phase"] == "Succeeded" and st["step"] == STEPS
    assert identical


@pytest.mark.parametrize("store_env", stores("s3"), indirect=True)
def test_a_slow_link_and_a_stalled_server_cost_nothing(tmp_path, store_env, reference, figures):
    env, node = store_env, tmp_path / "node-a"
    with S3Proxy(env.server.port) as proxy:
        proxy.set("delay", 0.01)                       # 10 ms on every chunk a client sends
        proc = start_node(node, "apply", "-f", str(job(tmp_path, env.url)), GRPO_RUN_NOTICES="none",
                          **through(proxy.port, env))
        seconds, durable = outage(node, proc, lambda: proxy.set("stall"), lambda: proxy.set("delay", 0.01))
        out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    st = status(tmp_path / "node-x", env.url)
    identical = exported_bytes(tmp_path / "node-y", env.url, tmp_path / "export") == reference
    figures.add("store", store=STORE_NAMES[env.scheme], fault="slow link (10 ms a chunk), then the server stalled",
                outage_seconds=round(seconds, 1), outcome=st["phase"],
                detail=f"durable stayed {durable} while stalled; identical: {identical}", identical=identical)
    assert st["phase"] == "Succeeded" and st["step"] == STEPS
    assert identical


def test_a_notice_while_the_store_stalls_still_ends_inside_the_window(tmp_path, s3_env, reference, figures):
    """A hung server (requests accepted, never answered, for longer than botocore's 60 s read
    timeout) and then a notice: neither the stop checkpoint nor the record can reach storage, and
    the node still ends Preempted inside the window, without waiting for them. A node resuming
    once storage answers again continues from what was durable before the stall."""
    node = tmp_path / "node-a"
    with S3Proxy(s3_env.server.port) as proxy, notice_source("signal") as (env, notice):
        proc = start_node(node, "apply", "-f", str(job(tmp_path, s3_env.url)), AWS_ENDPOINT_URL=proxy.endpoint_url,
                          **env)
        wait_until("a durable checkpoint", lambda: checkpoints(node)[1] >= SAVE, proc)
        proxy.set("stall")
        before, durable = checkpoints(node)
        wait_until("checkpoints sealed while the store stalls", lambda: checkpoints(node)[0] >= before + SAVE, proc)
        noticed = time.monotonic()
        notice(proc)
        out, err = proc.communicate(timeout=180)
        exited = time.monotonic() - noticed
        proxy.set("pass")
    with Record(node / "runs" / "resumable" / "state.db") as record:
        here = record.job()["phase"]
    assert proc.returncode == 3, err[-3000:]
    assert exited <= NOTICE_WINDOW_S, f"exited {exited:.1f} s after the notice"
    assert here == "Preempted"
    # Nothing claimed durable that storage lacks. The claim may be newer than `durable`, read just
    # after the stall began: an upload whose manifest got through before it is noted a moment later.
    claimed = checkpoints(node)[1]
    assert durable <= claimed <= before, f"checkpoint {claimed}, sealed during the stall, claimed durable"
    assert claimed in stored_steps(s3_env), f"checkpoint {claimed} claimed durable, not in storage"
    grpo_run(tmp_path / "node-b", "resume", "resumable", "--storage", s3_env.url)
    st = status(tmp_path / "node-x", s3_env.url)
    identical = exported_bytes(tmp_path / "node-y", s3_env.url, tmp_path / "export") == reference
    figures.add("store", store=STORE_NAMES["s3"], fault="the server stalled, then a notice (SIGTERM)", outage_seconds=0.0, outcome=st["phase"],
                detail=f"Preempted {exited:.1f} s after the notice (window {NOTICE_WINDOW_S:.0f} s); durable "
                       f"stayed {claimed}; identical: {identical}", identical=identical)
    assert st["phase"] == "Succeeded" and identical


def _fails_clearly(proc, node: Path, *said: str, status: dict[int, str] | None = None) -> tuple[str, int]:
    """The node failed (exit 1, saying one of `said`; or any exit in `status`, saying its line),
    without a traceback, its local checkpoint whole. (What it said last, that checkpoint's step)"""
    out, err = proc.communicate(timeout=300)
    status = status or {1: ""}
    assert proc.returncode in status, f"status {proc.returncode}\n{err[-3000:]}"
    said = (status[proc.returncode],) if status[proc.returncode] else said
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if any(s in line for s in said)]
    assert lines, err[-3000:]
    local = newest_sealed(node / "runs" / "resumable" / "checkpoints")
    assert local is not None
    verify(local[1])                                 # the local checkpoint is whole
    return lines[-1], local[0]          # the last: what the command itself ended with


@pytest.mark.parametrize("store_env", stores("az"), indirect=True)
def test_revoked_credentials_fail_the_run_clearly_and_it_resumes_once_they_are_back(
        tmp_path, store_env, reference, figures):
    env, node = store_env, tmp_path / "node-a"
    with S3Proxy(env.server.port) as proxy:
        proc = start_node(node, "apply", "-f", str(job(tmp_path, env.url)), GRPO_RUN_NOTICES="none",
                          **through(proxy.port, env))
        wait_until("a durable checkpoint", lambda: checkpoints(node)[1] >= SAVE, proc)
        proxy.set("deny")                              # every request: 403
        line, local = _fails_clearly(proc, node, "AccessDenied", "Access Denied", "access denied",
                                     "refused the credentials")
        proxy.set("pass")
        again = start_node(node, "resume", "resumable", "--storage", env.url, GRPO_RUN_NOTICES="none",
                           **through(proxy.port, env))
        out, err = again.communicate(timeout=600)
    assert again.returncode == 0, err[-3000:]
    identical = exported_bytes(tmp_path / "node-y", env.url, tmp_path / "export") == reference
    figures.add("store", store=STORE_NAMES[env.scheme], fault="credentials revoked mid-run (every request 403)",
                outcome="Failed, clearly", identical=identical,
                detail=f"said: {line.strip()[:160]}; local checkpoint {local} intact; resumed after: identical {identical}")
    assert identical


@pytest.mark.parametrize("store_env", stores("s3"), indirect=True)
def test_a_bucket_deleted_mid_run_fails_it_clearly_with_the_local_checkpoints_intact(tmp_path, store_env, figures):
    env, node = store_env, tmp_path / "node-a"
    long_job = write_job(tmp_path, env.url, maxSteps=100_000, saveSteps=SAVE)   # still training when it goes
    proc = start_node(node, "apply", "-f", str(long_job), GRPO_RUN_NOTICES="none")
    wait_until("a durable checkpoint", lambda: checkpoints(node)[1] >= SAVE, proc)
    delete_bucket(env)               # emptied first where the store insists (S3, GCS), as the run writes on
    what = "container" if env.scheme == "az" else "bucket"
    # The node notices whichever goes first: the bucket (exit 1, naming it) or, when a lease
    # renewal falls while the bucket is being emptied (seen once in a two-worker clean-clone
    # run), its lease object removed (exit 5: it stops, as when another node may have taken over).
    line, local = _fails_clearly(proc, node, status={1: env.bucket, 5: "was removed while"})
    figures.add("store", store=STORE_NAMES[env.scheme], fault=f"{what} deleted mid-run", outcome="Failed, clearly",
                detail=f"said: {line.strip()[:160]}; local checkpoint {local} intact")
    assert "lease" in line.lower() if proc.returncode == 5 else what in line.lower()


@pytest.mark.parametrize("private_store", stores("gs", among=("gs", "az")), indirect=True)
def test_a_stopped_server_then_a_notice_still_ends_inside_the_window(tmp_path, private_store, figures):
    """SIGSTOP the server itself (connections accepted by the kernel, nothing answered), then a
    notice: the node ends Preempted inside the window, and nothing sealed during the stall is
    called durable. (On S3 the proxy's stall, above, is the same fault.)"""
    env, node = private_store, tmp_path / "node-a"
    with notice_source("signal") as (notice_env, notice):
        proc = start_node(node, "apply", "-f", str(write_job(tmp_path, env.url, maxSteps=100_000, saveSteps=SAVE)),
                          **notice_env)
        wait_until("a durable checkpoint", lambda: checkpoints(node)[1] >= SAVE, proc)
        os.kill(env.server.process.pid, signal.SIGSTOP)
        try:
            before, _ = checkpoints(node)
            wait_until("checkpoints sealed while the store stalls", lambda: checkpoints(node)[0] >= before + SAVE, proc)
            noticed = time.monotonic()
            notice(proc)
            out, err = proc.communicate(timeout=180)
            exited = time.monotonic() - noticed
        finally:
            os.kill(env.server.process.pid, signal.SIGCONT)
    assert proc.returncode == 3, err[-3000:]
    assert exited <= NOTICE_WINDOW_S, f"exited {exited:.1f} s after the notice"
    claimed = checkpoints(node)[1]
    assert claimed <= before and claimed in stored_steps(env)
    figures.add("store", store=STORE_NAMES[env.scheme], fault="the server stopped (SIGSTOP), then a notice (SIGTERM)",
                outage_seconds=0.0, outcome="Preempted",
                detail=f"exited {exited:.1f} s after the notice (window {NOTICE_WINDOW_S:.0f} s); durable stayed {claimed}")
