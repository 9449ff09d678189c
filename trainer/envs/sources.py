"""A job's tasks read from their sources, in one place: the preflight's look at the first rows of
each task file and data set (as the trainer will read them), and the trainer's train and held-out
tasks (`split_tasks`) from tasks/evalTasks files, dataFiles or a data set, through `data`.

`TaskSources` is what a job's environment says of them (runner.spec.environment.EnvironmentSpec is
one): this module reads and checks, the job file's schema lives in runner/spec/."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol

from grpo_run.trainer.envs.catalog import CATALOG
from grpo_run.trainer.envs.data import (as_tasks, builder_of, held_out, load_split, open_source, repeated_prompts,
                                        splits_of)
from grpo_run.trainer.envs.tasks import prompt_problem, read_tasks

log = logging.getLogger(__name__)

FIRST_ROWS = 5                  # rows read of each task file: enough to catch a wrong column or format
_PROMPT_LIKE = ("prompt", "question", "problem", "instruction", "input", "query", "messages", "text")


class TaskSources(Protocol):
    """What an environment of the job says of its tasks (spec.environment's fields)."""
    name: str
    tasks: str | None
    evalTasks: str | None
    dataFiles: Mapping[str, str] | None
    dataset: str | None
    datasetConfig: str | None
    trainSplit: str
    evalSplit: str
    heldOutFraction: float | None
    columns: Mapping[str, str]


def task_file_problems(path: str, columns: Mapping[str, str], where: str,
               check: Callable[[Any], str | None] | None = None) -> list[str]:
    try:
        rows = first_rows(path)
    except ValueError as e:
        return [f"{where}: {e}"]
    return row_problems(rows, columns, where, Path(path).name, check)


def dataset_problems(env, where: str) -> list[str]:
    """A local data set folder: the train split there, the held-out one (or heldOutFraction), and
    the first rows of each through the columns."""
    
    try:
        splits = splits_of(open_source(env.dataset, config=env.datasetConfig))
    except Exception as e:                  # datasets raises many kinds for a folder it cannot read
        return [f"{where}: {env.dataset} cannot be read as a data set: {first_line(e)}"]
    names = ", ".join(splits)
    if env.trainSplit not in splits:
        return [f"spec.environment.trainSplit: {env.dataset} has no split {env.trainSplit!r} (it has {names}): "
                "set trainSplit to one of them"]
    problems = []
    if env.evalSplit not in splits and env.heldOutFraction is None:
        problems.append(f"spec.environment.evalSplit: {env.dataset} has no split {env.evalSplit!r} for held-out "
                        f"tasks (it has {names}): set evalSplit, or heldOutFraction to hold out part of "
                        f"{env.trainSplit}")
    for split in dict.fromkeys((env.trainSplit, env.evalSplit)):
        if split in splits:
            data = splits[split]
            rows = data.select(range(min(FIRST_ROWS, len(data)))).to_list()
            problems += row_problems(rows, env.columns, where, f"{Path(env.dataset).name} split {split!r}")
    return problems


def first_rows(path: str, n: int = FIRST_ROWS) -> list[dict[str, Any]]:
    """The first `n` rows of a task file (JSONL, JSON, CSV, Parquet) or save_to_disk folder,
    without reading the rest. Raises ValueError saying what cannot be read, and where."""
    source = Path(path)
    if source.is_dir():
        
        try:
            splits = splits_of(open_source(path))
        except Exception as e:
            raise ValueError(f"{path} cannot be read as a data set folder: {first_line(e)}") from None
        if "train" not in splits:
            raise ValueError(f"{path} has no split 'train' (it has {', '.join(splits)}): a folder of tasks is "
                             "one save_to_disk split, or a DatasetDict with a train split")
        data = splits["train"]
        return data.select(range(min(n, len(data)))).to_list()
    if source.suffix.lower() == ".jsonl":
        rows = []
        with open(source, encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{source.name}:{lineno}: not JSON ({e.msg}): one JSON object per line") from None
                if len(rows) == n:
                    break
        return rows
    builder = builder_of(path)             # ValueError for a suffix it cannot read
    try:
        import datasets

        datasets.disable_progress_bars()
        with quiet("datasets"):            # it logs the error it then raises: said once, below
            stream = datasets.load_dataset(builder, data_files={"train": str(source)}, split="train", streaming=True)
            return list(itertools.islice(stream, n))
    except Exception as e:                  # a CSV that does not parse, a Parquet file that is not one
        raise ValueError(f"{source.name} cannot be read as {builder}: {first_line(e)}") from None


def row_problems(rows: list[Any], columns: Mapping[str, str], where: str, name: str,
                 check: Callable[[Any], str | None] | None = None) -> list[str]:
    """At most one line for `rows` read through `columns` (task key -> column) as
    trainer.envs.data.as_tasks reads them: a mapped column missing, or no usable prompt, or what
    `check` (a catalog environment's task_problem) finds."""
    if not rows:
        return [f"{where}: {name} has no rows: one task per row, each with a prompt"]
    mapping = f" (now columns: {json.dumps(dict(columns))})" if columns else ""
    for i, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            return [f"{where}: {name} row {i} is not an object (got {type(row).__name__}): each task is a JSON "
                    "object with a prompt"]
        have = ", ".join(map(str, row)) or "none"
        for key, column in columns.items():
            if column not in row:
                return [f"spec.environment.columns.{key}: {name} has no column {column!r} (row {i} has {have}): "
                        f"map {key} to one of those"]
        task = {**row, **{key: row[column] for key, column in columns.items()}}
        if "prompt" not in task:
            guess = _prompt_like(row)
            return [f"{where}: {name} has no column \"prompt\" (row {i} has {have}): spec.environment.columns maps "
                    f"a column to it, e.g. columns: {{prompt: {guess or 'COLUMN'}}}{mapping}"]
        trouble = prompt_problem(task)
        if trouble:
            via = f" (column {columns['prompt']!r})" if "prompt" in columns else ""
            return [f"{where}: {name} row {i}: {trouble}{via}"]
        trouble = check(task) if check is not None else None
        if trouble:
            return [f"{where}: {name} row {i}: {trouble}"]
    return []


def _prompt_like(row: Mapping[str, Any]) -> str | None:
    """The row's column most likely to be the prompt: a usual name holding text, else the first text."""
    for name in _PROMPT_LIKE:
        if isinstance(row.get(name), (str, list)):
            return name
    return next((k for k, v in row.items() if isinstance(v, str)), None)


def gsm8k_problems(path: str, where: str) -> list[str]:
    """gsm8k's own files: GSM8K's columns, question and an answer ending in '#### N'."""
    try:
        rows = first_rows(path)
    except ValueError as e:
        return [f"{where}: {e}"]
    for i, row in enumerate(rows, 1):
        if not isinstance(row, dict) or not isinstance(row.get("question"), str) or "####" not in str(row.get("answer", "")):
            have = ", ".join(map(str, row)) if isinstance(row, dict) else type(row).__name__
            return [f"{where}: {Path(path).name} row {i} is not GSM8K's: gsm8k needs the columns question and answer "
                    f"(ending in '#### N'); it has {have}"]
    return [] if rows else [f"{where}: {Path(path).name} has no rows"]




def checked_tasks(env: TaskSources, tasks: tuple[list, list]) -> tuple[list, list]:
    """Your tasks for a catalog environment that takes them, each checked by the environment
    (a code task needs its tests). Raises ValueError naming the first bad one."""
    check = CATALOG[env.name].task_problem
    source = "tasks" if env.tasks is not None else "dataset" if env.dataset is not None else "dataFiles"
    for is_eval, rows in enumerate(tasks):
        where = "evalTasks" if is_eval and env.evalTasks is not None else source
        for task in rows:
            trouble = check(task) if check is not None else None
            if trouble:
                raise ValueError(f"spec.environment.{where}: the task with prompt {str(task.get('prompt'))[:60]!r}: "
                                 f"{trouble} ({env.name} environment)")
    return tasks


_SAID: set[str] = set()       # what repeated_prompts reported in this process: once, though the tasks are read again


def own_tasks(env: TaskSources, seed: int) -> tuple[list, list]:
    """(train, held-out) tasks of your own environment, from its one source; prompts that are on
    both sides, or repeated, are reported (a warning, once per process)."""
    train, held = split_tasks(env, seed)
    said = repeated_prompts(train, held)
    if said and said not in _SAID:
        _SAID.add(said)
        log.warning("spec.environment: %s", said)
    return train, held


def split_tasks(env: TaskSources, seed: int) -> tuple[list, list]:

    def read(path: str, where: str) -> list:
        if path.endswith(".jsonl") and not env.columns:
            return read_tasks(Path(path))          # line-numbered errors for the common case
        return as_tasks(load_split(path, "train"), env.columns, where)

    if env.tasks is not None:
        train = read(env.tasks, "spec.environment.tasks")
        if env.evalTasks is not None:
            return train, read(env.evalTasks, "spec.environment.evalTasks")
        return held_out(train, env.heldOutFraction, seed)
    source = env.dataFiles if env.dataFiles is not None else env.dataset
    splits = splits_of(open_source(source, config=env.datasetConfig))
    where = "spec.environment." + ("dataFiles" if env.dataFiles is not None else "dataset")
    if env.trainSplit not in splits:
        raise ValueError(f"{where}: no split {env.trainSplit!r} (it has {', '.join(splits)}): set trainSplit")
    train = as_tasks(splits[env.trainSplit].to_list(), env.columns, where)
    if env.evalSplit in splits:
        return train, as_tasks(splits[env.evalSplit].to_list(), env.columns, where)
    if env.heldOutFraction is None:
        raise ValueError(f"{where}: no split {env.evalSplit!r} for held-out tasks (it has {', '.join(splits)}): "
                         "set evalSplit, or heldOutFraction to hold out part of the train split")
    return held_out(train, env.heldOutFraction, seed)


@contextlib.contextmanager
def quiet(name: str, level: int = logging.CRITICAL) -> Iterator[None]:
    """A library's logger held at `level` for the block (it logs what it then raises)."""
    logger = logging.getLogger(name)
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
