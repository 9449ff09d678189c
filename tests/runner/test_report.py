"""`grpo-run report`: the picture of a run, drawn from storage alone, with every attempt boundary
where the record has it."""

import json
import os
import signal
import struct
import subprocess
import sys
import time

from runner.report import boundaries, trailing_mean
from tests.faults.harness import wait_until
from tests.runner.test_resume import REPO, grpo_run, write_job
from tests.runner.test_supervisor import start_apply


def test_trailing_mean_averages_each_point_with_the_ones_before_it():
    assert trailing_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert trailing_mean([2.0, 4.0], 5) == [2.0, 3.0]


def test_boundaries_say_why_each_attempt_ended_and_what_the_next_one_redid():
    attempts = [
        {"id": 1, "ended": "t", "reason": "Preempted", "notice": "aws", "from_step": 0, "to_step": 30},
        {"id": 2, "ended": "t", "reason": "Crashed", "notice": None, "from_step": 30, "to_step": 57},
        {"id": 3, "ended": "t", "reason": "Succeeded", "notice": None, "from_step": 50, "to_step": 100}]
    assert boundaries(attempts) == [
        {"attempt": 1, "step": 30, "reason": "Preempted", "label": "preempted (aws)", "redone": 0, "resumedFrom": 30},
        {"attempt": 2, "step": 57, "reason": "Crashed", "label": "crashed", "redone": 7, "resumedFrom": 50}]


def png_size(path):
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", head[16:24])


def test_the_report_of_a_twice_preempted_run_is_drawn_from_storage_alone(tmp_path):
    store = str(tmp_path / "bucket")                       # the job's storage: nothing else is shared
    job = write_job(tmp_path, store)
    # attempt 1: a notice (SIGTERM) while step 2 is in its backward pass
    held = tmp_path / "held-a"
    proc = start_apply(tmp_path / "node-a", job, GRPO_RUN_NOTICES="none", GRPO_RUN_FAULT="hold:backward@2",
                       GRPO_RUN_FAULT_MARKER=str(held))
    wait_until("the hold", held.exists, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 3
    # attempt 2: the node is killed without a word after step 5's backward pass
    killed = grpo_run(tmp_path / "node-b", "resume", "resumable", "--storage", store, fault="backward@5",
                      check=False)
    assert killed.returncode == -signal.SIGKILL
    # attempt 3: another notice, at step 6; attempt 4 finishes the job
    held = tmp_path / "held-c"
    env = {"GRPO_RUN_NOTICES": "none", "GRPO_RUN_FAULT": "hold:backward@6", "GRPO_RUN_FAULT_MARKER": str(held)}
    proc = subprocess.Popen([sys.executable, "-m", "runner.cli", "resume", "resumable", "--storage", store],
                            cwd=REPO, env={**os.environ, "GRPO_RUN_HOME": str(tmp_path / "node-c"), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until("the hold", held.exists, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 3
    grpo_run(tmp_path / "node-d", "resume", "resumable", "--storage", store)

    # a machine that never ran the job: the storage URL is all it has
    viewer = tmp_path / "viewer"
    picture = viewer / "out" / "report.png"
    started = time.monotonic()
    done = grpo_run(viewer, "report", "resumable", "--storage", store, "--out", str(picture))
    print(f"\nreport drawn in {time.monotonic() - started:.1f} s: {done.stdout.strip()}")
    assert png_size(picture) == (1300, 1050)
    summary = picture.with_suffix(".md").read_text()
    attempts = json.loads(grpo_run(viewer, "get", "tj", "resumable", "--storage", store, "-o", "json").stdout
                          )["status"]["attempts"]
    assert [a["reason"] for a in attempts] == ["Preempted", "Crashed", "Preempted", "Succeeded"]
    redone = [attempts[i]["toStep"] - attempts[i + 1]["fromStep"] for i in range(3)]
    assert redone[0] == 0 and redone[2] == 0 and redone[1] >= 0   # notices lose nothing; a kill may
    assert f"3 boundaries, {sum(redone)} steps redone" in done.stdout
    for a, r, label in zip(attempts, redone, ["preempted (signal)", "crashed", "preempted (signal)"]):
        assert f"| {label} | {a['fromStep']} -> {a['toStep']} | {r} |" in summary
    assert "| succeeded |" in summary

    # the picture's own boundary lines sit at the steps the record gives, on every step panel
    from runner.places import open_record
    from runner.report import gather, render

    os.environ["GRPO_RUN_HOME"] = str(viewer)
    try:
        with open_record("resumable", store) as record:
            drawn = render(gather(record), viewer / "again.png")
    finally:
        del os.environ["GRPO_RUN_HOME"]
    lines = [ln for ax in drawn["figure"].axes for ln in ax.get_lines() if ln.get_gid() == "attempt-boundary"]
    assert sorted({ln.get_xdata()[0] for ln in lines}) == sorted({a["toStep"] for a in attempts[:3]})
    assert len(lines) == 3 * 5
    assert drawn["panels"][:5] == ["rewardMean", "completionLength", "identicalGroups", "loss",
                                                 "learningRate"]
    assert [seg["attempt"] for seg in drawn["segments"]] == [1, 2, 3, 4]
