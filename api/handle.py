"""The handle on a job (`grpo_run.Job`), `grpo_run.apply` and `grpo_run.get`: thin callers of
the library the CLI uses (runner/jobs/run.py), so a job applied from Python is the job `grpo-run
apply -f` would run, and a refusal reads as the CLI's line (raised as JobError or RunError)."""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from grpo_run import JobError, RunError
from grpo_run.runner.exits import EXIT_USAGE, Refused
from grpo_run.state.phases import Phase

# The phases in which no node continues the job by itself: wait() returns there. Preempted is not
# among them: a spot node that boots runs `grpo-run resume` and continues it.
SETTLED = (Phase.SUCCEEDED, Phase.FAILED, Phase.BUDGET_EXCEEDED, Phase.CANCELLED)


def live_view() -> bool | None:
    """Whether the trainer draws its progress bar: yes in a Jupyter kernel, whose stderr is no
    terminal but which shows in the cell what child processes write to file descriptor 2
    (ipykernel 6 and later capture it); otherwise as the CLI decides (None)."""
    return True if "ipykernel" in sys.modules else None


@contextmanager
def as_api_errors() -> Iterator[None]:
    """Refused (the library's refusal, in the CLI's words) as JobError for bad input (exit 2) and
    RunError for the rest; LookupError (no such job) as JobError."""
    try:
        yield
    except Refused as e:
        if e.exit_code == EXIT_USAGE:
            raise JobError(e.message) from None
        raise RunError(e.message, e.exit_code) from None
    except LookupError as e:
        raise JobError(str(e.args[0]) if e.args else str(e)) from None


class Job:
    """A TrainingJob by name, read from its record on each call (nothing is cached): where it ran
    on this machine, or in `storage` (as `grpo-run get tj NAME --storage URL`).

        job = grpo_run.get("gsm8k-lora", storage="s3://bucket/prefix")
        job.status()["phase"]            # 'Training'
        job.wait()                       # until Succeeded, Failed, BudgetExceeded or Cancelled
        job.report("run.png")            # the run as a picture (and run.md beside it)
        job.export("adapter/")           # the adapter as PEFT files
    """

    def __init__(self, name: str, storage: str | None = None) -> None:
        self.name = name
        self.storage = storage          # None: this machine's work folder, or where it was submitted from here

    def __repr__(self) -> str:
        where = f", storage={self.storage!r}" if self.storage else ""
        return f"grpo_run.Job({self.name!r}{where})"

    def doc(self) -> dict[str, Any]:
        """The job as `grpo-run get tj NAME -o json` prints it: {apiVersion, kind, metadata, spec, status}."""
        from grpo_run.runner.jobs.find import get_job

        with as_api_errors():
            return get_job(self.name, self.storage)

    def status(self) -> dict[str, Any]:
        """The job's status, as `get tj -o json` shows it (phase, step, baseline, final, costUSD,
        attempts, ...). Cheap: one read of the record (from storage, a download of it).

            job.status()["phase"]        # 'Succeeded'
        """
        return self.doc()["status"]

    def wait(self, *, timeout_s: float | None = None, poll_s: float = 2.0) -> dict[str, Any]:
        """Block until the job is Succeeded, Failed, BudgetExceeded or Cancelled (a Preempted job
        is waited through: a node resumes it) and return its status. Raises TimeoutError after
        `timeout_s` seconds.

            status = grpo_run.get("my-job", storage="s3://bucket/prefix").wait(timeout_s=3600)
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            status = self.status()
            if status["phase"] in SETTLED:
                return status
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"{self.name}: still {status['phase']} at step {status['step']} after {timeout_s} s")
            time.sleep(poll_s)

    def report(self, path: str | Path) -> Path:
        """Draw the run into the PNG `path` (rewards, cost, attempt boundaries) with a Markdown
        summary beside it (.md), as `grpo-run report`; returns the PNG's path.

            job.report("run.png")
        """
        from grpo_run.runner.jobs.report import write_report

        with as_api_errors():
            write_report(self.name, self.storage, Path(path))
        return Path(path)

    def export(self, out: str | Path) -> Path:
        """Write the final adapter (before the job finished: the newest durable checkpoint's) as
        standard PEFT files into the folder `out`, as `grpo-run export`; returns the folder.

            job.export("adapter/")       # then PeftModel.from_pretrained(base, "adapter/")
        """
        from grpo_run.runner.jobs.export import export_adapter

        with as_api_errors():
            export_adapter(self.name, self.storage, Path(out))
        return Path(out)


def get(name: str, *, storage: str | None = None) -> Job:
    """The handle on job `name`: run on this machine (or submitted from it), or in `storage`.
    Raises JobError when there is no such job.

        job = grpo_run.get("gsm8k-lora", storage="s3://bucket/prefix")
    """
    from grpo_run.runner.spec.job import name_problem

    if (trouble := name_problem(name)) is not None:
        raise JobError(f"name {name!r}: {trouble}")
    job = Job(name, storage)
    job.status()                        # there, or JobError now rather than at the first call
    return job


def apply(path: str | Path, *, dry_run: bool = False, detach: bool = False) -> Any:
    """`grpo-run apply -f PATH` from Python: check the job file as the CLI does, then train it
    in the foreground here (the live view on stderr; returns when the run stops) or, with
    `detach`, submit it to spec.storage for a node to train; returns the Job. With `dry_run`,
    start nothing and return the job with status.estimate, as `apply --dry-run -o yaml` prints it.
    Raises JobError for a job file the CLI would refuse (exit 2), RunError when it cannot run here.

        grpo_run.apply("job.yaml", dry_run=True)["status"]["estimate"]["costToCompletionUSD"]
        job = grpo_run.apply("job.yaml", detach=True)
    """
    from grpo_run.runner.jobs.run import check_job_file, start

    with as_api_errors():
        checked = check_job_file(str(path), dry_run=dry_run, detach=detach)
        if dry_run:
            if checked.refusal:
                raise Refused(checked.refusal, EXIT_USAGE, prefixed=False)
            return checked.dry_run_doc()
        start(checked, detach=detach, output=None, stop=threading.Event(), progress=live_view())
    job = checked.job
    return Job(job.name, job.storage if detach else None)
