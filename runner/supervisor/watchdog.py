"""How long a trainer may go without a word before its attempt ends as a hang.

The trainer reports as it goes (a step, an evaluation batch, a checkpoint sealed: trainer.protocol);
a trainer that stops reporting may be held by its reward function (one that stops reading the
grader's requests and ignores its alarm; the grader's own deadlines catch what they can), by a
wedged collective or by a driver. Without a bound, such a trainer keeps the GPU billed until a
notice or a `cancel`, past rewardTimeoutSeconds and maxCostUSD (the budget is the trainer's own
check between steps). From the trainer's first event on, the supervisor ends an attempt that has
gone `bound_s` without one: killed, recorded Crashed ("hung: ..."), restarted under the crash
limit.

The bound is the longest of:
  * HANG_FLOOR_S (10 min): a step of a large model, a checkpoint's upload;
  * what one step's or one evaluation batch's rewards may legitimately take: every completion,
    every reward function, each up to rewardTimeoutSeconds plus the grader's kill grace, on every
    try (1 + the grader's retries), and every LLM judge's calls (its timeoutSeconds on each of
    its tries, `concurrency` at once);
  * HANG_STEP_FACTOR times the longest wait between two events so far in this attempt.
GRPO_RUN_HANG_SECONDS on the node sets it instead (a number of seconds).
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any, Callable, Sequence

from grpo_run.trainer.config import GRPOParams
from grpo_run.trainer.grader.tools import MAX_TOOL_CALLS

log = logging.getLogger(__name__)

HANG_ENV = "GRPO_RUN_HANG_SECONDS"
HANG_FLOOR_S = 600.0
HANG_STEP_FACTOR = 3.0
# the grader's own: kill_grace_s (after the in-process alarm) and the SIGABRT grace, and its retries
_GRADER_GRACE_S = 2.0 + 2.0
_GRADER_TRIES = 3


def reward_bound_s(params: GRPOParams, functions: int, judges: Sequence[Any] = ()) -> float:
    """What one step's (or one evaluation batch's) reward calls may take at most, in seconds: every
    function's every completion on every try, and every judge's calls (each up to its timeout on
    each try, `concurrency` at once)."""
    items = max(params.promptsPerStep * params.numGenerations, params.evalBatchSize)
    bound = items * max(functions, 1) * (params.rewardTimeoutSeconds + _GRADER_GRACE_S) * _GRADER_TRIES
    return bound + sum(items * j.timeout_s * (j.retries + 1) / max(j.concurrency, 1) for j in judges)


def sandboxed_calls(env: Any, reward_timeout_s: float) -> int:
    """How many sandboxed calls (each up to rewardTimeoutSeconds) per item a step's scoring makes
    (the trainer's Environment): one per reward function (reward models and judges are not in the
    sandbox), and an episode's environment calls: making its object, reset, each of its maxTurns
    steps (as many calls' worth as stepTimeoutSeconds is, when it is longer), and with tools, as
    many calls' worth as the most tool calls a reply may make can take."""
    calls = sum(1 for r in env.rewards if not r.model and r.judge is None)
    if env.episodes is None:
        return calls
    per_step = math.ceil(max(env.episodes.step_timeout_s or 0, reward_timeout_s) / reward_timeout_s)
    calls += 2 + env.episodes.max_turns * per_step
    if env.episodes.tools:
        per_tool = math.ceil((env.episodes.tool_timeout_s or reward_timeout_s) / reward_timeout_s)
        calls += env.episodes.max_turns * MAX_TOOL_CALLS * per_tool
    return calls


def configured_bound_s(environ: dict[str, str] | None = None) -> float | None:
    """GRPO_RUN_HANG_SECONDS, or None: unset, or not a positive number (said in a warning that
    names the variable; the derived bound holds then)."""
    value = (os.environ if environ is None else environ).get(HANG_ENV, "").strip()
    if not value:
        return None
    try:
        bound = float(value)
    except ValueError:
        bound = -1.0
    if not bound > 0:
        log.warning("%s=%r is not a number of seconds > 0 (how long a trainer may go without reporting before its "
                    "attempt ends as a hang): using the bound derived from rewardTimeoutSeconds and the step time; "
                    "set a number or unset it", HANG_ENV, value)
        return None
    return bound


class Watchdog:
    """The time since a trainer's last event, against the bound. `seen()` at each event; `overdue()`
    says, once the first event came, how long it has been silent past the bound (None while not)."""

    def __init__(self, params: GRPOParams, functions: int, *, judges: Sequence[Any] = (),
                 fixed_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._floor = max(HANG_FLOOR_S, reward_bound_s(params, functions, judges))
        self._fixed = fixed_s
        self._clock = clock
        self._last: float | None = None
        self._longest = 0.0

    def seen(self) -> None:
        now = self._clock()
        if self._last is not None:
            self._longest = max(self._longest, now - self._last)
        self._last = now

    @property
    def bound_s(self) -> float:
        return self._fixed if self._fixed is not None else max(self._floor, HANG_STEP_FACTOR * self._longest)

    def overdue(self) -> float | None:
        """Seconds since the last event when past the bound, else None (and None before the first)."""
        if self._last is None:
            return None
        silent = self._clock() - self._last
        return silent if silent > self.bound_s else None
