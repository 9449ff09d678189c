"""One trainer process, from its plan to how it ended. What the two processes say to each other
is trainer.protocol; this is the supervisor's side of it:

    plan       what the books already have: the cached baseline, the evaluation batches an earlier
               attempt finished, the first trainer's micro-batch size, the budget as a deadline
    spawn      its own session (a terminal's Ctrl-C reaches the supervisor only, which decides), the
               events pipe, the thread pool; alone, or one rank per GPU under accelerate's launcher
               (runner.supervisor.spawn); alone it is started before the checkpoint fetch and loads
               beside it, then goes on when told (`go`)
    events     read on a pipe by one thread, each into the books or an upload
    signals    STOP_SIGNAL at a notice (then a kill when the window runs out), CHECKPOINT_SIGNAL at a
               rebalance recommendation, once the trainer listens
    outcome    its exit status and its last words, read as one of done, stopped, deadline, disk
               full, code error, infrastructure, crashed
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from grpo_run.trainer.startup import clock
from grpo_run.checkpoint.storage.fsio import atomic_write_bytes
from grpo_run.checkpoint.storage.lease import LeaseLost
from grpo_run.checkpoint.storage.store import StorageConfigError, StorageUnavailable
from grpo_run.runner.books.books import Books
from grpo_run.runner.books.fingerprint import baseline_fingerprint, final_fingerprint
from grpo_run.runner.notices.monitor import Notice
from grpo_run.runner.supervisor.diskfull import unless_disk_full
from grpo_run.runner.supervisor.durability import Durability
from grpo_run.runner.supervisor import startup
from grpo_run.runner.supervisor.runspec import RunSpec
from grpo_run.runner.supervisor.spawn import PrewarmedTrainer, Spawned, launched, start_trainer
from grpo_run.runner.supervisor.watchdog import Watchdog, configured_bound_s, sandboxed_calls
from grpo_run.state.phases import InvalidTransition, Phase
from grpo_run.runner.estimate.config import model_config
from grpo_run.trainer.sampling.choice import decide, missing_engine, node_has_gpu
from grpo_run.trainer.protocol import (CHECKPOINT_SIGNAL, CHILD_CODE_ERROR, CHILD_DONE, CHILD_INFRA_FAILED, CHILD_NO_GROUP,
                                       RENDEZVOUS_TIMEOUT_ENV,
                                       CHILD_STOPPED, PLAN_FILE, STOP_SIGNAL, EvalBatch, Evaluated, Failed, Final, HeldOut, JudgeCalls,
                                       PhaseStarted, Plan, Samples, Sealed, Started, Step, Stopped, TrainerEvent,
                                       TrainerPhase, parse_event)

log = logging.getLogger(__name__)

# The record's phase for each phase a trainer reports: the one place the two are tied (the
# trainer cannot import the record; runner sees both).
RECORD_PHASE: Mapping[TrainerPhase, Phase] = {
    TrainerPhase.BASELINE_EVAL: Phase.BASELINE_EVAL,
    TrainerPhase.TRAINING: Phase.TRAINING,
    TrainerPhase.FINAL_EVAL: Phase.FINAL_EVAL,
}


class SamplerUnavailable(Exception):
    """The run's sampling engine cannot sample on this node (its message says why and what to do)."""


