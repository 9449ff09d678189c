"""The sandboxed grader: rewards come back, and every way a reward function can fail is reported
as RewardFunctionError with its own error, never as a reward of 0."""

from __future__ import annotations

import os
import socket
import textwrap
from pathlib import Path

import pytest

from trainer.grader import Grader, RewardFunctionError

REWARDS = '''
import os, signal, sys, time
from pathlib import Path

def length(completion, task):
    return len(completion) + task.get("bonus", 0)

def is_correct(completion, task):
    return completion.strip() == task["answer"]

def chatty(completion, task):
    print("hello from the reward function", completion)
    sys.stdout.write("\\x00\\x00\\x00\\x10{\\"ok\\": 999.0}\\n")
    os.write(1, b"raw bytes on fd 1\\n")
    return 1.5

def raises(completion, task):
    raise ValueError(f"cannot parse {completion!r}")

def returns_str(completion, task):
    return "abc"

def returns_none(completion, task):
    return None

def returns_nan(completion, task):
    return float("nan")

def returns_huge_int(completion, task):
    return 10**400

def number_like(completion, task):
    import fractions, numpy
    return {
        "bool": True,
        "int": 3,
        "fraction": fractions.Fraction(1, 4),
        "numpy float32": numpy.float32(0.5),
        "numpy bool": numpy.isclose(1.0, 1.0),
    }[task["kind"]]

def sleeps_forever(completion, task):
    time.sleep(1e6)

def ignores_the_alarm(completion, task):
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    time.sleep(1e6)

def exits(completion, task):
    os._exit(3)

def allocates_a_gigabyte(completion, task):
    return len(bytearray(1 << 30))

def connects(completion, task):
    with socket_module().create_connection(("127.0.0.1", task["port"]), timeout=2):
        return 1.0

def socket_module():
    import socket
    return socket

def fails_once(completion, task):
    marker = Path(task["marker"])
    if not marker.exists():
        marker.write_text("failed once")
        if task["how"] == "crash":
            os._exit(1)
        raise RuntimeError("flaky")
    return 1.0

def torch_is_loaded(completion, task):
    return "torch" in sys.modules

if __name__ == "__main__":
    Path(os.environ["MAIN_GUARD_MARKER"]).write_text("the script's main block ran")
'''


@pytest.fixture
def rewards_file(tmp_path: Path) -> Path:
    path = tmp_path / "rewards.py"
    path.write_text(REWARDS)
    return path


def grader_for(rewards_file: Path, name: str, **settings) -> Grader:
    settings.setdefault("retries", 0)
    settings.setdefault("retry_wait_s", 0)
    return Grader(f"{rewards_file}:{name}", **settings)


def failure_of(grader: Grader, completions=("x",), tasks=({},)) -> str:
    with pytest.raises(RewardFunctionError) as raised:
        grader.score(list(completions), list(tasks))
    return str(raised.value)


def test_a_good_function_scores_every_completion_in_order(rewards_file):
    with grader_for(rewards_file, "length") as grader:
        assert grader.score(["ab", "abcd", ""], [{"bonus": 1}, {}, {"bonus": 0.5}]) == [3.0, 4.0, 0.5]


def test_bools_and_ints_become_floats(rewards_file):
    with grader_for(rewards_file, "is_correct") as grader:
        rewards = grader.score(["42", "41"], [{"answer": "42"}, {"answer": "42"}])
    assert rewards == [1.0, 0.0]
    assert all(type(reward) is float for reward in rewards)


def test_number_like_values_become_floats(rewards_file):
    expected = {"bool": 1.0, "int": 3.0, "fraction": 0.25, "numpy float32": 0.5, "numpy bool": 1.0}
    with grader_for(rewards_file, "number_like") as grader:
        rewards = grader.score(["x"] * len(expected), [{"kind": kind} for kind in expected])
    assert rewards == list(expected.values())


def test_an_empty_batch_scores_nothing(rewards_file):
    with grader_for(rewards_file, "length") as grader:
        assert grader.score([], []) == []


