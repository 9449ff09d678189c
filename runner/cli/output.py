"""`grpo-run`'s output helpers for the commands (runner.cli). `error`, `printable` and `dump` live
in runner/text.py, below every module that prints (views, the queue, the preflight, the library)."""

from __future__ import annotations

import click

from grpo_run.runner.text import dump, error, printable  # noqa: F401  (the commands import them from here)

# -h as well as --help (as argparse had); help up to 100 columns wide, as the examples are
CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
FORMAT = click.Choice(["yaml", "json"])


def job_name(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A click callback for a NAME on the command line: the rule metadata.name follows (it becomes
    a folder in storage and on the node, and a word in generated launch files)."""
    from grpo_run.runner.spec.job import name_problem

    trouble = None if value is None else name_problem(value)
    if trouble:
        raise click.BadParameter(trouble)
    return value
