"""TRL's reward functions in the grader worker: which functions have TRL's batched signature, and
the keyword arguments TRL would call them with. Standard library only, as the worker is."""

from __future__ import annotations

import inspect
from typing import Any, Callable


def is_batched(fn: Callable[..., Any]) -> bool:
    """Whether `fn` has TRL's signature, `(prompts, completions, **columns) -> list` (or
    `(completions, **kwargs)`): a parameter named `completions`, or `prompts` first. Anything else
    is called per completion, `fn(completion, task) -> number`."""
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: called per completion
        return False
    return "completions" in names or names[:1] == ["prompts"]


def batch_arguments(fn: Callable[..., Any], items: list) -> dict[str, Any]:
    """The keyword arguments TRL passes a reward function, for these [completion, task] items:
    `prompts` (each task's prompt), `completions` (as text; for a chat prompt, as TRL gives them:
    [{"role": "assistant", "content": TEXT}]) and every other task column as a list (None where a
    task lacks it). Only the parameters `fn` names, unless it takes **kwargs."""
    tasks = [task for _, task in items]
    prompts = [task.get("prompt") for task in tasks]
    completions = [[{"role": "assistant", "content": c}] if isinstance(p, list) else c
                   for (c, _), p in zip(items, prompts)]
    args: dict[str, Any] = {"prompts": prompts, "completions": completions}
    for column in sorted({k for task in tasks for k in task} - {"prompt", "prompts", "completions"}):
        args[column] = [task.get(column) for task in tasks]
    params = inspect.signature(fn).parameters
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return args
    return {k: v for k, v in args.items() if k in params}
