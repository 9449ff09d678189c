"""How a supervisor's run of a job ends: one table from each ending to the job's phase, the last
attempt's reason and the process's exit status. The supervisor ends a run in one place
(Supervisor._end) by naming a row; `grpo-run get tj` and the report read the same enums back."""

from __future__ import annotations

import enum
from typing import NamedTuple

from grpo_run.runner.exits import EXIT_BUDGET, EXIT_CANCELLED, EXIT_FAILED, EXIT_OK, EXIT_PREEMPTED
from grpo_run.state.phases import AttemptEnd, Phase


class End(enum.Enum):
    """Why a supervisor's run ends."""
    SUCCEEDED = "succeeded"             # the final weights are durable
    FAILED = "failed"                   # an error another attempt would repeat (the job's code, storage refusing)
    CRASHED_OUT = "crashed out"         # crashes (or outages) past their restart limit
    PREEMPTED = "preempted"             # a notice, a signal or a stop: the newest step durable, resume continues
    BUDGET_EXCEEDED = "budget exceeded" # maxCostUSD reached, the newest step durable
    CANCELLED = "cancelled"             # `grpo-run cancel`, the newest step durable
    GROUP_LOST = "group lost"           # several nodes: a rank died; the launcher restarts the group, resume continues


class Ending(NamedTuple):
    phase: Phase            # the job's phase afterwards
    attempt: AttemptEnd     # the last attempt's reason
    exit_code: int          # the supervisor's (and `apply`'s, `resume`'s) exit status: runner.exits


ENDINGS: dict[End, Ending] = {
    End.SUCCEEDED: Ending(Phase.SUCCEEDED, AttemptEnd.SUCCEEDED, EXIT_OK),
    End.FAILED: Ending(Phase.FAILED, AttemptEnd.FAILED, EXIT_FAILED),
    End.CRASHED_OUT: Ending(Phase.FAILED, AttemptEnd.CRASHED, EXIT_FAILED),
    End.PREEMPTED: Ending(Phase.PREEMPTED, AttemptEnd.PREEMPTED, EXIT_PREEMPTED),
    End.BUDGET_EXCEEDED: Ending(Phase.BUDGET_EXCEEDED, AttemptEnd.BUDGET_EXCEEDED, EXIT_BUDGET),
    End.CANCELLED: Ending(Phase.CANCELLED, AttemptEnd.CANCELLED, EXIT_CANCELLED),
    End.GROUP_LOST: Ending(Phase.PREEMPTED, AttemptEnd.CRASHED, EXIT_PREEMPTED),
}
