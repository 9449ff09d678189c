"""Held-out evaluation: every held-out task answered once (greedy by default), scored by the
run's graders, in batches of evalBatchSize that a stopped attempt's successor reuses.

Each batch draws from its own generator, seeded from (seed, i), so a batch computes the same
whichever batches came before it: the batches an earlier attempt finished are taken as they are.
The trainer's rollout answers (trainer.rollout: a completion, or an episode played to its end, per
task); this module decides which batches, keeps the first tasks' completions for people to read,
gathers several processes' batches and sums up."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, ContextManager, Mapping, Protocol, Sequence

import numpy as np

from grpo_run.trainer import kept_samples
from grpo_run.trainer.config import GRPOParams
from grpo_run.trainer.distributed import World
from grpo_run.trainer.envs.tasks import Task
from grpo_run.trainer.grader.scoring import Scorer
from grpo_run.trainer.protocol import EvalSummary, SampleGroup
from grpo_run.trainer.rollout import Rollout
from grpo_run.trainer.sampling.sampler import GenerationInterrupted
from grpo_run.trainer.seeds import step_seed


@dataclass(frozen=True)
class EvalResult:
    """One evaluation as the trainer computed it: the figures everyone keeps (`summary`), and
    what only this attempt has (each task's total, the completions it kept)."""
    meanReward: float           # of the weighted sum
    tasks: int
    solved: int                 # tasks the primary (first) reward scored 1.0
    rewards: tuple[float, ...]  # the weighted sum per task
    batches: int = 1            # evaluation batches in all
    reusedBatches: int = 0      # of them, finished by an earlier attempt and not computed again
    byReward: Mapping[str, float] | None = None   # each reward function's mean
    samples: tuple[SampleGroup, ...] = ()         # the completions for the first sampleEvalTasks tasks computed here

    @property
    def no_signal(self) -> bool:
        """All held-out rewards equal: at 0% or 100% GRPO's groups would all be identical."""
        return len(set(self.rewards)) <= 1

    def summary(self) -> EvalSummary:
        """The figures the record, the trackers and the baseline cache keep (rounded to 6 places)."""
        return EvalSummary(meanReward=round(self.meanReward, 6), tasks=self.tasks, solved=self.solved,
                           batches=self.batches, reusedBatches=self.reusedBatches,
                           rewards=None if self.byReward is None else {k: round(v, 6) for k, v in self.byReward.items()})


class Answerer(Protocol):
    """What an evaluation needs of a trainer (trainer.trainer.GRPOTrainer is one)."""
    params: GRPOParams
    world: World
    stop: threading.Event
    scorer: Scorer

    rollout: Rollout

    def sampling_weights(self) -> ContextManager[float]: ...


def evaluate(trainer: Answerer, tasks: Sequence[Task], *,
             done: Mapping[int, Mapping[str, Sequence[float]]] | None = None,
             on_batch: Callable[[int, dict[str, list[float]]], None] | None = None,
             on_samples: Callable[[list[SampleGroup]], None] | None = None) -> EvalResult:
    """Mean reward of `trainer`'s policy on held-out `tasks`, in batches of evalBatchSize. Batch
    i's scores in `done` (from an attempt that was stopped part-way) are taken as they are; every
    batch computed here goes to `on_batch(i, {reward: scores})`. Raises GenerationInterrupted on a
    stop request between batches or between two tokens; the batches finished before it were
    reported. Several processes: batch i is computed by rank i mod world size, all are gathered at
    the end (a stop request on any rank stops all there) and rank 0's `on_batch` gets each. The
    completions for the first sampleEvalTasks tasks go to `on_samples` before their batch's
    `on_batch`, and into the result's `samples` (those computed here)."""
    p, done, world, scorer = trainer.params, done or {}, trainer.world, trainer.scorer
    starts = range(0, len(tasks), p.evalBatchSize)
    computed: dict[int, dict[str, list[float]]] = {}
    kept: dict[int, list[SampleGroup]] = {}      # batch -> its tasks among the first sampleEvalTasks
    stopped = False
    try:
        with trainer.sampling_weights():
            for i, start in enumerate(starts):
                if i in done or i % world.size != world.rank:
                    continue
                if trainer.stop.is_set():            # preemption honoured between evaluation batches
                    raise GenerationInterrupted()
                chunk = list(tasks[start:start + p.evalBatchSize])
                # batch i draws from generators seeded from (seed, i) alone
                answers = trainer.rollout.play(chunk, [step_seed(p.seed, -1 - i)], p.evalTemperature)
                computed[i] = scorer.score(answers.texts, chunk,
                                           episode=answers.episode_rewards() if scorer.episodes else None)
                # an answer's length: all its tokens (an episode's observations among them)
                kept[i] = kept_samples.eval_items(start, answers.prompts, answers.texts, computed[i],
                                                  scorer.total(computed[i]), answers.mask.sum(1).tolist(),
                                                  answers.ended.tolist(), p.sampleEvalTasks, scorer.primary,
                                                  **answers.episode_view(trainer.rollout.decode_ids))
                if on_samples is not None and kept[i]:
                    on_samples(kept[i])
                if on_batch is not None:
                    on_batch(i, computed[i])
    except GenerationInterrupted:
        if not world.distributed:
            raise
        stopped = True                               # the others still come to the gather below
    if world.distributed:
        # JSON between ranks (trainer.distributed): batch numbers as pairs, samples as their JSON form
        shares = world.gather([stopped, sorted(computed.items()),
                               [(i, [g.model_dump(mode="json") for g in gs]) for i, gs in sorted(kept.items())]])
        for rank, (_, theirs, their_samples) in enumerate(shares):
            if rank == world.rank:
                continue
            theirs = dict(theirs)
            their_samples = {i: [SampleGroup.model_validate(g) for g in gs] for i, gs in their_samples}
            computed.update(theirs)
            kept.update(their_samples)
            for i, batch in theirs.items():
                if on_samples is not None and their_samples.get(i):
                    on_samples(their_samples[i])
                if on_batch is not None:
                    on_batch(i, batch)
        if any(s for s, _, _ in shares):
            raise GenerationInterrupted()
    by_reward: dict[str, list[float]] = {name: [] for name in scorer.names}
    for i in range(len(starts)):
        batch = done[i] if i in done else computed[i]
        for name in by_reward:
            by_reward[name] += list(batch[name])
    totals = scorer.total(by_reward)
    return EvalResult(meanReward=float(np.mean(totals)), tasks=len(tasks),
                      solved=sum(1 for r in by_reward[scorer.primary] if r == 1.0), rewards=tuple(totals),
                      batches=len(starts), reusedBatches=sum(1 for i in range(len(starts)) if i in done),
                      byReward={k: float(np.mean(v)) for k, v in by_reward.items()},
                      samples=tuple(g for i in sorted(kept) for g in kept[i]))
