"""The user's own measured step times: a finished run on a GPU teaches later estimates.

$GRPO_RUN_HOME/measured-steps.json, version 2:

    {"version": 2, "gpus": {"H100": [{"job": "...", "model": "Qwen/Qwen3-8B", "completionBucket": 512,
                                      "stepSeconds": 21.4, "finishedAt": "2026-01-01T00:00:00Z"}, ...]}}

A run is kept under (GPU, model, completion-length bucket): a step time says little about another
model, or about completions eight times as long. The bucket is maxCompletionLength rounded up to
a power of two (64, 128, ..., 512, 1024). Oldest first, at most MEASURED_WINDOW runs per key.

Version 1 (grpo-run before this) kept runs per GPU only, under the earlier GPU names. It is read
as it is: its GPU names become today's (`H100-SXM-80GB` -> `H100`) and its runs, which say no
model, stay in the file under (GPU, no model, no bucket) -- an estimate, which always asks for a
model, never uses them -- and the next record writes version 2. Written atomically (temporary
file, fsync, rename) under a lock, so two jobs finishing at once both get recorded and a reader
never sees half a file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import statistics
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from grpo_run.checkpoint.storage.fsio import atomic_write_text
from grpo_run.runner.gpus import canonical_name
from grpo_run.runner.home import grpo_run_home

log = logging.getLogger(__name__)

__all__ = [
    "MEASURED_WINDOW",
    "completion_bucket",
    "measured_step_seconds",
    "measured_steps_path",
    "record_measured_step_seconds",
]

# The estimate uses the median of this many most recent finished runs of a key: recent enough to
# follow a new driver, many enough that one odd run does not swing it.
MEASURED_WINDOW = 20
VERSION = 2


def measured_steps_path() -> Path:
    return grpo_run_home() / "measured-steps.json"


def completion_bucket(max_completion_length: int | None) -> int | None:
    """maxCompletionLength rounded up to a power of two (None stays None)."""
    if max_completion_length is None:
        return None
    return 1 << max(0, int(max_completion_length) - 1).bit_length()


def measured_step_seconds(gpu: str, model: str | None = None, completion_length: int | None = None) -> float | None:
    """The median step time of the user's last MEASURED_WINDOW finished runs of `model` on `gpu`
    with completions in the bucket of `completion_length`, or None when there are none. An
    unreadable file counts as none (logged): a dry run never fails on it."""
    key = (model, completion_bucket(completion_length))
    runs = _load(measured_steps_path()).get(_gpu_key(gpu), [])
    seconds = [r["stepSeconds"] for r in runs if _key(r) == key][-MEASURED_WINDOW:]
    return statistics.median(seconds) if seconds else None


def record_measured_step_seconds(gpu: str, seconds: float, job: str, *, model: str | None = None,
                                 completion_length: int | None = None) -> None:
    """Remember that `job` (of `model`, completions of at most `completion_length` tokens) ran at
    `seconds` per training step on `gpu`; later estimates for the same key use the median of the
    last MEASURED_WINDOW such runs. A card outside the table is kept under the job's own name.

    Raises ValueError for an empty GPU name or a step time that is not a number > 0.
    """
    if not isinstance(gpu, str) or not gpu:
        raise ValueError(f"gpu: must be a GPU's name (got {gpu!r})")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
            or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"step seconds: must be a number > 0 (got {seconds!r})")
    path = measured_steps_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    run = {"job": job, "model": model, "completionBucket": completion_bucket(completion_length),
           "stepSeconds": float(seconds), "finishedAt": _iso(datetime.now(timezone.utc))}
    with _locked(path.with_name(path.name + ".lock")):
        gpus = _load(path)
        runs = gpus.setdefault(_gpu_key(gpu), [])
        runs.append(run)
        same = [i for i, r in enumerate(runs) if _key(r) == _key(run)]
        for i in reversed(same[:-MEASURED_WINDOW]):      # the oldest of this key past the window
            del runs[i]
        atomic_write_text(path, json.dumps({"version": VERSION, "gpus": gpus}, indent=2) + "\n")


def _gpu_key(gpu: str) -> str:
    return canonical_name(gpu) or gpu


def _key(run: dict[str, Any]) -> tuple[str | None, int | None]:
    return run.get("model"), run.get("completionBucket")


def _load(path: Path) -> dict[str, list[dict[str, Any]]]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        gpus: dict[str, list[dict[str, Any]]] = {}
        for name, runs in doc["gpus"].items():       # version 1 or 2: the same layout
            if isinstance(name, str) and isinstance(runs, list):
                gpus.setdefault(_gpu_key(name), []).extend(r for r in runs if _valid_run(r))
        return gpus
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        # Written atomically, so this is a hand edit gone wrong; the next record starts afresh.
        log.warning("ignoring %s (%s: %s); estimates use the model of a step", path, type(e).__name__, e)
        return {}


def _valid_run(run: Any) -> bool:
    if not isinstance(run, dict):
        return False
    s, model, bucket = run.get("stepSeconds"), run.get("model"), run.get("completionBucket")
    return (isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) and s > 0
            and (model is None or isinstance(model, str))
            and (bucket is None or (isinstance(bucket, int) and not isinstance(bucket, bool))))


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    import fcntl

    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        yield


def _iso(t: datetime) -> str:
    return t.astimezone(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")
