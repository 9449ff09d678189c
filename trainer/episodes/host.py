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
from typing import Any, Mapping, Sequence

from grpo_run.trainer.grader.grader import Grader
from grpo_run.trainer.grader.refs import RewardFunctionError, resolve_ref
from grpo_run.trainer.grader.process import WorkerGone, WorkerOverdue, WorkerProcess
from grpo_run.trainer.grader.replies import Failure
from grpo_run.trainer.grader.calls import MAX_ABS_REWARD
from grpo_run.trainer.episodes.limits import MAX_TOOL_CALLS


class EnvironmentFailed(RewardFunctionError):
    """The episodes environment failed (raised, hung, killed its process, returned something
    that is not a prompt or a Step, did what the sandbox refuses), or cannot be loaded. Like a
    reward function's failure: the job fails as the user's code's, never as a score."""


class EnvironmentHost(Grader):
    """Owns the sandboxed worker that holds one batch of episodes' environment objects.
    `timeout_s`: per call (one `reset`, one `step`). Raises EnvironmentFailed at once when the
    class cannot be loaded or is not an environment (no reset(task, seed), no step(reply))."""

    def __init__(self, ref: str, *, tools: Sequence[str] = (), tool_timeout_s: float | None = None,
                 step_timeout_s: float | None = None, **settings: Any) -> None:
        settings.pop("group", None)
        for name, value in (("tool_timeout_s", tool_timeout_s), ("step_timeout_s", step_timeout_s)):
            if value is not None and not value > 0:
                raise ValueError(f"{name}: must be > 0 (got {value})")
        self._step_timeout_s = step_timeout_s
        self._tools = [resolve_ref(t) for t in tools]
        self._tool_timeout_s = tool_timeout_s or settings.get("timeout_s", 10.0)
        self.tool_schemas: list[dict[str, Any]] = []      # as the worker described the tools, in the job's order
        try:
            super().__init__(ref, episodes=True, **settings)
        except RewardFunctionError as e:
            raise EnvironmentFailed(_named(str(e)), ref=e.ref, kind=e.kind, summary=e.summary) from None

    def _more_config(self) -> dict[str, Any]:
        return {**({"tools": self._tools, "tool_timeout_s": self._tool_timeout_s} if self._tools else {}),
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

    def step(self, episodes: Sequence[int], replies: Sequence[str]) -> list[dict[str, Any]]:
        """Each running episode's Step for its reply: {"observation", "reward", "done"}."""
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
                    failure = frame_problem(op, frame := worker.read(time.monotonic() + wait))
                    if failure is not None:
                        raise self._failed(where[i], failure)
                    out.append(frame["ok"])
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


def frame_problem(op: str, frame: dict) -> Failure | None:
    """A reply frame checked as if a stranger wrote it (the environment's code runs in the
    worker and can write frames itself): None when it is a prompt (reset) or a Step (step)."""
    from grpo_run.trainer.grader.episodes import prompt_problem
    from grpo_run.trainer.grader.replies import outcome

    if frame.keys() != {"ok"}:
        got = outcome(frame)            # the worker's failure frame, or a reply it cannot read
        return got if isinstance(got, Failure) else Failure("invalid", f"sent a reply it cannot read: {frame}")
    value = frame["ok"]
    if op == "reset":
        return Failure("invalid", f"reset {prompt_problem(value)}") if prompt_problem(value) else None
    ok = (isinstance(value, dict) and value.keys() - _TOOL_KEYS == {"observation", "reward", "done"}
          and all(type(value.get(k, 0)) is int and 0 <= value.get(k, 0) <= 10_000 for k in ("toolCalls", "toolErrors"))
          and value.get("truncated", "toolTime") in ("toolTime", "stepTime")
          and isinstance(value["done"], bool) and type(value["reward"]) in (int, float)
          and abs(value["reward"]) <= MAX_ABS_REWARD
          and (value["observation"] is None and value["done"]
               or value["observation"] is not None and not prompt_problem(value["observation"])))
    return None if ok else Failure("invalid", f"sent a step reply it cannot read: {str(value)[:200]}")


def _named(message: str) -> str:
    return message.replace("reward function", "environment", 1)