def test_prints_go_to_stderr_and_do_not_corrupt_the_scores(rewards_file, capfd):
    with grader_for(rewards_file, "chatty") as grader:
        assert grader.score(["a", "b"], [{}, {}]) == [1.5, 1.5]
    captured = capfd.readouterr()
    assert "hello from the reward function a" in captured.err
    assert "raw bytes on fd 1" in captured.err
    assert "hello from the reward function" not in captured.out


def test_a_raising_function_is_an_error_with_its_own_traceback_not_a_zero(rewards_file):
    with grader_for(rewards_file, "raises", retries=2) as grader:
        message = failure_of(grader, ["7 apples"])
    assert "raises" in message and str(rewards_file) in message
    assert "ValueError: cannot parse '7 apples'" in message
    assert 'raise ValueError(f"cannot parse {completion!r}")' in message  # the user's own line
    assert "on all 3 tries" in message
    assert "grader_worker" not in message  # the worker's frames are noise to the user


@pytest.mark.parametrize(
    ("name", "shown"),
    [
        ("returns_str", "'abc' (str)"),
        ("returns_none", "None (NoneType)"),
        ("returns_nan", "nan"),
        ("returns_huge_int", "a value of type int that float() rejects"),
    ],
)
def test_a_non_number_is_an_error(rewards_file, name, shown):
    with grader_for(rewards_file, name) as grader:
        message = failure_of(grader)
    assert f"{name} returned {shown}" in message


def test_a_function_that_sleeps_forever_times_out(rewards_file):
    with grader_for(rewards_file, "sleeps_forever", timeout_s=0.3) as grader:
        pid = grader.worker_pid
        message = failure_of(grader)
        assert grader.worker_pid == pid  # the in-process timeout needed no restart
    assert "timed out after timeout_s=0.3" in message
    assert "time.sleep(1e6)" in message  # where it was interrupted


def test_a_function_that_ignores_the_timeout_is_killed_and_the_worker_restarted(rewards_file):
    with grader_for(rewards_file, "ignores_the_alarm", timeout_s=0.2, kill_grace_s=0.3) as grader:
        first_pid = grader.worker_pid
        message = failure_of(grader)
        assert "ignored the in-process timeout" in message
        assert "in ignores_the_alarm" in message  # faulthandler's dump of where it was stuck
        assert grader.score([], []) == [] and grader.worker_pid != first_pid


def test_a_function_that_exits_its_process_reports_the_exit_code(rewards_file):
    with grader_for(rewards_file, "exits", retries=1) as grader:
        message = failure_of(grader)
    assert "exited with code 3" in message
    assert "on all 2 tries" in message


def test_allocating_past_the_memory_limit_is_an_error(rewards_file):
    with grader_for(rewards_file, "allocates_a_gigabyte", memory_mb=256) as grader:
        message = failure_of(grader)
    assert "MemoryError" in message


@pytest.mark.parametrize("network", ["auto", "python"])
def test_the_reward_function_cannot_reach_the_network(rewards_file, network):
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    port = listener.getsockname()[1]
    with listener, grader_for(rewards_file, "connects", network=network) as grader:
        assert grader.sandbox in ("netns", "python") if network == "auto" else grader.sandbox == "python"
        message = failure_of(grader, tasks=[{"port": port}])
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody ever connected
    expected = "network access is disabled in the grader" if grader.sandbox == "python" else "OSError"
    assert expected in message


@pytest.mark.parametrize("how", ["raise", "crash"])
def test_a_transient_failure_is_retried_and_then_scores(rewards_file, tmp_path, how):
    waits: list[float] = []
    task = {"marker": str(tmp_path / "marker"), "how": how}
    with grader_for(rewards_file, "fails_once", retries=1, retry_wait_s=0.25, sleep=waits.append) as grader:
        first_pid = grader.worker_pid
        assert grader.score(["x"], [task]) == [1.0]
        restarted = grader.worker_pid != first_pid
    assert waits == [0.25]
    assert restarted == (how == "crash")


