"""The samples' books: what the model wrote, in the run's record (state.record's `samples`
table), from the trainer's `Samples` events (trainer.kept_samples says what one holds).

    step       a training step's first groups; a redone step (after a preemption) replaces its own
    heldOut    the first held-out tasks at an evaluation every evalSteps, by step
    baseline   the same tasks before training (one set)
    final      ... and after it (one set: a final evaluation computed again replaces it)

The bound: text is capped where it is written (trainer.kept_samples.MAX_CHARS characters per prompt
and per completion), groups per step and tasks per evaluation by sampleGroups (at most 8) and
sampleEvalTasks (at most 32), and steps kept by `steps_to_drop`: the newest RECENT_STEPS steps
with samples, and of the older ones at most OLDER_STEPS, evenly spaced (every 2^k-th step)."""

from __future__ import annotations

from typing import Any

from grpo_run.state.record import Record

KINDS = ("step", "heldOut", "baseline", "final")
RECENT_STEPS = 100      # the newest steps' samples, all kept
OLDER_STEPS = 100       # ... and at most this many older ones, evenly spaced


def steps_to_drop(steps: list[int], newest: int) -> list[int]:
    """Of `steps` (with samples), those to drop once step `newest` has them: every older one not on
    the spacing, the smallest power of two that leaves at most OLDER_STEPS multiples before the
    newest RECENT_STEPS. The spacing only grows, so a dropped step is never wanted again."""
    cutoff = newest - RECENT_STEPS
    spacing = 1
    while cutoff // spacing > OLDER_STEPS:
        spacing *= 2
    return [s for s in steps if s <= cutoff and s % spacing]


class SampleBooks:
    def __init__(self, record: Record) -> None:
        self.record = record

    def add(self, kind: str, step: int, groups: list[dict[str, Any]]) -> None:
        """Samples of `kind` at `step`, in one transaction with what they replace and what the
        bound drops. Raises ValueError for an unknown kind."""
        if kind not in KINDS:
            raise ValueError(f"sample kind must be one of {KINDS} (got {kind!r})")
        record = self.record
        with record.transaction():
            if kind in ("baseline", "final"):       # one set: another step's (an earlier final) goes
                record.drop_samples(kind, [s for s in record.sample_steps(kind) if s != step])
            # an evaluation's batches come one by one; a step's groups all at once
            record.put_samples(kind, step, groups, whole=kind == "step")
            if kind in ("step", "heldOut"):
                record.drop_samples(kind, steps_to_drop(record.sample_steps(kind), step))

    def replace(self, kind: str, step: int, groups: list[dict[str, Any]]) -> None:
        """The one set of evaluation `kind` (baseline or final), all of it: `groups` at `step`,
        nothing else (a cached baseline's samples put back). Raises ValueError for another kind."""
        if kind not in ("baseline", "final"):
            raise ValueError(f"only an evaluation's one set is replaced whole (got {kind!r})")
        with self.record.transaction():
            self.record.drop_samples(kind, self.record.sample_steps(kind))
            self.record.put_samples(kind, step, groups, whole=True)
