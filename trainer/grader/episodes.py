"""The environment's side of episodes, inside the grader's sandboxed worker
(`grpo_run.trainer.grader.worker` started with "episodes": true): one object of the user's class
per episode, `reset` and `step` each called under the per-call time limit, what they return
checked and sent back as frames. Standard library only, as the worker is.

Conversation (after the worker's "sandbox" and "ready" frames, as for rewards):
    parent -> worker  {"op": "reset", "items": [[task, seed], ...]}   a new batch of episodes: the
                      objects of the one before are dropped; episode i is item i
    worker -> parent  {"ok": PROMPT} per item (text, or [{"role", "content"}, ...]), in order
    parent -> worker  {"op": "step", "items": [[i, reply], ...]}       the running episodes' replies
    worker -> parent  {"ok": {"observation": TEXT | MESSAGES | null, "reward": FLOAT, "done": BOOL}}
                      (a reply the tools answered: and "toolCalls": N, "toolErrors": N; a tool past its
                      time limit: "done": true, "truncated": "toolTime"; a step past stepTimeoutSeconds,
                      when the job sets it: "done": true, "truncated": "stepTime")
Either answer stops at the first failure, {"kind": "exception"|"timeout"|"invalid"|"refused",
"error": TEXT}, as a reward's does; the parent never goes on with that batch (the environment's
state after a failure is unknown).
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable

from grpo_run.trainer.grader.calls import RewardTimeout, call_with_alarm, failed_reply, shown, as_reward
from grpo_run.trainer.grader.tools import ToolTime, answer_calls, tool_calls


def class_problem(cls: Any) -> str:
    """Why `cls` cannot be an episodes environment ("" when it can): a class whose objects are
    made without arguments, with `reset(task, seed)` and `step(reply)`."""
    if not inspect.isclass(cls):
        name = getattr(cls, "__name__", type(cls).__name__)
        return f"{name} is a {type(cls).__name__}, not a class with reset(task, seed) and step(reply)"
    problems = []
    try:
        inspect.signature(cls).bind()
    except TypeError:
        problems.append(f"{cls.__name__}() must take no arguments (one object is made per episode)")
    except ValueError:
        pass                        # a signature inspect cannot read (a C type): found out when called
    for name, args, wanted in (("reset", ({}, 0), "reset(self, task: dict, seed: int)"),
                               ("step", ("",), "step(self, reply: str)")):
        method = getattr(cls, name, None)
        if not callable(method):
            problems.append(f"{cls.__name__} has no method {wanted}")
            continue
        try:
            inspect.signature(method).bind(None, *args)
        except TypeError:
            problems.append(f"{cls.__name__}.{name} must be {wanted} (it is {name}{inspect.signature(method)})")
        except ValueError:
            pass
    return "; ".join(problems)


def prompt_problem(value: Any) -> str:
    """Why `value` cannot be a prompt or an observation's messages ("" when it can): text, or a
    non-empty list of {"role": text, "content": text} messages."""
    if isinstance(value, str):
        return ""
    if isinstance(value, list) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            and all(isinstance(k, str) for k in m) for m in value):
        return ""
    return (f"returned {shown(value)} ({type(value).__name__}); expected text or chat messages like "
            "[{\"role\": \"user\", \"content\": \"...\"}]")


def as_step(value: Any) -> dict:
    """A Step (or anything with observation, reward and done attributes, or a dict with those
    keys) as a frame's payload; raises TypeError/ValueError saying what is wrong."""
    fields = value if isinstance(value, dict) else {k: getattr(value, k) for k in ("observation", "reward", "done")
                                                     if hasattr(value, k)}
    if set(fields) != {"observation", "reward", "done"}:
        raise TypeError(f"returned {shown(value)} ({type(value).__name__}); step must return "
                        "grpo_run.Step(observation=..., reward=..., done=...)")
    done, observation = fields["done"], fields["observation"]
    if not isinstance(done, bool):
        raise TypeError(f"returned a Step whose done is {shown(done)} ({type(done).__name__}); done must be "
                        "True or False")
    if observation is None and not done:
        raise ValueError("returned a Step with observation None and done False; an episode that goes on needs "
                         "an observation for the model to read")
    if observation is not None and prompt_problem(observation):
        raise TypeError(f"returned a Step whose observation {prompt_problem(observation)}")
    try:
        reward = as_reward(fields["reward"])
    except (TypeError, ValueError) as error:
        raise type(error)(f"returned a Step whose reward {str(error).removeprefix('returned ')}") from None
    return {"observation": observation, "reward": reward, "done": done}


