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

import time
from typing import Any, Mapping, Sequence

from grpo_run.trainer.grader.grader import Grader, RewardFunctionError
from grpo_run.trainer.grader.process import WorkerGone, WorkerOverdue
from grpo_run.trainer.grader.replies import Failure
from grpo_run.trainer.grader.calls import MAX_ABS_REWARD


class EnvironmentFailed(RewardFunctionError):
    """The episodes environment failed (raised, hung, killed its process, returned something
    that is not a prompt or a Step, did what the sandbox refuses), or cannot be loaded. Like a
    reward function's failure: the job fails as the user's code's, never as a score."""


class EnvironmentHost(Grader):
    """Owns the sandboxed worker that holds one batch of episodes' environment objects.
    `timeout_s`: per call (one `reset`, one `step`). Raises EnvironmentFailed at once when the
    class cannot be loaded or is not an environment (no reset(task, seed), no step(reply))."""

    def __init__(self, ref: str, **settings: Any) -> None:
        settings.pop("group", None)
        try:
            super().__init__(ref, episodes=True, **settings)
        except RewardFunctionError as e:
            raise EnvironmentFailed(_named(str(e)), ref=e.ref, kind=e.kind, summary=e.summary) from None

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
            wait = self.timeout_s * 2 + self._kill_grace_s        # a reset is two calls: the class's and reset's
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
        what = {"exception": "raised", "timeout": "timed out", "invalid": "returned what it may not",
                "hung": "hung", "crashed": "killed its process", "refused": "did what the grader refuses"}[failure.kind]
        detail = failure.detail
        if failure.kind == "timeout":
            detail = f"timed out after timeout_s={self.timeout_s:g} s; it was interrupted here:\n{detail}"
        return EnvironmentFailed(f"environment {self.reward_ref!r} {what} in the {where} (not retried: an "
                                 f"environment's state after a failure is unknown):\n{detail.rstrip()}",
                                 ref=self.reward_ref, kind=failure.kind)


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
    ok = (isinstance(value, dict) and value.keys() == {"observation", "reward", "done"}
          and isinstance(value["done"], bool) and type(value["reward"]) in (int, float)
          and abs(value["reward"]) <= MAX_ABS_REWARD
          and (value["observation"] is None and value["done"]
               or value["observation"] is not None and not prompt_problem(value["observation"])))
    return None if ok else Failure("invalid", f"sent a step reply it cannot read: {str(value)[:200]}")


def _named(message: str) -> str:
    return message.replace("reward function", "environment", 1)
