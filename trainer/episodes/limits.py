"""Why a completion or an episode ended before it was done: the limit that cut it.

Standard library only (the grader's worker reports `toolTime` and `stepTime` as these values)."""

from __future__ import annotations

from enum import Enum


class Truncation(str, Enum):
    """The limit that ended a completion or an episode. Equal to its value as a string, and written
    as it (records, samples, metrics' names)."""
    LENGTH = "maxCompletionLength"   # a single-turn completion cut at maxCompletionLength tokens
    MAX_TURNS = "maxTurns"           # an episode that made maxTurns replies without being done
    CONTEXT = "context"              # no room left in the model's context for a reply or an observation
    TOOL_TIME = "toolTime"           # a tool past toolTimeoutSeconds
    STEP_TIME = "stepTime"           # the environment's step past stepTimeoutSeconds

    def __str__(self) -> str:
        return self.value
