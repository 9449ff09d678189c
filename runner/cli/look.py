"""The commands that look at a job: `get` (with `-w`, the live view), `logs`, `report` and `samples`
(what the model wrote, from the run's record: runner.views.completions)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from grpo_run.runner.exits import EXIT_OK, EXIT_USAGE
from grpo_run.runner.cli.output import FORMAT, dump as _dump, error as _error, job_name, printable
from grpo_run.runner.jobs.find import get_job, jobs_in as _jobs_in, local_jobs as _local_jobs
from grpo_run.runner.home import work_dir
from grpo_run.state.phases import TERMINAL


@click.command("get", short_help="show jobs (get tj: tj is TrainingJob, kubectl-style): phase, step, rewards")
@click.argument("resource")
@click.argument("name", required=False, callback=job_name)
@click.option("--storage", metavar="URL", help="read the job from this storage URL instead of this node's work folder "
              "(default: the work folder of a job run here, which says so on stderr when the job's storage is "
              "elsewhere; else where apply --detach sent it)")
@click.option("-o", "--output", type=FORMAT, help="output format (default: a table)")
@click.option("-w", "--watch", is_flag=True, help="follow the job until it stops: a live bar per phase with steps/s, ETA, "
              "reward, spend and projected cost (with -o: the job again on every change)")
def cmd_get(resource: str, name: str | None, storage: str | None, output: str | None, watch: bool) -> int:
    """Show a TrainingJob as {apiVersion, kind, metadata, spec, status}. RESOURCE: tj (TrainingJob);
    NAME: the job (all jobs when left out).

    \b
    example:
      grpo-run get tj tiny-arithmetic -o yaml
      grpo-run get tj -w                      # follow every job on this node
      grpo-run get tj my-grpo-lora --storage s3://bucket/prefix -o json
    """
    from grpo_run.runner.views.status import table

    # checked here rather than by click.Choice: the error keeps naming the fix, as it always has
    if resource not in ("tj", "trainingjob", "trainingjobs"):
        _error(f"unknown resource {resource!r}: use tj (TrainingJob)")
        return EXIT_USAGE
    if name:
        names = [name]
    else:
        names = _local_jobs() if storage is None else _jobs_in(storage)
    if watch:
        return _watch(names, storage, output)
    try:
        docs = [get_job(n, storage) for n in names]
    except LookupError as e:
        _error(str(e))
        return EXIT_USAGE
    if output:
        out = docs[0] if name else {"apiVersion": "v1", "kind": "List", "items": docs}
        print(_dump(out, output), end="")
    else:
        print(table(docs))
    if name and storage is None:
        said_local(name, docs[0])
    return EXIT_OK


def said_local(name: str, doc: dict) -> None:
    """A note on stderr when `get tj NAME` answered from this machine's work folder (the job ran
    here) for a job that keeps its storage elsewhere: another node may have gone on with it since,
    and storage's record is the one to ask (the answer itself stays on stdout, -o json unchanged)."""
    from grpo_run.runner.home import default_storage
    from grpo_run.state.record import RECORD_FILE

    stored = (doc.get("spec") or {}).get("storage")
    if not stored or stored == default_storage() or not (work_dir(name) / RECORD_FILE).exists():
        return
    print(f"note: {name}: from this machine's copy ({work_dir(name)}), as of its run here; another node may have "
          f"gone on with it since: grpo-run get tj {name} --storage {printable(stored)}", file=sys.stderr)


TERMINAL_PHASES = tuple(str(p) for p in TERMINAL)


