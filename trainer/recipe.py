"""One trainer process's work, read top to bottom: baseline -> training -> final evaluation.

The trainer trains from a local folder and knows nothing of object storage, clouds, budgets or
the run's record: the supervisor (runner/) restores the newest durable checkpoint into
`work/checkpoints` before it starts this process, tells it what to run in a `Plan`, and turns
what it reports (events, one JSON line each) into the record and uploads.

Where a stop request (preemption) is honoured: in `train`, before every step — the one place in
this file — and, inside the trainer, between two tokens while sampling and between evaluation
batches. Either way the last *completed* step is checkpointed and sealed locally, the process
says `Stopped`, and the supervisor makes that checkpoint durable. With several processes
(trainer.distributed) every rank runs this same recipe; the decision to stop, to checkpoint or
to stop for the budget is agreed among them at each step boundary, so all stop at the same
step; rank 0 alone reports events and seals checkpoints.

The plan, the events, the signals and the exit statuses: trainer.protocol.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from grpo_run.checkpoint.manifest import checkpoint_dir
from grpo_run.trainer.checkpointing.checkpointer import Checkpointer
from grpo_run.trainer.distributed import World
from grpo_run.trainer.metrics import LOSS_NOTE
from grpo_run.trainer.protocol import (CHECKPOINTS_DIR, Evaluated, EvalBatch, EvalKind, EvalSummary, Events, Final,
                                       HeldOut, JudgeCalls, PhaseStarted, Plan, SampleGroup, Samples, Sealed, Started,
                                       Step, Stopped, TrainerPhase)
from grpo_run.trainer.sampling.sampler import GenerationInterrupted
from grpo_run.trainer.startup import clock
from grpo_run.trainer.trainer import GRPOTrainer

log = logging.getLogger(__name__)
progress_log = logging.getLogger("grpo_run.trainer.progress")   # the job's log file, not the terminal


@dataclass
class Requests:
    """What the supervisor asks for while the trainer runs (set from signal handlers)."""
    stop: threading.Event = field(default_factory=threading.Event)   # STOP_SIGNAL: stop at the last completed step
    checkpoint: bool = False                                          # CHECKPOINT_SIGNAL: checkpoint at the next step


@dataclass(frozen=True)
class Ending:
    how: str          # done | stopped
    step: int


def run(plan: Plan, work: Path, events: Events, requests: Requests, *, progress: bool = False,
        world: World | None = None, ready: Callable[[], Plan | None] | None = None) -> Ending:
    """The phases the plan asks for, to the end or to a stop. Raises RewardFunctionError when
    the reward function fails on every try, CheckpointFailed when a checkpoint cannot be
    written. `world`: this process's rank among several (default: alone). `ready`: called once
    the model, the graders and the engine are loaded, before anything is read from the checkpoints
    or reported; it blocks until the supervisor has the checkpoint in place and returns the
    attempt's plan (None: the supervisor gave this process up; it stops without a word)."""
    p, world = plan.params, world or World()
    logs = work / "logs" / "trainer.log"
    checkpoints = Checkpointer(work / CHECKPOINTS_DIR, interval=p.saveSteps, keep=plan.keep_checkpoints,
                               meta={"job": plan.name, "run": plan.run_id}, log_file=logs if logs.exists() else None,
                               world=world)
    trainer = None
    try:
        trainer = GRPOTrainer(plan.model, plan.env, p, stop=requests.stop, model_name=plan.model_name, world=world,
                              sandbox_strict=plan.sandbox_strict, judge_calls=plan.judge_calls,
                              judge_usd=plan.judge_usd, work=work)
        checkpoints.attach(trainer)
        if ready is not None:                      # loaded beside the supervisor's checkpoint fetch
            plan = ready()
            if plan is None:
                return Ending("stopped", 0)
        trainer.replays = plan.episode_digests     # a replayed step's episodes must be those recorded

        # baseline: the model as loaded is the base itself (a new LoRA adapter is the identity)
        if plan.baseline:
            events.emit(PhaseStarted(phase=TrainerPhase.BASELINE_EVAL))
            log.info("baseline evaluation on %d held-out tasks", len(plan.env.eval_tasks))
            if evaluate(trainer, plan, "baseline", events) is None:
                return _stopped(events, checkpoints, None, TrainerPhase.BASELINE_EVAL)

        with clock().part("checkpoint load"):
            start = checkpoints.load_latest()
        device = trainer.device
        events.emit(Started(step=start, device=f"cuda:{_gpu_name(device)}" if device.type == "cuda" else "cpu",
                            microBatchSize=trainer.micro_batch_size, cpuThreads=trainer.cpu_threads,
                            sandbox=trainer.sandbox_mode, sampler=trainer.sampler_status(),
                            startup=[dict(p) for p in clock().parts()]))
        if start:
            log.info("resumed from the checkpoint at step %d", start)

        if start < p.maxSteps:
            events.emit(PhaseStarted(phase=TrainerPhase.TRAINING))
        step, why = train(trainer, plan, start, checkpoints, events, requests, progress)
        if why is not None:
            return _stopped(events, checkpoints, step, TrainerPhase.TRAINING, why)

        events.emit(PhaseStarted(phase=TrainerPhase.FINAL_EVAL))
        log.info("final evaluation on the same %d held-out tasks", len(plan.env.eval_tasks))
        if evaluate(trainer, plan, "final", events, step) is None:
            return _stopped(events, checkpoints, step, TrainerPhase.FINAL_EVAL)
        final = checkpoints.save_final(work / "final", step, {"job": plan.name, "final": True, "run": plan.run_id})   # rank 0's
        if final is not None:
            events.emit(Final(step=step, path=str(final)))
        return Ending("done", step)
    finally:
        if trainer is not None:           # a judge's calls count, even those before a failure
            _report_judge_calls(events, trainer)
        _report_sealed(events, checkpoints, checkpoints.close())
        if trainer is not None:
            trainer.close()


