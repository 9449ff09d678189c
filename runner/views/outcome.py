"""What applying or resuming a job tells as it goes and when it ends, as text: the budget's
warning before a run, a submission's lines, a job with nothing left to do, the failure's one
line, and the summary a run ends with.

runner/jobs/ decides and hands each text to a `Tell` (the CLI's and the Python API's is
`to_terminal`); nothing under runner/jobs/ prints.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, Protocol

from grpo_run.runner.text import printable, printable_lines
from grpo_run.state.phases import STOPPED, Phase

__all__ = ["Tell", "code_error_advice", "each_node", "failed", "nothing_to_do", "run_summary", "submitted", "to_terminal"]


class Tell(Protocol):
    """Where a job's words go: `err` for what belongs on stderr (warnings, failures)."""

    def __call__(self, text: str, *, err: bool = False) -> None: ...


def to_terminal(text: str, *, err: bool = False) -> None:
    """The CLI's and the Python API's Tell: stdout, or stderr for `err`; `text` as it is (a job
    document printed with -o ends with its own newline)."""
    print(text, end="" if text.endswith("\n") else "\n", file=sys.stderr if err else sys.stdout)


def submitted(name: str, outcome: str, url: str, phase: str, est: dict[str, Any] | None, *, nodes: int,
              storage: str) -> str:
    """`apply --detach`'s lines: where the job went, its estimate, how a node trains it."""
    said = {"submitted": "submitted", "updated": "submitted again with the changed spec",
            "unchanged": "already submitted with this spec"}[outcome]
    lines = [f"{name}: {said} to {url} (phase {printable(phase)}); nothing runs on this machine."]
    if est and est.get("costToCompletionUSD") is not None:
        lines.append(f"  estimate: ${est['costToCompletionUSD']:.2f} to completion on {est['gpu']} "
                     f"(first hold ${est['firstHoldUSD']:.2f}), {est['memory']['totalGB']:.1f} GB of memory")
    elif est:
        lines.append(f"  estimate: {est['memory']['totalGB']:.1f} GB of memory; set spec.gpu for the cost")
    if nodes > 1:                # a plain resume is refused for it: say the form that works
        lines.append(f"  its nodes train it with: {each_node(name, storage, nodes)}")
    else:
        lines.append(f"  a node trains it with: grpo-run resume {name} --storage {storage}")
    lines.append(f"  follow it: grpo-run get tj {name} -w")
    return "\n".join(lines)


def nothing_to_do(name: str, phase: str, message: str = "") -> str:
    """A job storage already ended: succeeded, or cancelled (exit 0: a boot unit ends quietly)."""
    if phase == Phase.SUCCEEDED:
        return f"{name}: already succeeded; nothing to do"
    return (f"{name}: cancelled ({printable(message)}); nothing to do; "
            f"`grpo-run delete {name} --yes` clears the name to train it again")


def each_node(name: str, storage: str | None, count: int) -> str:
    """The command that starts job `name` of `count` nodes, for advice (after `apply --detach`, at
    the end of a stopped run): a plain `grpo-run resume NAME` is refused for it (resolve)."""
    where = f" --storage {storage}" if storage else ""
    return (f"grpo-run resume {name}{where} --nnodes {count} --node-rank R --master HOST:PORT on each of its "
            f"{count} nodes (R = 0 on the node at HOST, 1 to {count - 1} on the others), or launch them together "
            f"with grpo-run deploy skypilot or deploy k8s (docs/multi-gpu.md)")


def failed(name: str, message: str) -> str:
    """The one place a failed run's error is said: the summary and the trainer do not repeat it."""
    return f"error: {name} failed: {printable_lines(message)}"


def run_summary(name: str, status: dict, result, job_file: str | None = None, nodes: int = 1,
                storage: str | None = None) -> str:
    """The lines a run ends with: phase and step, the held-out rewards, the notice's timing, and
    how to go on (`job_file` as run_job's; a job of several `nodes` goes on with each node's flags,
    from `storage`)."""
    from grpo_run.runner.views.status import reward_signal_warning

    lines = [f"{name}: {status['phase']} after {status['step']} steps"]
    if status.get("message") and status["phase"] not in (Phase.SUCCEEDED, Phase.FAILED):   # Failed: the error line
        lines.append(f"  {printable(status['message'])}")
    b, f = status.get("baseline"), status.get("final")
    if b and f:
        lines.append(f"  held-out mean reward: baseline {b['meanReward']:.3f} -> final {f['meanReward']:.3f} "
                     f"({b['tasks']} tasks; solved {b.get('solved', '?')} -> {f.get('solved', '?')})")
    if said := reward_signal_warning(status):
        lines.append(f"  warning: {printable(said)}")
    if result.notice_to_durable_s is not None and status["phase"] == Phase.SUCCEEDED:
        lines.append(f"  notice ({result.notice}) as the run ended -> its final weights (step {result.durable_step}) "
                     f"in storage {result.notice_to_durable_s:.2f} s after it")
    elif result.notice_to_durable_s is not None:
        lines.append(f"  notice ({result.notice}) -> checkpoint at step {result.durable_step} durable in "
                     f"{result.notice_to_durable_s:.2f} s")
    if getattr(result, "code_error", False):
        lines.append(f"  {code_error_advice(status.get('message', ''), job_file)}")
    elif status["phase"] in STOPPED and nodes > 1:      # a plain resume is refused for it (runner.jobs.nodes)
        lines.append(f"  continue with: {each_node(name, storage, nodes)}")
    elif status["phase"] in STOPPED:
        lines.append(f"  continue with: grpo-run resume {name}")
    return "\n".join(lines)


_REWARD_FILE = re.compile(r"reward function '([^'\n]+\.py):[A-Za-z_][\w.]*'")


def code_error_advice(message: str, job_file: str | None) -> str:
    """What to do after the job's own code failed (a reward raised, returned a non-number): a
    resume would run the copies stored at submit time and fail the same way, so the fix goes
    into the user's files and the job is applied again (a changed spec continues the job)."""
    if job_file is not None and not Path(job_file).is_file():     # the Python API: "grpo_run.train()"
        return f"fix the function the error names, then call {job_file} again with the same name"
    found = _REWARD_FILE.search(message)
    what = "what the error names"
    if found:
        what = printable(found.group(1) if job_file is not None else f"your copy of {Path(found.group(1)).name}")
    again = (f"grpo-run apply -f {printable(job_file)}" if job_file is not None else
             "grpo-run apply -f JOB (the job file you submitted; --detach to submit it again)")
    return f"fix {what}, then {again} again (resume would replay the copy stored at submit time)"


