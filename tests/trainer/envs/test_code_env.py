"""The `code` environment: the completion's code block runs against the task's tests in a child of
the grader's sandboxed worker. Its failures (wrong, raising, hanging, out of memory, the network)
are scores of the model's answer; the reward is the fraction of tests passed, or 1/0."""

from __future__ import annotations

import time

import pytest
import yaml

from grpo_run.runner.environments import build_environment
from grpo_run.runner.spec.job import JobError, load_job
from grpo_run.trainer.envs.code import extract_code
from grpo_run.trainer.envs.code import tests_problem as code_task_problem  # not collected as a test
from grpo_run.trainer.envs.codetasks import builtin_code_tasks, code_tasks
from grpo_run.trainer.grader.grader import Grader

FRACTION = "grpo_run.trainer.envs.code:fraction_passed"
ALL = "grpo_run.trainer.envs.code:all_passed"
ADD = {"prompt": "Write add(a, b).", "tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 0) == 0"]}


def block(code: str) -> str:
    return f"Here it is:\n```python\n{code}\n```\nDone."


def test_each_failure_of_the_completions_code_is_a_score_never_an_error():
    completions = {
        "right": block("def add(a, b):\n    return a + b"),
        "two of three": block("def add(a, b):\n    return a + b if a else 1"),
        "wrong": block("def add(a, b):\n    return a - b"),
        "raises": block("raise ValueError('no')"),
        "hangs": block("while True:\n    pass"),
        "socket": block("import socket\nsocket.create_connection(('1.1.1.1', 80))\ndef add(a, b):\n    return a + b"),
        "memory": block("hog = bytearray(10**11)\ndef add(a, b):\n    return a + b"),
        "reads a node file": block("open('/etc/hostname').read()\ndef add(a, b):\n    return a + b"),
        "exits before the tests": block("import os\ndef add(a, b):\n    return 0\nprint('0\\n1\\n2')\nos._exit(0)"),
        "no code block": "I do not know.\n```text\nadd\n```",
    }
    started = time.monotonic()
    with Grader(FRACTION, timeout_s=3, retries=0) as grader:
        scores = dict(zip(completions, grader.score(list(completions.values()), [ADD] * len(completions))))
    assert scores == {"right": 1.0, "two of three": pytest.approx(2 / 3), "wrong": 1 / 3, "raises": 0.0, "hangs": 0.0,
                      "socket": 0.0, "memory": 0.0, "reads a node file": 0.0, "exits before the tests": 0.0,
                      "no code block": 0.0}
    assert time.monotonic() - started < 15           # the hang cost what was left of its 3 s, once


def test_all_passed_is_one_only_when_every_test_passes():
    with Grader(ALL, timeout_s=3, retries=0) as grader:
        assert grader.score([block("def add(a, b):\n    return a + b"), block("def add(a, b):\n    return a + b if a else 1")],
                            [ADD, ADD]) == [1.0, 0.0]


def test_mbpp_and_humaneval_tasks_are_scored_under_their_own_field_names():
    mbpp = {"text": "Write inc(x).", "prompt": "Write inc(x).", "test_setup_code": "OFFSET = 1",
            "test_list": ["assert inc(1) == 1 + OFFSET", "assert inc(-1) == 0"]}
    humaneval = {"prompt": "def inc(x):\n    \"\"\"x plus one\"\"\"\n", "entry_point": "inc",
                 "test": "def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(5) == 6\n"}
    with Grader(FRACTION, timeout_s=3, retries=0) as grader:
        scores = grader.score([block("def inc(x):\n    return x + 1"), "    return x + 1\n",
                               block("def inc(x):\n    return x + 1"), "    return x + 2\n"],
                              [mbpp, humaneval, humaneval, humaneval])
    assert scores == [1.0, 1.0, 1.0, 0.0]     # HumanEval's body-only answer runs after its prompt


