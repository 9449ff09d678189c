"""What the grader hands its worker: a reward's reference, checked and made absolute, and the
items of a batch, checked to cross the pipe as JSON; and the error a reward function's failure
becomes (RewardFunctionError)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from grpo_run.trainer.grader.replies import FailureKind

_IDENTIFIER_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


class RewardFunctionError(RuntimeError):
    """The user's reward function failed (raised, hung, returned a non-number, or killed its process)
    on every try, or did what the sandbox refuses. str() names the function ref and gives its own
    error.

    Also raised at once, without retries, when the ref cannot be loaded (malformed, module or file
    not found, no such function, the module's top level raised).
    """

    def __init__(
        self, message: str, *, ref: str | None = None, index: int | None = None, kind: FailureKind | None = None,
        summary: str | None = None,
    ) -> None:
        super().__init__(message)
        self.ref = ref  # "pkg.module:function" or "/path/file.py:function"
        self.index = index  # which completion of the batch failed; None for load failures
        self.kind = kind  # how its last try (or its loading) failed; None when the ref is wrong
        # a load failure in one line (FILE:LINE of a syntax error, the names a module defines), for
        # a preflight; the message with the traceback otherwise
        self.summary = summary if summary else message.split("\n", 1)[0]


def resolve_ref(ref: str) -> str:
    """The ref as the worker needs it (file paths absolute); RewardFunctionError when malformed
    or naming a file that does not exist."""
    target, sep, attr_path = ref.rpartition(":")
    if not sep or not target or not _IDENTIFIER_PATH.match(attr_path):
        raise RewardFunctionError(
            f"reward function ref {ref!r} is malformed: expected 'package.module:function' or "
            f"'/path/to/file.py:function'",
            ref=ref,
        )
    if target.endswith(".py") or "/" in target or os.sep in target:
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise RewardFunctionError(
                f"cannot load reward function {ref!r}: no such file {str(path)!r}", ref=ref
            )
        return f"{path}:{attr_path}"
    if not _IDENTIFIER_PATH.match(target):
        raise RewardFunctionError(
            f"reward function ref {ref!r} is malformed: {target!r} is not a module name "
            f"(expected 'package.module:function' or '/path/to/file.py:function')",
            ref=ref,
        )
    return ref


def encode_items(completions: Sequence[str], tasks: Sequence[Mapping[str, Any]]) -> list[list[Any]]:
    items: list[list[Any]] = []
    for i, (completion, task) in enumerate(zip(completions, tasks)):
        if not isinstance(completion, str):
            raise TypeError(f"completions[{i}] is a {type(completion).__name__}; completions must be str")
        task = dict(task)
        try:
            json.dumps(task)
        except (TypeError, ValueError) as error:
            raise TypeError(
                f"tasks[{i}] cannot be sent to the grader process ({error}); tasks must be "
                f"JSON-compatible: dicts, lists, str, numbers, bool, None"
            ) from None
        items.append([completion, task])
    return items
