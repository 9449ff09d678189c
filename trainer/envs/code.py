"""The `code` environment's rewards: the completion's code run against the task's unit tests, in
a child process of the grader's sandboxed worker (so under its limits: no network, no sockets,
writes only in a scratch folder, its memory limit), with what is left of the worker's time limit.

A task is `{prompt, tests}`, `tests` a list of Python statements (usually `assert ...`); MBPP's
`test_list` (with `test_setup_code`, run before the tests) and HumanEval's `test` (defining
`check(candidate)`) with `entry_point` are the same thing under their own names. The code is the
completion's first fenced block (```python, ```py or bare ```; an unclosed one runs to the end),
else the whole completion. For a HumanEval task whose code does not define `entry_point`, the
prompt (the function's signature) is put before it, as HumanEval's own harness does.

The completion's code failing, hanging, exhausting memory or opening a socket fails its tests:
a score, the model's mistake. Only the harness failing to run at all raises (an infrastructure
failure, which the grader reports and never records as a score).

Standard library only, nothing from the trainer: the grader's worker imports this module.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from typing import Any

_FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
_ANY_FENCE = re.compile(r"```[ \t]*([\w+-]*)[ \t]*\n")
# The harness's own share of the worker's time limit: starting the child interpreter, reading its
# answer and removing its folder, so the worker answers before its alarm does.
_HARNESS_S = 0.5

# The child's program. Its answer goes to a pipe of its own (fd given in argv), not to stdout, so a
# completion that prints (or calls os._exit(0) before the tests) cannot pass a test it did not run.
_CHILD = r"""
import json, os, sys
def _no_network(event, args):
    if event.startswith(("socket.", "urllib.")):
        raise PermissionError("network access is disabled for the completion's code")
sys.addaudithook(_no_network)
_out = os.fdopen(int(sys.argv[1]), "w", buffering=1)
_job = json.loads(sys.stdin.read())
sys.stdin.close()
_scope = {"__name__": "completion"}
try:
    exec(compile(_job["code"], "<completion>", "exec"), _scope)
    exec(compile(_job["setup"], "<setup>", "exec"), _scope)
except BaseException:
    os._exit(0)
for _i, _test in enumerate(_job["tests"]):
    try:
        exec(compile(_test, "<test %d>" % _i, "exec"), _scope)
    except BaseException:
        continue
    _out.write("%d\n" % _i)
os._exit(0)
"""


def extract_code(completion: str) -> str:
    """The completion's first fenced block of Python (```python, ```py or bare ```; unclosed:
    to the end), else the whole completion when it has no fenced block at all."""
    for match in _FENCE.finditer(completion):
        return match.group(2)
    if _ANY_FENCE.search(completion):        # only blocks of another language: nothing to run
        return ""
    return completion


def task_tests(task: dict[str, Any]) -> tuple[list[str], str]:
    """(the test statements, the setup code run before them) of a task: `tests`, MBPP's
    `test_list` (+ `test_setup_code`) or HumanEval's `test` + `entry_point` (one test: the check).
    Raises ValueError naming the field when there are none or they are not strings."""
    problem = tests_problem(task)
    if problem:
        raise ValueError(problem)
    if "tests" in task:
        return list(task["tests"]), ""
    if "test_list" in task:
        return list(task["test_list"]), task.get("test_setup_code") or ""
    return [f"check({task['entry_point']})"], task["test"]


def tests_problem(task: Any) -> str | None:
    """What keeps a task from being a code task, or None."""
    if not isinstance(task, dict):
        return "each task must be a JSON object with a prompt and tests"
    for field in ("tests", "test_list"):
        if field in task:
            tests = task[field]
            if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t.strip() for t in tests):
                return f"{field!r} must be a non-empty list of Python statements such as \"assert f(2) == 4\""
            if field == "test_list" and not isinstance(task.get("test_setup_code") or "", str):
                return "'test_setup_code' must be Python code (a string)"
            return None
    if "test" in task or "entry_point" in task:
        if not (isinstance(task.get("test"), str) and isinstance(task.get("entry_point"), str)
                and task["entry_point"].isidentifier()):
            return ("HumanEval's form needs both 'test' (code defining check(candidate)) and 'entry_point' "
                    "(the function's name)")
        return None
    return ("needs 'tests': a list of assert statements (or MBPP's 'test_list', or HumanEval's 'test' and "
            "'entry_point')")


def program(completion: str, task: dict[str, Any]) -> str:
    """The code to run: the completion's block, after the prompt for a HumanEval task whose block
    does not define its entry point."""
    code = extract_code(completion)
    entry = task.get("entry_point")
    if "tests" not in task and "test_list" not in task and isinstance(entry, str) \
            and not re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, re.MULTILINE):
        prompt = task.get("prompt")
        if isinstance(prompt, str):
            code = prompt + code
    return code


def tests_passed(completion: str, task: dict[str, Any]) -> list[bool]:
    """Which of the task's tests pass against the completion's code, run in a child interpreter
    in a fresh folder, for what is left of the grader's time limit (all of them fail when it runs
    out). Raises ValueError for a task without tests, OSError when no child could be started."""
    tests, setup = task_tests(task)
    code = program(completion, task)
    if not code.strip():
        return [False] * len(tests)
    left, _ = signal.getitimer(signal.ITIMER_REAL)      # the grader's alarm: 0 outside the worker
    budget = max(left - _HARNESS_S, 0.1) if left else None
    read_end, write_end = os.pipe()
    passed: set[int] = set()
    try:
        with tempfile.TemporaryDirectory(prefix="code-") as folder:
            child = subprocess.Popen(
                [sys.executable, "-I", "-c", _CHILD, str(write_end)], cwd=folder, pass_fds=(write_end,),
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            os.close(write_end)
            write_end = -1
            try:
                child.communicate(json.dumps({"code": code, "setup": setup, "tests": tests}).encode(), timeout=budget)
            except subprocess.TimeoutExpired:
                pass                                    # a hang: the tests it did not reach fail
            finally:
                _kill_group(child)
            passed = {int(line) for line in _written(read_end).split() if line.isdigit()}
    finally:
        for fd in (read_end, write_end):
            if fd >= 0:
                os.close(fd)
    return [i in passed for i in range(len(tests))]


def _written(fd: int) -> str:
    """What is in the pipe now, without waiting: a process the child moved out of its session
    may hold the other end open."""
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode("ascii", "replace")


def _kill_group(child: subprocess.Popen) -> None:
    """The child and whatever it started (its own session), then the child reaped."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    child.wait()


def fraction_passed(completion: str, task: dict[str, Any]) -> float:
    """The fraction of the task's tests the completion's code passes (0 when it does not run)."""
    results = tests_passed(completion, task)
    return sum(results) / len(results)


def all_passed(completion: str, task: dict[str, Any]) -> float:
    """1.0 when the completion's code passes every test of the task, else 0.0."""
    return 1.0 if all(tests_passed(completion, task)) else 0.0
