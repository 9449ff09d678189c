"""grpo-run from Python: the same TrainingJob the YAML describes, run by the same supervisor.

    import grpo_run

    def correct(completion: str, task: dict) -> float:
        return float(completion.strip() == task["answer"])

    job = grpo_run.train(model="Qwen/Qwen2.5-0.5B-Instruct", name="add-lora", rewards=[correct],
                         tasks=[{"prompt": "2+2=", "answer": "4"}, ...], held_out_fraction=0.1)
    job = grpo_run.apply("examples/tiny-arithmetic.yaml")      # a job file, from Python
    job.status()["phase"]                                       # 'Succeeded'
    job.report("run.png"); job.export("adapter/")
    grpo_run.get("tiny-arithmetic")                             # the same handle, later

`__all__` is the public API; every other module under grpo_run is internal.

Import-light on purpose: every `python -m grpo_run.…` child process (the trainer, the checkpoint
writer, the grader's stdlib-only worker) imports this file first, so nothing heavy is imported
here; the functions are loaded on first use (PEP 562).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["train", "apply", "get", "Job", "JobError", "RunError", "Step"]


class JobError(ValueError):
    """Bad input: a job file, an argument or a job name the CLI would refuse with exit status 2.
    The message is the CLI's own (one line, or a job file's problems one per line); nothing was
    started or written to storage.

        try:
            grpo_run.apply("job.yaml")
        except grpo_run.JobError as e:
            print(e)        # spec.parameters.numGenerations: must be >= 2 (got 1): ...
    """

    exit_code = 2


class RunError(RuntimeError):
    """The job could not run here at this moment: its storage did not answer or refused the
    credentials, another node holds the job, the disk is full. `exit_code` is the CLI's (1, or 5
    when another node holds it); the message is the CLI's line.

        try:
            grpo_run.get("my-job", storage="s3://bucket/prefix").status()
        except grpo_run.RunError as e:
            print(e.exit_code, e)
    """

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


if TYPE_CHECKING:           # what type checkers and editors see; loaded lazily below
    from grpo_run.handle import Job, apply, get
    from grpo_run.training import train
    from grpo_run.trainer.episodes.step import Step

_LAZY = {"train": "grpo_run.training", "apply": "grpo_run.handle", "get": "grpo_run.handle", "Job": "grpo_run.handle",
         "Step": "grpo_run.trainer.episodes.step"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'grpo_run' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value                 # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