def test_the_worker_is_reused_across_batches(rewards_file):
    with grader_for(rewards_file, "length") as grader:
        pid = grader.worker_pid
        for _ in range(3):
            grader.score(["abc"] * 8, [{}] * 8)
        assert grader.worker_pid == pid


def test_a_crash_restarts_the_worker_for_the_next_batch(rewards_file, tmp_path):
    task = {"marker": str(tmp_path / "marker"), "how": "crash"}
    with grader_for(rewards_file, "fails_once") as grader:
        first_pid = grader.worker_pid
        assert "exited with code 1" in failure_of(grader, tasks=[task])
        assert grader.score(["x"], [task]) == [1.0]
        assert grader.worker_pid not in (None, first_pid)


def test_a_file_ref_does_not_run_the_scripts_main_block(rewards_file, tmp_path, monkeypatch):
    marker = tmp_path / "main-ran"
    monkeypatch.setenv("MAIN_GUARD_MARKER", str(marker))
    with grader_for(rewards_file, "length") as grader:
        assert grader.score(["ab"], [{}]) == [2.0]
    assert not marker.exists()


def test_a_module_ref_is_imported_from_the_search_path(rewards_file):
    with Grader("rewards:length", search_path=[str(rewards_file.parent)]) as grader:
        assert grader.score(["abc"], [{}]) == [3.0]


def test_the_worker_does_not_import_torch(rewards_file):
    with grader_for(rewards_file, "torch_is_loaded") as grader:
        assert grader.score(["x"], [{}]) == [0.0]


@pytest.mark.parametrize(
    ("ref", "says"),
    [
        ("no_such_module_xyz:reward", "No module named 'no_such_module_xyz'"),
        ("{file}:no_such_function", "no_such_function"),
        ("{dir}/missing.py:reward", "no such file"),
        ("just_a_module_name", "malformed"),
    ],
)
def test_a_bad_ref_fails_at_once_naming_the_ref(rewards_file, ref, says):
    ref = ref.format(file=rewards_file, dir=rewards_file.parent)
    with pytest.raises(RewardFunctionError) as raised:
        Grader(ref)
    assert ref in str(raised.value) and says in str(raised.value)


def test_a_module_that_fails_to_import_is_not_retried(tmp_path):
    imports = tmp_path / "imports.log"
    broken = tmp_path / "broken.py"
    broken.write_text(
        textwrap.dedent(
            f"""
            with open({str(imports)!r}, "a") as log:
                log.write("imported\\n")
            raise ImportError("needs a package the grader does not have")
            """
        )
    )
    with pytest.raises(RewardFunctionError) as raised:
        Grader(f"{broken}:reward", retries=5)
    assert "needs a package the grader does not have" in str(raised.value)
    assert imports.read_text() == "imported\n"


def test_a_module_that_hangs_on_import_fails_after_load_timeout(tmp_path):
    stuck = tmp_path / "stuck.py"
    stuck.write_text("import time\ntime.sleep(1e6)\ndef reward(completion, task):\n    return 1.0\n")
    with pytest.raises(RewardFunctionError) as raised:
        Grader(f"{stuck}:reward", load_timeout_s=0.3, kill_grace_s=0.5)
    assert "load_timeout_s=0.3" in str(raised.value)
    assert "stuck.py" in str(raised.value)  # faulthandler's dump of where the import was


def test_close_leaves_no_child_process_and_is_idempotent(rewards_file):
    grader = grader_for(rewards_file, "length")
    pid = grader.worker_pid
    grader.close()
    grader.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(RuntimeError, match="after close"):
        grader.score(["x"], [{}])


def test_tasks_that_cannot_reach_the_worker_are_a_caller_error(rewards_file):
    with grader_for(rewards_file, "length") as grader:
        with pytest.raises(TypeError, match=r"tasks\[1\]"):
            grader.score(["a", "b"], [{}, {"ids": {1, 2}}])
        with pytest.raises(ValueError, match="2 completions but 1 tasks"):
            grader.score(["a", "b"], [{}])
