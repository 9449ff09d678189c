"""`grpo-run score`: try a job's rewards on completions you wrote, before paying for a GPU (the
library: runner/score.py)."""

from __future__ import annotations

import json

import click

from grpo_run.runner.cli.output import error as _error, printable
from grpo_run.runner.exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE


@click.command("score", short_help="score completions from a file with a job's rewards, in the sandbox")
@click.option("-f", "--file", required=True, metavar="FILE", help="the job file (YAML, kind: TrainingJob)")
@click.option("--completions", required=True, metavar="FILE.jsonl",
              help="one JSON object per line: \"completion\", and \"task\" (an index into the job's training tasks) "
                   "or the task's own fields")
@click.option("-o", "--output", type=click.Choice(["json"]), help="a JSON list, one {rewards, total} per completion")
def cmd_score(file: str, completions: str, output: str | None) -> int:
    """Score each completion in FILE.jsonl with the job's rewards, as training would: in the grader's
    sandbox, with the job's rewardTimeoutSeconds, rewardMemoryMB and spec.sandbox. Prints every
    reward by name and the weighted total, one line per completion in the file's order. No model
    is loaded, unless the job names a reward model; an LLM judge is called from here (with
    GRPO_RUN_ALLOW_JUDGES=1). A reward that fails is an error (exit 1), never a score.

    \b
    example:
      grpo-run score -f examples/code.yaml --completions examples/code-completions.jsonl
      grpo-run score -f job.yaml --completions mine.jsonl -o json

    \b
    A line of FILE.jsonl:
      {"task": 0, "completion": "```python\\ndef add(a, b):\\n    return a + b\\n```"}
      {"prompt": "2+2=", "answer": "4", "completion": "4"}
    """
    from grpo_run.runner.score import CompletionsError, read_completions, score_completions
    from grpo_run.runner.spec.job import JobError, load_job
    from grpo_run.trainer.grader.grader import RewardFunctionError, SandboxUnavailable
    from grpo_run.trainer.grader.judge import JudgeError, JudgeUnavailable

    try:
        job = load_job(file)
    except FileNotFoundError:
        _error(f"no such job file: {file}")
        return EXIT_USAGE
    except JobError as e:
        print(e, file=click.get_text_stream("stderr"))
        return EXIT_USAGE
    try:
        scored = score_completions(job, read_completions(completions, job))
    except CompletionsError as e:
        _error(str(e))
        return EXIT_USAGE
    except RewardFunctionError as e:
        _error(printable(str(e)) if e.index is None else str(e))
        return EXIT_USAGE if e.index is None else EXIT_FAILED      # one that cannot load is the job file's
    except (SandboxUnavailable, JudgeError, JudgeUnavailable) as e:
        _error(str(e))
        return EXIT_FAILED
    except (OSError, ValueError) as e:          # a reward model that cannot be loaded, or is not one
        _error(f"{e}".splitlines()[0] if str(e) else type(e).__name__)
        return EXIT_FAILED
    if output == "json":
        print(json.dumps(scored, indent=2))
    else:
        print(_table(scored))
    return EXIT_OK


def _table(scored: list[dict]) -> str:
    """One line per completion: its number, each reward, the weighted total; columns aligned."""
    names = list(scored[0]["rewards"])
    rows = [["#", *names, "total"]] + [[str(i), *(f"{s['rewards'][n]:g}" for n in names), f"{s['total']:g}"]
                                       for i, s in enumerate(scored)]
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