def serve_episodes(cls: type, read: Callable[[], dict | None], write: Callable[[dict], None], timeout_s: float,
                   cleanup: Callable[[], None], *, tools: dict[str, Callable[..., Any]] | None = None,
                   tool_timeout_s: float | None = None, step_timeout_s: float | None = None,
                   tool_format: str | dict = "hermes") -> None:
    """Answer the parent's requests until it closes the pipe. `cleanup`: ends what a call left
    running (the worker's own, after each call). `tools`: a reply that calls them is answered by
    them (grpo_run.trainer.grader.tools), each call under `tool_timeout_s`; the others go to `step`.
    `tool_format`: how the model writes a call (grader.tools.TOOL_FORMATS), chosen by the trainer
    from the model's chat template.
    `step_timeout_s`: a `step` past it ends its episode ("stepTime") instead of failing the batch."""
    worker_pid = os.getpid()
    episodes: list[Any] = []
    while (request := read()) is not None:
        if request.get("op") == "reset":
            episodes = []
        for item in request["items"]:
            result = _reset(cls, episodes, *item, timeout_s) if request["op"] == "reset" else \
                _step(episodes, *item, timeout_s, tools, tool_timeout_s or timeout_s, step_timeout_s, tool_format)
            if os.getpid() != worker_pid:
                os._exit(0)          # a copy forked below Python returned here: only the worker answers
            cleanup()
            write(result)
            if "ok" not in result:
                break


def _reset(cls: type, episodes: list[Any], task: dict, seed: int, timeout_s: float) -> dict:
    episodes.append(None)
    try:
        env = call_with_alarm(cls, timeout_s)
        prompt = call_with_alarm(lambda: env.reset(task, seed), timeout_s)
    except BaseException as error:
        return failed_reply(error)
    problem = prompt_problem(prompt)
    if problem:
        return {"kind": "invalid", "error": f"reset {problem}"}
    episodes[-1] = env
    return {"ok": prompt}


def _step(episodes: list[Any], index: int, reply: str, timeout_s: float,
          tools: dict[str, Callable[..., Any]] | None = None, tool_timeout_s: float = 0.0,
          step_timeout_s: float | None = None, tool_format: str | dict = "hermes") -> dict:
    env = episodes[index] if 0 <= index < len(episodes) else None
    if env is None:
        return {"kind": "invalid", "error": f"episode {index} has ended or was never started"}
    calls = tool_calls(reply, tool_format) if tools else []
    if calls:                                      # the tools answer; the environment does not see this reply
        try:
            messages, errors = answer_calls(tools, calls, tool_timeout_s)
        except ToolTime:
            episodes[index] = None
            return {"ok": {"observation": None, "reward": 0.0, "done": True, "truncated": "toolTime",
                           "toolCalls": len(calls), "toolErrors": 1}}
        return {"ok": {"observation": messages, "reward": 0.0, "done": False, "toolCalls": len(calls),
                       "toolErrors": errors}}
    try:
        value = call_with_alarm(lambda: env.step(reply), step_timeout_s or timeout_s)
    except RewardTimeout as error:
        if step_timeout_s is None:
            return failed_reply(error)
        episodes[index] = None                     # its state after the interrupt is unknown: it ends here
        return {"ok": {"observation": None, "reward": 0.0, "done": True, "truncated": "stepTime"}}
    except BaseException as error:
        return failed_reply(error)
    try:
        step = as_step(value)
    except (TypeError, ValueError) as error:
        return {"kind": "invalid", "error": f"step {error}"}
    if step["done"]:
        episodes[index] = None
    return {"ok": step}
