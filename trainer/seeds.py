"""Every seed of a run, from the job's `seed` through one mixing function.

Each seed is `mix` of a parent seed and a place (a step, a prompt's position, a completion, a
turn), with constants of its own so no two kinds of seed coincide. Derived from the parent and the
place alone, a seed needs no state: a resumed step, an evaluation batch computed by another
attempt, or a prompt sampled on another number of processes draws exactly what it drew before.

Standard library only: the episode loop, the engines and the trainer all derive theirs here."""

from __future__ import annotations

MODULUS = 2**63 - 1          # within a signed 64-bit integer: torch's generators and vLLM's seeds take it


def mix(parent: int, place: int, parent_factor: int, place_factor: int, offset: int) -> int:
    """The seed of `place` under `parent`: an affine mix modulo MODULUS (distinct factors per kind)."""
    return (parent * parent_factor + place * place_factor + offset) % MODULUS


def step_seed(seed: int, step: int) -> int:
    """Step `step` of a run seeded `seed` (evaluation batch i uses step -1 - i)."""
    return mix(seed, step, 1_000_003, 7919, 17)


def prompt_seed(seed: int, step: int, position: int) -> int:
    """The sampling seed of the prompt at `position` (0-based) among step `step`'s: its group's."""
    return mix(step_seed(seed, step), position, 1_000_033, 104_729, 1)


def member_seed(block_seed: int, index: int) -> int:
    """Member `index` (0-based) of a block seeded `block_seed`: completion k of a prompt's group
    (an episode: its environment's reset gets it), or a request of an engine's block."""
    return mix(block_seed, index, 1_000_037, 15_485_863, 3)


def turn_seed(episode: int, turn: int) -> int:
    """The sampling seed of turn `turn` (0-based) of the episode seeded `episode`."""
    return mix(episode, turn, 1_000_039, 32_452_843, 5)