def _watch(names: list[str], storage: str | None, output: str | None, interval_s: float = 2.0) -> int:
    """Until every job has stopped: with -o, print the job(s) again whenever phase or step changes;
    without, a live bar per phase (runner.live), redrawn in place on a terminal and printed again
    on every change otherwise."""
    import time

    from grpo_run.runner.views.live import view
    from grpo_run.runner.jobs.find import open_record

    tty = sys.stdout.isatty()
    last, drawn = None, 0
    while True:
        try:
            if output:
                docs = [get_job(n, storage) for n in names]
                key = [(d["status"]["phase"], d["status"]["step"]) for d in docs]
            else:
                views, key = [], []
                for n in names:
                    with open_record(n, storage) as record:
                        views.append(view(record))
                        key.append((str(record.job()["phase"]), views[-1][2:]))
        except LookupError as e:
            _error(str(e))
            return EXIT_USAGE
        if key != last:
            if output:
                for d in docs:
                    print(_dump(d, output) + ("---" if output == "yaml" else ""), flush=True)
            else:
                lines = [printable(line) for v in views for line in v]     # names, nodes: from storage
                if tty and drawn:       # back to the block's first line, then each line cleared and redrawn
                    sys.stdout.write(f"\x1b[{drawn}F")
                sys.stdout.write("".join(("\x1b[2K" if tty else "") + line + "\n" for line in lines))
                sys.stdout.flush()
                drawn = len(lines)
            last = key
        if all(phase in TERMINAL_PHASES for phase, _ in key):
            return EXIT_OK
        time.sleep(1.0 if tty and storage is None else interval_s)   # from storage: a download each time


@click.command("logs", short_help="the trainer's log on this node")
@click.argument("name", callback=job_name)
@click.option("-f", "--follow", is_flag=True, help="keep printing until the job stops")
def cmd_logs(name: str, follow: bool) -> int:
    """Print the trainer's log for a job run on this node (progress every 5% of the steps, checkpoints, warnings).

    \b
    example:
      grpo-run logs tiny-arithmetic -f
    """
    import time

    path = work_dir(name) / "logs" / "trainer.log"
    if not path.exists():
        _error(f"no log for {name!r} on this node ({path}); logs stay on the node that ran the job")
        return EXIT_USAGE
    f = open(path, encoding="utf-8", errors="replace")
    try:
        while True:
            chunk = f.read()
            if chunk:
                print(chunk, end="", flush=True)
            if not follow:
                return EXIT_OK
            if not chunk and _rotated(path, f):      # the trainer rotated it (trainer.logs): on to the new file
                print(f.read(), end="", flush=True)   # what was written before the rotation
                f.close()
                f = open(path, encoding="utf-8", errors="replace")
                continue
            try:
                phase = get_job(name, None)["status"]["phase"]
            except LookupError:
                phase = None
            if phase in TERMINAL_PHASES and not chunk:
                return EXIT_OK
            time.sleep(0.5)
    finally:
        f.close()


def _rotated(path: Path, f) -> bool:
    """Whether `path` now names another file than the open `f` (the log was rotated)."""
    try:
        return os.stat(path).st_ino != os.fstat(f.fileno()).st_ino
    except FileNotFoundError:
        return False



@click.command("report", short_help="draw the run as a PNG: rewards, cost, where attempts ended")
@click.argument("name", callback=job_name)
@click.option("--storage", metavar="URL", help="read the job from this storage URL (no local run needed)")
@click.option("--out", required=True, metavar="FILE.png", help="the picture to write; a Markdown summary goes beside it (.md)")
def cmd_report(name: str, storage: str | None, out: str) -> int:
    """Draw a job's run into a PNG from its record: the train reward (raw and smoothed) with the
    held-out baseline, periodic and final evaluations; the groups with identical rewards, solved or
    without signal; completion length and the truncated fraction; the gradient norm (with KL when
    beta > 0, the clip ratio when numIterations > 1); turns per episode and the share of tool calls
    answered with an error for episodes; the spend over wall time when the job has a rate. Every attempt boundary is marked with why it ended and the steps the next attempt redid.
    A Markdown summary with one row per attempt is written beside it (same name, .md).

    \b
    example:
      grpo-run report tiny-arithmetic --out report.png
      grpo-run report my-grpo-lora --storage s3://bucket/prefix --out report.png
    """
    from grpo_run.runner.exits import Refused
    from grpo_run.runner.jobs.report import write_report

    try:
        run, drawn, md = write_report(name, storage, Path(out))
    except Refused as e:
        print(e.text, file=sys.stderr)
        return e.exit_code
    cuts = drawn["boundaries"]
    print(f"wrote {out} and {md}: {printable(run['name'])} {run['phase']}, {len(run['steps'])} steps, "
          f"{len(run['attempts'])} attempt(s), {len(cuts)} boundar{'y' if len(cuts) == 1 else 'ies'}, "
          f"{sum(c['redone'] for c in cuts)} steps redone")
    return EXIT_OK


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
    from grpo_run.runner.views.completions import eval_tasks, render, rows, step_groups

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
