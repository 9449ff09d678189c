"""The notice window: from the moment a notice comes, the node has about 30 s (GCP, Azure) and
everything it still sends to storage must fit inside them.

A notice sets the job's stop Event. The job's Store was built with it, so its retries stop (a
backoff of up to 15 s cannot be afforded), and from then on every storage call is bounded by the
window's end (`Store.finish_by`): a stalled server holds a request until botocore's 60 s read
timeout, which would hold the exit past the window. The last writes of the record and the lease's
release are bounded the same way; what did not reach storage in time stays on this node's disk
(the lease expires by itself), and a resuming node continues from what storage has.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from grpo_run.checkpoint.storage.lease import Lease
from grpo_run.checkpoint.storage.store import ObjectStore, StorageUnavailable

log = logging.getLogger(__name__)

EXIT_MARGIN_S = 5.0      # of the window, kept for closing the books and the exit after the last upload
RETRY_LEFT_S = 1.0       # the last record upload is tried again while this much of the window is left
RETRY_PAUSE_S = 0.25


class NoticeWindow:
    """Watches the stop Event; once it is set, bounds `store`'s calls by the window's end."""

    def __init__(self, preempt: threading.Event, seconds: float) -> None:
        self.preempt = preempt
        self.seconds = seconds
        self.deadline: float | None = None          # time.monotonic() at which storage is given up

    def watch(self, store: ObjectStore, wake: threading.Event) -> None:
        """From a thread of its own: at the notice, bound `store`'s calls and wake the supervisor."""
        def on_notice() -> None:
            self.preempt.wait()
            self.deadline = time.monotonic() + max(1.0, self.seconds - EXIT_MARGIN_S)
            store.finish_by(self.deadline)
            wake.set()

        threading.Thread(target=on_notice, name="notice-window", daemon=True).start()

    def left(self) -> float | None:
        """Seconds left for storage, None before any notice."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def last_write(self, what: str, write: Callable[[], None], again: Callable[[], None]) -> None:
        """`write()` (the record's last change and its upload, ending a preempted attempt). After
        a notice the store tries each call once (its retries stop), so one transient error would
        leave storage's record saying the job still trains: the upload is tried `again()` while
        the window has RETRY_LEFT_S to spare. A failure past that is logged, not raised: the
        record is on this node's disk either way."""
        try:
            write()
            return
        except StorageUnavailable as e:
            error = e
        while (left := self.left()) is not None and left > RETRY_LEFT_S:
            log.warning("%s did not reach storage (%s); trying again, %.0f s of the window left", what, error, left)
            time.sleep(RETRY_PAUSE_S)
            try:
                again()
                return
            except StorageUnavailable as e:
                error = e
        log.error("%s did not reach storage inside the notice window; this node's copy has it (%s)", what, error)

    def release(self, lease: Lease) -> None:
        """Release the lease; after a notice, only as long as the window allows (a lease that
        is not released expires by itself)."""
        left = self.left()
        if left is None:
            lease.release()
            return
        thread = threading.Thread(target=lease.release, name="lease-release", daemon=True)
        thread.start()
        thread.join(left)
        if thread.is_alive():
            log.warning("the lease was not released inside the notice window; it expires by itself")
