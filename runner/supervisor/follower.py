"""A node of rank > 0 among a job's nodes: this node's ranks of the trainer, and nothing else.

The node of rank 0 runs the Supervisor: it holds the job's lease, writes the record, seals and
uploads every checkpoint. A follower writes nothing to storage and keeps no record; it reads the
stored job (resume) like any node, then

    spawn    its ranks under accelerate's launcher, on the rendezvous at rank 0's node; they take
             rank 0's plan and rank 0's checkpoint over the process group (trainer.child,
             trainer.checkpointing), so every node starts from the same bytes
    notice   (its own cloud's, SIGTERM/SIGINT) -> STOP_SIGNAL to its ranks: they tell the others
             at the next step boundary, every rank stops at the same step, and rank 0's node makes
             that checkpoint durable; killed if not gone within the notice window
    end      the exit status says what the group did: 0 done, EXIT_PREEMPTED stopped (a notice
             anywhere) or lost (a rank died: the launcher starts the group again), EXIT_FAILED
             for the job's own code
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
from pathlib import Path

from grpo_run.runner.notices.monitor import AWAKE_S, NoticeMonitor, Watcher, install_signal_handlers, wait_awake
from grpo_run.runner.supervisor.spawn import spawn_trainer
from grpo_run.runner.supervisor.endings import ENDINGS, End
from grpo_run.runner.supervisor.runspec import RunSpec, SupervisorResult
from grpo_run.trainer.protocol import (CHECKPOINTS_DIR, CHILD_CODE_ERROR, CHILD_DONE, CHILD_NO_GROUP, CHILD_STOPPED,
                                       RENDEZVOUS_TIMEOUT_ENV, STOP_SIGNAL, Failed, Plan, parse_event)

log = logging.getLogger(__name__)


class Follower:
    """This node's ranks of a job whose node of rank 0 is elsewhere."""

    def __init__(self, spec: RunSpec, work: Path, *, watchers: list[Watcher], notice_window_s: float,
                 progress: bool = False, preempt: threading.Event | None = None) -> None:
        assert spec.nodes is not None and spec.nodes.rank > 0
        self.spec, self.work = spec, Path(work)
        self.watchers, self.notice_window_s, self.progress = watchers, notice_window_s, progress
        self.preempt = preempt or threading.Event()
        self.failed: Failed | None = None

    def run(self) -> SupervisorResult:
        nodes = self.spec.nodes
        # Only rank 0's node keeps checkpoints; whatever lies here (this node was rank 0 of an
        # earlier group, say) is not this group's: the ranks receive rank 0's
        shutil.rmtree(self.work / CHECKPOINTS_DIR, ignore_errors=True)
        plan = Plan(name=self.spec.name, model=self.spec.model, env=self.spec.env, params=self.spec.params,
                    model_name=self.spec.model_name, keep_checkpoints=self.spec.keep_checkpoints)
        monitor = NoticeMonitor(self.watchers, preempt=self.preempt)
        restore = install_signal_handlers(self.preempt, on_notice=monitor.report) \
            if threading.current_thread() is threading.main_thread() else (lambda: None)
        proc = None
        try:
            with monitor:
                log.info("node %d of %d: joining the group at %s", nodes.rank, nodes.count, nodes.master)
                proc, read_fd = spawn_trainer(self.spec, self.work, plan, progress=self.progress, kept_threads=None)
                reader = threading.Thread(target=self._read_events, args=(read_fd,), daemon=True)
                reader.start()
                while proc.poll() is None and not self.preempt.is_set():
                    wait_awake(self.preempt, AWAKE_S)
                if self.preempt.is_set() and proc.poll() is None:
                    source = monitor.notice.source if monitor.notice else "signal"
                    log.warning("preemption notice (%s): stopping this node's ranks; every node stops at the same step",
                                source)
                    proc.send_signal(STOP_SIGNAL)
                    try:
                        proc.wait(timeout=self.notice_window_s)
                    except subprocess.TimeoutExpired:
                        log.error("this node's ranks did not stop within %.0f s; killing them", self.notice_window_s)
                        os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                reader.join(timeout=5)
                return self._result(proc.returncode)
        finally:
            restore()
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def _read_events(self, fd: int) -> None:
        """Only failures come from ranks other than 0 (trainer.child)."""
        with os.fdopen(fd, "r") as lines:
            for line in lines:
                try:
                    event = parse_event(line)
                except Exception:
                    continue
                if isinstance(event, Failed) and not (self.failed and self.failed.code):
                    self.failed = event

    def _result(self, code: int) -> SupervisorResult:
        """What this node's ranks' exit says, with the endings table's exit status (this node writes no
        record: rank 0's node ends the job's)."""
        nodes, why = self.spec.nodes, f" ({self.failed.message})" if self.failed else ""
        here = f"node {nodes.rank} of {nodes.count}"
        if code == CHILD_DONE:
            return _ended(End.SUCCEEDED, f"{here}: the job is done (rank 0's node holds its record and final weights)")
        if code == CHILD_STOPPED:
            return _ended(End.PREEMPTED, f"{here}: the group stopped at the same step (a notice); rank 0's node made "
                                         f"it durable; resume continues from there", notice="group")
        if code == CHILD_NO_GROUP:
            return _ended(End.FAILED, f"{here}: no group formed at {nodes.master} (the node of rank 0 did not answer "
                                      f"there, or not every node came, within the rendezvous timeout, "
                                      f"{RENDEZVOUS_TIMEOUT_ENV}): start the node of rank 0 with --master at an address "
                                      f"this node reaches; nothing was trained or written")
        if code == CHILD_CODE_ERROR:
            return _ended(End.FAILED, f"{here}: the job's own code failed{why}", code_error=True)
        return _ended(End.GROUP_LOST, f"{here}: the group lost a rank (this node's ranks ended with status {code}{why}); "
                                      f"the group started again resumes from rank 0's newest durable checkpoint")


def _ended(end: End, message: str, **result) -> SupervisorResult:
    return SupervisorResult(ENDINGS[end].exit_code, message, **result)
