"""The one retry policy: transient errors retried with growing, jittered waits until the budget,
the attempts or the preemption event says stop; configuration errors and a caller's own answers
never retried; one log line per retry; the sleep injected, so nothing here waits."""

from __future__ import annotations

import logging
import threading

import pytest

from grpo_run.checkpoint.storage.retry import (RetryPolicy, StorageConfigError, StorageUnavailable, backoff, nth_wait)


class RecordingSleep:
    def __init__(self, on_call=None) -> None:
        self.delays: list[float] = []
        self.on_call = on_call

    def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)
        if self.on_call is not None:
            self.on_call(len(self.delays))


class Flaky:
    """Raises `error` for the first `failures` calls, then returns "done"."""

    def __init__(self, error: BaseException, failures: int = 10**9) -> None:
        self.error, self.failures, self.calls = error, failures, 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "done"


def test_a_transient_error_is_ridden_out_with_growing_jittered_waits():
    sleep = RecordingSleep()
    fn = Flaky(ConnectionResetError("reset"), failures=4)

    assert RetryPolicy("storage s3://b/run", sleep=sleep).call("get 'k'", fn) == "done"

    assert fn.calls == 5
    for n, delay in enumerate(sleep.delays):           # 0.5, 1, 2, 4 s, each plus < 0.125 s
        assert 0.5 * 2 ** n <= delay <= 0.5 * 2 ** n + 0.125


def test_attempts_run_out_into_storage_unavailable_naming_the_last_error():
    sleep = RecordingSleep()
    with pytest.raises(StorageUnavailable, match=r"storage s3://b/run: get 'k' failed 3 time\(s\)"
                                                 r".*3 attempts made.*ConnectionRefusedError"):
        RetryPolicy("storage s3://b/run", attempts=3, sleep=sleep).call(
            "get 'k'", Flaky(ConnectionRefusedError("refused")))
    assert len(sleep.delays) == 2


def test_the_budget_ends_retries():
    sleep = RecordingSleep()
    with pytest.raises(StorageUnavailable, match="retry budget of 0s spent"):
        RetryPolicy("storage x", budget_s=0, sleep=sleep).call("get", Flaky(TimeoutError()))
    assert sleep.delays == []


def test_a_preemption_during_a_backoff_ends_retries_without_another_try():
    stop = threading.Event()
    fn = Flaky(ConnectionResetError("reset"))
    sleep = RecordingSleep(on_call=lambda n: stop.set())

    with pytest.raises(StorageUnavailable, match="preemption requested"):
        RetryPolicy("storage x", budget_s=600, stop=stop, sleep=sleep).call("get", fn)

    assert fn.calls == 1 and len(sleep.delays) == 1


def test_the_default_sleep_is_the_stop_event_so_a_notice_ends_the_wait():
    class NoticeDuringTheWait(threading.Event):
        """The preemption event; the notice arrives while the policy waits on it."""
        def __init__(self):
            super().__init__()
            self.waits = []

        def wait(self, timeout=None):
            self.waits.append(timeout)
            self.set()
            return True

    stop = NoticeDuringTheWait()
    fn = Flaky(ConnectionResetError("reset"))
    with pytest.raises(StorageUnavailable, match="preemption requested"):
        RetryPolicy("storage x", budget_s=600, stop=stop).call("get", fn)
    # the backoff was a wait on the event itself (not time.sleep), and no second try followed it
    assert fn.calls == 1 and len(stop.waits) == 1 and stop.waits[0] >= 0.5


def test_a_configuration_error_fails_at_once_and_says_what_to_fix():
    sleep = RecordingSleep()
    fn = Flaky(PermissionError("nope"))
    with pytest.raises(StorageConfigError, match=r"storage x: access denied \(put 'k': "
                                                 r"PermissionError: nope\)"):
        RetryPolicy("storage x", sleep=sleep).call("put 'k'", fn)
    assert fn.calls == 1 and sleep.delays == []


def test_a_callers_own_answer_is_neither_retried_nor_translated():
    class Conflict(Exception):
        pass

    fn = Flaky(Conflict())
    with pytest.raises(Conflict):
        RetryPolicy("lease x", passthrough=(Conflict,), sleep=RecordingSleep()).call("renew", fn)
    assert fn.calls == 1


def test_other_errors_propagate_unchanged():
    fn = Flaky(FileNotFoundError("k"))
    with pytest.raises(FileNotFoundError):
        RetryPolicy("storage x", sleep=RecordingSleep()).call("get", fn)
    assert fn.calls == 1


def test_each_retry_is_one_log_line_on_the_callers_logger(caplog):
    logger = logging.getLogger("checkpoint.test-owner")
    caplog.set_level(logging.WARNING, logger="checkpoint.test-owner")
    RetryPolicy("lease on s3://b/job", sleep=RecordingSleep(), logger=logger).call(
        "renew", Flaky(ConnectionResetError("reset"), failures=2))

    lines = [r.getMessage() for r in caplog.records if r.name == "checkpoint.test-owner"]
    assert len(lines) == 2
    assert lines[0].startswith("lease on s3://b/job: renew failed (attempt 1: ConnectionResetError")
    assert "retrying in 0." in lines[0] and "(attempt 2:" in lines[1]


def test_the_restart_backoff_doubles_to_a_minute_with_jitter():
    wait = backoff(2.0, 60.0)
    for n, base in enumerate([2, 4, 8, 16, 32, 60, 60], start=1):
        assert base <= nth_wait(wait, n) <= base + 0.5
