"""Environments must be deterministic given the task and the seed: a step replayed after a resume
plays the same episodes, or the resumed run is not the run it continues. Each episode of a step
leaves three digests, "PROMPT:REPLY:ANSWER": of the first prompt (reset's), of the first prompt
and the first reply (the sampled ids), and of those and the environment's answer to it (the ids
of its observation; none when it ended the episode). Replayed, an episode must have the same
prompt, and when its first reply is the same, the same answer; when not, the environment answered
alike questions differently (a clock, an unseeded random draw, a counter kept across episodes, a
network call), and the job fails saying so, as the environment's failure. The first turn is where
such an environment shows itself; later turns are not compared (their replies follow from the
answers before them, and a record of every turn would not be small).

The supervisor keeps the digests of the steps a resume may replay (those after the newest durable
checkpoint) in the record, and hands them to the next trainer in its plan."""

from __future__ import annotations

import hashlib
from typing import Mapping, Sequence

import torch

from grpo_run.trainer.distributed import World
from grpo_run.trainer.episodes.loop import Episodes


def _hex(ids: Sequence[int]) -> str:
    return hashlib.blake2b(torch.tensor(list(ids), dtype=torch.int64).numpy().tobytes(), digest_size=8).hexdigest()


def digests(played: Episodes) -> list[str]:
    """Each episode's "PROMPT:REPLY:ANSWER", in the episodes' order."""
    out = []
    for i in range(played.ids.size(0)):
        used = played.mask[i].bool()
        ids, learnt = played.ids[i][used].tolist(), played.loss_mask[i][used].tolist()
        reply_end = next((k for k, sampled in enumerate(learnt) if not sampled), len(ids))
        answer_end = next((k for k in range(reply_end, len(ids)) if learnt[k]), len(ids))
        first = played.prompt_ids[i][played.prompt_mask[i].bool()].tolist()
        out.append(f"{_hex(first)}:{_hex([*first, -1, *ids[:reply_end]])}:{_hex([*first, -1, *ids[:answer_end]])}")
    return out


def checked_digests(step: int, played: Episodes, prompts: Sequence[int], group_size: int,
                    recorded: Mapping[int, Sequence[str]], world: World, ref: str) -> dict[int, str]:
    """This process's episodes' digests by their place in step `step` (0-based; `prompts`: the
    places of its prompts among the step's, each prompt's `group_size` episodes consecutive in
    `played`), checked against those `recorded` when the step was first played, if it was (a
    resume replays it). Raises EnvironmentFailed on every process when the environment answered
    differently on any."""
    from grpo_run.trainer.episodes.host import EnvironmentFailed

    places = [j * group_size + k for j in prompts for k in range(group_size)]
    found = dict(zip(places, digests(played)))
    problem = replay_problem(step + 1, found, recorded.get(step + 1), group_size)
    differs, = world.agree(bool(problem))
    if differs:
        raise EnvironmentFailed(f"environment {ref!r}: {problem or 'a replayed step differs on another process'}",
                                ref=ref, kind="invalid")
    return found


def replay_problem(step: int, now: Mapping[int, str], before: Sequence[str] | None, group_size: int) -> str:
    """Why step `step`'s episodes (`now`: {episode's place in the step: digest}, a group's
    `group_size` consecutive) are not the ones recorded the first time it was played (`before`, in
    the step's order; None: never recorded), or "" when they are (or their replies differ, so their
    observations may too)."""
    if not before:
        return ""
    for place, digest in sorted(now.items()):
        if place >= len(before) or not isinstance(before[place], str):
            continue
        prompt, reply, answer = digest.split(":")
        was = before[place].split(":")
        if len(was) != 3:
            continue
        group, k = divmod(place, group_size)
        where = f"step {step} was replayed after a resume, and episode {k + 1} of its group {group + 1}"
        if prompt != was[0]:
            return f"{where} got another first prompt from reset than the first time: {_FIX}"
        if reply == was[1] and answer != was[2]:
            return f"{where} got another answer from step to the same first reply than the first time: {_FIX}"
    return ""


_FIX = ("the environment is not deterministic given its task and seed, so no resumed run can continue the run it "
        "resumes. Derive everything random from reset's seed (random.Random(seed)), and keep no state across "
        "episodes, no clock and no network in reset and step (docs/environments.md)")
