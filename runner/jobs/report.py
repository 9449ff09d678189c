"""`grpo-run report`: a job's run drawn as a PNG with its Markdown summary beside it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grpo_run.runner.exits import EXIT_USAGE, Refused
from grpo_run.runner.jobs.find import open_record

__all__ = ["write_report"]


def write_report(name: str, storage: str | None, path: Path) -> tuple[dict[str, Any], dict[str, Any], Path]:
    """Draw job `name`'s run into the PNG `path` and its Markdown summary beside it (.md); returns
    (the run as gathered, what was drawn, the summary's path). Raises Refused (EXIT_USAGE) for a
    path that is not a .png or a job that is not found."""
    from grpo_run.runner.views.report import gather, render, summary

    if path.suffix.lower() != ".png":
        raise Refused(f"--out {path}: the picture is a PNG; name it FILE.png", EXIT_USAGE)
    try:
        with open_record(name, storage) as record:
            run = gather(record)
    except LookupError as e:
        raise Refused(str(e), EXIT_USAGE) from None
    drawn = render(run, path)
    md = path.with_suffix(".md")
    md.write_text(summary(run, path.name), encoding="utf-8")
    return run, drawn, md
