"""The commands that end a job: `cancel` and `delete` (the library: runner/jobs/cancel.py). A storage
error (bad URL, refused credentials, no answer) reaches runner.cli.commands.main, which says it in
one line and exits 1, as for every command."""

from __future__ import annotations

import click

from grpo_run.runner.cli.output import error as _error, job_name, printable
from grpo_run.runner.exits import EXIT_HELD, EXIT_OK, EXIT_USAGE
from grpo_run.runner.home import default_storage


@click.command("cancel", short_help="stop a job for good: at its next step boundary, with a checkpoint")
@click.argument("name", callback=job_name)
@click.option("--storage", metavar="URL", help="the job's storage (default: where `apply --detach` sent it from "
              "here, or where it runs on this machine, else $GRPO_RUN_HOME/store)")
def cmd_cancel(name: str, storage: str | None) -> int:
    """Cancel job NAME. A node running it stops at the step boundary (the step in flight is dropped,
    as at a spot notice), makes the last completed step's checkpoint durable, records the phase
    Cancelled and exits 6; it finds the request at its next record upload or lease renewal (within
    seconds while it trains, about 20 s at most). A job waiting for a
    node (submitted with --detach) or stopped (Preempted, Failed, BudgetExceeded) becomes Cancelled
    at once, and no `grpo-run resume` starts it again (it says so and exits 0). A finished job
    (Succeeded, Cancelled) is left as it is. The checkpoints stay: `grpo-run export` still works,
    `grpo-run delete` removes them.

    \b
    example:
      grpo-run cancel my-grpo-lora
      grpo-run cancel my-grpo-lora --storage s3://bucket/prefix
      grpo-run get tj my-grpo-lora -w          # until it says Cancelled
    """
    from grpo_run.runner.jobs.cancel import NoSuchJob, cancel_job
    from grpo_run.runner.jobs.find import job_storage

    storage = job_storage(name, storage)
    try:
        done = cancel_job(name, storage)
    except NoSuchJob as e:
        _error(str(e))
        return EXIT_USAGE
    where = storage or default_storage()
    if done.outcome == "finished":
        print(f"{name}: already {done.phase}; nothing changed")
    elif done.outcome == "requested":
        print(f"{name}: cancel requested; {printable(done.holder)} runs it and stops at its next step boundary "
              f"with a checkpoint (phase Cancelled)\n  follow it: grpo-run get tj {name} --storage {where} -w")
    else:
        print(f"{name}: Cancelled (it was {done.was}); no node starts it again")
    return EXIT_OK


@click.command("delete", short_help="remove a job: its storage folder and this machine's work folder")
@click.argument("name", callback=job_name)
@click.option("--storage", metavar="URL", help="the job's storage (default: as for cancel)")
@click.option("--yes", is_flag=True, help="really delete: checkpoints, final weights, record, everything under it")
@click.option("--force", is_flag=True, help="delete even while a node holds the job's lease (a node known to be gone)")
def cmd_delete(name: str, storage: str | None, yes: bool, force: bool) -> int:
    """Delete job NAME: everything under its storage folder (record, checkpoints, final weights,
    baseline cache, the job's files) and its work folder on this machine, so the name can be used
    again. Refused (exit 5) while a node holds the job's lease: cancel it first, or add --force
    when that node is gone. Nothing is deleted without --yes.

    \b
    example:
      grpo-run delete my-grpo-lora --yes
      grpo-run delete my-grpo-lora --storage s3://bucket/prefix --yes
    """
    from grpo_run.runner.jobs.cancel import NoSuchJob, StillHeld, delete_job
    from grpo_run.runner.jobs.find import job_storage

    storage = job_storage(name, storage)
    if not yes:
        _error(f"delete removes every checkpoint and the record of {name}; add --yes to do it: "
               f"grpo-run delete {name} --yes")
        return EXIT_USAGE
    try:
        removed = delete_job(name, storage, force=force)
    except NoSuchJob as e:
        _error(str(e))
        return EXIT_USAGE
    except StillHeld as e:
        _error(printable(str(e)))
        return EXIT_HELD
    print(f"{name}: deleted " + "; ".join(removed))
    return EXIT_OK
