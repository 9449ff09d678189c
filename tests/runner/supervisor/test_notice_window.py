"""The record's last write after a notice: the store tries each call once then (its retries stop
at the notice), so the window itself tries the upload again while it has time."""

import threading
import time

from grpo_run.checkpoint.storage.store import StorageUnavailable
from grpo_run.runner.supervisor.window import RETRY_LEFT_S, NoticeWindow


class Flaky:
    """A store call that fails `failures` times, then succeeds."""

    def __init__(self, failures: int) -> None:
        self.failures, self.calls = failures, 0

    def __call__(self) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            raise StorageUnavailable("connection reset by peer")


class NoStore:
    def finish_by(self, deadline):
        pass


def noticed(seconds: float) -> NoticeWindow:
    window = NoticeWindow(threading.Event(), seconds)
    window.watch(NoStore(), threading.Event())
    window.preempt.set()
    while window.left() is None:
        time.sleep(0.01)
    return window


def test_a_transient_error_in_the_last_record_upload_is_tried_again_inside_the_window():
    write, again = Flaky(1), Flaky(1)
    noticed(30).last_write("the preempted attempt", write, again)
    assert (write.calls, again.calls) == (1, 2)        # the write once, then the upload until it went


def test_past_the_window_the_last_write_gives_up_and_the_exit_is_not_held(caplog):
    window = noticed(30)
    window.deadline = time.monotonic() + RETRY_LEFT_S / 2     # less than the retries need is left
    write, again = Flaky(100), Flaky(100)
    started = time.monotonic()
    window.last_write("the preempted attempt", write, again)
    assert time.monotonic() - started < 1 and again.calls == 0
    assert "did not reach storage inside the notice window" in caplog.text