def test_the_first_python_block_is_the_code():
    assert extract_code("a\n```py\nx = 1\n```\n```python\nx = 2\n```") == "x = 1\n"
    assert extract_code("```python\nx = 1\n") == "x = 1\n"           # cut off at maxCompletionLength
    assert extract_code("x = 3") == "x = 3"                          # no fence: all of it
    assert extract_code("```bash\nls\n```") == ""                   # another language: nothing to run


def test_every_builtin_task_is_solvable_and_its_tests_catch_a_wrong_answer():
    solutions = {
        "add": "def add(a, b): return a + b",
        "is_even": "def is_even(n): return n % 2 == 0",
        "reverse_string": "def reverse_string(s): return s[::-1]",
        "factorial": "import math\ndef factorial(n): return math.factorial(n)",
        "count_vowels": "def count_vowels(s): return sum(c in 'aeiouAEIOU' for c in s)",
        "max_of_list": "def max_of_list(xs): return max(xs)",
        "is_palindrome": "def is_palindrome(s): return s == s[::-1]",
        "fibonacci": "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
        "sum_of_digits": "def sum_of_digits(n): return sum(map(int, str(n)))",
        "remove_duplicates": "def remove_duplicates(xs): return list(dict.fromkeys(xs))",
        "is_prime": "def is_prime(n): return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))",
        "word_count": "def word_count(s): return len(s.split())",
    }
    tasks = builtin_code_tasks()
    assert len(tasks) == 12 and all(code_task_problem(t) is None for t in tasks)
    wrong = [block(f"def {t['entry']}(*args):\n    return None") for t in tasks]
    with Grader(FRACTION, timeout_s=5, retries=0) as grader:
        assert grader.score([block(solutions[t["entry"]]) for t in tasks], tasks) == [1.0] * 12
        assert grader.score(wrong, tasks) == [0.0] * 12
    train, held_out = code_tasks(seed=3, n_train=None, n_eval=None)
    assert len(train) == 8 and len(held_out) == 4
    assert not {t["entry"] for t in train} & {t["entry"] for t in held_out}


def job_file(folder, environment) -> str:
    doc = {"apiVersion": "grpo-run/v1", "kind": "TrainingJob", "metadata": {"name": "code-job"},
           "spec": {"runtime": "grpo-lora", "model": "tiny:char", "environment": environment}}
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_a_code_job_takes_the_builtin_tasks_or_yours_and_checks_yours_have_tests(tmp_path):
    env = build_environment(load_job(job_file(tmp_path, {"name": "code"})))
    assert [r.name for r in env.rewards] == ["passed"] and (len(env.train_tasks), len(env.eval_tasks)) == (8, 4)

    (tmp_path / "mbpp.jsonl").write_text('{"prompt": "p1", "test_list": ["assert True"]}\n'
                                         '{"prompt": "p2", "test_list": ["assert True"]}\n')
    env = build_environment(load_job(job_file(tmp_path, {"name": "code", "tasks": "mbpp.jsonl", "heldOutFraction": 0.5,
                                                         "rewards": ["all_passed"]})))
    assert env.rewards[0].ref == ALL and len(env.train_tasks) == len(env.eval_tasks) == 1

    (tmp_path / "bad.jsonl").write_text('{"prompt": "p1", "tests": ["assert True"]}\n{"prompt": "p2", "tests": "assert True"}\n')
    with pytest.raises(ValueError, match=r"spec.environment.tasks: .*'tests' must be a non-empty list"):
        build_environment(load_job(job_file(tmp_path, {"name": "code", "tasks": "bad.jsonl", "heldOutFraction": 0.5})))

    with pytest.raises(JobError) as e:
        load_job(job_file(tmp_path, {"name": "code", "heldOutFraction": 0.5, "rewards": ["tests"]}))
    assert "heldOutFraction: goes with tasks, dataset or dataFiles" in str(e.value)
    assert "code has no reward 'tests': it has passed, all_passed" in str(e.value)
