"""`grpo_run.Step`: what an environment's `step(reply)` returns. Standard library only: the
environment's module imports it inside the grader's sandboxed worker.

    from grpo_run import Step

    class Guess:
        def reset(self, task: dict, seed: int) -> str:
            self.secret = task["secret"]
            return "guess:"
        def step(self, reply: str) -> Step:
            if reply.strip() == str(self.secret):
                return Step(observation=None, reward=1.0, done=True)
            return Step(observation="+" if int(reply) < self.secret else "-", reward=0.0, done=False)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

Message = dict[str, Any]
Observation = Union[str, list[Message], None]


@dataclass(frozen=True)
class Step:
    """One environment turn's answer to the model's reply.

    observation: what the model reads next (text, or chat messages such as
        [{"role": "user", "content": "higher"}]); None when the episode is done.
    reward: this turn's reward; the episode's reward is the sum over its turns (plus any reward
        functions of the job, applied to the whole episode).
    done: the episode ends here.
    """

    observation: Observation = None
    reward: float = 0.0
    done: bool = False
