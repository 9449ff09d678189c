"""The trainer's side of an episodes environment: its objects live in a sandboxed grader worker
(the same process, sandbox and limits as a reward function's: `grpo_run.trainer.grader`), and
this class asks them to `reset` and `step` (the conversation: `grpo_run.trainer.grader.episodes`).

    with EnvironmentHost("/job/env.py:Guess", timeout_s=10) as host:
        prompts = host.reset(tasks, seeds)            # one episode per task
        steps = host.step([0, 2], ["5", "7"])         # the running episodes' replies

An environment that raises, hangs, crashes its process or returns what is not a prompt or a
Step is a failure of the user's code: `EnvironmentFailed`, never a score, and never retried (its
objects' state after a failure is unknown; a resumed step replays the episodes from `reset`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from grpo_run.trainer.grader.grader import Grader
from grpo_run.trainer.grader.refs import RewardFunctionError, resolve_ref
from grpo_run.trainer.grader.process import WorkerGone, WorkerOverdue, WorkerProcess
from grpo_run.trainer.grader.replies import Failure
from grpo_run.trainer.grader.calls import MAX_ABS_REWARD
from grpo_run.trainer.episodes.limits import Truncation
from grpo_run.trainer.grader.tools import MAX_TOOL_CALLS
from grpo_run.trainer.episodes.step import Observation


class EnvironmentFailed(RewardFunctionError):
    """The episodes environment failed (raised, hung, killed its process, returned something
    that is not a prompt or a Step, did what the sandbox refuses), or cannot be loaded. Like a
    reward function's failure: the job fails as the user's code's, never as a score."""


@dataclass(frozen=True)
class Reply:
    """An environment's answer to one model reply, as the trainer takes it from the worker (a
    Step, or the tools' answer: grpo_run.trainer.grader.episodes), checked as a stranger's frame."""
    observation: Observation           # what the model reads next; None when done
    reward: float                      # this turn's
    done: bool
    truncated: Truncation | None = None     # a tool or the step past its time limit ended the episode
    tool_calls: int = 0                # the reply's tool calls, and how many were answered with an error
    tool_errors: int = 0

    @classmethod
    def read(cls, value: Any) -> Reply | None:
        """The frame's value as a Reply; None when it is not one (keys, types, bounds)."""
        from grpo_run.trainer.grader.episodes import prompt_problem

        if not isinstance(value, dict) or value.keys() - _TOOL_KEYS != {"observation", "reward", "done"}:
            return None
        calls, errors = value.get("toolCalls", 0), value.get("toolErrors", 0)
        observation, reward, done = value["observation"], value["reward"], value["done"]
        if (not all(type(n) is int and 0 <= n <= 10_000 for n in (calls, errors))
                or value.get("truncated", "toolTime") not in (Truncation.TOOL_TIME, Truncation.STEP_TIME)
                or not isinstance(done, bool) or type(reward) not in (int, float) or not abs(reward) <= MAX_ABS_REWARD
                or not (observation is None and done or observation is not None and not prompt_problem(observation))):
            return None
        truncated = value.get("truncated")
        return cls(observation, float(reward), done, None if truncated is None else Truncation(truncated), calls, errors)


