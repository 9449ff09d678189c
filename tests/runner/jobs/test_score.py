"""`grpo-run score`: completions from a file scored with a job's rewards in the grader's sandbox, no
model loaded; each reward by name and the weighted total, or a JSON list with -o json."""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml

from grpo_run.runner.cli.commands import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main

ADD = {"prompt": "Write add(a, b).", "tests": ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]}


def write_job(folder: Path, environment: dict, **params) -> str:
    doc = {"apiVersion": "grpo-run/v1", "kind": "TrainingJob", "metadata": {"name": "score-job"},
           "spec": {"runtime": "grpo-lora", "model": "tiny:char", "environment": environment,
                    "parameters": {"rewardTimeoutSeconds": 2, **params}}}
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def write_rows(folder: Path, rows: list[dict]) -> str:
    path = folder / "completions.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def code(text: str) -> str:
    return f"```python\n{text}\n```"


def test_the_code_environment_scores_right_wrong_hanging_and_network_answers_1_0_0_0(tmp_path, capsys):
    job = write_job(tmp_path, {"name": "code"})
    rows = write_rows(tmp_path, [{**ADD, "completion": c} for c in (
        code("def add(a, b):\n    return a + b"),
        code("def add(a, b):\n    return str(a) + str(b)"),
        code("def add(a, b):\n    while True:\n        pass"),
        code("import socket\ndef add(a, b):\n    socket.create_connection(('127.0.0.1', 22))\n    return a + b"),
    )])
    started = time.monotonic()
    assert main(["score", "-f", job, "--completions", rows]) == EXIT_OK
    assert time.monotonic() - started < 30
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["#", "passed", "total"]
    assert [line.split() for line in lines[1:]] == [["0", "1", "1"], ["1", "0", "0"], ["2", "0", "0"], ["3", "0", "0"]]

    assert main(["score", "-f", job, "--completions", rows, "-o", "json"]) == EXIT_OK
    assert json.loads(capsys.readouterr().out) == [{"rewards": {"passed": 1.0}, "total": 1.0},
                                                   {"rewards": {"passed": 0.0}, "total": 0.0},
                                                   {"rewards": {"passed": 0.0}, "total": 0.0},
                                                   {"rewards": {"passed": 0.0}, "total": 0.0}]


def test_rows_name_a_training_task_by_index_and_the_total_is_the_weighted_sum(tmp_path, capsys):
    (tmp_path / "rewards.py").write_text("def exact(completion, task):\n    return float(completion == task['answer'])\n"
                                         "def length(completion, task):\n    return len(completion)\n")
    (tmp_path / "tasks.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n')
    (tmp_path / "eval.jsonl").write_text('{"prompt": "3+3=", "answer": "6"}\n')
    job = write_job(tmp_path, {"name": "sums", "tasks": "tasks.jsonl", "evalTasks": "eval.jsonl",
                               "rewards": [{"function": "rewards.py:exact"},
                                           {"function": "rewards.py:length", "weight": 0.5}]})
    rows = write_rows(tmp_path, [{"task": 1, "completion": "4"}, {"task": 0, "completion": "22"},
                                 {"prompt": "9+9=", "answer": "18", "completion": "18"}])
    assert main(["score", "-f", job, "--completions", rows, "-o", "json"]) == EXIT_OK
    assert json.loads(capsys.readouterr().out) == [
        {"rewards": {"exact": 1.0, "length": 1.0}, "total": 1.5},
        {"rewards": {"exact": 0.0, "length": 2.0}, "total": 1.0},
        {"rewards": {"exact": 1.0, "length": 2.0}, "total": 2.0}]


def test_a_reward_that_fails_is_an_error_naming_it_never_a_score(tmp_path, capsys):
    (tmp_path / "rewards.py").write_text("def broken(completion, task):\n    return 1 / 0\n")
    (tmp_path / "tasks.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    job = write_job(tmp_path, {"name": "broken", "reward": "rewards.py:broken", "tasks": "tasks.jsonl",
                               "heldOutFraction": 0.5}, rewardRetries=0)
    assert main(["score", "-f", job, "--completions", write_rows(tmp_path, [{"task": 0, "completion": "x"}])]) \
        == EXIT_FAILED
    out, err = capsys.readouterr()
    assert out == "" and "rewards.py:broken' raised on completion 0 of 1" in err and "ZeroDivisionError" in err


def test_a_bad_completions_file_is_a_usage_error_naming_the_line(tmp_path, capsys):
    job = write_job(tmp_path, {"name": "code"})
    for content, expected in [
        ('{"task": 0, "completion": "x"}\nnot json\n', "completions.jsonl:2: not JSON"),
        ('{"task": 0}\n', "completions.jsonl:1: each row needs \"completion\""),
        ('{"task": 99, "completion": "x"}\n', "completions.jsonl:1: task 99 is not one of the job's 8 training tasks"),
        ('{"task": 0, "prompt": "p", "completion": "x"}\n', "give \"task\" (an index) or the task's own fields"),
        ("\n", "no completions"),
    ]:
        (tmp_path / "completions.jsonl").write_text(content)
        assert main(["score", "-f", job, "--completions", str(tmp_path / "completions.jsonl")]) == EXIT_USAGE
        out, err = capsys.readouterr()
        assert out == "" and expected in err, err
    assert main(["score", "-f", job, "--completions", str(tmp_path / "missing.jsonl")]) == EXIT_USAGE
    assert "no such completions file" in capsys.readouterr().err


def test_the_code_example_scores_its_four_completions_1_0_0_0(capsys):
    examples = Path(__file__).resolve().parents[3] / "examples"
    assert main(["score", "-f", str(examples / "code.yaml"), "--completions", str(examples / "code-completions.jsonl"),
                 "-o", "json"]) == EXIT_OK
    assert [row["total"] for row in json.loads(capsys.readouterr().out)] == [1.0, 0.0, 0.0, 0.0]
