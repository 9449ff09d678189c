"""The supervisor: one per node. It starts the trainer as a child process and owns everything
outside it — spot notices, the guarantee that the last checkpoint is durable, restarts.

    notice (AWS/GCP/Azure metadata, SIGTERM/SIGINT)
        -> SIGTERM to the trainer: it abandons the step in flight, checkpoints the last
           completed step, waits until it is durable in object storage, and exits 3
        -> if the trainer does not finish inside the notice window, it is killed and the
           supervisor uploads the newest local checkpoint itself
        -> the attempt is recorded as Preempted; the supervisor exits with EXIT_PREEMPTED
    rebalance recommendation (AWS) -> SIGUSR1: checkpoint at the next step, keep training
    trainer crash -> restart with backoff, counted by kind, each kind with its own limit

Exit statuses (also in `grpo-run --help`): 0 succeeded, 1 failed, 3 preempted, 4 budget exceeded.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from checkpoint.lease import Lease, LeaseHeld, LeaseLost
from checkpoint.manifest import discover
from checkpoint.store import Store
from checkpoint.sync import Uploader, remote_discover
from runner.notices import NoticeMonitor, Watcher, install_signal_handlers
from state.record import Phase, Record
from trainer import child
from trainer.run import RECORD, RunSpec

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_PREEMPTED = 3
EXIT_BUDGET = 4
EXIT_HELD = 5            # another node holds the job (fencing); nothing was started here

# The shortest notice (GCP, Azure) is ~30 s; leave room for the upload after a forced kill.
DEFAULT_NOTICE_WINDOW_S = 25.0


@dataclass(frozen=True)
class RestartLimits:
    """How many times each kind of trainer failure is restarted on this node before giving up.
    Code errors (the user's reward function) and storage configuration errors are never
    restarted: the same input fails the same way."""
    crashes: int = 3            # the trainer process died or raised unexpectedly
    infrastructure: int = 5     # object storage unavailable past its own retries
    backoff_s: float = 2.0      # doubled after each restart, at most 60 s


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
    """Who holds a job's lease: this host (its name is the instance's name on the clouds)."""
    return socket.gethostname()


def _die_with_parent() -> None:
    """In the child before exec: if the supervisor dies (node lost, SIGKILL), so does the
    trainer — never an orphan training on without anyone watching notices."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Supervisor:
    """Owns the trainer child process, the notice monitor and the end-of-attempt durability."""

    def __init__(self, spec: RunSpec, work: Path, *, watchers: list[Watcher],
                 notice_window_s: float = DEFAULT_NOTICE_WINDOW_S, limits: RestartLimits = RestartLimits(),
                 poll_interval_s: float = 1.0, progress: bool = False,
                 sleep: Callable[[float], None] | None = None) -> None:
        self.spec = spec
        self.work = Path(work)
        self.watchers = watchers
        self.notice_window_s = notice_window_s
        self.limits = limits
        self.poll_interval_s = poll_interval_s
        self.progress = progress
        self.preempt = threading.Event()
        self._sleep = sleep or self.preempt.wait   # a backoff ends early on a notice
        self._child: subprocess.Popen | None = None

    # --- the child -------------------------------------------------------------------------------

    def _start_child(self) -> subprocess.Popen:
        self.work.mkdir(parents=True, exist_ok=True)
        spec_path = self.work / "runspec.json"
        spec_path.write_text(self.spec.to_json())
        env = dict(os.environ)
        env["GRPO_RUN_PROGRESS"] = "1" if self.progress else "0"
        env["GRPO_RUN_SUPERVISOR_PID"] = str(os.getpid())
        # OpenMP threads that spin while waiting turn a busy CPU node (the grader, the uploader,
        # a second process) into 10x slower steps: measured 177 s vs 30 s for two tiny runs side
        # by side on 2 cores. Sleeping waits cost nothing measurable alone. A user's setting wins.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        # Its own session: a terminal's Ctrl-C reaches the supervisor only, which decides.
        return subprocess.Popen([sys.executable, "-m", "trainer.child", str(spec_path)], env=env,
                                start_new_session=True, preexec_fn=_die_with_parent)

    def _request_checkpoint(self, notice) -> None:
        log.info("rebalance recommendation from %s: checkpointing early", notice.source)
        if self._child is not None and self._child.poll() is None:
            self._child.send_signal(signal.SIGUSR1)

    # --- the loop ----------------------------------------------------------------------------------

    def run(self) -> SupervisorResult:
        """Hold the job's lease, then supervise the trainer until it ends or a notice comes."""
        lease = Lease(self.spec.storage, holder=node_name(), stop=self.preempt)
        try:
            lease.acquire()
        except LeaseHeld as e:
            return SupervisorResult(EXIT_HELD, "Held", str(e))
        lease.start_renewing(on_lost=self._lease_lost)
        try:
            return self._supervise()
        finally:
            lease.release()

    def _lease_lost(self, lost: LeaseLost) -> None:
        """Another node took the job over: a stale holder must not write another byte."""
        log.error("lost the job's lease (%s); stopping the trainer without a checkpoint", lost)
        if self._child is not None and self._child.poll() is None:
            self._child.kill()

    def _supervise(self) -> SupervisorResult:
        monitor = NoticeMonitor(self.watchers, preempt=self.preempt, on_rebalance=self._request_checkpoint,
                                poll_interval_s=self.poll_interval_s)
        restore = install_signal_handlers(self.preempt, on_notice=monitor.report) \
            if threading.current_thread() is threading.main_thread() else (lambda: None)
        restarts = {"crashes": 0, "infrastructure": 0}
        backoff = self.limits.backoff_s
        try:
            with monitor:
                while True:
                    self._child = self._start_child()
                    code, notice_at = self._wait_child(monitor)
                    if notice_at is not None:
                        return self._preempted(monitor, notice_at, code, restarts)
                    if code == child.CHILD_SUCCEEDED:
                        return SupervisorResult(EXIT_OK, "Succeeded", restarts=restarts)
                    if code == child.CHILD_PREEMPTED:
                        return SupervisorResult(EXIT_PREEMPTED, "Preempted", restarts=restarts)
                    if code == child.CHILD_BUDGET:
                        return SupervisorResult(EXIT_BUDGET, "BudgetExceeded", restarts=restarts)
                    if code in (child.CHILD_CODE_ERROR, child.CHILD_STORAGE_CONFIG):
                        return SupervisorResult(EXIT_FAILED, "Failed", self._record_message(), restarts=restarts)
                    kind = "infrastructure" if code == child.CHILD_INFRA_ERROR else "crashes"
                    restarts[kind] += 1
                    limit = getattr(self.limits, kind)
                    why = f"trainer exited with status {code}" if code >= 0 else \
                        f"trainer killed by {signal.Signals(-code).name}"
                    if restarts[kind] > limit:
                        message = f"{why}; {kind} restart limit ({limit}) reached"
                        self._record_failure(message, kind)
                        return SupervisorResult(EXIT_FAILED, "Failed", message, restarts=restarts)
                    log.warning("%s; restart %d of %d (%s) in %.0f s", why, restarts[kind], limit, kind, backoff)
                    self._sleep(backoff)
                    backoff = min(backoff * 2, 60.0)
                    if self.preempt.is_set():
                        return self._preempted(monitor, time.monotonic(), None, restarts)
        finally:
            restore()
            if self._child is not None and self._child.poll() is None:
                self._child.kill()
                self._child.wait()

    def _wait_child(self, monitor: NoticeMonitor) -> tuple[int, float | None]:
        """Wait for the child to exit, or for a notice. On a notice: stop the child inside the
        window (SIGTERM, then SIGKILL). Returns (exit status, monotonic time of the notice)."""
        assert self._child is not None
        while True:
            try:
                return self._child.wait(timeout=0.2), None
            except subprocess.TimeoutExpired:
                pass
            if self.preempt.is_set():
                notice_at = time.monotonic()
                log.warning("preemption notice (%s): stopping the trainer at the last completed step",
                            monitor.notice.source if monitor.notice else "signal")
                self._child.send_signal(signal.SIGTERM)
                try:
                    code = self._child.wait(timeout=self.notice_window_s)
                except subprocess.TimeoutExpired:
                    log.error("the trainer did not stop within %.0f s; killing it", self.notice_window_s)
                    self._child.kill()
                    code = self._child.wait()
                return code, notice_at

    def _preempted(self, monitor: NoticeMonitor, notice_at: float, code: int | None,
                   restarts: dict[str, int]) -> SupervisorResult:
        """Make sure the newest local checkpoint is durable (the trainer normally did it) and
        record the attempt as preempted."""
        durable = self._ensure_durable()
        elapsed = time.monotonic() - notice_at
        notice = monitor.notice
        source = notice.source if notice else "signal"
        with Record(self.work / RECORD) as record:
            open_attempts = [a for a in record.attempts() if a["ended"] is None]
            for a in open_attempts:       # the trainer was killed before it could say so
                record.end_attempt(a["id"], "Preempted", f"notice from {source}")
            job = record.job()
            if job and job["phase"] not in (Phase.PREEMPTED, Phase.SUCCEEDED):
                record.set_phase(Phase.PREEMPTED, f"notice from {source}; durable at step {durable}")
            record.set_value("lastNotice", {"source": source, "noticeToDurableSeconds": round(elapsed, 3),
                                            "durableStep": durable})
            self._upload_record(record)
        log.warning("preempted (%s): step %s durable %.2f s after the notice", source, durable, elapsed)
        return SupervisorResult(EXIT_PREEMPTED if code != child.CHILD_SUCCEEDED else EXIT_OK,
                                "Preempted" if code != child.CHILD_SUCCEEDED else "Succeeded",
                                notice=source, notice_to_durable_s=elapsed, durable_step=durable,
                                restarts=restarts)

    def _ensure_durable(self) -> int | None:
        """The newest verified local checkpoint, uploaded if it is not in storage yet."""
        store = Store(self.spec.storage)
        local = discover(self.work / "checkpoints") if (self.work / "checkpoints").exists() else []
        remote = remote_discover(store, "checkpoints")
        newest_remote = remote[0] if remote else None
        if not local or (newest_remote is not None and newest_remote >= local[0][0]):
            return newest_remote
        step, folder = local[0]
        with Uploader(store, "checkpoints", keep=self.spec.keep_checkpoints) as uploader:
            uploader.submit(folder)
            if uploader.wait():
                return step
        return newest_remote

    def _upload_record(self, record: Record) -> None:
        snap = self.work / "state.supervisor.db"
        record.snapshot(snap)
        Store(self.spec.storage).put_file(snap, RECORD)

    def _record_message(self) -> str:
        with Record(self.work / RECORD) as record:
            job = record.job()
            return job["message"] if job else ""

    def _record_failure(self, message: str, kind: str) -> None:
        with Record(self.work / RECORD) as record:
            for a in record.attempts():
                if a["ended"] is None:
                    record.end_attempt(a["id"], "Crashed", message)
            record.set_value("restartLimit", {"kind": kind, "message": message})
            record.set_phase(Phase.FAILED, message)
            self._upload_record(record)