class EnvironmentHost(Grader):
    """Owns the sandboxed worker that holds one batch of episodes' environment objects.
    `timeout_s`: per call (one `reset`, one `step`). Raises EnvironmentFailed at once when the
    class cannot be loaded or is not an environment (no reset(task, seed), no step(reply))."""

    def __init__(self, ref: str, *, tools: Sequence[str] = (), tool_timeout_s: float | None = None,
                 step_timeout_s: float | None = None, tool_format: str | dict[str, Any] = "hermes",
                 **settings: Any) -> None:
        settings.pop("group", None)
        for name, value in (("tool_timeout_s", tool_timeout_s), ("step_timeout_s", step_timeout_s)):
            if value is not None and not value > 0:
                raise ValueError(f"{name}: must be > 0 (got {value})")
        self._step_timeout_s = step_timeout_s
        from grpo_run.trainer.grader.tools import TOOL_FORMATS

        if not isinstance(tool_format, dict) and tool_format not in TOOL_FORMATS:
            raise ValueError(f"tool_format: {tool_format!r} is not one of {', '.join(TOOL_FORMATS)} nor a declared one")
        self._tool_format = tool_format       # how the model writes a tool call (grader.tools.TOOL_FORMATS)
        self._tools = [resolve_ref(t) for t in tools]
        self._tool_timeout_s = tool_timeout_s or settings.get("timeout_s", 10.0)
        self.tool_schemas: list[dict[str, Any]] = []      # as the worker described the tools, in the job's order
        try:
            super().__init__(ref, episodes=True, **settings)
        except RewardFunctionError as e:
            raise EnvironmentFailed(_named(str(e)), ref=e.ref, kind=e.kind, summary=e.summary) from None

    def _more_config(self) -> dict[str, Any]:
        return {**({"tools": self._tools, "tool_timeout_s": self._tool_timeout_s, "tool_format": self._tool_format}
                   if self._tools else {}),
                **({"step_timeout_s": self._step_timeout_s} if self._step_timeout_s else {})}

    def _ready(self, hello: dict[str, Any], worker: WorkerProcess) -> None:
        """The tools' schemas from the worker's ready frame, checked as a stranger's (the tools'
        modules ran before it was written): one JSON object per tool, named, 64 KB at most in all."""
        if not self._tools:
            return
        schemas = hello.get("tools")
        ok = (isinstance(schemas, list) and len(schemas) == len(self._tools)
              and all(isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
                      and isinstance(t["function"].get("name"), str) for t in schemas)
              and len(json.dumps(schemas)) <= 65536)
        if not ok:
            worker.release()
            raise EnvironmentFailed(f"environment {self.reward_ref!r}: its worker described its tools as something "
                                    f"other than one schema per tool: {str(schemas)[:200]}", ref=self.reward_ref,
                                    kind="invalid")
        self.tool_schemas = schemas

    def reset(self, tasks: Sequence[Mapping[str, Any]], seeds: Sequence[int]) -> list[Any]:
        """A new batch of episodes, one per task: each one's first prompt (text or messages).
        The previous batch's objects are dropped."""
        items = [[dict(t), int(s)] for t, s in zip(tasks, seeds, strict=True)]
        return [frame for frame in self._call("reset", items, [f"reset of episode {i}" for i in range(len(items))])]

    def step(self, episodes: Sequence[int], replies: Sequence[str]) -> list[Reply]:
        """Each running episode's answer to its reply."""
        items = [[int(i), r] for i, r in zip(episodes, replies, strict=True)]
        return self._call("step", items, [f"step of episode {i}" for i in episodes])

    def _call(self, op: str, items: list[list[Any]], where: list[str]) -> list[Any]:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"EnvironmentHost.{op} called after close()")
            if self._worker is None:
                self._worker = self._start_worker()
            worker, out = self._worker, []
            # a reset is two calls (the class's and reset's); a step, one, or its tool calls
            wait = max(self.timeout_s * 2, self._tool_timeout_s * MAX_TOOL_CALLS if self._tools else 0,
                       self._step_timeout_s or 0) + self._kill_grace_s
            try:
                worker.send({"op": op, "items": items}, time.monotonic() + wait)
                for i in range(len(items)):
                    value, failure = frame_value(op, worker.read(time.monotonic() + wait))
                    if failure is not None:
                        raise self._failed(where[i], failure)
                    out.append(value)
            except WorkerGone:
                raise self._failed(where[len(out)], self._restart_after(worker, "crashed")) from None
            except WorkerOverdue:
                raise self._failed(where[len(out)], self._restart_after(worker, "hung")) from None
            return out

    def _failed(self, where: str, failure: Failure) -> EnvironmentFailed:
        what, detail = failure.describe(self.timeout_s, invalid="returned what it may not")
        return EnvironmentFailed(f"environment {self.reward_ref!r} {what} in the {where} (not retried: an "
                                 f"environment's state after a failure is unknown):\n{detail.rstrip()}",
                                 ref=self.reward_ref, kind=failure.kind)


_TOOL_KEYS = {"toolCalls", "toolErrors", "truncated"}     # a reply the tools answered (grader.tools)


def frame_value(op: str, frame: dict) -> tuple[Any, Failure | None]:
    """A reply frame read as if a stranger wrote it (the environment's code runs in the worker and
    can write frames itself): a prompt (reset) or a Reply (step), or the failure it is."""
    from grpo_run.trainer.grader.episodes import prompt_problem
    from grpo_run.trainer.grader.replies import outcome

    if frame.keys() != {"ok"}:
        got = outcome(frame)            # the worker's failure frame, or a reply it cannot read
        return None, got if isinstance(got, Failure) else Failure("invalid", f"sent a reply it cannot read: {frame}")
    value = frame["ok"]
    if op == "reset":
        problem = prompt_problem(value)
        return value, Failure("invalid", f"reset {problem}") if problem else None
    reply = Reply.read(value)
    return reply, None if reply is not None else Failure("invalid", f"sent a step reply it cannot read: {str(value)[:200]}")


def _named(message: str) -> str:
    return message.replace("reward function", "environment", 1)
