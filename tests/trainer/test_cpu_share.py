"""Trainers on one node share its threads: alone the whole pool, side by side a part each, and a
dead trainer's share comes back."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from trainer.threads import CpuShare


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def other_trainer(folder):
    """Another process that registers in `folder` and waits; it says 'ready' once registered."""
    code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from trainer.threads import CpuShare
        CpuShare(2, Path({str(folder)!r}))
        print("ready", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_alone_a_trainer_runs_the_whole_pool_and_side_by_side_half(tmp_path, restore_threads):
    clock = Clock()
    share = CpuShare(2, tmp_path, clock=clock)
    try:
        assert share.adjust() == 2 and torch.get_num_threads() == 2
        other = other_trainer(tmp_path)
        try:
            assert share.adjust() == 2                 # counted at most once a second
            clock.now += 1.0
            assert share.adjust() == 1 and torch.get_num_threads() == 1
        finally:
            other.send_signal(signal.SIGKILL)
            other.wait()
        clock.now += 1.0
        assert share.adjust() == 2                     # the killed trainer's lock went with it
        assert [p.name for p in tmp_path.glob("*.lock")] == [share.path.name]
    finally:
        share.close()
    assert not list(tmp_path.glob("*.lock"))


def test_a_share_is_never_below_one_thread(tmp_path, restore_threads):
    shares = [CpuShare(2, tmp_path) for _ in range(3)]
    try:
        assert [s.adjust() for s in shares] == [1, 1, 1]
    finally:
        for s in shares:
            s.close()
