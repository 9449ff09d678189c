"""A job's phase: the documented status enum, what may follow what, and the groups the views use."""

from __future__ import annotations

import enum


class Phase(str, enum.Enum):
    PENDING = "Pending"                 # accepted, nothing run yet
    BASELINE_EVAL = "BaselineEval"      # evaluating the untrained model on the held-out tasks
    TRAINING = "Training"               # GRPO steps; checkpoints every saveSteps
    FINAL_EVAL = "FinalEval"            # evaluating the trained adapter on the same tasks
    SUCCEEDED = "Succeeded"             # done, final evaluation recorded; terminal
    FAILED = "Failed"                   # stopped by an error; resumable once it is fixed
    PREEMPTED = "Preempted"             # the node was taken away; resumable from the last durable checkpoint
    BUDGET_EXCEEDED = "BudgetExceeded"  # spend reached maxCostUSD; resumable with a larger budget
    CANCELLED = "Cancelled"             # stopped by `grpo-run cancel` (checkpoint kept); terminal: never resumed

    def __str__(self) -> str:
        return self.value


class AttemptEnd(str, enum.Enum):
    """How one attempt (one trainer process under one supervisor) ended: the record's attempts.reason."""
    SUCCEEDED = "Succeeded"             # the job succeeded in it
    FAILED = "Failed"                   # the job failed in it: an error restarting cannot mend
    CRASHED = "Crashed"                 # the trainer died, hung or lost its node; the next attempt restarts it
    PREEMPTED = "Preempted"             # a spot notice (or SIGTERM, or a stop) ended it at a durable step
    BUDGET_EXCEEDED = "BudgetExceeded"  # maxCostUSD reached
    CANCELLED = "Cancelled"             # `grpo-run cancel`

    def __str__(self) -> str:
        return self.value


_ACTIVE = (Phase.BASELINE_EVAL, Phase.TRAINING, Phase.FINAL_EVAL)
_STOPPED = (Phase.FAILED, Phase.PREEMPTED, Phase.BUDGET_EXCEEDED)
STOPPED = _STOPPED                                      # ended without succeeding: resume may continue it
FINISHED = (Phase.SUCCEEDED, Phase.CANCELLED)           # over for good: resume, a queue, cancel leave it alone
TERMINAL = (*FINISHED, *_STOPPED)                       # no attempt is running

# Allowed moves (besides staying in the same phase, always allowed: a resumed attempt re-enters
# the phase a hard kill left recorded, and the message may change).
ALLOWED_TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    # Cancelled may follow every phase but the two finished ones: `grpo-run cancel` of a job
    # waiting for a node, running on one, or stopped and resumable.
    Phase.PENDING: frozenset({Phase.BASELINE_EVAL, Phase.TRAINING, *_STOPPED, Phase.CANCELLED}),
    Phase.BASELINE_EVAL: frozenset({Phase.TRAINING, *_STOPPED, Phase.CANCELLED}),
    # Training -> BaselineEval: a node killed without a word leaves Training recorded; the next
    # attempt re-evaluates the baseline when its cache no longer matches the (edited) job.
    Phase.TRAINING: frozenset({Phase.FINAL_EVAL, Phase.BASELINE_EVAL, *_STOPPED, Phase.CANCELLED}),
    # FinalEval -> BaselineEval / Training: likewise, a kill during the final evaluation, resumed
    # from a checkpoint before the last step.
    Phase.FINAL_EVAL: frozenset({Phase.SUCCEEDED, Phase.BASELINE_EVAL, Phase.TRAINING, *_STOPPED, Phase.CANCELLED}),
    # resume: back to whichever phase was interrupted
    Phase.PREEMPTED: frozenset({*_ACTIVE, Phase.FAILED, Phase.BUDGET_EXCEEDED, Phase.CANCELLED}),
    Phase.FAILED: frozenset({*_ACTIVE, Phase.CANCELLED}),
    Phase.BUDGET_EXCEEDED: frozenset({*_ACTIVE, Phase.FAILED, Phase.CANCELLED}),
    Phase.SUCCEEDED: frozenset(),
    Phase.CANCELLED: frozenset(),       # to train again under the name: `grpo-run delete`, then apply
}


class InvalidTransition(RuntimeError):
    """A phase change the lifecycle does not allow (e.g. anything after Succeeded)."""
