"""Rewards for examples/custom-reward/job.yaml: the larger of two different digits ("3,7=" -> "7").

A reward is a plain function `(completion: str, task: dict) -> float`. `task` is the task's
row from tasks.jsonl: its `prompt` and every other key (here `answer`). Each runs in the
sandboxed grader, with a time and memory limit; an exception is reported as your code's
crash, never counted as a 0.
"""


def correct(completion: str, task: dict) -> float:
    """1.0 when the completion starts with the right digit."""
    return 1.0 if completion.strip()[:1] == task["answer"] else 0.0


def close(completion: str, task: dict) -> float:
    """Partial credit: 1.0 for the right digit, less the further off a digit is, 0 for no digit.

    A reward that only says right or wrong gives a group of wrong answers nothing to compare;
    this one ranks them, so the model has something to learn from early on."""
    guess = completion.strip()[:1]
    if not guess.isdigit():
        return 0.0
    return 1.0 - abs(int(guess) - int(task["answer"])) / 9
