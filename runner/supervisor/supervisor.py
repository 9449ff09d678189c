"""The supervisor: one per node. It owns everything that outlives a trainer process — the lease,
the run's books (runner.books), what is durable in storage (durability.py), spot notices and
restarts — and runs the job as attempts, one trainer process each (attempt.py), until one ends it.

    attempt: restore the newest durable checkpoint into work/checkpoints -> the plan -> the
             trainer, its events into the books and uploads -> how it ended, recorded
    notice (AWS/GCP/Azure metadata, SIGTERM/SIGINT)
        -> STOP_SIGNAL to the trainer: it abandons the step or evaluation batch in flight, seals
           the last completed step and exits; its upload started the moment it was sealed
        -> if the trainer does not finish inside the notice window it is killed, and the newest
           sealed local checkpoint is uploaded as it is
        -> the attempt is recorded as Preempted; the supervisor exits with EXIT_PREEMPTED
    rebalance recommendation (AWS) -> CHECKPOINT_SIGNAL: checkpoint at the next step, keep training
    cancel request (runner.jobs.cancel: `grpo-run cancel`), found at a record upload or lease renewal
        -> STOP_SIGNAL, as for a notice but without its hurry; the last completed step made durable
        -> the job is recorded as Cancelled; the supervisor exits with EXIT_CANCELLED
    trainer crash -> restart with backoff, counted by kind, each kind with its own limit
    trainer silent past its watchdog's bound (watchdog.py) -> killed, recorded as a hang, restarted
        as a crash
"""

from __future__ import annotations

import datetime as dt
import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

from grpo_run.checkpoint.storage.by_url import open_store
from grpo_run.checkpoint.storage.fenced import FencedStore
from grpo_run.checkpoint.storage.lease import Lease, LeaseHeld, LeaseLost
from grpo_run.checkpoint.storage.retry import backoff, nth_wait
from grpo_run.checkpoint.storage.store import ObjectStore, StorageConfigError, StorageUnavailable
from grpo_run.runner.books.books import Books
from grpo_run.runner.supervisor.uploads import upload_environment
from grpo_run.runner.exits import EXIT_HELD, EXIT_OK
from grpo_run.runner.supervisor.cancel import cancel_requested
from grpo_run.runner.notices.monitor import AWAKE_S, NoticeMonitor, Watcher, install_signal_handlers, wait_awake
from grpo_run.runner.supervisor.attempt import CheckpointRequest, How, SamplerUnavailable, TrainerProcess
from grpo_run.runner.supervisor.diskfull import disk_full_message
from grpo_run.runner.supervisor.durability import Durability
from grpo_run.runner.supervisor.endings import ENDINGS, End
from grpo_run.runner.supervisor.runspec import RestartLimits, RunSpec, SupervisorResult
from grpo_run.runner.supervisor.spawn import PrewarmedTrainer
from grpo_run.runner.supervisor.watchdog import HANG_ENV
from grpo_run.runner.supervisor.window import NoticeWindow
from grpo_run.state.phases import AttemptEnd, InvalidTransition
from grpo_run.trainer.grader.cgroup import leave_delegated_root
from grpo_run.trainer.startup import clock

log = logging.getLogger(__name__)

# The shortest notice (GCP, Azure) is ~30 s; leave room for the upload after a forced kill.
DEFAULT_NOTICE_WINDOW_S = 25.0
# Attempts in a row that may end Preempted without completing a step before the job fails
# instead: a real spot market rarely takes a node that often before its first step, while a
# process that fakes notices (SIGTERM from something on the node) would otherwise have a
# restarting Job or unit boot paid GPUs forever. `grpo-run resume` after the failure tries again.
PREEMPTED_WITHOUT_PROGRESS = 5
# How long past maxCostUSD a trainer that has not stopped by itself (its own check runs between
# steps) may go before the supervisor stops it.
BUDGET_GRACE_S = 30.0
# Attempts in a row whose node was lost without a word (SIGKILL, the OOM killer, a hang that
# someone or something ended) before completing a step, before the job fails instead: a job that
# takes its node down (a reward that exhausts memory, a baseline or first step that hangs) would
# otherwise be picked up again by every replacement node, and a queue node, which serves jobs in
# name order, would never reach the jobs behind it. Spot reclaims come with a notice (Preempted).
# 5, as for Preempted: a node lost in its first minutes five times running is the job's doing far
# more often than the market's (the kill campaign's random SIGKILLs land that early one time in ten).
LOST_WITHOUT_PROGRESS = 5


