"""`grpo-run samples`: what the model wrote, from the run's record (runner.views.samples)."""

from __future__ import annotations

import click

from grpo_run.runner.cli.output import FORMAT, dump as _dump, error as _error, job_name
from grpo_run.runner.exits import EXIT_OK, EXIT_USAGE


@click.command("samples", short_help="what the model wrote: completions and their rewards")
@click.argument("name", callback=job_name)
@click.option("--step", type=click.IntRange(min=1), metavar="N", help="the groups kept of training step N")
@click.option("--last", type=click.IntRange(min=1), metavar="K", help="the newest K steps with samples (default 1)")
@click.option("--eval", "evaluation", type=click.Choice(["baseline", "final", "heldout"]),
              help="an evaluation's held-out tasks instead, each beside the baseline's (or final) answer to it; "
                   "heldout: the one every evalSteps (--step N: after step N)")
@click.option("--storage", metavar="URL", help="read the job from this storage URL (no local run needed)")
@click.option("-o", "--output", type=FORMAT, help="one object per completion: prompt, completion, rewards (by name), ...")
def cmd_samples(name: str, step: int | None, last: int | None, evaluation: str | None, storage: str | None,
                output: str | None) -> int:
    """Show what the model wrote: each prompt, then each completion with its rewards by name (the
    best and worst of a group marked, a group whose rewards were all equal said to be solved or
    without signal). A run keeps the first sampleGroups groups of every step (the newest 100 steps,
    evenly spaced ones before them) and, at every evaluation, the first sampleEvalTasks held-out
    tasks.

    \b
    example:
      grpo-run samples tiny-arithmetic --last 2
      grpo-run samples tiny-arithmetic --eval final          # baseline and final answers, task by task
      grpo-run samples my-grpo-lora --step 120 --storage s3://bucket/prefix -o json
    """
    from grpo_run.runner.jobs.find import open_record
    from grpo_run.runner.views.samples import eval_tasks, render, rows, step_groups

    if step is not None and last is not None:
        _error("--step and --last: give one (a step, or the newest K)")
        return EXIT_USAGE
    if evaluation in ("baseline", "final") and (step is not None or last is not None):
        _error(f"--eval {evaluation} has one set of samples: leave out --step and --last")
        return EXIT_USAGE
    kind = evaluation or "step"
    try:
        with open_record(name, storage) as record:
            groups = (step_groups(record, step=step, last=last) if kind == "step"
                      else eval_tasks(record, kind, step=step, last=last))
    except LookupError as e:          # no such job, or no such samples (NoSamples)
        _error(str(e))
        return EXIT_USAGE
    if output:
        print(_dump(rows(groups, kind), output), end="")
    else:
        print(render(groups, kind), end="")
    return EXIT_OK
