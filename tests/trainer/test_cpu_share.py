"""Trainers on one node share its threads: alone the whole pool, beside others a part, decided
once per trainer; a dead trainer's registration goes with it."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from grpo_run.trainer.threads import CpuShare


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
        from grpo_run.trainer.threads import CpuShare
        CpuShare(2, Path({str(folder)!r}))
        print("ready", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_alone_a_trainer_takes_the_whole_pool_and_beside_another_half_which_it_keeps(tmp_path, restore_threads):
    alone = CpuShare(2, tmp_path)
    try:
        assert alone.take() == 2 and torch.get_num_threads() == 2
        other = other_trainer(tmp_path)
        try:
            assert alone.take() == 2                   # decided once: a run keeps its arithmetic
            second = CpuShare(2, tmp_path)
            try:
                assert second.take() == 1              # a trainer that starts beside two others
            finally:
                second.close()
        finally:
            other.send_signal(signal.SIGKILL)
            other.wait()
        assert alone.take() == 2
        third = CpuShare(2, tmp_path)
        try:
            assert third.take() == 1                   # the killed trainer's lock went with it: two left
            assert sorted(p.name for p in tmp_path.glob("*.lock")) == sorted([alone.path.name, third.path.name])
        finally:
            third.close()
    finally:
        alone.close()
    assert not list(tmp_path.glob("*.lock"))


def test_a_share_is_never_below_one_thread(tmp_path, restore_threads):
    shares = [CpuShare(2, tmp_path) for _ in range(3)]
    try:
        assert [s.take() for s in shares] == [1, 1, 1]
    finally:
        for s in shares:
            s.close()