def node_name() -> str:
    """Who holds a job's lease and runs its attempts: this host (on the clouds, the instance)."""
    return socket.gethostname()


class _Restart(Exception):
    """This attempt ended in a way worth another: `kind` names its restart limit."""

    def __init__(self, kind: str, why: str) -> None:
        super().__init__(why)
        self.kind = kind


class Supervisor:
    """Owns the lease, the notice monitor, the run's books, the uploads and the attempts."""

    def __init__(self, spec: RunSpec, work: Path, *, watchers: list[Watcher], store: ObjectStore | None = None,
                 notice_window_s: float = DEFAULT_NOTICE_WINDOW_S, limits: RestartLimits = RestartLimits(),
                 poll_interval_s: float = 1.0, progress: bool = False,
                 sleep: Callable[[float], None] | None = None, preempt: threading.Event | None = None,
                 prewarmed: PrewarmedTrainer | None = None) -> None:
        self.spec = spec
        self.work = Path(work)
        self.store: ObjectStore = store or open_store(spec.storage)   # fenced by the lease once it is held (run)
        self.watchers = watchers
        self.notice_window_s = notice_window_s
        self.limits = limits
        self.poll_interval_s = poll_interval_s
        self.progress = progress
        self.preempt = preempt or threading.Event()   # the job's stop Event: its Store retries until it is set
        self.window = NoticeWindow(self.preempt, notice_window_s)
        self._sleep = sleep or (lambda s: wait_awake(self.preempt, s))   # a backoff ends early on a notice
        self._wake = threading.Event()             # the trainer ended, or a notice came
        self._checkpoints = CheckpointRequest()    # rebalance recommendations, for whichever trainer listens
        self._cancel = threading.Event()           # `grpo-run cancel` asked: stop at the step boundary, end the job
        self._cancelled_by = ""                    # ... who asked (the request's "by")
        self._trainer: TrainerProcess | None = None
        self.books: Books | None = None
        self.durability: Durability | None = None
        self._crashed = False                      # the last attempt's trainer crashed: verify what it loaded
        self._prewarmed = prewarmed                # a trainer process started early, for the first attempt

    def run(self) -> SupervisorResult:
        """Hold the job's lease, then supervise trainers until the job ends or a notice comes."""
        leave_delegated_root()        # a systemd unit's delegated cgroup: room for the rewards' cgroups
        lease = Lease(self.spec.storage, holder=node_name(), stop=self.preempt)
        try:
            with clock().part("lease"):
                lease.acquire()
        except LeaseHeld as e:
            return SupervisorResult(EXIT_HELD, str(e))
        lease.start_renewing(on_lost=self._lease_lost, on_renewed=self._check_cancel)
        # Every upload from here on (checkpoints, prunes, the record, the final weights) checks
        # that the lease is still ours right before it starts: a stale holder writes nothing.
        self.store = FencedStore(self.store, lease)
        try:
            with clock().part("record fetch"):
                self.books = Books(self.store, self.work, name=self.spec.name, manifest=self.spec.manifest,
                                   usd_per_hour=self.spec.usd_per_hour, max_cost_usd=self.spec.max_cost_usd,
                                   tracking=self.spec.tracking, after_upload=self._check_cancel,
                                   estimate=self.spec.estimate)
            if self.books.succeeded():    # decided from storage's record, fetched now that the lease is ours
                return SupervisorResult(EXIT_OK, f"{self.spec.name} already succeeded; nothing to do",
                                        already_succeeded=True)
            self._check_cancel()          # asked before this node held it (`cancel` left the request: it always does)
            if self._cancel.is_set():
                durable = [c["step"] for c in self.books.record.checkpoints() if c["durable"]]
                return self._cancelled(max(durable, default=0))
            # apply's environment files: only now, holding the lease and with the record agreeing
            # to this spec (a finished job refused it above), can they replace the stored ones
            upload_environment(self.spec.environment_uploads, self.store)
            self.durability = Durability(self.store, self.work, self.books, job=self.spec.name,
                                         keep=self.spec.keep_checkpoints, max_steps=self.spec.params.maxSteps,
                                         on_lease_lost=self._lease_lost,
                                         on_fatal=self._storage_refused, stop=self.preempt)
            return self._supervise()
        except LeaseLost as e:     # an upload found the job taken over: it belongs to another node now
            log.error("%s", e)
            return SupervisorResult(EXIT_HELD, str(e))
        finally:
            if self.durability is not None:
                self.durability.close()
            if self.books is not None:
                self.books.close()
            self.window.release(lease)

    def _supervise(self) -> SupervisorResult:
        monitor = NoticeMonitor(self.watchers, preempt=self.preempt, on_rebalance=self._checkpoints.ask,
                                poll_interval_s=self.poll_interval_s)
        restore = install_signal_handlers(self.preempt, on_notice=monitor.report) \
            if threading.current_thread() is threading.main_thread() else (lambda: None)
        self.window.watch(self.store, self._wake)
        try:
            with monitor:
                self.books.close_dangling_attempts()
                stuck = self.books.preempted_without_progress()
                if stuck >= PREEMPTED_WITHOUT_PROGRESS:
                    return self._fail_stuck(stuck)
                lost, step = self.books.lost_without_progress()
                if lost >= LOST_WITHOUT_PROGRESS:
                    return self._fail_poison(lost, step)
                try:
                    return self._attempts(monitor)
                except InvalidTransition as e:
                    return self._fail_inconsistent(e)
        finally:
            restore()
            if self._trainer is not None:
                self._trainer.kill()

    def _fail_stuck(self, stuck: int) -> SupervisorResult:
        """The job's newest attempts all ended Preempted without a step: fail it (an attempt on this
        node, ended Failed, so that a `resume` afterwards counts afresh)."""
        message = (f"the last {stuck} attempts all ended Preempted without completing a step, so this node does not "
                   f"start another: real spot notices rarely come that close together, while anything on the node "
                   f"that sends the supervisor SIGTERM looks the same (see the attempts: grpo-run get tj "
                   f"{self.spec.name} -o yaml); `grpo-run resume {self.spec.name}` tries again")
        self.books.start_attempt(node_name(), from_step=self.books.record.attempts()[-1]["to_step"] or 0)
        return self._end(End.FAILED, message)

    def _fail_inconsistent(self, e: InvalidTransition) -> SupervisorResult:
        """The record cannot move where the run is (e.g. Pending -> Succeeded: a record replayed or
        edited in storage while a checkpoint says the run got further). The attempt ends Failed
        with the reason, and the job too where its phase allows that; never a traceback."""
        message = (f"the job's record and the run disagree ({e}): the record or a checkpoint in storage was changed "
                   f"by hand or replayed, so this attempt is ended; see `grpo-run get tj {self.spec.name} -o yaml`")
        log.error("%s", message)
        if self._trainer is not None:
            self._trainer.kill()
        self.books.abandon(message)
        return SupervisorResult(ENDINGS[End.FAILED].exit_code, message)

    def _fail_poison(self, lost: int, step: int) -> SupervisorResult:
        """The job's newest attempts all lost their node before completing a step, each from the
        checkpoint at `step`: fail it with the reason (an attempt on this node, ended Failed, so
        that a `resume` afterwards counts afresh), and the node (or its queue) moves on."""
        message = (f"the last {lost} attempts each lost their node without a word (killed, out of memory, or hung "
                   f"until stopped), all from step {step} before completing a step, so this node does not start "
                   f"another: the job itself most likely takes the node down (a reward's memory or processes, a "
                   f"step that hangs); see the attempts (grpo-run get tj {self.spec.name} -o yaml) and the "
                   f"node's kernel log (OOM kills), fix it, then `grpo-run resume {self.spec.name}` tries again")
        self.books.start_attempt(node_name(), from_step=step)
        return self._end(End.FAILED, message)

    def _attempts(self, monitor: NoticeMonitor) -> SupervisorResult:
        """Attempts until one ends the job: one that ends in a way worth another (_Restart) is
        followed by another after a backoff, each kind of failure up to its own limit."""
        restarts = {"crashes": 0, "infrastructure": 0}
        wait = backoff(self.limits.backoff_s, 60.0)    # tenacity's exponential wait + jitter, as storage's
        while True:
            try:
                return self._attempt(monitor)
            except _Restart as why:
                self._crashed = why.kind == "crashes"
                restarts[why.kind] += 1
                limit = self.limits.limit(why.kind)
                if restarts[why.kind] > limit:
                    return self._end(End.CRASHED_OUT, f"{why}; {why.kind} restart limit ({limit}) reached")
                delay = nth_wait(wait, sum(restarts.values()))
                log.warning("%s; restart %d of %d (%s) in %.0f s", why, restarts[why.kind], limit, why.kind, delay)
                self._sleep(delay)
                if self.preempt.is_set():
                    source = _source(monitor)
                    return self._end(End.PREEMPTED, f"notice from {source} between attempts", notice=source,
                                     durable_step=self.durability.durable)

    def _attempt(self, monitor: NoticeMonitor) -> SupervisorResult:
        """One trainer process, from restoring its checkpoint to recording how it ended. Raises
        _Restart when that is worth another attempt. A trainer alone is started first: its model,
        graders and engine load while the checkpoint is fetched, and it goes on (TrainerProcess.go)
        once the checkpoint is in place and the attempt is in the books; under a launcher it is
        started after the fetch."""
        trainer = self._trainer = TrainerProcess(self.spec, self.work, self.books, self.durability,
                                                 checkpoints=self._checkpoints, wake=self._wake,
                                                 prewarmed=self._prewarmed)
        self._prewarmed = None            # one attempt takes it (or ends it)
        unavailable: SamplerUnavailable | None = None
        if trainer.starts_before_restore:
            try:
                trainer.start(progress=self.progress)
            except SamplerUnavailable as e:
                unavailable = e           # said once the attempt is recorded, as before the overlap
        try:
            with clock().part("checkpoint fetch"):
                start = self.durability.restore(verify_local=self._crashed)
        except StorageUnavailable as e:
            if not self.preempt.is_set():
                trainer.kill()            # it waits for `go`: nothing of it is recorded
                raise _Restart("infrastructure", f"storage unavailable while restoring: {e}") from None
            start = 0                     # the notice stopped the download: not an outage
        if self.preempt.is_set():         # a notice while restoring: the waiting trainer has nothing to save
            trainer.kill()
            source, durable = _source(monitor), self.durability.durable
            since = (dt.datetime.now(dt.timezone.utc) - monitor.notice.received_at).total_seconds() \
                if monitor.notice else 0.0
            self.books.record_notice(source, since, durable)
            return self._end(End.PREEMPTED, f"notice from {source} while restoring; nothing to save, step {durable} "
                                            f"stays durable", notice=source, durable_step=durable)
        self.books.start_attempt(node_name(), from_step=start)
        if unavailable is not None:
            return self._end(End.FAILED, str(unavailable))
        if not trainer.starts_before_restore:
            try:
                trainer.start(progress=self.progress)
            except SamplerUnavailable as e:
                return self._end(End.FAILED, str(e))
        trainer.go()
        budget = self.books.budget()
        while not (trainer.done.is_set() or self.preempt.is_set() or self._cancel.is_set()):
            wait_awake(self._wake, AWAKE_S)  # awake enough for a SIGTERM the kernel gave another thread
            self._wake.clear()
            silent = trainer.watchdog.overdue()
            if silent is not None and not trainer.done.is_set():
                return self._hung(trainer, silent)
            # the trainer stops itself before a step would pass maxCostUSD; one that has not, well
            # past it (held by its reward, say), is stopped here
            # (a budget already spent when the attempt began, by the stop's reserve say, is late from
            # the attempt's start: the grace counts from there, never from before it)
            graced = time.monotonic() - BUDGET_GRACE_S
            if budget is not None and graced > budget.since and budget.late(graced) and not trainer.done.is_set():
                return self._over_budget(trainer)
        if self.preempt.is_set():
            return self._preempted(monitor, trainer)
        if self._cancel.is_set():         # stop at the last completed step (killed if it will not)
            trainer.stop(self.notice_window_s)
        return self._ended(trainer)

    def _over_budget(self, trainer: TrainerProcess) -> SupervisorResult:
        """The trainer ran BUDGET_GRACE_S past maxCostUSD without stopping itself: stopped at its
        last completed step (killed if not gone within the notice window), the job BudgetExceeded."""
        log.error("the trainer is %.0f s past maxCostUSD and has not stopped by itself: stopping it", BUDGET_GRACE_S)
        trainer.stop(self.notice_window_s)
        step = self.durability.wait()
        message = (f"spent ${self.books.spent_usd():.4f} of maxCostUSD ${self.spec.max_cost_usd}: the trainer went "
                   f"{BUDGET_GRACE_S:.0f} s past it without stopping itself, so the supervisor stopped it after step "
                   f"{step}, durable (resume with a larger budget)")
        return self._end(End.BUDGET_EXCEEDED, message, durable_step=step)

    def _hung(self, trainer: TrainerProcess, silent: float) -> SupervisorResult:
        """The trainer went `silent` seconds without an event, past its watchdog's bound: killed
        with what it started, the attempt recorded Crashed, restarted under the crash limit."""
        message = (f"hung: the trainer reported nothing for {silent:.0f} s (no step, no evaluation batch, no "
                   f"checkpoint; the bound is {trainer.watchdog.bound_s:.0f} s, from rewardTimeoutSeconds and the "
                   f"step time, or {HANG_ENV}); it was killed, and the next attempt continues from step "
                   f"{self.durability.durable}")
        log.error("%s", message)
        trainer.kill_session()
        trainer.done.wait()
        if self.spec.nodes is not None:
            return self._group_lost(message)
        self.books.end_attempt(AttemptEnd.CRASHED, message)
        raise _Restart("crashes", message)

    def _ended(self, trainer: TrainerProcess) -> SupervisorResult:
        """The trainer exited on its own: done, stopped at the deadline, or failed."""
        out, fatal = trainer.outcome(), self.durability.fatal
        if out.how is How.DONE:
            return self._succeeded(trainer)
        if self._cancel.is_set() and fatal is None and out.how in (How.STOPPED, How.DEADLINE, How.CRASHED):
            return self._cancelled(self.durability.wait())   # "crashed": killed after the window
        if out.how in (How.STOPPED, How.DEADLINE) and fatal is None:
            step = self.durability.wait()
            if out.how is How.DEADLINE:
                return self._end(End.BUDGET_EXCEEDED, f"spent ${self.books.spent_usd():.4f} of maxCostUSD "
                                 f"${self.spec.max_cost_usd}; stopped after step {out.step} with a checkpoint (resume "
                                 f"with a larger budget)", durable_step=step)
            if self.spec.nodes is not None:       # no notice here, no cancel: one on another node
                return self._end(End.PREEMPTED, f"stopped after step {step} with the other nodes of the group (a "
                                 f"notice on one of them), durable; resume continues from there", durable_step=step)
            return self._end(End.PREEMPTED, f"stopped after step {step}; resume continues from there", durable_step=step)
        if fatal is None and out.how is How.CRASHED and self.spec.nodes is not None:
            return self._group_lost(out.message)
        if fatal is None and out.how is How.CRASHED:
            self.books.end_attempt(AttemptEnd.CRASHED, out.message)
            raise _Restart("crashes", out.message)
        message = str(fatal) if fatal is not None else out.message if out.how is not How.DISK_FULL else \
            disk_full_message(self.work, out.message, self.durability.durable)
        return self._end(End.FAILED, message, code_error=fatal is None and out.how is How.CODE_ERROR)

    def _group_lost(self, why: str) -> SupervisorResult:
        """Several nodes: a rank ended the attempt (a node lost, a crash). No node restarts alone:
        its ranks would wait at the rendezvous for peers that are not coming. The newest sealed
        checkpoint is made durable and every node exits EXIT_PREEMPTED, for the launcher (SkyPilot,
        a JobSet) to start the group again, which resumes from there."""
        step = self.durability.wait(timeout=self.notice_window_s)
        message = (f"the {self.spec.nodes.count}-node group lost a rank ({why}): every node stops, and the group "
                   f"started again resumes from step {step}, durable")
        log.error("%s", message)
        return self._end(End.GROUP_LOST, message, durable_step=step)

    def _succeeded(self, trainer: TrainerProcess, noticed: tuple[str, float] | None = None) -> SupervisorResult:
        """The final weights into storage, the job Succeeded. `noticed`: a notice's source and
        time (time.monotonic) when one came as the trainer finished; its timing is the final
        weights' upload."""
        final = trainer.last_words.final
        if final is None:
            raise _Restart("crashes", "the trainer exited without its final weights")
        error = self.durability.upload_final(Path(final.path))
        if error is not None:
            raise _Restart("infrastructure", f"the final weights could not be uploaded: {error}")
        notice: dict[str, Any] = {}
        if noticed is not None:
            source, at = noticed
            elapsed = time.monotonic() - at
            self.books.record_notice(source, elapsed, final.step)
            log.warning("notice (%s) as the run ended: its final weights (step %d) in storage %.2f s after it", source,
                        final.step, elapsed)
            notice = {"notice": source, "notice_to_durable_s": elapsed, "durable_step": final.step}
        b, f = self.books.evaluation("baseline"), self.books.evaluation("final")
        self.books.update_reward_signal()
        message = f"final held-out reward {f['meanReward']:.3f} (baseline {b['meanReward']:.3f})" if b and f else ""
        return self._end(End.SUCCEEDED, message, **notice)

    def _preempted(self, monitor: NoticeMonitor, trainer: TrainerProcess) -> SupervisorResult:
        """A notice: stop the trainer inside the window, make the newest sealed checkpoint
        durable, record the attempt as preempted."""
        notice_at = time.monotonic()
        source = _source(monitor)
        if trainer.last_words.final is None:
            log.warning("preemption notice (%s): stopping the trainer at the last completed step", source)
            trainer.stop(self.notice_window_s)
        else:      # its final weights are sealed and it is on its way out: not stopped, uploaded
            log.warning("preemption notice (%s): the trainer has sealed its final weights; uploading them", source)
            trainer.wait_for_exit(self.notice_window_s)
        if trainer.outcome().how is How.DONE:     # it finished before it heard: its final weights go up first
            return self._succeeded(trainer, noticed=(source, notice_at))
        # inside the window even when the store stalls: the rest of it, at least a few seconds
        durable = self.durability.wait(timeout=max(5.0, self.notice_window_s - (time.monotonic() - notice_at)))
        elapsed = time.monotonic() - notice_at
        self.books.record_notice(source, elapsed, durable)
        notice = {"notice": source, "notice_to_durable_s": elapsed, "durable_step": durable}
        log.warning("preempted (%s): step %s durable %.2f s after the notice", source, durable, elapsed)
        return self._end(End.PREEMPTED, f"notice from {source}; stopped after step {durable}, durable; resume "
                                        f"continues from there", **notice)

    def _end(self, end: End, message: str, *, notice: str | None = None, **result: Any) -> SupervisorResult:
        """The one place a run ends: the last attempt's reason and the job's phase from ENDINGS,
        written in one transaction and sent to storage, and the supervisor's result with the
        table's exit status. After a notice (`notice`: its source) the record is the last write
        inside the notice window (window.last_write: tried again while time is left)."""
        row = ENDINGS[end]

        def finish() -> None:      # a notice's source is kept with the attempt it preempted
            self.books.finish(row.phase, row.attempt, message, notice=notice if end is End.PREEMPTED else None)

        if notice is not None and end is End.PREEMPTED:
            self.window.last_write("the preempted attempt", finish, lambda: self.books.sync(wait=True))
        else:
            finish()
        return SupervisorResult(row.exit_code, message, notice=notice, **result)

    def _check_cancel(self) -> None:
        """Whether `grpo-run cancel` has asked (runner.jobs.cancel), called where the supervisor
        talks to storage anyway: after each record upload and each lease renewal. A request
        found stops the trainer at its last completed step. A storage error here is left to the
        upload or renewal that meets it too."""
        if self._cancel.is_set():
            return
        try:
            request = cancel_requested(self.store)
        except (StorageUnavailable, StorageConfigError) as e:
            log.warning("could not look for a cancel request: %s", e)
            return
        if request is None:
            return
        self._cancelled_by = str(request.get("by", "unknown"))
        log.warning("cancelled by %s: stopping the trainer at the last completed step", self._cancelled_by)
        self._cancel.set()
        if self._trainer is not None:
            self._trainer.terminate()
        self._wake.set()

    def _cancelled(self, durable: int) -> SupervisorResult:
        """The job ends as Cancelled, its newest checkpoint (step `durable`) in storage."""
        return self._end(End.CANCELLED, f"cancelled by {self._cancelled_by}; stopped after step {durable}, durable",
                         durable_step=durable)

    def _storage_refused(self, error: BaseException) -> None:
        """A storage configuration error (durability.fatal): the trainer stops, the run fails."""
        if self._trainer is not None:
            self._trainer.terminate()

    def _lease_lost(self, lost: LeaseLost) -> None:
        """Another node took the job over: a stale holder must not write another byte."""
        log.error("lost the job's lease (%s); stopping the trainer without a checkpoint", lost)
        if self._trainer is not None:
            self._trainer.kill()


def _source(monitor: NoticeMonitor) -> str:
    return monitor.notice.source if monitor.notice else "signal"
