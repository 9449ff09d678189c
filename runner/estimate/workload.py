"""What a job will compute, for its estimate: how long its prompts are and how much its
evaluations decode -- read offline, from the tasks the job names.

- Catalog environments make their tasks from the seed (no network); GSM8K loads a data set, so
  without local `dataFiles` only its held-out count is known (its test split's 1,319 problems,
  or `evalTasks`).
- Your own environment's tasks are read when they are local files or a local data-set folder; a
  hub data set is not fetched for an estimate.
Anything that cannot be read here leaves its figure unknown (None), said in the estimate's note;
a dry run never fails on it.

Prompt length is the *expected* one: the mean over the tasks (and the system prompt), in tokens
at CHARS_PER_TOKEN characters each -- the usual rule of thumb for English text in a byte-level
BPE vocabulary; digit-heavy prompts run longer in Qwen's tokenizer, which splits digits. The
demo models (`tiny:`) have a token per character. The chat template's few tokens are not counted.
Completion length is maxCompletionLength, the maximum (see steptime.py for why).
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_run.runner.home import is_tiny
from grpo_run.runner.spec.job import TrainingJob

log = logging.getLogger(__name__)

__all__ = ["CHARS_PER_TOKEN", "GSM8K_TEST_TASKS", "Workload", "evaluations", "prompt_tokens", "workload"]

CHARS_PER_TOKEN = 4
# GSM8K's test split: 1,319 problems (Cobbe et al. 2021, "Training Verifiers to Solve Math Word
# Problems", and the openai/gsm8k data set card), the catalog's held-out tasks by default.
GSM8K_TEST_TASKS = 1319


@dataclass(frozen=True)
class Workload:
    """The estimate's view of a job's tasks; None where it could not be read here."""

    prompt_tokens: float | None       # expected train prompt, tokens
    eval_prompt_tokens: float | None  # expected held-out prompt, tokens
    eval_tasks: int | None            # held-out tasks each evaluation decodes
    evaluations: int                  # baseline + every evalSteps while training + final
    unknown: str = ""                 # what could not be read, for the note


def evaluations(max_steps: int, eval_steps: int | None) -> int:
    """How many held-out evaluations a run makes: the baseline, one after every `eval_steps`
    training steps before the last (trainer.recipe), and the final one."""
    return 2 + ((max_steps - 1) // eval_steps if eval_steps else 0)


def prompt_tokens(tasks: list[dict[str, Any]], *, system_prompt: str | None = None, tiny: bool = False) -> float | None:
    """The mean prompt length of `tasks` in tokens (module docstring); None for no tasks."""
    if not tasks:
        return None
    per_token = 1 if tiny else CHARS_PER_TOKEN
    extra = len(system_prompt or "")
    return round(statistics.fmean(_chars(t.get("prompt")) + extra for t in tasks) / per_token, 1)


def _chars(prompt: Any) -> int:
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):             # chat messages
        return sum(len(m.get("content", "")) for m in prompt
                   if isinstance(m, dict) and isinstance(m.get("content"), str))
    return 0


def workload(job: TrainingJob) -> Workload:
    """The job's prompt lengths and held-out tasks, as far as they can be read offline."""
    p = job.parameters
    count = evaluations(p.maxSteps, p.evalSteps)
    try:
        train, held = _tasks(job)
    except Exception as e:              # noqa: BLE001 -- an estimate never fails on the tasks
        log.debug("estimate: tasks of %s not read: %s", job.name, e)
        train = held = None
    if train is None and held is None:
        known = _known_eval_count(job)
        return Workload(None, None, known, count,
                        unknown="the tasks could not be read here (a data set on the hub): prompts not counted"
                        + ("" if known else ", nor evaluations"))
    tiny = is_tiny(job.model)
    return Workload(prompt_tokens(train or [], system_prompt=p.systemPrompt, tiny=tiny),
                    prompt_tokens(held or [], system_prompt=p.systemPrompt, tiny=tiny),
                    len(held) if held is not None else None, count)


def _known_eval_count(job: TrainingJob) -> int | None:
    env = job.environment
    if env.is_catalog and env.name == "gsm8k":
        return job.parameters.evalTasks or GSM8K_TEST_TASKS
    return None


def _tasks(job: TrainingJob) -> tuple[list | None, list | None]:
    """(train, held-out) tasks when they can be read without the network, else (None, None)."""
    from grpo_run.runner.environments import environment_of
    from grpo_run.trainer.envs.catalog import CATALOG

    env, p = job.environment, job.parameters
    if env.is_catalog:
        entry = CATALOG[env.name]
        if not entry.data:
            train, held = entry.make(p.seed, p.trainTasks, p.evalTasks)
            return train, held
        if env.dataFiles is None or not _local(*env.dataFiles.values()):
            return None, None
    elif env.tasks is None and not _local(*(env.dataFiles or {}).values(), env.dataset or ""):
        return None, None
    built = environment_of(env, p)
    return list(built.train_tasks), list(built.eval_tasks)


def _local(*paths: str) -> bool:
    return bool(paths) and all(p and Path(p).exists() for p in paths)
