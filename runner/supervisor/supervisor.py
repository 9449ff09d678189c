"""The supervisor: one per node. It owns everything that outlives a trainer process — the lease,
the run's books (record, ledger, budget, baseline cache), restoring the newest durable checkpoint
before the trainer starts, uploading every checkpoint the trainer seals, spot notices, restarts.
The trainer (`python -m trainer.child`) trains from the local folder and reports events.

    start:   lease -> restore the newest durable checkpoint into work/checkpoints -> the plan
             (baseline cached? evaluation batches already done? the budget as a deadline)
             -> the trainer, its events read on a pipe by one thread
    events:  step -> the record; sealed -> upload (manifest trusted, last); eval -> the record
             and the baseline cache; final -> uploaded before the job is called Succeeded
    notice (AWS/GCP/Azure metadata, SIGTERM/SIGINT)
        -> SIGTERM to the trainer: it abandons the step or evaluation batch in flight, seals the
           last completed step and exits; its upload started the moment it was sealed
        -> if the trainer does not finish inside the notice window it is killed, and the newest
           sealed local checkpoint is uploaded as it is
        -> the attempt is recorded as Preempted; the supervisor exits with EXIT_PREEMPTED
    rebalance recommendation (AWS) -> SIGUSR1: checkpoint at the next step, keep training
    trainer crash -> restart with backoff, counted by kind, each kind with its own limit
"""

from __future__ import annotations

import datetime as dt
import errno
import json
import logging
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from grpo_run.checkpoint.storage.fenced import FencedStore
from grpo_run.checkpoint.storage.fsio import atomic_write_bytes
from grpo_run.checkpoint.storage.lease import Lease, LeaseHeld, LeaseLost
from grpo_run.checkpoint.manifest import newest_sealed, sealed
from grpo_run.checkpoint.procs import python_env
from grpo_run.checkpoint.storage.retry import backoff, nth_wait
from grpo_run.checkpoint.storage.store import StorageConfigError, StorageUnavailable, Store
from grpo_run.checkpoint.sync import Uploader, restore_latest
from grpo_run.runner.books.books import Books
from grpo_run.runner.exits import EXIT_BUDGET, EXIT_FAILED, EXIT_HELD, EXIT_OK, EXIT_PREEMPTED
from grpo_run.runner.books.fingerprint import baseline_fingerprint, final_fingerprint
from grpo_run.runner.views.live import EVAL_PLAN
from grpo_run.runner.notices.monitor import NoticeMonitor, Watcher, install_signal_handlers
from grpo_run.state.phases import Phase
from grpo_run.trainer import child
from grpo_run.trainer.config import GRPOParams
from grpo_run.trainer.distributed import WORLD_ENV
from grpo_run.trainer.envs.catalog import Environment
from grpo_run.trainer.recipe import Plan
from grpo_run.trainer.threads import SHARE_ENV

log = logging.getLogger(__name__)

# The shortest notice (GCP, Azure) is ~30 s; leave room for the upload after a forced kill.
DEFAULT_NOTICE_WINDOW_S = 25.0


@dataclass(frozen=True)
class RunSpec:
    """What the supervisor needs for a job, resolved by the caller (runner.job) from the
    TrainingJob."""
    name: str
    manifest: dict[str, Any]         # the job as the user wrote it, defaults filled (never credentials)
    model: str                       # what from_pretrained takes: a hub id or a folder
    env: Environment
    params: GRPOParams
    storage: str                     # URL of this job's folder in object storage
    keep_checkpoints: int = 3
    model_name: str | None = None    # the model as the user named it (saved adapters say this)
    usd_per_hour: float | None = None  # the GPU's rate, for the cost ledger (None: cost unknown)
    max_cost_usd: float | None = None  # spec.maxCostUSD: stop cleanly before a step would pass it
    processes: int = 1               # spec.resources.processes, resolved: > 1 runs the trainer under accelerate


