"""`grpo-run dashboard`'s data and web app, in process (the browser's view: test_dashboard_browser.py).
The records are made with the product's own Record, in a folder storage, as nodes leave them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from grpo_run.runner.views.dashboard.app import create_app
from grpo_run.runner.views.dashboard.data import Bucket
from grpo_run.state import values
from grpo_run.state.phases import AttemptEnd, Phase
from grpo_run.state.record import RECORD_FILE, Record


def spec(name: str, max_steps: int) -> dict:
    return {"apiVersion": "grpo-run/v1", "kind": "TrainingJob", "metadata": {"name": name},
            "spec": {"model": "tiny:char", "maxCostUSD": 5.0,
                     "parameters": {"maxSteps": max_steps, "numGenerations": 4, "method": "LoRA"}}}


def metrics(step: int) -> dict:
    return {"rewardMean": 0.1 * step, "solvedGroups": 0.05 * step, "noSignalGroups": 0.5 - 0.05 * step,
            "completionLength": 20 + step, "tokenEntropy": 1.5 - 0.1 * step, "gradNorm": 1.0 / step,
            "logprobMismatch": 0.001 * step, "costUSD": 0.01 * step}


def a_group(step: int) -> dict:
    return {"item": 0, "prompt": "2+3=", "solved": False,
            "completions": [{"text": "5", "rewards": {"exact": 1.0}, "reward": 1.0, "length": 1, "truncated": False,
                             "advantage": 0.87},
                            {"text": "<b>6</b>", "rewards": {"exact": 0.0}, "reward": 0.0, "length": 3,
                             "truncated": False, "advantage": -0.87},
                            {"text": "<tool_call>add(2, 3)</tool_call>5", "rewards": {"exact": 1.0}, "reward": 1.0,
                             "length": 9, "truncated": False, "advantage": 0.87, "turns": 2,
                             "exchange": ["<tool_call>add(2, 3)</tool_call>", "<tool_response>5</tool_response>", "5"]}]}


def finished_job(storage: Path, name: str = "finished-run") -> None:
    """Preempted (aws) at step 3 on node-a, resumed from checkpoint 3 on node-b, succeeded at 8."""
    path = storage / name / RECORD_FILE
    path.parent.mkdir(parents=True)
    with Record(path) as r:
        r.init_job(name, spec(name, 8))
        r.set_phase(Phase.BASELINE_EVAL)
        first = r.start_attempt("node-a", from_step=0)
        r.record_eval("baseline", {"meanReward": 0.125, "tasks": 8}, computed=True, fingerprint="f")
        r.set_phase(Phase.TRAINING)
        for step in (1, 2, 3):
            r.log_step(step, metrics(step))
        r.end_attempt(first, AttemptEnd.PREEMPTED, notice="aws")
        r.set_phase(Phase.PREEMPTED)
        second = r.start_attempt("node-b", from_step=3)
        r.set_phase(Phase.TRAINING)
        for step in range(4, 9):
            r.log_step(step, metrics(step))
        r.put_samples("step", 8, [a_group(8)], whole=True)
        r.set_phase(Phase.FINAL_EVAL)
        r.record_eval("final", {"meanReward": 0.625, "tasks": 8}, computed=True, fingerprint="f")
        r.end_attempt(second, AttemptEnd.SUCCEEDED)
        r.set_value(values.LEDGER.key, {str(first): {"seconds": 60.0, "usd": 0.03, "usdPerHour": 1.8},
                                        str(second): {"seconds": 100.0, "usd": 0.05, "usdPerHour": 1.8}})
        r.set_value(values.SAMPLER.key, {"engine": "native", "why": "the default"})
        r.set_value(values.ESTIMATE.key, {"gpu": "L4", "gpus": 1, "usdPerHour": 0.8, "steps": 8, "stepSeconds": 20.0,
                                          "costToCompletionUSD": 0.1, "firstHoldUSD": 0.05})
        r.set_phase(Phase.SUCCEEDED)


def running_job(storage: Path, name: str = "running-run") -> Path:
    path = storage / name / RECORD_FILE
    path.parent.mkdir(parents=True)
    with Record(path) as r:
        r.init_job(name, spec(name, 20))
        r.set_phase(Phase.BASELINE_EVAL)
        r.start_attempt("node-c", from_step=0)
        r.set_phase(Phase.TRAINING)
        for step in (1, 2):
            r.log_step(step, metrics(step))
    return path


@pytest.fixture
def bucket(tmp_path) -> Path:
    storage = tmp_path / "bucket"
    finished_job(storage)
    running_job(storage)
    return storage


def test_the_list_shows_each_job_with_its_phase_step_spend_and_held_out_rewards(bucket):
    body, _ = Bucket(str(bucket)).jobs()
    assert body["error"] is None
    rows = {r["name"]: r for r in body["jobs"]}
    done, live = rows["finished-run"], rows["running-run"]
    assert (done["phase"], done["step"], done["maxSteps"], done["maxCostUSD"]) == ("Succeeded", 8, 8, 5.0)
    assert (done["baseline"], done["final"], done["nodes"]) == (0.125, 0.625, ["node-a", "node-b"])
    assert done["costUSD"] == pytest.approx(0.08) and done["engine"] == "native"
    assert (live["phase"], live["step"], live["maxSteps"], live["nodes"]) == ("Training", 2, 20, ["node-c"])
    assert live["costUSD"] == pytest.approx(0.02)      # no ledger yet: its newest step's


def test_a_jobs_page_has_its_timeline_curves_and_samples(bucket):
    page, _ = Bucket(str(bucket)).job("finished-run")
    first, second = page["attempts"]
    assert (first["node"], first["reason"], first["notice"], first["toStep"]) == ("node-a", "Preempted", "aws", 3)
    assert first["lostSeconds"] is not None and first["lostSeconds"] >= 0
    assert (second["reason"], second["fromStep"], second["toStep"], second["lostSeconds"]) == ("Succeeded", 3, 8, None)
    assert page["boundaries"] == [{"attempt": 1, "step": 3, "label": "preempted (aws)", "redone": 0}]
    assert page["steps"]["step"] == list(range(1, 9))
    assert {"rewardMean", "gradNorm", "tokenEntropy", "logprobMismatch"} <= set(page["steps"])
    assert "clipRatio" not in page["steps"]           # no step recorded it: no chart for it
    kept = page["samples"]["step"]
    assert [r["completion"] for r in kept[:2]] == ["5", "<b>6</b>"]
    assert [t["from"] for t in kept[2]["exchange"]] == ["model", "tools", "model"]     # an episode, turn by turn
    assert page["spend"]["maxCostUSD"] == 5.0 and "spend $0.0800" in page["spend"]["projection"]
    assert page["spend"]["estimate"]["costToCompletionUSD"] == 0.1        # apply's estimate beside the spend
    assert "environment" not in page["spec"] and page["log"] is None     # not run on this machine


def test_a_job_run_on_this_machine_shows_the_end_of_its_log(bucket, tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_RUN_HOME", str(tmp_path / "home"))
    log = tmp_path / "home" / "runs" / "running-run" / "logs" / "trainer.log"
    log.parent.mkdir(parents=True)
    log.write_text("".join(f"step {i}\n" for i in range(10_000)))
    page, _ = Bucket(str(bucket)).job("running-run")
    assert page["log"]["text"].endswith("step 9999\n") and len(page["log"]["text"]) <= 32_000
    assert page["log"]["text"].startswith("step ")      # whole lines only
    client = TestClient(create_app(Bucket(str(bucket))))
    etag = client.get("/api/jobs/running-run").headers["etag"]
    with open(log, "a") as f:                            # the log grows, the record does not change
        f.write("step 10000\n")
    grown = client.get("/api/jobs/running-run", headers={"If-None-Match": etag})
    assert grown.status_code == 200 and grown.json()["log"]["text"].endswith("step 10000\n")


def test_a_storage_slower_than_the_limit_is_said_and_never_holds_the_server(bucket):
    import threading

    release = threading.Event()

    class Stuck(Bucket):
        def jobs(self):
            release.wait(60)
            return super().jobs()

    with TestClient(create_app(Stuck(str(bucket)), read_limit_s=0.2)) as client:
        got = client.get("/api/jobs").json()
        assert got["jobs"] is None and got["error"].startswith("storage did not answer within 0.2 s")
        assert client.get("/static/uPlot.LICENSE").status_code == 200     # served while the read hangs
        release.set()


def test_open_pages_share_one_read_of_each_record_per_interval(bucket):
    now = [0.0]
    b = Bucket(str(bucket), fresh_s=5.0, settled_s=60.0, clock=lambda: now[0])
    b.jobs()
    assert b.reads == 3                  # the listing and two records
    for _ in range(10):                  # ten pages polling within the interval: nothing read again
        b.jobs()
    assert b.reads == 3
    now[0] = 6.0                         # past the interval: the listing and the running job only
    b.jobs()
    assert b.reads == 5
    now[0] = 61.0                        # the finished job's record, once a minute
    b.jobs()
    assert b.reads == 8


def test_a_damaged_record_keeps_the_last_good_state_and_says_why_in_one_line(bucket):
    now = [0.0]
    b = Bucket(str(bucket), clock=lambda: now[0])
    good, _ = b.job("running-run")
    (bucket / "running-run" / RECORD_FILE).write_bytes(b"SQLite format 3\x00" + b"\x00" * 100)   # caught mid-write
    now[0] = 10.0
    page, _ = b.job("running-run")
    assert page["row"] == good["row"] and page["attempts"] == good["attempts"]
    assert page["error"] and "\n" not in page["error"] and "Traceback" not in page["error"]


def test_a_storage_that_cannot_be_read_is_one_line_on_the_page_never_a_traceback(tmp_path):
    client = TestClient(create_app(Bucket("s3://bucket-that-is-not/anywhere?endpoint=http://127.0.0.1:9")))
    got = client.get("/api/jobs").json()
    assert got["jobs"] == [] and got["error"] and "\n" not in got["error"] and "Traceback" not in got["error"]


def test_polling_an_unchanged_job_answers_304(bucket):
    client = TestClient(create_app(Bucket(str(bucket))))
    first = client.get("/api/jobs")
    again = client.get("/api/jobs", headers={"If-None-Match": first.headers["etag"]})
    assert again.status_code == 304 and again.content == b""
    assert "default-src 'self'" in first.headers["content-security-policy"]


def test_a_name_storage_does_not_hold_is_404_and_reads_no_record(bucket):
    b = Bucket(str(bucket))
    client = TestClient(create_app(b))
    assert client.get("/api/jobs/..%2F..%2Fetc").status_code == 404
    assert client.get("/api/jobs/no-such-job").status_code == 404
    assert b.reads == 1                  # the listing only


def test_with_a_token_every_request_needs_it_and_the_first_load_sets_a_cookie(bucket):
    client = TestClient(create_app(Bucket(str(bucket)), token="s3cret-token"))
    assert client.get("/api/jobs").status_code == 401
    assert client.get("/api/jobs", headers={"Authorization": "Bearer wrong"}).status_code == 403
    assert client.get("/api/jobs", headers={"Authorization": "Bearer s3cret-token"}).status_code == 200
    assert client.get("/?token=nope", follow_redirects=False).status_code == 403
    first = client.get("/?token=s3cret-token", follow_redirects=False)
    assert first.status_code == 303 and first.headers["location"] == "/"
    assert client.get("/api/jobs").status_code == 200            # the cookie it set


def test_the_dashboard_refuses_to_listen_beyond_loopback_without_a_token(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "GRPO_RUN_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "grpo_run.runner.cli", "dashboard", "--storage", str(tmp_path),
                           "--host", "0.0.0.0"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "needs a token: set GRPO_RUN_DASHBOARD_TOKEN" in done.stderr and "Traceback" not in done.stderr


def test_every_asset_is_package_data_with_the_charting_librarys_license():
    static = Path(__file__).resolve().parents[3] / "runner" / "views" / "dashboard" / "static"
    names = {p.name for p in static.iterdir()}
    assert {"index.html", "job.html", "dashboard.js", "dashboard.css", "uPlot.iife.min.js", "uPlot.LICENSE"} <= names
    for page in ("index.html", "job.html"):
        assert "http" not in (static / page).read_text()     # nothing from the internet
