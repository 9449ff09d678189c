"""A reward function written to hold the node: it forges its answers and stops reading requests,
fills the node's processes or disk through children, or leaves a process behind. None of it may
outlast rewardTimeoutSeconds, the reward's limits or its worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
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

def forks_until_refused(completion, task):
    children = []
    try:
        while len(children) < task["at_most"]:
            children.append(subprocess.Popen(["sleep", "60"]))
    except OSError as error:
        return float(len(children))
    return -1.0

def fills_the_disk(completion, task):
    for i in range(task["files"]):          # each under RLIMIT_FSIZE: the scratch folder's size stops them
        with open(f"big-{i}.bin", "wb") as f:
            for _ in range(task["mib"]):
                f.write(b"x" * (1 << 20))
    return 1.0

def writes_the_crash_log(completion, task):
    fd = json.loads(sys.argv[1])["crash_fd"]
    for _ in range(task["mib"]):
        os.write(fd, b"x" * (1 << 20))
    return 1.0

def holds_memory_in_children(completion, task):
    """Children each well under rewardMemoryMB (its RLIMIT_AS), together well past it."""
    hold = f"import time; b = b'x' * ({task['mib']} << 20); print('held', flush=True); time.sleep(60)"
    children = [subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE) for _ in range(task["children"])]
    held = [child for child in children if child.stdout.readline() == b"held\\n"]
    time.sleep(0.5)
    return float(sum(child.poll() is None for child in held))

def returns_one(completion, task):
    return 1.0
'''

HELPER = '''
import signal, subprocess, sys, time
# the review's N4 repro: a process started at import, in a session of its own
subprocess.Popen([sys.executable, "-c", "import time\\nwhile True: time.sleep(1)", "MARKER"], start_new_session=True)

def returns_one(completion, task):
    return 1.0

def hangs(completion, task):
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    print("hanging", flush=True)
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


def alive(marker: str) -> list[int]:
    """The host's processes whose command line holds `marker` (zombies are not alive)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmdline and state != "Z":
            found.append(int(entry))
    return found


def wait_for(what: str, reached, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not reached():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.02)


def helper_module(tmp_path: Path) -> tuple[Path, str]:
    marker = f"grpo-helper-{uuid.uuid4().hex}"
    module = tmp_path / "helper.py"
    module.write_text(HELPER.replace("MARKER", marker))
    return module, marker


@pytest.mark.parametrize("end", ["closed", "killed as hung"])
def test_a_process_started_at_import_in_a_session_of_its_own_dies_with_the_worker(tmp_path, end, figures):
    """Closed, the worker's own cleanup could reach it; killed as hung (SIGABRT, then SIGKILL to its
    group), nothing of the worker's runs: only the kernel can."""
    module, marker = helper_module(tmp_path)
    grader = Grader(f"{module}:{'returns_one' if end == 'closed' else 'hangs'}", strict=True, retries=0,
                    timeout_s=1, kill_grace_s=0.5)
    try:
        wait_for("the helper started", lambda: alive(marker))
        assert grader.sandbox_limits["contained"].startswith("a PID namespace")
        if end == "killed as hung":
            with pytest.raises(RewardFunctionError, match="hung"):
                grader.score(["x"], [{}])
            assert alive(marker) == []
    finally:
        grader.close()
    assert alive(marker) == []
    figures.add("trust", actor="reward author", tried=f"start a process at import with start_new_session=True "
                f"(worker {end})", protection="a PID namespace for every worker", outcome="gone with the worker",
                held=True)


TRAINER = """
import sys
from grpo_run.trainer.grader.grader import Grader
grader = Grader(sys.argv[1], strict=True, retries=0, timeout_s=600)
grader.score(["x"], [{}])
"""


def test_a_trainer_killed_with_sigkill_mid_reward_leaves_no_worker_and_no_helper(tmp_path, figures):
    """The supervisor's watchdog or a lost lease SIGKILLs the trainer while its reward hangs: the
    worker (in a session of its own) and the reward's helper must not live on."""
    module, marker = helper_module(tmp_path)
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, f"{module}:hangs"], stderr=subprocess.PIPE, text=True)
    try:
        assert "hanging" in trainer.stderr.readline()      # the worker passes the reward's output on
        assert alive(marker) and alive(str(module))
    finally:
        trainer.kill()
        trainer.wait()
    wait_for("the worker and the helper gone", lambda: not alive(marker) and not alive(str(module)))
    figures.add("trust", actor="reward author", tried="outlive a trainer killed with SIGKILL mid-reward",
                protection="the worker dies with the trainer (PR_SET_PDEATHSIG), its namespace with it",
                outcome="none left", held=True)


