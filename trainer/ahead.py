"""Asynchronous GRPO (spec.parameters.staleness N > 0): step k trains on rollouts that the policy of
step k-N drew, sampled by a producer (a process on a CPU, trainer.producer; a thread on a GPU)
while steps k-N..k-1 updated.

The schedule, fixed and never decided by timing: the policy *version* v is the weights after v
completed steps; step k's rollouts are drawn by version `drawing_version(k, N)` = max(0, k-N)
(the first N steps are drawn by the initial adapter). At the start of step k the trainer's live
adapter is version k: it is copied (a snapshot: the update may change the live adapter at once)
and the producer is handed step k+N to draw with it, while the main thread waits for step k's
rollouts and trains on them. What a step draws depends on its step, its seeds and the version's
bytes only, so the run is the same whatever the speeds of the two sides.

On a CPU the producer is a spawned process (trainer.producer): the tiny models' kernels last
microseconds, so a thread and the update would take turns holding Python's interpreter lock and
nothing would overlap. It loads the same model folder, and each request carries the drawing
version's adapter tensors with the step's prompts and seeds; it replies the Rollouts with their
recorded log-probabilities. On a GPU the producer is a thread, which samples with a *draft*: a
copy of the policy whose base weights are the live model's own tensors (shared, never written) and
whose adapter tensors are its own, into which each version's snapshot is copied before it draws.
Either records each drawn token's log-probability
(trainer.sampling.sampler's `logprobs`), against which the update weights the tokens
(trainer.update: truncated importance sampling, spec.parameters.stalenessImportanceCap).

In flight after k completed steps: steps k..k+N-1, drawn (or being drawn) by versions
max(0, k-N)..k-1. A checkpoint holds those versions' adapters (`inflight`), not the rollouts: a
resume draws them again, the same tokens from the same bytes, so a kill or a notice at any moment
ends where the uninterrupted run ends, and every task is trained once per epoch. A stop request
(a notice) aborts the producer's sampling between two tokens, as it does the synchronous run's
(the process: a shared event, set while the trainer waits for a step and on close).

On a CPU the update and the producer process split the trainer's threads (`split_threads`): on 2
cores one each, where the synchronous run's second thread bought ~10% (trainer.threads' table).
"""

from __future__ import annotations

import copy
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Mapping, Sequence

import torch

from grpo_run.trainer.envs.tasks import Task
from grpo_run.trainer.producer import Drawn, ProducerProcess
from grpo_run.trainer.rollout import Rollout, Rollouts

Weights = dict[str, torch.Tensor]


def drawing_version(step: int, staleness: int) -> int:
    """The policy version (completed steps) that draws step `step`'s (0-based) rollouts."""
    return max(0, step - staleness)


