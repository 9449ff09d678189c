"""The sandboxed grader: rewards come back, and every way a reward function can fail or misbehave
is reported as RewardFunctionError with its own error (or refused, or cut short), never as a
reward of 0.

The fault tests (`-m fault`) record what became of each fault with the `figures` fixture."""

from __future__ import annotations

import logging
import os
import re
import select
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from grpo_run.trainer.grader.grader import Grader, RewardFunctionError

REPOSITORY = Path(__file__).resolve().parents[3]

REWARDS = '''
import os, signal, subprocess, sys, time
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

TRIES = 0

def raises_differently(completion, task):
    global TRIES
    TRIES += 1
    raise ValueError(f"try {TRIES}")

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

def fails_until_marked(completion, task):
    if not Path(task["marker"]).exists():  # made by the test: the function may not write there
        if task["how"] == "crash":
            os._exit(1)
        raise RuntimeError("flaky")
    return 1.0

def writes(completion, task):
    Path(task["path"]).write_text("the reward function wrote here")
    return 1.0

def removes(completion, task):
    os.remove(task["path"])
    return 1.0

def writes_where_it_may(completion, task):
    import tempfile
    with tempfile.NamedTemporaryFile("w", delete=False) as f:
        f.write("in $TMPDIR")
    Path("relative.txt").write_text("in the working directory")
    os.makedirs("folder/inside", exist_ok=True)
    with open(os.devnull, "w") as null:
        null.write("nothing")
    return float(Path(f.name).parent == Path.cwd())

def runs_a_program(completion, task):
    done = subprocess.run(["sh", "-c", task["script"]], capture_output=True, text=True, check=True)
    return float(done.stdout)

def forks(completion, task):
    if task.get("fork"):
        os.fork()
    return len(completion)

def forks_in_c(completion, task):
    import ctypes
    pid = ctypes.CDLL(None).fork()  # below Python: no audit event, nothing to refuse
    if pid == 0:
        return 99.0  # the copy returns into the worker's serve loop
    os.waitpid(pid, 0)
    return 1.0

def makes_a_multiprocessing_queue(completion, task):
    import multiprocessing
    multiprocessing.Queue()  # its lock is a POSIX semaphore, a file in /dev/shm
    return 1.0

def uses_multiprocessing(completion, task):
    import multiprocessing
    child = multiprocessing.get_context("fork").Process(target=os._exit, args=(7,))
    child.start()
    child.join()
    return float(child.exitcode)

def leaves_a_process_running(completion, task):
    if task["which"] == "child":
        return float(subprocess.Popen(["sleep", "60"]).pid)
    # A grandchild in a session of its own, orphaned at once: no process group holds it.
    spawn = (
        "import subprocess; print(subprocess.Popen(['sleep', '60'], start_new_session=True,"
        " stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)"
    )
    return float(subprocess.run([sys.executable, "-c", spawn], capture_output=True, text=True).stdout)

def hangs_with_a_process_running(completion, task):
    print("child", subprocess.Popen(["sleep", "60"]).pid, file=sys.stderr, flush=True)
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    time.sleep(1e6)

def prints_a_flood(completion, task):
    block = b"x" * (1 << 20)
    for _ in range(task["mib"]):
        os.write(1, block)
        os.write(2, block)
    return 1.0

def returns_a_huge_string(completion, task):
    return "x" * (task["mib"] << 20)

def raises_a_huge_message(completion, task):
    raise ValueError("x" * (task["mib"] << 20))

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


# how each kind of failure reads in docs/reliability.md
OUTCOMES = {
    "refused": "refused",
    "hung": "infrastructure failure",
    "crashed": "infrastructure failure",
    "exception": "error",
    "timeout": "error",
    "invalid": "error",
}


def fault(figures, name: str, grader: Grader, completions=("x",), tasks=({},)):
    """Score, record what became of the fault `name`; (rewards, None) or (None, the error)."""
    try:
        rewards, error = grader.score(list(completions), list(tasks)), None
    except RewardFunctionError as raised:
        rewards, error = None, raised
    figures.add("grader", fault=name, outcome=OUTCOMES[error.kind] if error else "scored", scored=rewards is not None)
    return rewards, error


def load_fault(figures, name: str, ref: str, **settings) -> RewardFunctionError | None:
    """Make a Grader for `ref` (closed at once), record what became of the fault `name`; the error."""
    try:
        Grader(ref, **settings).close()
        error = None
    except RewardFunctionError as raised:
        error = raised
    figures.add("grader", fault=name, outcome=OUTCOMES[error.kind] if error else "loaded", scored=error is None)
    return error


def ended_within(pid: int, timeout_s: float) -> bool:
    """Whether process `pid` ends (exits or is killed, reaped or not) within timeout_s."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True  # ended and reaped
    try:
        return bool(select.select([fd], [], [], timeout_s)[0])  # a pidfd is readable once it ended
    finally:
        os.close(fd)


def seen_from_here(grader: Grader, pid: int) -> int | None:
    """Process `pid` as the reward function saw it, as this process sees it: the same, unless the
    worker is pid 1 of a PID namespace of its own (wherever one can be made). Then the
    process of that namespace whose pid there is `pid`, or None when there is none: not even the
    namespace, once its pid 1 is gone and the kernel killed every process in it."""
    if grader.sandbox_mode["signals"] != "pidns" and not grader.sandbox_limits.get("contained"):
        return pid
    launcher = grader.worker_pid  # the worker's launcher, outside the namespace
    try:
        (init,) = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
        namespace = os.readlink(f"/proc/{init}/ns/pid")
    except (OSError, ValueError):
        return None
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.readlink(entry / "ns" / "pid") == namespace:
                status = (entry / "status").read_text()
                if int(re.search(r"^NSpid:.*\s(\d+)$", status, re.MULTILINE).group(1)) == pid:
                    return int(entry.name)
        except (OSError, AttributeError):
            continue  # ended meanwhile
    return None


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
    assert "twice with the same error, so not again" in message       # not a third time: it is the code's own
    assert "grader_worker" not in message and "grader_sandbox" not in message  # the worker's frames are noise


def test_a_raise_that_changes_between_tries_keeps_its_retries(rewards_file):
    with grader_for(rewards_file, "raises_differently", retries=2) as grader:
        message = failure_of(grader, ["x"])
    assert "on all 3 tries (retries=2)" in message and "ValueError: try 3" in message


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


@pytest.mark.fault
def test_a_function_that_sleeps_forever_times_out(rewards_file, figures):
    with grader_for(rewards_file, "sleeps_forever", timeout_s=0.3) as grader:
        pid = grader.worker_pid
        rewards, error = fault(figures, "sleeps forever", grader)
        assert grader.worker_pid == pid  # the in-process timeout needed no restart
    assert rewards is None
    message = str(error)
    assert "timed out after timeout_s=0.3" in message
    assert "time.sleep(1e6)" in message  # where it was interrupted


@pytest.mark.fault
def test_a_function_that_ignores_the_timeout_is_killed_and_the_worker_restarted(rewards_file, figures):
    with grader_for(rewards_file, "ignores_the_alarm", timeout_s=0.2, kill_grace_s=0.3) as grader:
        first_pid = grader.worker_pid
        rewards, error = fault(figures, "hangs, ignoring the timeout", grader)
        assert rewards is None
        message = str(error)
        assert "ignored the in-process timeout" in message
        assert "in ignores_the_alarm" in message  # faulthandler's dump of where it was stuck
        assert "grader/worker.py" not in message  # without the worker's own frames under it
        assert grader.score([], []) == [] and grader.worker_pid != first_pid


@pytest.mark.fault
def test_a_function_that_exits_its_process_reports_the_exit_code(rewards_file, figures):
    with grader_for(rewards_file, "exits", retries=1) as grader:
        rewards, error = fault(figures, "exits its process", grader)
    assert rewards is None
    message = str(error)
    assert "exited with code 3" in message
    assert "on all 2 tries" in message


@pytest.mark.fault
def test_allocating_past_the_memory_limit_is_an_error(rewards_file, figures):
    with grader_for(rewards_file, "allocates_a_gigabyte", memory_mb=256) as grader:
        rewards, error = fault(figures, "allocates past memory_mb", grader)
    assert rewards is None
    assert "MemoryError" in str(error)


@pytest.mark.fault
@pytest.mark.parametrize("network", ["auto", "python"])
def test_the_reward_function_cannot_reach_the_network(rewards_file, network, figures):
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    port = listener.getsockname()[1]
    with listener, grader_for(rewards_file, "connects", network=network) as grader:
        assert grader.sandbox in ("netns", "python") if network == "auto" else grader.sandbox == "python"
        rewards, error = fault(figures, f"connects to the network ({grader.sandbox})", grader, tasks=[{"port": port}])
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody ever connected
    assert rewards is None
    # Refused in Python first in every mode, so the error says why (netns alone said "OSError")
    assert "network access is disabled in the grader" in str(error)


@pytest.mark.parametrize("how", ["raise", "crash"])
def test_a_transient_failure_is_retried_and_then_scores(rewards_file, tmp_path, how):
    waits: list[float] = []
    marker = tmp_path / "marker"

    def wait(seconds: float) -> None:  # the flaky dependency recovers while the grader waits
        waits.append(seconds)
        marker.touch()

    task = {"marker": str(marker), "how": how}
    with grader_for(rewards_file, "fails_until_marked", retries=1, retry_wait_s=0.25, sleep=wait) as grader:
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


@pytest.mark.fault
def test_a_crash_restarts_the_worker_for_the_next_batch(rewards_file, tmp_path, figures):
    task = {"marker": str(tmp_path / "marker"), "how": "crash"}
    with grader_for(rewards_file, "fails_until_marked") as grader:
        first_pid = grader.worker_pid
        rewards, error = fault(figures, "crashes its worker", grader, tasks=[task])
        assert rewards is None and "exited with code 1" in str(error)
        (tmp_path / "marker").touch()
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


def test_a_missing_function_names_what_the_file_defines_and_no_internal_module(tmp_path):
    rewards = tmp_path / "rewards.py"
    rewards.write_text("from math import sqrt\n\ndef score(c, t):\n    return 1.0\n\nclass Helper:\n    pass\n\n"
                       "def _private():\n    pass\n")
    with pytest.raises(RewardFunctionError) as raised:
        Grader(f"{rewards}:scor")
    # getattr's own words named the module as the worker loads it: grader_reward_rewards
    assert raised.value.summary == f"{rewards} has no 'scor'; it defines: Helper, score"
    assert "grader_reward" not in str(raised.value)


def test_a_syntax_error_is_summed_up_as_its_file_and_line(tmp_path):
    rewards = tmp_path / "rewards.py"
    rewards.write_text("import math\n\ndef score(c, t)\n    return 1.0\n")
    with pytest.raises(RewardFunctionError) as raised:
        Grader(f"{rewards}:score")
    assert raised.value.summary == f"{rewards}:3: SyntaxError: expected ':'"
    assert "Traceback" in str(raised.value)            # the whole story stays in the message


def test_an_error_raised_at_import_is_summed_up_at_the_user_s_line(tmp_path):
    rewards = tmp_path / "rewards.py"
    rewards.write_text("import json\n\nTABLE = json.loads('{')\n")
    with pytest.raises(RewardFunctionError) as raised:
        Grader(f"{rewards}:score")
    assert raised.value.summary.startswith(f"{rewards}:3: JSONDecodeError: Expecting property name")


def test_a_module_that_fails_to_import_is_not_retried(tmp_path, capfd):
    broken = tmp_path / "broken.py"
    broken.write_text(
        textwrap.dedent(
            """
            import sys
            print("importing broken.py", file=sys.stderr)
            raise ImportError("needs a package the grader does not have")
            """
        )
    )
    with pytest.raises(RewardFunctionError) as raised:
        Grader(f"{broken}:reward", retries=5)
    assert "needs a package the grader does not have" in str(raised.value)
    assert capfd.readouterr().err.count("importing broken.py") == 1


@pytest.mark.fault
def test_a_module_that_hangs_on_import_fails_after_load_timeout(tmp_path, figures):
    stuck = tmp_path / "stuck.py"
    stuck.write_text("import time\ntime.sleep(1e6)\ndef reward(completion, task):\n    return 1.0\n")
    error = load_fault(figures, "hangs on import", f"{stuck}:reward", load_timeout_s=0.3, kill_grace_s=0.5)
    assert error is not None
    assert "load_timeout_s=0.3" in str(error)
    assert "stuck.py" in str(error)  # faulthandler's dump of where the import was


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


# sandbox: writes ------------------------------------------------------------------------------


@pytest.mark.fault
@pytest.mark.parametrize("where", ["/tmp", "the repository", "$HOME"])
def test_a_reward_that_writes_outside_its_sandbox_is_refused_not_scored(rewards_file, tmp_path, figures, where):
    folder = {"/tmp": Path(tempfile.gettempdir()), "the repository": REPOSITORY, "$HOME": Path.home()}[where]
    target = folder / f"grader-test-{tmp_path.name}.txt"
    waits: list[float] = []
    try:
        with grader_for(rewards_file, "writes", retries=2, retry_wait_s=0.1, sleep=waits.append) as grader:
            rewards, error = fault(figures, f"writes into {where}", grader, tasks=[{"path": str(target)}])
        assert not target.exists()
        assert rewards is None and error.kind == "refused"
        message = str(error)
        assert f"writing to {str(target)!r} was refused: a reward function may write only in its scratch directory" in message
        assert waits == [] and "not retried" in message  # it would be refused again
        assert "Path(task[\"path\"]).write_text(" in message  # the user's own line
        assert "grader_worker" not in message and "grader_sandbox" not in message  # the audit hook's frames
    finally:
        target.unlink(missing_ok=True)  # only there if the sandbox failed


@pytest.mark.fault
def test_a_reward_that_removes_a_file_outside_its_sandbox_is_refused_and_the_file_stays(rewards_file, tmp_path, figures):
    victim = tmp_path / "keep-me.txt"
    victim.write_text("precious")
    with grader_for(rewards_file, "removes") as grader:
        rewards, error = fault(figures, "removes a file outside its sandbox", grader, tasks=[{"path": str(victim)}])
    assert victim.read_text() == "precious"
    assert rewards is None and error.kind == "refused"
    assert f"removing {str(victim)!r} was refused" in str(error)


@pytest.mark.fault
def test_a_reward_module_that_writes_when_imported_is_refused_at_load(tmp_path, figures):
    target = tmp_path / "written-at-import.txt"
    module = tmp_path / "writes_at_import.py"
    module.write_text(f"open({str(target)!r}, 'w').write('x')\ndef reward(completion, task):\n    return 1.0\n")
    error = load_fault(figures, "writes outside its sandbox when imported", f"{module}:reward")
    assert not target.exists()
    assert error is not None and error.kind == "refused"
    assert f"writing to {str(target)!r} was refused" in str(error)


def test_a_reward_function_writes_in_its_scratch_directory_which_goes_with_the_worker(
    rewards_file, tmp_path, monkeypatch
):
    scratch_parent = tmp_path / "tmp"
    scratch_parent.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch_parent))  # where the parent makes it
    with grader_for(rewards_file, "writes_where_it_may") as grader:
        assert grader.score(["x"], [{}]) == [1.0]  # $TMPDIR is its working directory
        (scratch,) = scratch_parent.iterdir()
        if grader.sandbox_limits.get("scratch"):       # a tmpfs in the worker's own mount namespace
            assert list(scratch.iterdir()) == []        # nothing of it on the node's disk
        else:
            assert (scratch / "relative.txt").read_text() == "in the working directory"
            assert (scratch / "folder" / "inside").is_dir()
    assert list(scratch_parent.iterdir()) == []


@pytest.mark.fault
def test_programs_a_reward_function_runs_work_but_cannot_write_outside_its_sandbox_either(
    rewards_file, tmp_path, figures
):
    target = tmp_path / "written-by-a-program.txt"
    with grader_for(rewards_file, "runs_a_program") as grader:
        if grader.filesystem != "landlock":
            pytest.skip("no Landlock on this kernel: only writes through Python are refused")
        assert grader.score(["x"], [{"script": "echo 42 > answer.txt && cat answer.txt"}]) == [42.0]
        rewards, error = fault(
            figures, "runs a program that writes outside the sandbox", grader, tasks=[{"script": f"echo 1 > {target}"}]
        )
    assert not target.exists()
    assert rewards is None and "returned non-zero exit status" in str(error)


@pytest.mark.fault
def test_without_landlock_writes_through_python_are_still_refused_and_the_grader_warns_once(
    rewards_file, tmp_path, caplog, figures
):
    target = tmp_path / "outside.txt"
    with caplog.at_level(logging.WARNING, logger="grpo_run.trainer.grader.grader"):
        with grader_for(rewards_file, "writes", filesystem="python") as grader:
            assert grader.filesystem == "python"
            rewards, error = fault(figures, "writes outside its sandbox (no Landlock)", grader, tasks=[{"path": str(target)}])
            with pytest.raises(RewardFunctionError):
                grader.score(["x"], [{"path": str(target)}])  # again: no second warning
    assert not target.exists()
    assert rewards is None and error.kind == "refused"
    warnings = [r.getMessage() for r in caplog.records if r.name == "grpo_run.trainer.grader.grader"]
    assert len(warnings) == 1
    assert "cannot keep reward function" in warnings[0] and "filesystem='python' was asked for" in warnings[0]


# sandbox: processes ---------------------------------------------------------------------------


@pytest.mark.fault
def test_a_reward_that_forks_is_refused_not_scored(rewards_file, figures):
    with grader_for(rewards_file, "forks") as grader:
        rewards, error = fault(figures, "forks (os.fork)", grader, tasks=[{"fork": True}])
        assert rewards is None and error.kind == "refused"
        assert "os.fork() was refused" in str(error) and "subprocess" in str(error)
        assert grader.score(["ab", "abc"], [{}, {}]) == [2.0, 3.0]  # one answer per item, in order


@pytest.mark.fault
def test_a_copy_of_the_worker_forked_below_python_never_answers_for_it(rewards_file, figures):
    with grader_for(rewards_file, "forks_in_c") as grader:
        rewards = grader.score(["x"], [{}])
        copy_scored = 99.0 in rewards
        figures.add("grader", fault="forks in C; the copy returns", outcome="scored" if copy_scored else "refused",
                    scored=copy_scored)
        assert rewards == [1.0]  # the worker's own answer, not its copy's 99.0
        assert grader.score(["x", "y"], [{}, {}]) == [1.0, 1.0]


@pytest.mark.fault
def test_a_write_refused_below_python_says_the_sandbox_may_be_why(rewards_file, figures):
    with grader_for(rewards_file, "makes_a_multiprocessing_queue") as grader:
        if grader.filesystem != "landlock":
            pytest.skip("no Landlock on this kernel: writes below Python are not refused")
        rewards, error = fault(figures, "makes a multiprocessing.Queue (a semaphore in /dev/shm)", grader)
    assert rewards is None and error.kind == "exception"
    assert "Permission denied" in str(error)
    assert "may be the grader's sandbox" in str(error) and "/dev/shm" in str(error)


def test_multiprocessing_still_works_in_a_reward_function(rewards_file):
    with grader_for(rewards_file, "uses_multiprocessing") as grader:
        assert grader.score(["x"], [{}]) == [7.0]  # its forked child's exit code


@pytest.mark.fault
@pytest.mark.parametrize("which", ["child", "orphaned grandchild"])
def test_a_process_a_reward_function_leaves_running_is_gone_when_its_score_arrives(rewards_file, which):
    with grader_for(rewards_file, "leaves_a_process_running") as grader:
        (pid,) = grader.score(["x"], [{"which": which}])
        here = seen_from_here(grader, int(pid))
        assert here is None or not Path(f"/proc/{here}").exists()  # killed and reaped before the answer


def test_a_helper_process_started_at_import_lives_as_long_as_the_worker(tmp_path):
    module = tmp_path / "with_helper.py"
    module.write_text(
        "import subprocess\nhelper = subprocess.Popen(['sleep', '60'])\n"
        "def reward(completion, task):\n    return float(helper.pid)\n"
    )
    with Grader(f"{module}:reward", retries=0) as grader:
        (pid,) = grader.score(["x"], [{}])
        assert grader.score(["x"], [{}]) == [pid]
        here = seen_from_here(grader, int(pid))
        assert here is not None and not ended_within(here, 0)
    assert ended_within(here, 5)


@pytest.mark.fault
def test_the_processes_of_a_hung_reward_function_die_with_its_worker(rewards_file, capfd, figures):
    with grader_for(rewards_file, "hangs_with_a_process_running", timeout_s=0.2, kill_grace_s=0.3) as grader:
        rewards, error = fault(figures, "hangs with a process running", grader)
        assert rewards is None and error.kind == "hung"
        pid = int(re.search(r"child (\d+)", capfd.readouterr().err).group(1))
        here = seen_from_here(grader, pid)
        assert here is None or ended_within(here, 5)  # None: its PID namespace went with the worker


# huge output ----------------------------------------------------------------------------------


@pytest.mark.fault
def test_a_flood_of_output_is_cut_off_per_worker_with_a_note_of_how_much_was_dropped(rewards_file, capfd):
    with grader_for(rewards_file, "prints_a_flood") as grader:
        assert grader.score(["x"], [{"mib": 16}]) == [1.0]  # 16 MiB to stdout and 16 to stderr
    captured = capfd.readouterr()
    dropped = (32 << 20) - (1 << 20)
    assert captured.out == ""
    assert len(captured.err) < (1 << 20) + 1_000
    assert re.findall(r"dropped [\d.]+ MiB \([\d,]+ bytes\)", captured.err) == [f"dropped 31.0 MiB ({dropped:,} bytes)"]


@pytest.mark.fault
def test_a_huge_string_returned_is_an_error_whose_message_stays_short(rewards_file, figures):
    with grader_for(rewards_file, "returns_a_huge_string", memory_mb=256) as grader:
        rewards, error = fault(figures, "returns a 150 MiB string", grader, tasks=[{"mib": 150}])
    assert rewards is None and error.kind == "invalid"
    message = str(error)
    assert "returns_a_huge_string returned 'xxxxxxxx" in message and f"(str of length {150 << 20:,})" in message
    assert len(message) < 1_000


@pytest.mark.fault
def test_a_huge_error_message_is_shortened_and_keeps_the_users_line(rewards_file, figures):
    with grader_for(rewards_file, "raises_a_huge_message", memory_mb=256) as grader:
        rewards, error = fault(figures, "raises with a 100 MiB message", grader, tasks=[{"mib": 100}])
    assert rewards is None and error.kind == "exception"
    message = str(error)
    assert 'raise ValueError("x" * (task["mib"] << 20))' in message  # the traceback survived
    assert "ValueError: xxxx" in message and "message shortened" in message
    assert len(message) < 25_000


def test_the_workers_children_are_read_from_its_open_proc_files_while_it_has_one_thread():
    # After every reward call the worker looks for processes it left running: with one thread,
    # two preads of files it opened once (a path lookup per call cost most of a cheap reward's
    # time); with more threads, each thread's list. Checked in a fresh one-thread process.
    if not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists():
        pytest.skip("needs /proc/PID/task/TID/children (CONFIG_PROC_CHILDREN)")
    script = textwrap.dedent("""
        import os, subprocess, threading
        from grpo_run.trainer.grader import sandbox
        me = os.getpid()
        assert threading.active_count() == 1
        child = subprocess.Popen(["sleep", "60"])
        try:
            assert sandbox._children_of_one_thread(me) == {child.pid} == sandbox._children()
        finally:
            child.kill()
            child.wait()
        assert sandbox._children_of_one_thread(me) == set()
        done = threading.Event()
        thread = threading.Thread(target=done.wait)
        thread.start()
        try:
            assert sandbox._children_of_one_thread(me) is None      # two threads: the full scan
            assert sandbox._children() == set()
        finally:
            done.set()
            thread.join()
        print("ok")
    """)
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0 and ran.stdout == "ok\n", ran.stderr[-2000:]
