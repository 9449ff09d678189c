"""Reward functions of the catalog's math environment (`gsm8k`), run in the grader's process.

`math_correct` reads the completion's final answer (the last `\\boxed{...}`, else the last
number) and checks it against the task's reference with math-verify, the library the community
uses for this (`72`, `72.0`, `\\frac{144}{2}` all equal 72). `boxed_format` rewards the answer
format the prompt asks for. Both are `reward(completion, task) -> float`.

math-verify's own time limits use SIGALRM, which would replace the grader's per-completion alarm;
they are turned off here, and the grader's limit (`rewardTimeoutSeconds`) bounds each call.
No torch here: the grader's worker imports this module and nothing else of the trainer.
"""

from __future__ import annotations

import logging
import re
from typing import Any

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")

logging.getLogger("math_verify").setLevel(logging.ERROR)   # "timeout is disabled": the grader times calls


def last_boxed(text: str) -> str | None:
    """The contents of the last `\\boxed{...}` in `text` (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j].strip()
    return None


def final_answer(text: str) -> str | None:
    """What a completion answers: the last `\\boxed{...}`, else its last number (commas dropped)."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def reference_answer(answer: str) -> str:
    """GSM8K's reference: the text after `####` (worked solution before it), commas dropped."""
    return answer.rsplit("####", 1)[-1].strip().replace(",", "")


def math_correct(completion: str, task: dict[str, Any]) -> float:
    """1.0 when the completion's final answer equals the task's `answer` (GSM8K's `#### N` or a
    bare value) by math-verify, else 0.0."""
    from math_verify import parse, verify

    predicted = final_answer(completion)
    if predicted is None:
        return 0.0
    gold = parse(f"${reference_answer(str(task['answer']))}$", parsing_timeout=None)
    guess = parse(f"${predicted}$", parsing_timeout=None)
    return 1.0 if gold and guess and verify(gold, guess, timeout_seconds=None) else 0.0


def boxed_format(completion: str, task: dict[str, Any]) -> float:
    """1.0 when the completion gives exactly one `\\boxed{...}` answer, else 0.0."""
    return 1.0 if completion.count("\\boxed{") == 1 and last_boxed(completion) else 0.0