def test_a_fork_bomb_stops_at_the_process_cap_not_the_nodes(rewards_file, figures):
    with Grader(f"{rewards_file}:forks_until_refused", strict=True, retries=0, timeout_s=60) as grader:
        if not grader.sandbox_limits.get("processes"):
            pytest.skip("this kernel caps a PID namespace's processes only from Linux 6.14 (pid_max)")
        (started,) = grader.score(["x"], [{"at_most": 2000}])
    assert 0 < started < 301
    figures.add("trust", actor="reward author", tried="start processes until refused",
                protection="pid_max of its PID namespace", outcome=f"refused after {started:.0f}", held=True)


@pytest.mark.parametrize("where", ["scratch", "crash log"])
def test_the_reward_cannot_fill_the_disk(rewards_file, where, figures):
    name = "fills_the_disk" if where == "scratch" else "writes_the_crash_log"
    with Grader(f"{rewards_file}:{name}", strict=True, retries=0, memory_mb=128, timeout_s=60) as grader:
        with pytest.raises(RewardFunctionError) as raised:
            grader.score(["x"], [{"files": 3, "mib": 100} if where == "scratch" else {"mib": 300}])
    assert raised.value.kind == "exception"
    assert ("No space left on device" if where == "scratch" else "File too large") in str(raised.value)
    figures.add("trust", actor="reward author", tried=f"write 300 MiB to its {where} under rewardMemoryMB 128",
                protection="a 128 MiB tmpfs scratch; RLIMIT_FSIZE", outcome="refused at 128 MiB", held=True)


@pytest.fixture
def node_cgroups() -> None:
    """Skips where this node gives no process a cgroup for a tree (a read-only /sys/fs/cgroup)."""
    from grpo_run.trainer.grader import cgroup

    tree, why = cgroup.make(64, 10)
    if tree is None:
        pytest.skip(f"no cgroup for a reward's tree on this node: {why}")
    tree.remove()


def test_children_each_under_the_memory_limit_cannot_together_pass_the_trees(rewards_file, node_cgroups, figures):
    """The review's N3 repro: RLIMIT_AS bounds each process, not the tree; the cgroup bounds the tree
    (rewardMemoryMB for its processes plus rewardMemoryMB of scratch) and the kernel kills past it."""
    with Grader(f"{rewards_file}:holds_memory_in_children", strict=True, retries=0, memory_mb=200,
                timeout_s=60) as grader:
        assert grader.sandbox_limits["memory"].startswith("a cgroup (v"), grader.sandbox_limits
        (holding,) = grader.score(["x"], [{"children": 6, "mib": 100}])   # 600 MiB in all, each under 200
    assert 0 <= holding <= 3, holding                                      # 400 MiB for the whole tree
    figures.add("trust", actor="reward author", tried="hold 600 MiB in 6 children of 100 MiB under rewardMemoryMB 200",
                protection="a cgroup of 2 × rewardMemoryMB for the reward's whole tree",
                outcome=f"the kernel killed the children past it: {holding:.0f} left holding", held=True)


def test_the_trees_cgroup_goes_with_its_worker_and_a_killed_trainers_is_swept(rewards_file, node_cgroups):
    from grpo_run.trainer.grader import cgroup

    with Grader(f"{rewards_file}:returns_one", strict=True, retries=0) as grader:
        folders = list(grader._worker._tree.folders)
        assert all(str(grader._worker.pid) in Path(f, "cgroup.procs").read_text().split() for f in folders)
        assert grader.score(["x"], [{}]) == [1.0]
        assert Path(f"/proc/{grader._worker.pid}/oom_score_adj").read_text().strip() == "1000"   # first to go
        # one a trainer killed with SIGKILL left behind: its pid is gone
        dead = subprocess.Popen(["true"])
        dead.wait()
        stale = [Path(f).parent / f"{cgroup.PREFIX}{dead.pid}-1" for f in folders]
        for folder in stale:
            folder.mkdir()
    assert not any(Path(f).exists() for f in folders)
    tree, why = cgroup.make(64, 10)                 # the next one made sweeps the stale ones
    assert tree is not None, why
    tree.remove()
    assert not any(folder.exists() for folder in stale)
