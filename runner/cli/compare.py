"""`grpo-run apply -f JOB --dry-run --compare [CLOUDS]`: the cards that fit the job, on the
shapes each cloud rents, cheapest to completion first (runner/estimate/compare.py)."""

from __future__ import annotations

import sys

from grpo_run.runner.cli.output import dump, error
from grpo_run.runner.exits import EXIT_OK, EXIT_USAGE, Refused


def run_compare(file: str, clouds: str, *, dry_run: bool, live: str | None, output: str | None) -> int:
    """Read and check the job as a dry run does, then print the ranking (as data with `output`).
    Bad flags are refused, naming the flag and the fix (exit 2)."""
    from grpo_run.runner.estimate.compare import compare, compare_lines, parse_clouds
    from grpo_run.runner.jobs.run import check_job_file

    if not dry_run:
        error("--compare is for --dry-run: it prices the job on every card and starts nothing; "
              f"grpo-run apply -f {file} --dry-run --compare")
        return EXIT_USAGE
    if live:
        error("--compare ranks on the dated table's shapes (runner/estimate/shapes.py); --live prices spec.gpu alone "
              "from a cloud's API: run them apart")
        return EXIT_USAGE
    try:
        chosen = parse_clouds(clouds)
    except ValueError as e:
        error(str(e))
        return EXIT_USAGE
    try:
        checked = check_job_file(file, dry_run=True, detach=False)
    except Refused as e:
        print(e.text, file=sys.stderr)
        return e.exit_code
    if checked.estimate is None:            # the model's config cannot be read here: nothing to size or time
        error(f"--compare: {checked.job.name}'s model config cannot be read here, so no card can be sized or timed; "
              "see `grpo-run apply -f ... --dry-run`")
        return EXIT_USAGE
    engine = (checked.sampler or {}).get("engine")
    data = compare(checked.job, clouds=chosen, sampler=engine)
    print(dump({"compare": data}, output) if output else compare_lines(checked.job.name, data), end="" if output else "\n")
    return EXIT_OK
