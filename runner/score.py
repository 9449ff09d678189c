"""`grpo-run score`'s library: completions from a JSONL file scored with a job's rewards, in the
grader's sandbox with the job's limits, as the trainer scores them; no model is loaded (unless
a reward model is named); an LLM judge is called from this process, where the node allows it.

    rows = read_completions("completions.jsonl", job)     # [(completion, task)], checked
    scored = score_completions(job, rows)                 # [{"rewards": {name: r}, "total": t}]

A row is `{"completion": TEXT, "task": N}` (the job's N-th training task, counting from 0) or the
task's own fields with `completion` beside them (`{"prompt": ..., "tests": [...], "completion": ...}`).
A group reward (`group: true`) sees consecutive rows of the same task as one prompt's group.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grpo_run.runner.environments import build_environment
from grpo_run.runner.spec.job import TrainingJob
from grpo_run.runner.supervisor.runspec import sandbox_strict
from grpo_run.runner.environments import rewards_of
from grpo_run.runner.spec.judge import judges_refused


class CompletionsError(ValueError):
    """The completions file is missing or a row is wrong; str() names the file and line."""


def read_completions(path: str | Path, job: TrainingJob) -> list[tuple[str, dict[str, Any]]]:
    """(completion, task) for each row of `path`, in order. The job's tasks are read only when a
    row names one by index. Raises CompletionsError naming the file, line and fix."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise CompletionsError(f"no such completions file: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CompletionsError(f"{path}: cannot be read ({e})") from None
    rows: list[tuple[int, Any]] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append((lineno, json.loads(line)))
        except json.JSONDecodeError as e:
            raise CompletionsError(f"{path}:{lineno}: not JSON ({e.msg}): one JSON object per line") from None
    if not rows:
        raise CompletionsError(f"{path}: no completions: one JSON object per line, each with a \"completion\"")
    train: tuple[dict[str, Any], ...] | None = None
    out: list[tuple[str, dict[str, Any]]] = []
    for lineno, row in rows:
        where = f"{path}:{lineno}"
        if not isinstance(row, dict) or not isinstance(row.get("completion"), str):
            raise CompletionsError(f"{where}: each row needs \"completion\" (a string), with \"task\" (an index into "
                                   "the job's training tasks) or the task's own fields")
        fields = {k: v for k, v in row.items() if k != "completion"}
        index = fields.get("task")
        if isinstance(index, int) and not isinstance(index, bool):
            if len(fields) > 1:
                raise CompletionsError(f"{where}: give \"task\" (an index) or the task's own fields, not both "
                                       f"(got {', '.join(sorted(fields))})")
            if train is None:
                train = _training_tasks(job)
            if not 0 <= index < len(train):
                raise CompletionsError(f"{where}: task {index} is not one of the job's {len(train)} training tasks "
                                       f"(0 to {len(train) - 1})")
            out.append((row["completion"], dict(train[index])))
        else:
            out.append((row["completion"], fields))
    return out


def _training_tasks(job: TrainingJob) -> tuple[dict[str, Any], ...]:
    try:
        return build_environment(job).train_tasks
    except ValueError as e:
        raise CompletionsError(f"the job's tasks cannot be read: {e}") from None


def score_completions(job: TrainingJob, rows: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """[{"rewards": {name: reward}, "total": weighted sum}], one per row, in order: the job's
    rewards in the grader's sandbox with the job's limits (rewardTimeoutSeconds, rewardMemoryMB,
    rewardRetries, spec.sandbox). Raises RewardFunctionError (a reward failed: never a score),
    SandboxUnavailable (strict, and a layer is missing), JudgeError (judges not allowed here, or
    one refused), JudgeUnavailable (a judge did not answer)."""
    from grpo_run.trainer.grader.judge import JudgeError
    from grpo_run.trainer.grader.scoring import Scorer

    env, p = job.environment, job.parameters
    if env.episodes is not None and not rewards_of(env):
        raise CompletionsError("the job's only reward is its episodes environment's (spec.environment.episodes), "
                               "which scores the episodes it plays, not completions: score applies to a job's "
                               "reward functions, and this job has none")
    refused = judges_refused(env)
    if refused:
        raise JudgeError("; ".join(refused))
    completions, tasks = [c for c, _ in rows], [t for _, t in rows]
    groups: list[int] = []                  # a group reward sees consecutive rows of one task together
    for i, task in enumerate(tasks):
        if i and task == tasks[i - 1]:
            groups[-1] += 1
        else:
            groups.append(1)
    with Scorer(rewards_of(env), search_path=env.path, timeout_s=p.rewardTimeoutSeconds,
                memory_mb=p.rewardMemoryMB, retries=p.rewardRetries, strict=sandbox_strict(job)) as scorer:
        by_name = scorer.score(completions, tasks, groups)
        totals = scorer.total(by_name)
    return [{"rewards": {name: scores[i] for name, scores in by_name.items()}, "total": totals[i]}
            for i in range(len(rows))]
