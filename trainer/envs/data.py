"""Tasks from data sets, through `datasets`: files, folders saved by `save_to_disk`, hub names.

A source is one of
  * a file: `.jsonl` / `.json`, `.csv`, `.parquet` (by its suffix);
  * `{split: file}` (the shape of `datasets`' `data_files`), e.g. {train: a.parquet, test: b.parquet};
  * a folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`;
  * any other folder of data files, or a data set name such as `openai/gsm8k`, as
    `datasets.load_dataset` resolves it (a hub name needs the network, once: `datasets` caches it).
Rows come back as plain Python objects (JSON-ready: they travel to the trainer and the grader).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import numpy as np

_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


def builder_of(path: str) -> str:
    """The `datasets` builder for a data file. Raises ValueError for a suffix it cannot read."""
    suffix = Path(path).suffix.lower()
    if suffix not in _BUILDERS:
        raise ValueError(f"{path}: cannot read {suffix or 'a file without a suffix'}: use .jsonl, .json, .csv or .parquet")
    return _BUILDERS[suffix]


def _quiet() -> None:
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()


def open_source(source: str | Mapping[str, str], *, config: str | None = None):
    """A `datasets.DatasetDict` (or `Dataset`) for `source`. Raises ValueError naming the source
    for files it cannot read, FileNotFoundError for a data set that is not there."""
    import datasets

    _quiet()
    if isinstance(source, Mapping):
        builders = {builder_of(p) for p in source.values()}
        if len(builders) != 1:
            raise ValueError(f"dataFiles: every file must have the same format (got {', '.join(source.values())})")
        return datasets.load_dataset(builders.pop(), data_files={k: str(v) for k, v in source.items()})
    path = Path(source)
    if path.is_file():
        return datasets.load_dataset(builder_of(source), data_files={"train": str(path)})
    if path.is_dir() and ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
        return datasets.load_from_disk(str(path))
    return datasets.load_dataset(str(source), config)


def splits_of(data) -> dict[str, Any]:
    """{split name: Dataset}; a lone Dataset (a file, a save_to_disk of one split) is `train`."""
    import datasets

    return dict(data) if isinstance(data, datasets.DatasetDict) else {"train": data}


def load_split(source: str | Mapping[str, str], split: str, *, config: str | None = None) -> list[dict[str, Any]]:
    """The rows of one split. Raises ValueError naming the splits there are when it is missing."""
    splits = splits_of(open_source(source, config=config))
    if split not in splits:
        raise ValueError(f"{_describe(source)} has no split {split!r}: it has {', '.join(splits)}")
    return splits[split].to_list()


def sample(rows: list[dict[str, Any]], n: int | None, seed: int) -> list[dict[str, Any]]:
    """All rows (n None), or n of them chosen by a seeded permutation. Raises ValueError when
    there are fewer than n."""
    if n is None:
        return rows
    if n > len(rows):
        raise ValueError(f"asked for {n} tasks but the data has {len(rows)}")
    order = np.random.default_rng(seed).permutation(len(rows))[:n]
    return [rows[int(i)] for i in order]


def as_tasks(rows: list[dict[str, Any]], columns: Mapping[str, str], where: str) -> list[dict[str, Any]]:
    """Rows as tasks: every column kept, and `task[key] = row[column]` for each entry of
    `columns` (e.g. {prompt: question, answer: answer}). Raises ValueError naming a missing
    column or a bad prompt, with the row."""
    from grpo_run.trainer.envs.tasks import prompt_problem

    tasks = []
    for i, row in enumerate(rows):
        task = dict(row)
        for key, column in columns.items():
            if column not in row:
                raise ValueError(f"{where}: row {i} has no column {column!r} (for {key}); "
                                 f"it has {', '.join(row)}")
            task[key] = row[column]
        problem = prompt_problem(task)
        if problem:
            raise ValueError(f"{where}: row {i}: {problem}; map a column to it with columns: {{prompt: COLUMN}}")
        tasks.append(task)
    if not tasks:
        raise ValueError(f"{where}: no tasks")
    return tasks


def held_out(rows: list[dict[str, Any]], fraction: float, seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, held out): a seeded `fraction` of the rows held out, at least one of each. Rows
    with the same prompt go to the same side, every copy of it: a held-out task is never trained
    on. Without repeated prompts the cut is the one a seeded permutation of the rows gives (the
    prompts are permuted in first-seen order, one per row). Raises ValueError for fewer than two
    distinct prompts."""
    if len(rows) < 2:
        raise ValueError(f"cannot hold out a fraction of {len(rows)} task")
    k = min(len(rows) - 1, max(1, round(len(rows) * fraction)))
    groups: dict[str, list[int]] = {}                     # a prompt -> its rows, in first-seen order
    for i, row in enumerate(rows):
        groups.setdefault(prompt_key(row), []).append(i)
    if len(groups) < 2:
        raise ValueError(f"cannot hold out part of {len(rows)} tasks that all have the same prompt")
    members = list(groups.values())
    out: set[int] = set()
    for g in np.random.default_rng(seed).permutation(len(members)):
        if len(out) >= k or len(out) + len(members[g]) == len(rows):     # enough, or no task left to train on
            break
        out.update(members[g])
    return [r for i, r in enumerate(rows) if i not in out], [r for i, r in enumerate(rows) if i in out]


def prompt_key(row: Mapping[str, Any]) -> str:
    """What makes two tasks the same for the held-out split: the prompt the model sees."""
    prompt = row.get("prompt")
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)


def repeated_prompts(train: list[dict[str, Any]], held: list[dict[str, Any]]) -> str | None:
    """What a user should hear about repeated prompts, or None: prompts that are in both the
    training and the held-out tasks (not held out at all), and prompts given more than once."""
    seen = [prompt_key(r) for r in train]
    both = {prompt_key(r) for r in held} & set(seen)
    counts: dict[str, int] = {}
    for key in seen + [prompt_key(r) for r in held]:
        counts[key] = counts.get(key, 0) + 1
    repeated = {key: n for key, n in counts.items() if n > 1}
    said = []
    if both:
        said.append(f"{len(both)} of the {len({prompt_key(r) for r in held})} held-out prompts are also training "
                    f"tasks, so they are not held out (e.g. {_short(next(iter(sorted(both))))}): remove them from one "
                    "side")
    if repeated and not both:
        copies = sum(repeated.values())
        said.append(f"{len(repeated)} prompts appear more than once ({copies} tasks, e.g. "
                    f"{_short(next(iter(repeated)))}); every copy of each is on one side of the held-out split")
    return "; ".join(said) or None


def _short(key: str) -> str:
    return repr(key if len(key) <= 40 else key[:37] + "...")


def _describe(source: str | Mapping[str, str]) -> str:
    return f"dataFiles {dict(source)}" if isinstance(source, Mapping) else str(source)