def train(trainer: GRPOTrainer, plan: Plan, start: int, checkpoints: Checkpointer, events: Events,
          requests: Requests, progress: bool) -> tuple[int, str | None]:
    """Steps start..maxSteps-1, a checkpoint every saveSteps. Returns (completed steps, why it
    stopped early: "requested" | "deadline" | None)."""
    p, world = plan.params, trainer.world
    bar = _Progress(p.maxSteps, start, progress and world.main, p.numIterations)
    step, last_seconds, eval_seconds = start, 0.0, 0.0
    last_usd = eval_usd = 0.0                          # what the newest step's, evaluation's judge calls cost
    try:
        while step < p.maxSteps:
            # one decision for all processes (each its own answer when alone)
            stop, late = world.agree(requests.stop.is_set(), _late(plan, trainer, last_seconds, last_usd))
            if stop:                                   # preemption: honoured here, between steps
                return step, "requested"
            if late:
                return step, "deadline"                # the next step would end past the budget
            calls, usd = trainer.scorer.judge_calls, _judges_usd(trainer)
            try:
                metrics = trainer.train_step(step)     # sample a group, score, advantages, update
            except GenerationInterrupted:              # ... and between tokens: the step is abandoned
                return step, "requested"
            step += 1
            last_seconds, last_usd = metrics["stepSeconds"], _judges_usd(trainer) - usd
            if trainer.samples:                        # before its Step: a recorded step has its samples
                events.emit(Samples(kind="step", step=step, groups=trainer.samples))
                checkpoints.add_samples(step, [g.model_dump() for g in trainer.samples])
            if calls:                                  # this step's answered calls of each judge
                metrics["judgeCalls"] = {k: n - calls[k] for k, n in trainer.scorer.judge_calls.items()}
            _report_judge_calls(events, trainer)      # before its Step: the step's costUSD counts its calls
            events.emit(Step(step=step, metrics=metrics, episodeDigests=trainer.episode_digests))
            checkpoints.add_metrics(step, metrics)     # every checkpoint holds the metrics so far
            bar.update(step, metrics)
            if step < p.maxSteps:
                asked, requests.checkpoint = requests.checkpoint, False   # a rebalance notice
                asked, = world.agree(asked)
                checkpoints.save(step, force=asked)
            _report_sealed(events, checkpoints, checkpoints.sealed())
            if p.evalSteps and step % p.evalSteps == 0 and step < p.maxSteps:
                late, = world.agree(_late(plan, trainer, eval_seconds, eval_usd))
                if late:
                    log.info("held-out evaluation after step %d skipped: it would end past the budget", step)
                    continue
                t0, usd = time.monotonic(), _judges_usd(trainer)
                try:                                   # the held-out curve while training
                    ev = trainer.evaluate(plan.env.eval_tasks)
                except GenerationInterrupted:          # this step's evaluation is given up, not the step
                    return step, "requested"
                eval_seconds, eval_usd = time.monotonic() - t0, _judges_usd(trainer) - usd
                if ev.samples:
                    events.emit(Samples(kind="heldOut", step=step, groups=list(ev.samples)))
                events.emit(HeldOut(step=step, result=ev.summary()))
                _report_judge_calls(events, trainer)
        return step, None
    finally:
        bar.close()


