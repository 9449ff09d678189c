"""Multi-turn episodes: environments that talk back (SPEC §8).

An environment is a class, one object per episode: `reset(task, seed)` gives the first prompt,
`step(reply)` answers each model turn with a `Step` (observation, reward, done). The objects live
in the reward sandbox (`serve`, in the grader's worker; `host`, the trainer's side of it); the
trainer builds each episode as one token sequence with a loss mask beside it (`tokens`, `loop`):
sampled ids and the environment's ids appended, never decoded and re-encoded.

Import-light: the grader's stdlib-only worker imports this package.
"""
