"""Spot-interruption notices: the monitor that polls the watchers (runner.metadata), and signal handlers.

SPEC §4: AWS spot (IMDSv2 ``spot/instance-action``, a 2-minute notice, plus rebalance
recommendations), GCP (``instance/preempted``, about 30 s), Azure Scheduled Events (``Preempt``,
about 30 s), and SIGTERM from Kubernetes / systemd. Every source ends in the same place: one
shared ``threading.Event`` meaning "we are being preempted", which the supervisor and every
retry loop watch (STYLE: one Event shared by watchers and retry loops).

A rebalance recommendation (AWS only) does not stop the run; ``on_rebalance`` is told once per
recommendation so the supervisor can take an early checkpoint while training continues.

Metadata base addresses come from ``GRPO_RUN_{AWS,GCP,AZURE}_METADATA_URL`` (SPEC §6) so tests
can point them at the emulators in ``tests/emulators.py``; a constructor argument wins over the
variable. Off-cloud the link-local addresses do not answer, so every request has a short
timeout, and a watcher that cannot reach its service logs one warning and lets the run go on.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, get_args

__all__ = ["CLOUDS", "DEFAULT_POLL_INTERVAL_S", "DEFAULT_REQUEST_TIMEOUT_S", "MAX_POLL_INTERVAL_S",
           "Notice", "NoticeMonitor", "Watcher", "install_signal_handlers", "wait_awake"]

logger = logging.getLogger(__name__)


# The shortest notice is ~30 s (GCP, Azure) and the supervisor still has to checkpoint and sync
# inside it, so a notice must not wait more than a couple of seconds to be seen.
DEFAULT_POLL_INTERVAL_S = 1.0
MAX_POLL_INTERVAL_S = 2.0
# The metadata services are link-local and answer in milliseconds when they exist at all.
DEFAULT_REQUEST_TIMEOUT_S = 1.0
# A GCP long poll hangs at most this long, so that stopping a monitor is prompt.
MAX_GCP_LONG_POLL_S = 2

Cloud = Literal["aws", "gcp", "azure"]  # the clouds whose metadata services runner.metadata asks
CLOUDS: tuple[Cloud, ...] = get_args(Cloud)
Source = Literal[Cloud, "signal"]
Kind = Literal["preempt", "rebalance"]


@dataclass(frozen=True)
class Notice:
    """One interruption notice, as it was received."""

    source: Source
    kind: Kind  # "preempt": checkpoint, sync and exit; "rebalance": checkpoint early, go on
    detail: str  # what the service said, for the attempt's record and the log
    received_at: dt.datetime  # UTC

    @classmethod
    def now(cls, source: Source, kind: Kind, detail: str) -> Notice:
        return cls(source, kind, detail, dt.datetime.now(dt.timezone.utc))


class Watcher(Protocol):
    """Something that can be asked, now and then, whether this node is about to go away."""

    source: Source

    def poll(self) -> Notice | None:
        """The current notice, if any. Never raises for an unreachable or failing service."""
        ...

    def probe(self) -> bool:
        """Whether this watcher's service answers at all (for ``make_watchers("auto")``)."""
        ...


# --- the monitor --------------------------------------------------------------------------------