class CheckpointRequest:
    """A rebalance recommendation, delivered as CHECKPOINT_SIGNAL to a trainer that listens (it
    sent an event, so its handler is installed: before that the signal's default action would
    kill it). One made while no trainer listens waits for the next that does."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._asked = False
        self._listener: subprocess.Popen | None = None

    def ask(self, notice: Notice) -> None:
        log.info("rebalance recommendation from %s: checkpointing early", notice.source)
        with self._lock:
            self._asked = True
            self._deliver()

    def set_listener(self, proc: subprocess.Popen | None) -> None:
        with self._lock:
            self._listener = proc
            self._deliver()

    def _deliver(self) -> None:      # with _lock held
        if self._asked and self._listener is not None and self._listener.poll() is None:
            self._listener.send_signal(CHECKPOINT_SIGNAL)
            self._asked = False


@dataclass
class LastWords:
    """What the trainer said about how it ended."""
    stopped: Stopped | None = None
    failed: Failed | None = None
    final: Final | None = None


class How(str, enum.Enum):
    """How a trainer process ended (Outcome.how)."""
    DONE = "done"                       # trained and evaluated: its final weights are sealed
    STOPPED = "stopped"                 # stopped when asked (a notice, a cancel), at a completed step
    DEADLINE = "deadline"               # stopped itself before a step would pass maxCostUSD
    DISK_FULL = "disk full"             # the work folder's disk is full: restarting cannot help
    CODE_ERROR = "code error"           # the job's own code failed (a reward): the same input fails the same way
    INFRASTRUCTURE = "infrastructure"   # a service the run calls (a judge) did not answer
    CRASHED = "crashed"                 # died, was killed, or raised unexpectedly
    BROKEN = "broken"                   # disagreed with the job's record: nothing it did after is trusted

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Outcome:
    how: How
    message: str = ""         # disk full, code error, infrastructure, crashed, broken: why
    step: int = 0             # deadline: the last completed step


class TrainerProcess:
    """One trainer process of an attempt (several, under accelerate's launcher, seen as one)."""

    def __init__(self, spec: RunSpec, work: Path, books: Books, durability: Durability, *,
                 checkpoints: CheckpointRequest, wake: threading.Event,
                 prewarmed: PrewarmedTrainer | None = None) -> None:
        self.spec, self.work, self.books, self.durability = spec, Path(work), books, durability
        self.prewarmed = prewarmed        # a trainer process started early, to take if it fits (runner.supervisor.spawn)
        self._spawned: Spawned | None = None
        self._plan_sent: Plan | None = None
        self.checkpoints = checkpoints
        self.done = threading.Event()     # it exited and every event it sent is handled
        self.last_words = LastWords()
        # A phase the record cannot move to (InvalidTransition): the trainer and the record disagree
        # on where the run is (a tampered record or checkpoint); the attempt ends, nothing more of
        # this trainer is recorded.
        self.broken: str | None = None
        self._wake = wake                 # the supervisor's: set with `done`
        self._proc: subprocess.Popen | None = None
        self._listens = False
        functions = sandboxed_calls(spec.env, spec.params.rewardTimeoutSeconds)
        judges = [r.judge for r in spec.env.rewards if r.judge is not None]
        self.watchdog = Watchdog(spec.params, functions, judges=judges, fixed_s=configured_bound_s())   # silence: a hang
        self._fingerprints: dict[str, str] = {}
        self._started_at: float | None = None      # when the node's first trainer said Started (runner.supervisor.startup)
        self._trainer_parts: list[dict] = []       # ... and the parts of its start

    @property
    def starts_before_restore(self) -> bool:
        """Whether this trainer is started before the checkpoint fetch (one process alone: it loads
        beside the fetch and waits for `go`); under a launcher it is started after it."""
        return not launched(self.spec)

    def start(self, *, progress: bool) -> None:
        """The trainer process, from the newest checkpoint in work/checkpoints once it goes on (`go`).
        Raises SamplerUnavailable."""
        with clock().part("plan"):
            plan = self._plan()
        with clock().part("trainer spawn"):
            self._spawn(plan, progress)

    def go(self) -> None:
        """The checkpoint is restored and the attempt started in the books: a trainer started before
        the restore gets the attempt's plan (its budget counts from the attempt's start) and goes on."""
        if self._spawned is None or self._spawned.control_fd is None:
            return                        # under a launcher: started after the restore, its plan final
        plan = self._plan_sent.model_copy(update={"budget": self.books.budget()})
        atomic_write_bytes(self.work / PLAN_FILE, plan.to_json().encode())
        self._spawned.go()

    def _plan(self) -> Plan:
        spec, books = self.spec, self.books
        params = spec.params.model_copy(update={"sampler": self._sampler()})
        fp = baseline_fingerprint(spec.model, spec.env, params)
        self._fingerprints = {"baseline": fp, "final": final_fingerprint(fp, spec.manifest)}
        cached = books.cached_baseline(fp, spec.params.sampleEvalTasks)
        done = {kind: books.eval_batches(kind, f) for kind, f in self._fingerprints.items()}
        books.plan_evaluations(len(spec.env.eval_tasks), params.evalBatchSize)
        chosen = books.carry_over().micro_batch_size     # the first attempt's choice: a resume keeps it
        if params.microBatchSize is None and chosen:
            params = params.model_copy(update={"microBatchSize": chosen})
        return Plan(name=spec.name, model=spec.model, env=spec.env, params=params, model_name=spec.model_name,
                    keep_checkpoints=spec.keep_checkpoints, baseline=cached is None,
                    eval_done={kind: batches for kind, batches in done.items() if batches},
                    budget=books.budget(), run_id=books.run_id, sandbox_strict=spec.sandbox_strict,
                    judge_calls=books.judge_calls(),
                    judge_usd=books.judge_usd(), episode_digests=books.episode_digests())

    def _sampler(self) -> str:
        """The engine the run samples with: the one its first attempt chose (a resume never switches
        engines), else spec.parameters.sampler resolved here (auto: vLLM where it serves the job).
        Raises SamplerUnavailable when that engine cannot sample on this node."""
        chosen = self.books.sampler()
        params = self.spec.params
        if chosen is None:
            try:
                choice = decide(params, lambda: model_config(self.spec.model), gpu=node_has_gpu(),
                                processes=self.spec.processes)
            except ValueError as e:
                raise SamplerUnavailable(str(e)) from None
            self.books.choose_sampler(choice.engine, choice.why)
            log.info("sampler: %s (%s)", choice.engine, choice.why)
            return choice.engine
        missing = missing_engine(chosen, params)
        if missing:
            raise SamplerUnavailable(missing)
        return chosen

    def _note_startup(self) -> None:
        """The node's path to this first new step, in parts: logged and in the record."""
        path = startup.path_to_first_step(self._trainer_parts, (self._started_at, time.time()))
        self._started_at = None
        log.info("%s", startup.summary(path))
        self.books.record_startup(path)

    def _spawn(self, plan: Plan, progress: bool) -> None:
        self.checkpoints.set_listener(None)
        self._spawned = start_trainer(self.spec, self.work, plan, progress=progress,
                                      kept_threads=self.books.carry_over().cpu_threads, prewarmed=self.prewarmed)
        self._proc, self._plan_sent = self._spawned.proc, plan
        threading.Thread(target=self._read_events, args=(self._spawned.events_fd,), name="trainer-events",
                         daemon=True).start()

    # --- what it says ----------------------------------------------------------------------------

    def _read_events(self, fd: int) -> None:
        """The trainer's events, one JSON line each, until it exits (its end of the pipe closes)."""
        with os.fdopen(fd, "r") as lines:
            for line in lines:
                self.watchdog.seen()
                if self.broken is not None:
                    continue                  # read to the end (the trainer is being killed), record nothing
                try:
                    with unless_disk_full(f"what the trainer reported ({line.strip()[:80]})", self.work):
                        self._on_event(parse_event(line))
                except InvalidTransition as e:
                    self.broken = str(e)
                    log.error("the trainer reported a phase the record cannot move to (%s): ending this attempt", e)
                    self.kill()
                except (StorageUnavailable, StorageConfigError, LeaseLost) as e:   # said where it is handled
                    log.error("could not store what the trainer reported (%s): %s", line.strip()[:80], e)
                except Exception:   # a bad line or a record error must not stop the reading
                    log.exception("could not handle the trainer's event %s", line.strip()[:200])
        self._proc.wait()
        self.done.set()
        self._wake.set()

    def _on_event(self, ev: TrainerEvent) -> None:
        books = self.books
        if not self._listens:      # it installs its signal handlers before its first event
            self._listens = True
            self.checkpoints.set_listener(self._proc)
        match ev:
            case Samples():          # a step's come before it, an evaluation batch's before it
                books.add_samples(ev.kind, ev.step, [g.model_dump() for g in ev.groups])
            case Step():
                if self._started_at is not None:      # this process's first new step: its path, recorded once
                    self._note_startup()
                books.log_step(ev.step, ev.metrics, ev.episodeDigests)
            case Sealed():
                self.durability.sealed(ev.step, Path(ev.path))
            case PhaseStarted():
                books.enter_phase(RECORD_PHASE[ev.phase])
            case EvalBatch():
                books.add_eval_batch(ev.kind, self._fingerprints[ev.kind], ev.batch, ev.rewards)
            case Evaluated():
                books.record_eval(ev.kind, ev.result, self._fingerprints[ev.kind], no_signal=ev.noSignal)
            case HeldOut():
                books.add_held_out(ev.step, ev.result)
            case JudgeCalls():
                books.note_judge_calls(ev.calls, ev.usd)
            case Started():
                books.trainer_started(ev.device, ev.microBatchSize, ev.cpuThreads, ev.sandbox, ev.sampler)
                if startup.first_attempt():
                    self._started_at, self._trainer_parts = time.time(), ev.startup
            case Stopped():
                self.last_words.stopped = ev
            case Final():
                self.last_words.final = ev
            case Failed():
                if not (self.last_words.failed and self.last_words.failed.code):   # several processes: the reward
                    self.last_words.failed = ev       # function's error, not the peers' lost connection after it

    # --- what it is told -------------------------------------------------------------------------

    def stop(self, window_s: float) -> None:
        """Stop at the last completed step (STOP_SIGNAL); killed if not gone within `window_s`. A
        trainer that has said nothing yet is still starting (its imports, the model's load, the
        grader's and the engine's start, the restore): it has nothing of this attempt to save and a
        model's load never asks for a stop, so it is killed at once rather than left to run out
        the notice window before the record can go up."""
        if not self._listens:
            log.info("the trainer is still starting: nothing of this attempt to save; ending it now")
            self.kill()
            self.done.wait()
            return
        self.terminate()
        if not self.done.wait(window_s):
            log.error("the trainer did not stop within %.0f s; killing it", window_s)
            self.kill()
            self.done.wait()

    def wait_for_exit(self, window_s: float) -> None:
        """Let a trainer that has reported its final weights exit by itself: no STOP_SIGNAL (one
        that lands while its interpreter shuts down kills it); killed if not gone within `window_s`."""
        if not self.done.wait(window_s):
            log.error("the trainer did not exit within %.0f s of its final weights; killing it", window_s)
            self.kill()
            self.done.wait()

    def terminate(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(STOP_SIGNAL)

    def kill(self) -> None:
        """No checkpoint, no word: for a lease lost to another node, or a supervisor on its way out."""
        if self._spawned is not None:
            self._spawned.give_up()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def kill_session(self) -> None:
        """kill(), and every process of the trainer's own process group (its ranks, what it started
        there): for a trainer that went silent, which may be anywhere in its work."""
        if self._proc is not None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)    # its own session: the group is its pid
            except (ProcessLookupError, PermissionError):
                pass
        self.kill()

    # --- how it ended ----------------------------------------------------------------------------

    def outcome(self) -> Outcome:
        """How it ended, from its exit status and its last words."""
        code, stopped, failed = self._proc.returncode, self.last_words.stopped, self.last_words.failed
        if self.broken is not None:          # whatever it did after that is not trusted
            return Outcome(How.BROKEN, f"the trainer and the job's record disagree on where the run is ({self.broken}): "
                                     f"the record or a checkpoint in storage was changed by hand or replayed; this "
                                     f"attempt is ended and nothing after that event recorded")
        if code == CHILD_DONE or self.last_words.final is not None:
            # its final weights sealed, it had nothing left to do: whatever ended its process after
            # that (a STOP_SIGNAL while its interpreter shut down, default-handled by then, say)
            return Outcome(How.DONE)
        if code == CHILD_STOPPED:
            if stopped is not None and stopped.reason == "deadline":
                return Outcome(How.DEADLINE, step=stopped.step or 0)
            return Outcome(How.STOPPED)
        if failed and failed.diskFull:       # restarting cannot help: the same disk is full
            return Outcome(How.DISK_FULL, failed.message)
        if code == CHILD_CODE_ERROR:
            return Outcome(How.CODE_ERROR, failed.message if failed else "the reward function failed")
        if code == CHILD_INFRA_FAILED:
            return Outcome(How.INFRASTRUCTURE, failed.message if failed else
                           "infrastructure failure: a service the run calls (a judge) did not answer")
        if code == CHILD_NO_GROUP:
            where = self.spec.nodes.master if self.spec.nodes else "this node"
            return Outcome(How.CRASHED, f"the job's other nodes did not join the rendezvous at {where} within its "
                                        f"timeout ({RENDEZVOUS_TIMEOUT_ENV})")
        why = f"trainer exited with status {code}" if code >= 0 else f"trainer killed by {signal.Signals(-code).name}"
        return Outcome(How.CRASHED, why + (f" ({failed.message})" if failed else ""))
