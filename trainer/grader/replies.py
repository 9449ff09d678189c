"""The worker's replies to a batch, checked as if a stranger wrote them: the reward function runs in
the worker's process and can write frames to the response pipe itself (its number is in the
worker's argv), so a frame proves nothing about who wrote it. A reward is a JSON number, finite and
within ±MAX_ABS_REWARD (`grpo_run.trainer.grader.worker`); anything else is the reward function's
error, never training data. Which item a forged frame lands on the reward function decides anyway:
it decides its rewards."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Literal

from grpo_run.trainer.grader.calls import reward_problem

FailureKind = Literal["exception", "timeout", "invalid", "refused", "hung", "crashed"]


@dataclass(frozen=True)
class Failure:
    """One failed try at one completion."""

    kind: FailureKind
    detail: str

    def describe(self, timeout_s: float, *, invalid: str) -> tuple[str, str]:
        """What the code did, as a verb for a person ("raised", "timed out", ...; `invalid`: the
        words for a reply it may not give), and the detail to show under it (a timeout's with
        the limit it passed)."""
        what = {"exception": "raised", "timeout": "timed out", "invalid": invalid, "hung": "hung",
                "crashed": "killed its process", "refused": "did what the grader refuses"}[self.kind]
        if self.kind == "timeout":
            return what, f"timed out after timeout_s={timeout_s:g} s; it was interrupted here:\n{self.detail}"
        return what, self.detail


def outcome(frame: dict) -> float | Failure:
    """A result frame, checked as if a stranger wrote it (the reward function can): a reward is a
    JSON number, finite and within ±MAX_ABS_REWARD, or it is the reward function's error."""
    if frame.keys() == {"ok"}:
        value = frame["ok"]
        if type(value) in (int, float):  # not bool: the worker sends floats
            try:
                reward = float(value)
            except OverflowError:  # a 400-digit integer
                reward = math.inf if value > 0 else -math.inf
            problem = reward_problem(reward)
            return Failure("invalid", problem) if problem else reward
    elif frame.keys() == {"kind", "error"} and frame["kind"] in ("exception", "timeout", "invalid", "refused"):
        if isinstance(frame["error"], str):
            return Failure(frame["kind"], frame["error"])
    shown = json.dumps(frame)
    return Failure("invalid", f"sent the grader a reply it cannot read: {shown[:200]}{'...' if len(shown) > 200 else ''}")