class NoticeMonitor:
    """Polls every watcher and turns the first preempt notice into ``preempt.set()``.

    One thread per watcher, so that a slow service (a GCP long poll, a lookup that hangs) never
    delays another cloud's notice. Threads end on ``stop()`` and once preemption is under way.

        monitor = NoticeMonitor(make_watchers(), on_rebalance=request_checkpoint)
        with monitor:
            ...  # train; check monitor.preempt between steps

    ``on_rebalance`` runs on a watcher thread, once per rebalance recommendation; it should be
    quick (set a flag) and is never allowed to stop the monitor by raising.
    """

    def __init__(
        self,
        watchers: Iterable[Watcher],
        *,
        preempt: threading.Event | None = None,
        on_rebalance: Callable[[Notice], None] | None = None,
        poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
    ) -> None:
        if not 0 < poll_interval_s <= MAX_POLL_INTERVAL_S:
            raise ValueError(
                f"poll_interval_s: must be in (0, {MAX_POLL_INTERVAL_S}] (got {poll_interval_s}); "
                "a 30 s notice leaves no time to wait longer"
            )
        self.watchers: tuple[Watcher, ...] = tuple(watchers)
        self.preempt = preempt if preempt is not None else threading.Event()
        self._on_rebalance = on_rebalance
        self._interval = poll_interval_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._notice: Notice | None = None
        self._threads: list[threading.Thread] = []

    @property
    def notice(self) -> Notice | None:
        """The first preempt notice, from whichever source it came."""
        with self._lock:
            return self._notice

    @property
    def running(self) -> bool:
        return any(thread.is_alive() for thread in self._threads)

    def start(self) -> NoticeMonitor:
        """Start polling. Raises RuntimeError if already started."""
        if self._threads:
            raise RuntimeError("NoticeMonitor.start: already started; make a new monitor")
        self._threads = [
            threading.Thread(
                target=self._watch, args=(w,), name=f"grpo-run-notices-{w.source}", daemon=True
            )
            for w in self.watchers
        ]
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, timeout_s: float = MAX_GCP_LONG_POLL_S + 2 * DEFAULT_REQUEST_TIMEOUT_S) -> None:
        """Stop polling and wait for the threads: at once between polls, or when a request in
        flight ends (bounded by its timeout). Threads still busy after ``timeout_s`` are daemons
        and are left to finish on their own."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def report(self, notice: Notice) -> None:
        """Act on a notice from any source (watcher threads, signal handlers' reader thread).
        Thread-safe; not for use inside a signal handler itself (it takes a lock)."""
        if notice.kind == "preempt":
            with self._lock:
                first = self._notice is None
                if first:
                    self._notice = notice
            if first:
                logger.warning("preemption notice from %s: %s", notice.source, notice.detail)
            else:     # one stop is under way already: it is not started again, nor cut short
                logger.warning("another preemption notice from %s (%s) while the first, from %s, is "
                               "handled: the stop under way goes on", notice.source, notice.detail,
                               self._notice.source)
            self.preempt.set()  # after recording, so whoever wakes on it finds the notice
            return
        logger.info("rebalance notice from %s: %s", notice.source, notice.detail)
        if self._on_rebalance is not None:
            try:
                self._on_rebalance(notice)
            except Exception:
                logger.exception("on_rebalance failed; polling goes on")

    def _watch(self, watcher: Watcher) -> None:
        crashed_before = False
        while not (self._stop.is_set() or self.preempt.is_set()):
            try:
                notice = watcher.poll()
            except Exception:
                # A bug in one watcher must not take the run down or flood the log.
                if not crashed_before:
                    logger.exception("%s watcher failed; it keeps polling", watcher.source)
                crashed_before = True
                notice = None
            if notice is not None:
                self.report(notice)
            self._stop.wait(self._interval)  # returns at once on stop(): no sleeping past it

    def __enter__(self) -> NoticeMonitor:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


# --- signals ------------------------------------------------------------------------------------


AWAKE_S = 0.5     # the longest the main thread sleeps at once while a notice may come by signal


def wait_awake(event: threading.Event, timeout: float | None = None) -> bool:
    """`event.wait(timeout)` in slices of AWAKE_S, for the main thread. The kernel may hand a
    process's SIGTERM to any of its threads, and CPython then runs the Python handler only when
    the main thread next runs Python: a main thread asleep on one long wait would sleep through
    the notice (until the trainer ended, in a test that sends the signal to another thread)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = AWAKE_S if deadline is None else min(AWAKE_S, deadline - time.monotonic())
        if left <= 0:
            return event.is_set()
        if event.wait(left):
            return True


def install_signal_handlers(
    preempt: threading.Event,
    *,
    on_notice: Callable[[Notice], None] | None = None,
    signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT),
) -> Callable[[], None]:
    """Make SIGTERM / SIGINT (Kubernetes, systemd, Ctrl-C) a preempt notice with source
    "signal": ``on_notice(notice)`` (e.g. ``monitor.report``) is called, then ``preempt`` is set.
    A second SIGINT raises KeyboardInterrupt as usual: Ctrl-C twice means stop now.

    Returns a function that restores the previous handlers (call it from the main thread).
    Raises ValueError off the main thread: Python runs signal handlers only there.
    """
    if threading.current_thread() is not threading.main_thread():
        raise ValueError(
            "install_signal_handlers: call it from the main thread; "
            "Python delivers signals only there"
        )

    # A Python signal handler runs between two bytecodes of the main thread -- possibly while
    # that thread holds the very lock Event.set() or a logger needs, which would deadlock. So
    # the handler only writes the signal number to a pipe (no locks), and a reader thread does
    # the rest.
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # a handler must never block, even on a full pipe
    seen: set[int] = set()

    def handler(signum: int, frame: object) -> None:
        if signum == signal.SIGINT and signum in seen:
            raise KeyboardInterrupt
        seen.add(signum)
        try:
            os.write(write_fd, bytes([signum]))
        except OSError:
            pass  # pipe full: a notice is already on its way

    def read() -> None:
        while chunk := os.read(read_fd, 64):  # b"" once restore() closes the write end
            for signum in chunk:
                notice = Notice.now("signal", "preempt", signal.Signals(signum).name)
                if on_notice is not None:
                    try:
                        on_notice(notice)
                    except Exception:
                        logger.exception("on_notice failed for %s", notice.detail)
                preempt.set()
        os.close(read_fd)

    reader = threading.Thread(target=read, name="grpo-run-signals", daemon=True)
    reader.start()
    previous = {sig: signal.signal(sig, handler) for sig in signals}

    restored = False

    def restore() -> None:
        nonlocal restored
        if restored:
            return
        restored = True
        for sig, old in previous.items():
            # None: the old handler was installed from C and cannot be put back; use the default.
            signal.signal(sig, signal.SIG_DFL if old is None else old)
        os.close(write_fd)  # after the handlers are gone, so none writes to a reused fd
        reader.join()

    return restore