@dataclass(frozen=True)
class RestartLimits:
    """How many times each kind of trainer failure is restarted on this node before giving up.
    Code errors (the user's reward function) and storage configuration errors are never
    restarted: the same input fails the same way."""
    crashes: int = 3            # the trainer process died or raised unexpectedly
    infrastructure: int = 5     # object storage unavailable past its own retries
    backoff_s: float = 2.0      # doubled after each restart, at most 60 s (plus jitter: checkpoint.retry)


@dataclass
class SupervisorResult:
    exit_code: int
    phase: str
    message: str = ""
    notice: str | None = None
    notice_to_durable_s: float | None = None
    durable_step: int | None = None
    restarts: dict[str, int] = field(default_factory=dict)


def node_name() -> str:
    """Who holds a job's lease and runs its attempts: this host (on the clouds, the instance)."""
    return socket.gethostname()


class _Restart(Exception):
    """This attempt ended in a way worth another: `kind` names its restart limit."""

    def __init__(self, kind: str, why: str) -> None:
        super().__init__(why)
        self.kind = kind


class Supervisor:
    """Owns the trainer child process, the notice monitor, the uploads and the run's books."""

    def __init__(self, spec: RunSpec, work: Path, *, watchers: list[Watcher], store: Store | None = None,
                 notice_window_s: float = DEFAULT_NOTICE_WINDOW_S, limits: RestartLimits = RestartLimits(),
                 poll_interval_s: float = 1.0, progress: bool = False,
                 sleep: Callable[[float], None] | None = None) -> None:
        self.spec = spec
        self.work = Path(work)
        self.store = store or Store(spec.storage)
        self.watchers = watchers
        self.notice_window_s = notice_window_s
        self.limits = limits
        self.poll_interval_s = poll_interval_s
        self.progress = progress
        self.preempt = threading.Event()
        self._sleep = sleep or self.preempt.wait   # a backoff ends early on a notice
        self._wake = threading.Event()             # the trainer ended, or a notice came
        self._child: subprocess.Popen | None = None
        self._child_done = threading.Event()
        self._fatal: BaseException | None = None   # a storage configuration error from an upload
        self._durable = 0                          # newest step durable in storage
        self._noted_durable: set[int] = set()
        self._fingerprints: dict[str, str] = {}
        self._attempt_events: dict[str, Any] = {}  # this attempt's `stopped`, `failed`, `final` events
        self._sealed: set[int] = set()             # checkpoints this attempt's trainer sealed (and we submitted)
        # A rebalance recommendation that came before the trainer's first event waits for it:
        # SIGUSR1 before the trainer's handler is installed would kill it (the default action).
        self._signal_lock = threading.Lock()
        self._trainer_listens = False
        self._checkpoint_asked = False
        self.books: Books | None = None
        self.uploads: Uploader | None = None

    # --- the loop ----------------------------------------------------------------------------------

    def run(self) -> SupervisorResult:
        """Hold the job's lease, then supervise trainers until the job ends or a notice comes."""
        lease = Lease(self.spec.storage, holder=node_name(), stop=self.preempt)
        try:
            lease.acquire()
        except LeaseHeld as e:
            return SupervisorResult(EXIT_HELD, "Held", str(e))
        lease.start_renewing(on_lost=self._lease_lost)
        # Every upload from here on (checkpoints, prunes, the record, the final weights) checks
        # that the lease is still ours right before it starts: a stale holder writes nothing.
        self.store = FencedStore(self.store, lease)
        try:
            self.books = Books(self.store, self.work, name=self.spec.name, manifest=self.spec.manifest,
                               usd_per_hour=self.spec.usd_per_hour, max_cost_usd=self.spec.max_cost_usd)
            self.uploads = Uploader(self.store, "checkpoints", keep=self.spec.keep_checkpoints,
                                    on_upload=self._uploaded)
            return self._supervise()
        except LeaseLost as e:     # an upload found the job taken over: it belongs to another node now
            log.error("%s", e)
            return SupervisorResult(EXIT_HELD, "Held", str(e))
        finally:
            if self.uploads is not None:
                self.uploads.close()
            if self.books is not None:
                self.books.close()
            lease.release()

    def _supervise(self) -> SupervisorResult:
        monitor = NoticeMonitor(self.watchers, preempt=self.preempt, on_rebalance=self._request_checkpoint,
                                poll_interval_s=self.poll_interval_s)
        restore = install_signal_handlers(self.preempt, on_notice=monitor.report) \
            if threading.current_thread() is threading.main_thread() else (lambda: None)
        threading.Thread(target=lambda: (self.preempt.wait(), self._wake.set()), name="notice-wake",
                         daemon=True).start()
        restarts = {"crashes": 0, "infrastructure": 0}
        wait = backoff(self.limits.backoff_s, 60.0)    # tenacity's exponential wait + jitter, as storage's
        try:
            with monitor:
                self.books.close_dangling_attempts()
                while True:
                    try:
                        return self._attempt(monitor, restarts)
                    except _Restart as why:
                        restarts[why.kind] += 1
                        limit = getattr(self.limits, why.kind)
                        if restarts[why.kind] > limit:
                            message = f"{why}; {why.kind} restart limit ({limit}) reached"
                            self._end(Phase.FAILED, "Crashed", message, restart_limit=why.kind)
                            return SupervisorResult(EXIT_FAILED, "Failed", message, restarts=restarts)
                        delay = nth_wait(wait, sum(restarts.values()))
                        log.warning("%s; restart %d of %d (%s) in %.0f s", why, restarts[why.kind], limit,
                                    why.kind, delay)
                        self._sleep(delay)
                        if self.preempt.is_set():
                            self._end(Phase.PREEMPTED, "Preempted", f"notice from {_source(monitor)} between attempts",
                                      notice=_source(monitor))
                            return SupervisorResult(EXIT_PREEMPTED, "Preempted", notice=_source(monitor),
                                                    durable_step=self._durable, restarts=restarts)
        finally:
            restore()
            if self._child is not None and self._child.poll() is None:
                self._child.kill()
                self._child.wait()

    def _attempt(self, monitor: NoticeMonitor, restarts: dict[str, int]) -> SupervisorResult:
        """One trainer process, from restoring its checkpoint to recording how it ended. Raises
        _Restart when that is worth another attempt."""
        books = self.books
        try:
            start = self._restore()
        except StorageUnavailable as e:
            if self.preempt.is_set():     # the notice stopped the download's retries: not an outage
                start = None
            else:
                raise _Restart("infrastructure", f"storage unavailable while restoring: {e}") from None
        if self.preempt.is_set():         # a notice while restoring: no trainer is started to be stopped
            source = _source(monitor)
            since = (dt.datetime.now(dt.timezone.utc) - monitor.notice.received_at).total_seconds() \
                if monitor.notice else 0.0
            self.books.record.set_value("lastNotice", {"source": source, "noticeToDurableSeconds": round(since, 3),
                                                       "durableStep": self._durable})
            self._end(Phase.PREEMPTED, "Preempted", f"notice from {source} while restoring; nothing to save, "
                                                    f"step {self._durable} stays durable", notice=source)
            return SupervisorResult(EXIT_PREEMPTED, "Preempted", notice=source, durable_step=self._durable,
                                    restarts=restarts)
        books.start_attempt(node_name(), from_step=start)
        if start:
            books.record.set_value("resumedFrom", start)
        self._start_child(self._plan(start))
        while not (self._child_done.is_set() or self.preempt.is_set()):
            self._wake.wait()
            self._wake.clear()
        if self.preempt.is_set():
            return self._preempted(monitor, restarts)
        return self._ended(self._child.returncode, restarts)

    def _ended(self, code: int, restarts: dict[str, int]) -> SupervisorResult:
        """The trainer exited on its own: done, stopped at the deadline, or failed."""
        stopped, failed = self._attempt_events.get("stopped"), self._attempt_events.get("failed")
        if code == child.CHILD_DONE:
            return self._succeeded(restarts)
        if code == child.CHILD_STOPPED and self._fatal is None:
            step = self._wait_durable()
            if stopped and stopped.get("reason") == "deadline":
                message = (f"spent ${self.books.spent_usd():.4f} of maxCostUSD ${self.spec.max_cost_usd}; "
                           f"stopped after step {stopped['step'] or 0} with a checkpoint (resume with a larger budget)")
                self._end(Phase.BUDGET_EXCEEDED, "BudgetExceeded", message)
                return SupervisorResult(EXIT_BUDGET, "BudgetExceeded", message, durable_step=step, restarts=restarts)
            message = f"stopped after step {step}; resume continues from there"
            self._end(Phase.PREEMPTED, "Preempted", message)
            return SupervisorResult(EXIT_PREEMPTED, "Preempted", message, durable_step=step, restarts=restarts)
        if self._fatal is not None:
            message = str(self._fatal)
        elif failed and failed.get("diskFull"):       # restarting cannot help: the same disk is full
            message = disk_full_message(self.work, failed["message"], self._durable)
        elif code == child.CHILD_CODE_ERROR:
            message = failed["message"] if failed else "the reward function failed"
        else:
            why = f"trainer exited with status {code}" if code >= 0 else \
                f"trainer killed by {signal.Signals(-code).name}"
            if failed:
                why += f" ({failed['message']})"
            self.books.end_attempt("Crashed", why)
            raise _Restart("crashes", why)
        self._end(Phase.FAILED, "Failed", message)
        return SupervisorResult(EXIT_FAILED, "Failed", message, restarts=restarts)

    def _succeeded(self, restarts: dict[str, int], **notice: Any) -> SupervisorResult:
        final = self._attempt_events.get("final")
        if final is None:
            raise _Restart("crashes", "the trainer exited without its final weights")
        folder = Path(final["path"])
        with Uploader(self.store, "final", keep=2) as uploader:
            uploader.submit(folder, sealed(folder))
            if not uploader.wait():
                raise _Restart("infrastructure", f"the final weights could not be uploaded: {uploader.error}")
        books = self.books
        b, f = books.record.eval("baseline"), books.record.eval("final")
        books.update_reward_signal()
        message = f"final held-out reward {f['meanReward']:.3f} (baseline {b['meanReward']:.3f})" if b and f else ""
        self._end(Phase.SUCCEEDED, "Succeeded", message)
        return SupervisorResult(EXIT_OK, "Succeeded", message, restarts=restarts, **notice)

    def _preempted(self, monitor: NoticeMonitor, restarts: dict[str, int]) -> SupervisorResult:
        """A notice: stop the trainer inside the window (SIGTERM, then SIGKILL), make the newest
        sealed checkpoint durable, record the attempt as preempted."""
        notice_at = time.monotonic()
        source = _source(monitor)
        log.warning("preemption notice (%s): stopping the trainer at the last completed step", source)
        if self._child.poll() is None:
            self._child.send_signal(signal.SIGTERM)
        if not self._child_done.wait(self.notice_window_s):
            log.error("the trainer did not stop within %.0f s; killing it", self.notice_window_s)
            self._child.kill()
            self._child_done.wait()
        # inside the window even when the store stalls: the rest of it, at least a few seconds
        durable = self._wait_durable(timeout=max(5.0, self.notice_window_s - (time.monotonic() - notice_at)))
        elapsed = time.monotonic() - notice_at
        self.books.record.set_value("lastNotice", {"source": source, "noticeToDurableSeconds": round(elapsed, 3),
                                                   "durableStep": durable})
        notice = {"notice": source, "notice_to_durable_s": elapsed, "durable_step": durable}
        if self._child.returncode == child.CHILD_DONE:     # it finished before it heard
            return self._succeeded(restarts, **notice)
        log.warning("preempted (%s): step %s durable %.2f s after the notice", source, durable, elapsed)
        self._end(Phase.PREEMPTED, "Preempted", f"notice from {source}; stopped after step {durable}, "
                                                f"durable; resume continues from there", notice=source)
        return SupervisorResult(EXIT_PREEMPTED, "Preempted", restarts=restarts, **notice)

    def _end(self, phase: Phase, reason: str, message: str, restart_limit: str | None = None,
             notice: str | None = None) -> None:
        """Close the attempt and the phase in one go, and wait until storage has the record."""
        books = self.books
        with books.record.transaction():
            if books.attempt is not None:
                books.end_attempt(reason, message, notice)
            if restart_limit:
                books.record.set_value("restartLimit", {"kind": restart_limit, "message": message})
            books.record.set_phase(phase, message)
        books.sync(wait=True)

    # --- checkpoints -------------------------------------------------------------------------------

    def _restore(self) -> int:
        """The newest durable checkpoint into work/checkpoints before the trainer starts (a newer
        one sealed here before a crash is kept and uploaded); its step, 0 for none."""
        got = restore_latest(self.store, self.work / "checkpoints", accept=self._ours)
        if got is None:
            return 0
        step, folder, manifest, durable = got
        if durable:
            self._note_durable([step])
        else:
            log.info("checkpoint %d was sealed here but never uploaded; uploading it", step)
            self.uploads.submit(folder, manifest)
        return step

    def _ours(self, manifest) -> str | None:
        """Why a checkpoint is not this run's to continue from (None: it is). One without a run
        id predates them and is trusted."""
        run = manifest.meta.get("run")
        if run is None or run == self.books.run_id:
            return None
        return (f"it was written by another run of job {self.spec.name} (run {run[:12]}; this record's is "
                f"{self.books.run_id[:12]}): a job submitted again under the name of one whose record was deleted")

    def _uploaded(self, step: int, durable: list[int], error: BaseException | None) -> None:
        """From the upload thread, after each upload ended."""
        with _unless_disk_full(f"checkpoints {durable} as durable"):
            self._note_durable(durable)
        if isinstance(error, LeaseLost):       # refused by the fence before the renewal thread said so
            self._lease_lost(error)
        if isinstance(error, StorageConfigError) and self._fatal is None:
            self._fatal = error
            log.error("%s; stopping the trainer", error)
            if self._child is not None and self._child.poll() is None:
                self._child.send_signal(signal.SIGTERM)

    def _note_durable(self, steps: list[int]) -> None:
        new = [s for s in steps if s not in self._noted_durable]
        if not new:
            return
        with self.books.record.transaction():
            for s in new:
                self.books.record.add_checkpoint(s, durable=True)
        self._noted_durable.update(new)
        self._durable = max(self._durable, *new)
        # the record after it, within DURABLE_SYNC_S: a node lost later leaves storage a record
        # with every step up to the checkpoint a resume starts from
        self.books.sync_after_durable()

    def _wait_durable(self, timeout: float | None = None) -> int:
        """The newest sealed local checkpoint made durable; its step (or the newest durable one
        when that upload fails or outlasts `timeout`: what is reported durable is only what is).
        A checkpoint the trainer sealed but could not report (it was killed) is uploaded too, its
        manifest trusted: nothing is hashed inside a notice window."""
        found = newest_sealed(self.work / "checkpoints")
        if found is not None and found[0] > self._durable and found[0] not in self._sealed:
            self.uploads.submit(found[1], found[2])
        if not self.uploads.wait(timeout) and timeout is not None:
            log.error("the newest checkpoint was not made durable within %.0f s (a stalled or failing "
                      "store?); step %d is the newest durable one", timeout,
                      max(self._durable, *self.uploads.durable_steps(), 0))
        self._note_durable(self.uploads.durable_steps())
        return self._durable

    # --- the trainer process ------------------------------------------------------------------------

    def _plan(self, start: int) -> Plan:
        spec, books = self.spec, self.books
        fp = baseline_fingerprint(spec.model, spec.env, spec.params)
        self._fingerprints = {"baseline": fp, "final": final_fingerprint(fp, spec.manifest)}
        cached = books.cached_baseline(fp)
        done = {kind: books.eval_batches(kind, f) for kind, f in self._fingerprints.items()}
        params = spec.params
        tasks = len(spec.env.eval_tasks)                   # for `get tj -w`'s evaluation bars
        books.record.set_value(EVAL_PLAN, {"tasks": tasks, "batches": -(-tasks // spec.params.evalBatchSize)})
        chosen = books.record.value("microBatchSize")     # the first attempt's choice: a resume keeps it
        if params.microBatchSize is None and chosen:
            params = params.model_copy(update={"microBatchSize": int(chosen)})
        return Plan(name=spec.name, model=spec.model, env=spec.env, params=params, model_name=spec.model_name,
                    keep_checkpoints=spec.keep_checkpoints, baseline=cached is None,
                    eval_done={kind: batches for kind, batches in done.items() if batches},
                    stop_by=books.stop_by(), run_id=books.run_id)

    def _start_child(self, plan: Plan) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        plan_path = self.work / child.PLAN_FILE
        atomic_write_bytes(plan_path, plan.to_json().encode())
        read_fd, write_fd = os.pipe()
        env = python_env()
        env[child.EVENTS_FD_ENV] = str(write_fd)
        env[child.PARENT_ENV] = str(os.getpid())
        env["GRPO_RUN_PROGRESS"] = "1" if self.progress else "0"
        if self.spec.processes == 1:      # alone, whatever a launcher that started grpo-run itself says
            for var in WORLD_ENV:
                env.pop(var, None)
        kept = self.books.record.value("cpuThreads")       # the first trainer's count: a run keeps it
        threads = trainer_threads(len(os.sched_getaffinity(0)), env, kept=int(kept) if kept else None)
        if kept and threads:
            log.info("trainer threads: %s, as the run's first trainer took", threads["OMP_NUM_THREADS"])
        env.update(threads)
        self._attempt_events, self._sealed = {}, set()
        self._child_done.clear()
        with self._signal_lock:
            self._trainer_listens = False
        try:
            # Its own session: a terminal's Ctrl-C reaches the supervisor only, which decides.
            command = ["-m", "grpo_run.trainer.child", str(plan_path)] if self.spec.processes == 1 else \
                ["-m", "grpo_run.trainer.launch", str(self.spec.processes), str(plan_path)]    # one rank per GPU
            self._child = subprocess.Popen([sys.executable, *command], env=env, pass_fds=[write_fd],
                                           cwd=self.work, start_new_session=True)
        finally:
            os.close(write_fd)
        threading.Thread(target=self._read_events, args=(read_fd, self._child), name="trainer-events",
                         daemon=True).start()

    def _read_events(self, fd: int, proc: subprocess.Popen) -> None:
        """The trainer's events, one JSON line each, until it exits (its end of the pipe closes)."""
        with os.fdopen(fd, "r") as lines:
            for line in lines:
                try:
                    with _unless_disk_full(f"what the trainer reported ({line.strip()[:80]})"):
                        self._on_event(json.loads(line))
                except (StorageUnavailable, StorageConfigError, LeaseLost) as e:   # said where it is handled
                    log.error("could not store what the trainer reported (%s): %s", line.strip()[:80], e)
                except Exception:   # a bad line or a record error must not stop the reading
                    log.exception("could not handle the trainer's event %s", line.strip()[:200])
        proc.wait()
        self._child_done.set()
        self._wake.set()

    def _on_event(self, ev: dict[str, Any]) -> None:
        books, kind = self.books, ev["event"]
        if not self._trainer_listens:      # it installs its signal handlers before its first event
            self._trainer_started()
        if kind == "step":
            books.log_step(ev["step"], ev["metrics"])
            books.sync_soon()
        elif kind == "sealed":
            books.record.add_checkpoint(ev["step"], durable=False)
            self._sealed.add(ev["step"])
            folder = Path(ev["path"])
            self.uploads.submit(folder, sealed(folder))     # hashed once, when sealed: trusted here
        elif kind == "phase":
            books.phase(Phase(ev["phase"]))
        elif kind == "evalBatch":
            books.add_eval_batch(ev["kind"], self._fingerprints[ev["kind"]], ev["batch"], ev["rewards"])
        elif kind == "eval":
            books.record_eval(ev["kind"], ev["result"], self._fingerprints[ev["kind"]], no_signal=ev["noSignal"])
        elif kind == "heldOut":
            books.add_held_out(ev["step"], ev["result"])
        elif kind == "started":
            books.record.set_value("device", ev["device"])
            books.record.set_value("microBatchSize", ev.get("microBatchSize"))
            if ev.get("cpuThreads") and books.record.value("cpuThreads") is None:
                books.record.set_value("cpuThreads", ev["cpuThreads"])
        elif kind in ("stopped", "failed", "final"):
            if kind == "failed" and self._attempt_events.get("failed", {}).get("code"):
                return       # several processes: the reward function's error, not the peers' lost connection
            self._attempt_events[kind] = ev

    def _request_checkpoint(self, notice) -> None:
        log.info("rebalance recommendation from %s: checkpointing early", notice.source)
        with self._signal_lock:
            self._checkpoint_asked = True
            self._deliver_checkpoint_request()

    def _trainer_started(self) -> None:
        with self._signal_lock:
            self._trainer_listens = True
            self._deliver_checkpoint_request()

    def _deliver_checkpoint_request(self) -> None:
        """SIGUSR1 to a trainer that has its handler installed (it sent an event); a request
        made before that is kept until it has. Called with _signal_lock held."""
        if self._checkpoint_asked and self._trainer_listens and self._child is not None \
                and self._child.poll() is None:
            self._child.send_signal(signal.SIGUSR1)
            self._checkpoint_asked = False

    def _lease_lost(self, lost: LeaseLost) -> None:
        """Another node took the job over: a stale holder must not write another byte."""
        log.error("lost the job's lease (%s); stopping the trainer without a checkpoint", lost)
        if self._child is not None and self._child.poll() is None:
            self._child.kill()


# Rounds an idle OpenMP thread spins before it sleeps: long enough to catch the next operation of a
# step (microseconds apart), short enough to give the core back while the trainer waits for its
# grader. libgomp's default (300,000 here) is an order longer.
SPIN_ROUNDS = 10_000


def trainer_threads(cores: int, user: Mapping[str, str], *, kept: int | None = None) -> dict[str, str]:
    """The trainer's CPU threads (environment variables to add to `user`, the environment it would
    inherit). A run's first attempt gets a pool to share with the node's other trainers
    (trainer.threads, with the measurements): all cores on a node of up to 3, where every core
    counts (2 threads alone: demo 16.3 s against 18.0 s with one, a 4 x 256 model 0.189 against
    0.246 s per step), one left to the grader, the checkpoint writer and the uploads on a bigger
    one. Later attempts run with the count the first one took (`kept`): another count would round
    the arithmetic differently. Waits spin briefly, then sleep (GOMP_SPINCOUNT). A user's own
    OMP_NUM_THREADS is kept, and then nothing is shared."""
    if "OMP_NUM_THREADS" in user:
        return {}
    if kept is not None:
        env = {"OMP_NUM_THREADS": str(kept)}
    else:
        pool = max(1, cores if cores <= 3 else cores - 1)
        env = {"OMP_NUM_THREADS": str(pool), SHARE_ENV: str(pool)}
    if int(env["OMP_NUM_THREADS"]) > 1 and "OMP_WAIT_POLICY" not in user and "GOMP_SPINCOUNT" not in user:
        env["GOMP_SPINCOUNT"] = str(SPIN_ROUNDS)
    return env


def disk_full(e: BaseException) -> bool:
    """The local disk (or the record's SQLite file on it) has no room left."""
    return (isinstance(e, OSError) and e.errno == errno.ENOSPC) or \
        (isinstance(e, sqlite3.OperationalError) and "disk is full" in str(e))


@contextmanager
def _unless_disk_full(what: str) -> Iterator[None]:
    """A full local disk while recording `what` is logged in one line; any other error propagates."""
    try:
        yield
    except (OSError, sqlite3.OperationalError) as e:
        if not disk_full(e):
            raise
        log.error("could not record %s: the local disk is full (%s)", what, e)


def disk_full_message(work: Path, detail: str, durable: int) -> str:
    return (f"the local disk is full ({detail}) under {work}: free space there, or set GRPO_RUN_HOME to a "
            f"bigger disk, then `grpo-run resume`; checkpoint {durable} is durable in storage and stays so")


def _source(monitor: NoticeMonitor) -> str:
    return monitor.notice.source if monitor.notice else "signal"
