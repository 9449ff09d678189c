"""The user's own measured step times: runs on a GPU teach later estimates.

Two sources, one vote per job:
- this node's job records ($GRPO_RUN_HOME/runs/NAME/state.db): every job that has taken at least
  MIN_STEPS steps on a GPU -- running, preempted, stopped or finished -- at the median of its
  steps' times so far;
- runs that finished (Succeeded) here, kept in a file that outlives their work folders (`grpo-run
  delete` removes those):

$GRPO_RUN_HOME/measured-steps.json, version 2:

    {"version": 2, "gpus": {"H100": [{"job": "...", "model": "Qwen/Qwen3-8B", "completionBucket": 512,
                                      "stepSeconds": 21.4, "finishedAt": "2026-01-01T00:00:00Z",
                                      "sampler": "vllm", "engineStartSeconds": 48.2}, ...]}}

A run is kept under (GPU, model, completion-length bucket, sampler): a step time says little about
another model, about completions eight times as long, or about another engine's sampling. The
bucket is maxCompletionLength (times maxTurns for episodes: sampled_length) rounded up to a power
of two (64, 128, ..., 512, 1024); a run
without "sampler" (written before vLLM) was sampled natively. Oldest first, at most
MEASURED_WINDOW runs per key. A vLLM run also keeps its engine's start-up, which later estimates
of the same GPU and model count (measured_start_seconds).

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
from grpo_run.runner.spec.gpus import canonical_name
from grpo_run.runner.home import grpo_run_home

log = logging.getLogger(__name__)

__all__ = [
    "MEASURED_WINDOW",
    "MIN_STEPS",
    "completion_bucket",
    "measured_runs",
    "measured_start_seconds",
    "measured_step_seconds",
    "measured_steps_path",
    "record_measured_step_seconds",
]

# The estimate uses the median of this many most recent finished runs of a key: recent enough to
# follow a new driver, many enough that one odd run does not swing it.
MEASURED_WINDOW = 20
# A record counts once it has this many steps: the first step warms up (kernels chosen, the
# allocator grown), and the median of three is past it.
MIN_STEPS = 3
VERSION = 2


def measured_steps_path() -> Path:
    return grpo_run_home() / "measured-steps.json"


def sampled_length(spec: dict[str, Any]) -> int | None:
    """The tokens a sequence of the job samples at most, from its spec (`spec:` of the job file):
    maxCompletionLength, times maxTurns for an episode (spec.environment.episodes; its default
    when left out), so an episodes run and a single-turn one are kept under the buckets of what
    they decode. None when the spec gives no maxCompletionLength."""
    from grpo_run.runner.spec.environment import DEFAULT_MAX_TURNS

    length = (spec.get("parameters") or {}).get("maxCompletionLength")
    env = spec.get("environment") or {}
    if not isinstance(length, int) or not isinstance(env, dict) or not (env.get("episodes") or env.get("tools")):
        return length if isinstance(length, int) else None
    turns = env.get("maxTurns")
    return length * (turns if isinstance(turns, int) and turns > 0 else DEFAULT_MAX_TURNS)


def completion_bucket(max_completion_length: int | None) -> int | None:
    """maxCompletionLength rounded up to a power of two (None stays None)."""
    if max_completion_length is None:
        return None
    return 1 << max(0, int(max_completion_length) - 1).bit_length()


def measured_runs(gpu: str, model: str | None = None, completion_length: int | None = None,
                  sampler: str = "native") -> list[float]:
    """Step times of the user's last MEASURED_WINDOW runs of `model` on `gpu` with completions in
    the bucket of `completion_length`, sampled by `sampler` (native | vllm), oldest first: one per
    job, a job's record on this node (finished or not) in place of what the file kept of it. An
    unreadable file or record counts as none (logged): a dry run never fails on it."""
    key = (model, completion_bucket(completion_length), sampler)
    recorded = _recorded_runs(_gpu_key(gpu), key)
    kept = [r["stepSeconds"] for r in _load(measured_steps_path()).get(_gpu_key(gpu), [])
            if _key(r) == key and r.get("job") not in recorded]
    return (kept + list(recorded.values()))[-MEASURED_WINDOW:]


def measured_step_seconds(gpu: str, model: str | None = None, completion_length: int | None = None,
                          sampler: str = "native") -> float | None:
    """The median of `measured_runs`, or None when there are none."""
    seconds = measured_runs(gpu, model, completion_length, sampler)
    return statistics.median(seconds) if seconds else None


def measured_start_seconds(gpu: str, model: str) -> float | None:
    """The median start-up of the vLLM engine in the user's last MEASURED_WINDOW finished vLLM
    runs of `model` on `gpu` (any completion length), or None when none kept one."""
    starts = [r["engineStartSeconds"] for r in _load(measured_steps_path()).get(_gpu_key(gpu), [])
              if r.get("model") == model and isinstance(r.get("engineStartSeconds"), (int, float))
              and not isinstance(r.get("engineStartSeconds"), bool) and r["engineStartSeconds"] > 0]
    return statistics.median(starts[-MEASURED_WINDOW:]) if starts else None


def _recorded_runs(gpu: str, key: tuple[str | None, int | None, str]) -> dict[str, float]:
    """{job: its median step time} of this node's job records of `key` on `gpu` (a table name)
    whose newest trainer ran on a GPU and took at least MIN_STEPS steps, oldest update first."""
    from grpo_run.state import values
    from grpo_run.state.record import RECORD_FILE, Record

    found: list[tuple[str, str, float]] = []
    for path in sorted((grpo_run_home() / "runs").glob(f"*/{RECORD_FILE}")):
        try:
            with Record(path) as record:
                job = record.job()
                if job is None or not (values.DEVICE.get(record) or "").startswith("cuda"):
                    continue
                spec = (job["spec"] or {}).get("spec") or {}
                length = sampled_length(spec)
                sampler = (values.SAMPLER.get(record) or {}).get("engine") or "native"
                if (_gpu_key(str(spec.get("gpu"))) != gpu
                        or (spec.get("model"), completion_bucket(length), sampler) != key):
                    continue
                times = sorted(float(s["stepSeconds"]) for s in record.steps()
                               if isinstance(s.get("stepSeconds"), (int, float)) and s["stepSeconds"] > 0)
        except Exception as e:          # noqa: BLE001 -- a record mid-write or of another version: skipped
            log.debug("measured step times: %s not read: %s", path, e)
            continue
        if len(times) >= MIN_STEPS:     # the upper median, as `get tj`'s medianStepSeconds
            found.append((str(job["updated"]), job["name"], round(times[len(times) // 2], 4)))
    return {name: seconds for _, name, seconds in sorted(found)}


def record_measured_step_seconds(gpu: str, seconds: float, job: str, *, model: str | None = None,
                                 completion_length: int | None = None, sampler: str = "native",
                                 engine_start_seconds: float | None = None) -> None:
    """Remember that `job` (of `model`, completions of at most `completion_length` tokens, sampled
    by `sampler`) ran at `seconds` per training step on `gpu`, and its engine started in
    `engine_start_seconds` (vLLM); later estimates for the same key use the median of the last
    MEASURED_WINDOW such runs. A card outside the table is kept under the job's own name.

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
    if sampler != "native":
        run["sampler"] = sampler
    if engine_start_seconds:
        run["engineStartSeconds"] = round(float(engine_start_seconds), 2)
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


def _key(run: dict[str, Any]) -> tuple[str | None, int | None, str]:
    return run.get("model"), run.get("completionBucket"), run.get("sampler") or "native"


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