def evaluate(trainer: GRPOTrainer, plan: Plan, kind: EvalKind, events: Events, step: int = 0) -> EvalSummary | None:
    """The held-out evaluation `kind` (after training step `step`), each batch reported as it is
    finished, its samples just before it; batches an earlier attempt finished are reused. None
    when a stop request interrupted it."""
    def on_batch(i: int, rewards: dict[str, list[float]]) -> None:
        events.emit(EvalBatch(kind=kind, batch=i, rewards=rewards))
        _report_judge_calls(events, trainer)

    def on_samples(groups: list[SampleGroup]) -> None:
        events.emit(Samples(kind=kind, step=step, groups=groups))

    try:
        ev = trainer.evaluate(plan.env.eval_tasks, done=plan.eval_done.get(kind), on_batch=on_batch,
                              on_samples=on_samples)
    except GenerationInterrupted:
        return None
    result = ev.summary()
    if ev.reusedBatches:
        log.info("%s evaluation: %d of %d batches reused from an earlier attempt", kind, ev.reusedBatches, ev.batches)
    log.info("%s held-out mean reward %.3f (%d of %d tasks solved)", kind, ev.meanReward, ev.solved, ev.tasks)
    events.emit(Evaluated(kind=kind, result=result, noSignal=ev.no_signal))
    return result


def _stopped(events: Events, checkpoints: Checkpointer, step: int | None, phase: TrainerPhase,
             reason: str = "requested") -> Ending:
    """Checkpoint the last completed step (unless there is nothing new to keep) and wait until it
    is sealed, then say so: the supervisor makes it durable."""
    if step:
        checkpoints.save(step, force=True)
        if checkpoints.last_saved == step:
            _report_sealed(events, checkpoints, checkpoints.sealed(wait_for=step))
    events.emit(Stopped(step=step, phase=phase, reason=reason))
    return Ending("stopped", step or 0)


def _late(plan: Plan, trainer: GRPOTrainer, seconds: float, usd: float) -> bool:
    """Whether a step or evaluation like the last one (`seconds` long, `usd` of judge calls) would
    end past the budget: the GPU's time and this attempt's judge calls so far count against it."""
    if plan.budget is None:
        return False
    spent = _judges_usd(trainer) - sum(plan.judge_usd.values())      # this attempt's (the plan counts earlier ones)
    return plan.budget.late(time.monotonic() + seconds, spent + usd)


def _judges_usd(trainer: GRPOTrainer) -> float:
    """The run's spend on priced judge calls so far."""
    return sum(trainer.scorer.judge_usd.values())


def _report_judge_calls(events: Events, trainer: GRPOTrainer) -> None:
    if trainer.scorer.judge_calls:
        events.emit(JudgeCalls(calls=trainer.scorer.judge_calls, usd=trainer.scorer.judge_usd))


def _report_sealed(events: Events, checkpoints: Checkpointer, steps: list[int]) -> None:
    for sealed in steps:
        events.emit(Sealed(step=sealed, path=str(checkpoint_dir(checkpoints.root, sealed))))


def _gpu_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device)


class _Progress:
    """The terminal's progress bar, and a line in the job's log every 5% of the steps."""

    def __init__(self, total: int, initial: int, enabled: bool, iterations: int = 1) -> None:
        from tqdm import tqdm

        self.total = total
        # GRPO's loss is ~0 by construction at one update per batch: said where it is printed
        self.loss_note = f" ({LOSS_NOTE})" if iterations == 1 else ""
        self.bar = tqdm(total=total, initial=initial, desc="training", unit="step", disable=not enabled,
                        file=sys.stderr, dynamic_ncols=True, mininterval=0.5)

    def update(self, step: int, m: dict[str, Any]) -> None:
        if step % max(1, self.total // 20) == 0:
            progress_log.info("step %d/%d reward %.3f solved-groups %.2f no-signal-groups %.2f length %.1f "
                              "grad-norm %.4f loss %.4f%s", step, self.total, m["rewardMean"], m["solvedGroups"],
                              m["noSignalGroups"], m["completionLength"], m["gradNorm"], m["loss"], self.loss_note)
            self.loss_note = ""             # said once, on an attempt's first line
        self.bar.update(1)
        self.bar.set_postfix(reward=f"{m['rewardMean']:.3f}", same=f"{m['identicalGroups']:.2f}",
                             len=f"{m['completionLength']:.1f}", refresh=False)

    def close(self) -> None:
        self.bar.close()
