"""The episodes' digests of the steps a resume may replay (trainer.episodes.replay): each step's
kept in the record until a durable checkpoint holds the step, and handed to the next trainer in
its plan, which checks that a replayed step's environment answers as it did the first time."""

from __future__ import annotations

import re

from grpo_run.state import values
from grpo_run.state.record import Record

DIGEST = re.compile(r"[0-9a-f]{16}:[0-9a-f]{16}:[0-9a-f]{16}")


def keep(record: Record, step: int, digests: list[str]) -> None:
    saved = values.EPISODE_DIGESTS.get(record)
    saved[str(step)] = digests
    values.EPISODE_DIGESTS.set(record, saved)


def forget_through(record: Record, step: int) -> None:
    """A durable checkpoint holds `step`: no resume replays it or any step before it."""
    saved = values.EPISODE_DIGESTS.get(record)
    if any(int(k) <= step for k in saved if k.isdigit()):
        values.EPISODE_DIGESTS.set(record, {k: v for k, v in saved.items() if k.isdigit() and int(k) > step})


def recorded(record: Record) -> dict[int, list[str]]:
    """{step: its episodes' digests} as the record has them. The record may come from storage,
    which is not trusted: a step whose digests do not read as digests is left out (never checked),
    so a planted record can at worst turn the check off for a step, never fail a run."""
    out = {}
    for step, digests in values.EPISODE_DIGESTS.get(record).items():
        if step.isdigit() and isinstance(digests, list) and all(isinstance(d, str) and DIGEST.fullmatch(d)
                                                                  for d in digests):
            out[int(step)] = digests
    return out
