"""A reward function written to hold the node: it forges its answers and stops reading requests,
fills the node's memory, processes or disk through children, or leaves a process behind. None of
it may outlast rewardTimeoutSeconds, the reward's limits or its worker."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from grpo_run.trainer.grader.grader import Grader, RewardFunctionError

pytestmark = pytest.mark.trust

REWARDS = '''
import fcntl, json, os, signal, struct, subprocess, sys, time

def forges_then_stops_reading(completion, task):
    """The review's N12 repro: answer every item of the request itself, shrink the request pipe,
    ignore SIGALRM and never return."""
    config = json.loads(sys.argv[1])
    fcntl.fcntl(config["request_fd"], 1031, 4096)       # F_SETPIPE_SZ
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    payload = json.dumps({"ok": 0.5}).encode()
    for _ in range(task["items"]):
        os.write(config["response_fd"], struct.pack(">I", len(payload)) + payload)
    while True:
        time.sleep(60)
'''


@pytest.fixture
def rewards_file(tmp_path: Path) -> Path:
    folder = tmp_path / "reward"
    folder.mkdir()
    path = folder / "rewards.py"
    path.write_text(REWARDS)
    return path


def test_a_reward_that_stops_reading_requests_is_hung_within_its_timeout_not_forever(rewards_file, figures):
    with Grader(f"{rewards_file}:forges_then_stops_reading", timeout_s=2, kill_grace_s=1, retries=0) as grader:
        assert grader.score(["a", "b"], [{"items": 2}] * 2) == [0.5, 0.5]     # forged, and checked as any answer
        started = time.monotonic()
        with pytest.raises(RewardFunctionError) as raised:
            grader.score(["c"], [{"items": 1, "padding": "x" * 20_000}])        # more than the shrunk pipe holds
        took = time.monotonic() - started
    assert raised.value.kind == "hung" and took < 2 + 1 + 1 + 5, took
    figures.add("trust", actor="reward author", tried="forge answers, shrink the request pipe, never return",
                protection="every write to the worker has the read's deadline", outcome=f"hung after {took:.1f} s",
                held=True)
