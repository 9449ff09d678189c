"""Guess the number: a multi-turn environment (docs/environments.md).

Each episode hides a digit in the range its task's prompt shows ("2-6:" hides one of 2..6),
chosen from the episode's seed, so the G episodes of a group play different numbers. The model answers
with a digit; a wrong guess is answered "+" (the number is higher) or "-" (lower), and the model
guesses again, up to spec.environment.maxTurns times. A right guess ends the episode with reward
1, less 0.25 for every guess before it; a reply that is not a digit is answered ":" and scores 0.
An episode is one token sequence: the model's guesses are trained, the environment's answers
never are.

Deterministic given the task and the seed, as every environment must be: a resumed step replays
the same episodes.
"""

from grpo_run import Step


class Guess:
    def reset(self, task: dict, seed: int) -> str:
        low, high = int(task["low"]), int(task["high"])
        self.secret = low + seed % (high - low + 1)
        self.guesses = 0
        return task["prompt"]

    def step(self, reply: str) -> Step:
        self.guesses += 1
        guess = reply.strip()[:1]
        if not guess.isdigit():
            return Step(observation=":", reward=0.0, done=False)
        if int(guess) == self.secret:
            return Step(observation=None, reward=max(0.0, 1.0 - 0.25 * (self.guesses - 1)), done=True)
        return Step(observation="+" if int(guess) < self.secret else "-", reward=0.0, done=False)