def split_threads(total: int) -> tuple[int, int]:
    """(the update's threads, the producer's) out of a trainer's `total` CPU threads."""
    producer = max(1, total // 2)
    return max(1, total - producer), producer


def draft_of(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` for the producer: its trainable tensors (the adapter) copied, every
    other tensor (the frozen base, buffers) shared with `model`. Made before anything sampled
    with `model` (a kept decoder would be copied with it)."""
    shared = {id(t): t for t in model.parameters() if not t.requires_grad}
    shared.update({id(b): b for b in model.buffers()})
    draft = copy.deepcopy(model, memo=dict(shared))
    for param in draft.parameters():
        param.requires_grad_(False)
    draft.eval()
    return draft


class _Either:
    """A stop flag that is set when any of its flags answers true (the run's stop request, or the
    producer's close)."""

    def __init__(self, *flags: Callable[[], bool]) -> None:
        self.flags = flags

    def is_set(self) -> bool:
        return any(flag() for flag in self.flags)


class Ahead:
    """The producer and its schedule (see the module's docstring).

    `live`: the trainer's adapter tensors by name (they change in place as it trains);
    `draft`: the draft's adapter tensors by the same names; `rollout`: plays with the draft;
    `group`: step j's tasks (each prompt G times) and seeds; `threads`: the producer's torch threads.
    `process` (a CPU): the producer process (trainer.producer) draws instead of the thread, and
    `draft`/`rollout`/`closing` are not used."""

    def __init__(self, staleness: int, max_steps: int, *, live: Callable[[], Mapping[str, torch.Tensor]],
                 draft: Mapping[str, torch.Tensor] | None, rollout: Rollout | None,
                 group: Callable[[int], tuple[Sequence[Task], Sequence[int]]], temperature: float,
                 threads: int, closing: threading.Event, process: ProducerProcess | None = None) -> None:
        self.n, self.max_steps, self.live, self.draft = staleness, max_steps, live, draft
        self.rollout, self.group, self.temperature, self.closing = rollout, group, temperature, closing
        self.versions: dict[int, Weights] = {}          # version -> its adapter snapshot
        self.pending: dict[int, Future | Drawn] = {}    # step -> its rollouts being drawn
        self.started = False
        self.process = process
        self.pool = None if process is not None else ThreadPoolExecutor(
            1, thread_name_prefix="grpo-run-producer", initializer=torch.set_num_threads, initargs=(threads,))

    def restore(self, versions: Mapping[int, Mapping[str, torch.Tensor]]) -> None:
        """A checkpoint's in-flight versions (before the first `take`)."""
        self.versions = {int(v): dict(w) for v, w in versions.items()}

    def take(self, step: int) -> tuple[Rollouts, int]:
        """Step `step`'s rollouts and the version that drew them, once they are drawn. Before
        waiting, hands the producer step step+N, drawn by the live adapter as it is now (version
        `step`). Raises what the drawing raised (GenerationInterrupted on a stop request)."""
        self.versions[step] = {k: t.detach().clone() for k, t in self.live().items()}
        if not self.started:         # the first step of this attempt: steps step..step+N-1, as scheduled
            self.started = True
            for j in range(step, min(step + self.n, self.max_steps)):
                self._submit(j)
        if step + self.n < self.max_steps:
            self._submit(step + self.n)
        if step not in self.pending:     # never dropped: a taken step is trained or the attempt ends
            self._submit(step)
        batch = self.pending.pop(step).result()
        oldest = drawing_version(step + 1, self.n)          # what the next checkpoint and draws still need
        for v in [v for v in self.versions if v < oldest]:
            del self.versions[v]
        return batch, drawing_version(step, self.n)

    def inflight(self, completed: int) -> dict[int, Weights]:
        """The versions that draw steps completed..completed+N-1: what a checkpoint after
        `completed` steps holds, so a resume draws them again."""
        need = {drawing_version(j, self.n) for j in range(completed, min(completed + self.n, self.max_steps))}
        missing = need - self.versions.keys()
        if missing:
            raise RuntimeError(f"policy versions {sorted(missing)} in flight are not kept (a checkpoint after "
                               f"step {completed} needs them)")
        return {v: self.versions[v] for v in sorted(need)}

    def _submit(self, step: int) -> None:
        version = drawing_version(step, self.n)
        if version not in self.versions:
            raise ValueError(f"step {step + 1} is drawn by the policy of step {version}, which the checkpoint "
                             f"resumed from does not hold (written with another spec.parameters.staleness?)")
        self.pending[step] = self._send(step, self.versions[version])

    def _send(self, step: int, weights: Mapping[str, torch.Tensor]) -> Future | Drawn:
        """Hands step `step` to the producer, to be drawn with `weights` (a version's adapter)."""
        if self.process is not None:
            tasks, seeds = self.group(step)
            return self.process.submit(step, weights, tasks, seeds, self.temperature)
        return self.pool.submit(self._draw, step, weights)

    def _draw(self, step: int, weights: Mapping[str, torch.Tensor]) -> Rollouts:
        """In the producer's thread: the version's adapter into the draft, then step `step`'s group."""
        with torch.no_grad():
            for name, tensor in self.draft.items():
                tensor.copy_(weights[name])
        tasks, seeds = self.group(step)
        return self.rollout.play(tasks, seeds, self.temperature)

    def close(self) -> None:
        """Abandons what is being drawn (between two tokens) and what is queued."""
        self.closing.set()
        if self.process is not None:
            self.process.close()
        else:
            self.pool.shutdown(wait=True, cancel_futures=True)


def either(*flags: Callable[[], bool]) -> _Either:
    """A stop flag for the draft's rollout, asked between two tokens: e.g. the run's stop request
    (looked up at every call: whoever stands in for it later is asked), or the producer's close."""
    return _Either(*flags)
