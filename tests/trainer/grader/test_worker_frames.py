"""The trainer's reading of a worker's frames (`grader.process`): a frame is checked for its shape
and size before anything walks it, its texts are scrubbed with the secrets listed once per frame,
and only error texts are capped: a prompt or an observation comes back whole."""

from __future__ import annotations

import json
import os
import tempfile
import time

import pytest

from grpo_run.trainer.grader import redact
from grpo_run.trainer.grader.process import WorkerGone, WorkerProcess
from grpo_run.trainer.grader.worker import _HEADER

pytestmark = pytest.mark.trust
SECRET = "FAKE-NODE-SECRET-1234567890"


@pytest.fixture
def scans(monkeypatch):
    """How many times the node's secrets were listed (each costs a glob and a dozen stat calls)."""
    monkeypatch.setenv("MY_API_KEY", SECRET)
    count = [0]
    listed = redact.credential_files

    def counting(environ=None):
        count[0] += 1
        return listed(environ)

    monkeypatch.setattr(redact, "credential_files", counting)
    return count


def read_frame(frame: object) -> dict:
    """`frame` as the worker would write it, read back by WorkerProcess.read."""
    payload = json.dumps(frame).encode()
    with tempfile.TemporaryFile() as f:
        f.write(_HEADER.pack(len(payload)) + payload)
        f.seek(0)
        worker = WorkerProcess(None, -1, f.fileno(), None, None, "")   # read() needs only its response fd
        return worker.read(time.monotonic() + 30)


def test_a_frame_is_scrubbed_with_one_secret_scan_however_many_texts_it_holds(scans):
    messages = [{"role": "user", "content": f"turn {i}: {SECRET}"} for i in range(2_000)]
    frame = read_frame({"ok": messages})
    assert frame["ok"][1999] == {"role": "user", "content": "turn 1999: [redacted $MY_API_KEY]"}
    assert scans[0] == 1


def test_a_long_prompt_or_observation_comes_back_whole_and_only_error_text_is_capped(scans):
    prompt = "p" * 9_000 + SECRET
    assert read_frame({"ok": prompt}) == {"ok": "p" * 9_000 + "[redacted $MY_API_KEY]"}
    step = {"observation": [{"role": "user", "content": "o" * 9_000}], "reward": 0.0, "done": False}
    assert read_frame({"ok": step}) == {"ok": step}
    error = read_frame({"kind": "exception", "error": "e" * 9_000})["error"]
    assert "characters cut" in error and len(error) < 5_000


@pytest.mark.parametrize("frame", [
    {"ok": [""] * 200_000},                                   # 200 k values: refused without a scan
    {"ok": [[[]] * 1_000] * 1_000},                           # a million values, nested
    {"ok": 1.0, "planted": "x"},                              # a key no frame has
    ["ok", 1.0],                                              # not an object
])
def test_a_frame_no_worker_writes_is_refused_before_it_is_walked(scans, frame):
    with pytest.raises(WorkerGone):
        read_frame(frame)
    assert scans[0] == 0
