"""The calculator's reward: the episode's answer, after its last tool result, is the task's."""

import re


def final_answer(completion: str, task: dict) -> float:
    """1.0 when the last number of the reply after the last tool result equals the task's answer.
    `completion` is the whole episode's text: its replies and the tools' results, in order."""
    answer = completion.rsplit("</tool_response>", 1)[-1]
    numbers = re.findall(r"-?\d+(?:\.\d+)?", answer)
    return float(bool(numbers) and float(numbers[-1]) == float(task["answer"]))
