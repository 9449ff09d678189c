"""`grpo-run dashboard` in a real browser (headless Chromium over the DevTools protocol): the list
shows a finished and a running job with their phases, a job's page its preempted attempt and its
charts, drawn. GRPO_RUN_SCREENSHOTS=DIR writes the pictures docs/ shows."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runner.views.browser import Browser, needs_chromium
from tests.runner.views.test_dashboard import finished_job, running_job

pytestmark = needs_chromium


@pytest.fixture
def served(tmp_path):
    """The dashboard over a storage with a finished and a running job: its address."""
    storage = tmp_path / "bucket"
    finished_job(storage)
    running_job(storage)
    proc = subprocess.Popen([sys.executable, "-m", "grpo_run.runner.cli", "dashboard", "--storage", str(storage),
                             "--port", "0"], env={**os.environ, "GRPO_RUN_HOME": str(tmp_path / "home")},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()             # printed once it listens
    address = re.search(r"http://127\.0\.0\.1:\d+/", line)
    assert address, f"no address printed: {line!r} {proc.stderr.read() if proc.poll() is not None else ''}"
    browser = Browser()
    yield browser, address.group(0)
    browser.close()
    proc.terminate()
    assert proc.wait(timeout=30) in (0, -signal.SIGTERM)     # uvicorn re-raises the signal once it has stopped


def shots() -> Path | None:
    where = os.environ.get("GRPO_RUN_SCREENSHOTS")
    return Path(where) if where else None


def test_the_list_shows_a_finished_and_a_running_job_with_their_phases(served):
    browser, address = served
    browser.open(address)
    phases = browser.until("document.querySelectorAll('#jobs tbody tr').length == 2 && "
                           "Array.from(document.querySelectorAll('#jobs tbody tr'), "
                           "r => [r.dataset.job, r.cells[1].textContent, r.cells[2].textContent, r.cells[4].textContent])")
    assert phases == [["finished-run", "Succeeded", "8 / 8", "0.125 \u2192 0.625"],
                      ["running-run", "Training", "2 / 20", "-"]]
    if shots():
        browser.screenshot(shots() / "dashboard-jobs.png")


def test_a_jobs_page_shows_its_preempted_attempt_and_draws_its_charts(served):
    browser, address = served
    browser.open(address + "job/finished-run")
    attempts = browser.until("document.querySelectorAll('#timeline li').length == 2 && "
                             "Array.from(document.querySelectorAll('#timeline li'), li => li.textContent)")
    assert attempts[0].startswith("attempt 1 on node-a: steps 0 \u2192 3, Preempted (aws); ")
    assert "until the next attempt began" in attempts[0]
    assert attempts[1].startswith("attempt 2 on node-b: steps 3 \u2192 8, Succeeded")
    summary = browser.until("Object.fromEntries(Array.from(document.querySelectorAll('#summary dt'), "
                            "dt => [dt.textContent, dt.nextElementSibling.textContent]))")
    assert summary["estimated"] == ("$0.1000 to completion on L4 (8 steps of 20.000 s, at $0.8000/h); "
                                    "spent so far 80% of it")       # the estimate beside what was spent
    # every chart's canvas has its curve drawn (not a blank box, not axes alone)
    drawn = browser.until("""(() => { const cs = Array.from(document.querySelectorAll('#charts .chart'));
        if (cs.length < 5) return null;
        return cs.map(c => { const cv = c.querySelector('canvas');
            const px = cv.getContext('2d').getImageData(0, 0, cv.width, cv.height).data;
            let inked = 0;          // pixels in the first series' colour (#3b75c4): its line, not the axes
            for (let i = 0; i < px.length; i += 4)
                if (Math.abs(px[i] - 59) < 30 && Math.abs(px[i + 1] - 117) < 30 && Math.abs(px[i + 2] - 196) < 30) inked++;
            return [c.dataset.chart, inked]; }); })()""")
    charts = dict(drawn)
    assert {"rewardMean heldOut", "solvedGroups noSignalGroups", "tokenEntropy", "gradNorm",
            "logprobMismatch"} <= set(charts)
    assert all(inked > 200 for inked in charts.values()), charts
    assert browser.until("document.querySelector('#samples pre') && document.querySelectorAll('#samples pre')[1].textContent") == "5"
    turns = browser.until("Array.from(document.querySelectorAll('#samples .turn'), t => t.textContent)")
    assert ["reply 1 (tool call)", "tools", "reply 2"] == turns[-3:]       # an episode, turn by turn
    if shots():
        browser.screenshot(shots() / "dashboard-job.png")


@pytest.mark.slow
def test_the_list_follows_a_running_job_without_a_reload(served, tmp_path):
    from grpo_run.state.record import RECORD_FILE, Record
    from tests.runner.views.test_dashboard import metrics

    browser, address = served
    browser.open(address)
    assert browser.until("document.querySelector('tr[data-job=\\'running-run\\']')?.cells[2].textContent") == "2 / 20"
    with Record(tmp_path / "bucket" / "running-run" / RECORD_FILE) as r:     # the node's next step reaches storage
        r.log_step(3, metrics(3))
    assert browser.until("document.querySelector('tr[data-job=\\'running-run\\']').cells[2].textContent == '3 / 20'",
                         timeout_s=30)
