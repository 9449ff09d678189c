"""A task is a JSON object with a `prompt`: a string, or a list of chat messages
(`{"role": ..., "content": ...}`) that the tokenizer's chat template renders; any other fields
(the answer, tests, ...) travel with it to the reward. Tasks from JSONL files, checked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

Task = dict[str, Any]


def read_tasks(path: Path) -> list[Task]:
    """Tasks from a JSONL file, one JSON object with a `prompt` per line (a string or a list of
    chat messages). Raises ValueError naming the file and line for anything else."""
    tasks: list[Task] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                task = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            problem = prompt_problem(task)
            if problem:
                raise ValueError(f"{path}:{lineno}: {problem}")
            tasks.append(task)
    if not tasks:
        raise ValueError(f"{path}: no tasks")
    return tasks


def prompt_problem(task: Any) -> str | None:
    """What is wrong with a task's prompt, or None: a string, or a non-empty list of
    {role, content} messages with string values."""
    if not isinstance(task, dict) or "prompt" not in task:
        return "each task must be a JSON object with a \"prompt\""
    prompt = task["prompt"]
    if isinstance(prompt, str):
        return None
    if (isinstance(prompt, list) and prompt
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in prompt)):
        return None
    return "\"prompt\" must be a string or a list of chat messages like [{\"role\": \"user\", \"content\": \"...\"}]"
