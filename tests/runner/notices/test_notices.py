"""Spot-interruption notices reach the shared preempt Event, tested over real HTTP against the
local metadata emulators in tests/emulators.py."""

from __future__ import annotations

import logging
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest
from tests.emulators import (
    AwsImdsEmulator,
    AzureScheduledEventsEmulator,
    GcpMetadataEmulator,
    closed_port_url,
)

from grpo_run.runner.notices.clouds import AwsWatcher, AzureWatcher, GcpWatcher, make_watchers
from grpo_run.runner.notices.monitor import Notice, NoticeMonitor, Watcher, install_signal_handlers

INTERVAL = 0.02  # seconds between polls in these tests
WAIT = 5.0  # upper bound on any wait; reached only when a test is failing


class CountingWatcher:
    """Wraps a watcher to count its polls, so tests synchronise on polls instead of time."""

    def __init__(self, inner: Watcher) -> None:
        self.inner = inner
        self.source = inner.source
        self.polls = 0
        self.noticed_at_poll: int | None = None
        self._changed = threading.Condition()

    def poll(self) -> Notice | None:
        notice = self.inner.poll()
        with self._changed:
            self.polls += 1
            if notice is not None and self.noticed_at_poll is None:
                self.noticed_at_poll = self.polls
            self._changed.notify_all()
        return notice

    def probe(self) -> bool:
        return self.inner.probe()

    def wait_for_polls(self, count: int) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self.polls >= count, WAIT)

    def polls_so_far(self) -> int:
        with self._changed:
            return self.polls


def warnings_logged(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return logged(caplog, logging.WARNING)


def logged(caplog: pytest.LogCaptureFixture, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("grpo_run.runner.notices.") and r.levelno == level]


def assert_preempted_within_a_couple_of_polls(watcher: Watcher, trigger) -> NoticeMonitor:
    counting = CountingWatcher(watcher)
    monitor = NoticeMonitor([counting], poll_interval_s=INTERVAL)
    with monitor:
        assert counting.wait_for_polls(1)
        assert not monitor.preempt.is_set()
        polls_before = counting.polls_so_far()
        trigger()
        assert monitor.preempt.wait(WAIT)
    # A poll in flight when the notice appeared may miss it; the next one must not.
    assert counting.noticed_at_poll is not None
    assert counting.noticed_at_poll <= polls_before + 2
    return monitor


# --- each cloud's notice ----------------------------------------------------------------------


def test_an_aws_spot_interruption_sets_preempt_within_a_couple_of_polls():
    with AwsImdsEmulator() as imds:
        watcher = AwsWatcher(imds.url)
        monitor = assert_preempted_within_a_couple_of_polls(watcher, imds.trigger_preempt)
    assert monitor.notice is not None
    assert (monitor.notice.source, monitor.notice.kind) == ("aws", "preempt")
    assert "terminate at 20" in monitor.notice.detail


@pytest.mark.parametrize("long_poll_s", [0, 1], ids=["plain-polls", "long-polls"])
def test_a_gcp_preemption_sets_preempt_within_a_couple_of_polls(long_poll_s):
    with GcpMetadataEmulator() as gcp:
        watcher = GcpWatcher(gcp.url, long_poll_s=long_poll_s)
        monitor = assert_preempted_within_a_couple_of_polls(watcher, gcp.trigger_preempt)
        assert (gcp.long_polls > 0) == (long_poll_s > 0)
    assert monitor.notice is not None
    assert (monitor.notice.source, monitor.notice.kind) == ("gcp", "preempt")


def test_an_azure_preempt_event_sets_preempt_within_a_couple_of_polls():
    with AzureScheduledEventsEmulator() as azure:
        event_ids: list[str] = []
        monitor = assert_preempted_within_a_couple_of_polls(
            AzureWatcher(azure.url), lambda: event_ids.append(azure.trigger_preempt())
        )
    assert monitor.notice is not None
    assert (monitor.notice.source, monitor.notice.kind) == ("azure", "preempt")
    assert event_ids[0] in monitor.notice.detail


def test_azure_maintenance_that_the_vm_survives_is_not_a_preemption():
    with AzureScheduledEventsEmulator() as azure:
        azure.add_event("Freeze")
        assert AzureWatcher(azure.url).poll() is None


def every_cloud():
    return AwsImdsEmulator(), GcpMetadataEmulator(), AzureScheduledEventsEmulator()


def test_one_monitor_watches_every_cloud_on_the_same_node():
    imds, gcp, azure = every_cloud()
    with imds, gcp, azure:
        watchers = [
            CountingWatcher(watcher)
            for watcher in (AwsWatcher(imds.url), GcpWatcher(gcp.url), AzureWatcher(azure.url))
        ]
        with NoticeMonitor(watchers, poll_interval_s=INTERVAL) as monitor:
            assert all(w.wait_for_polls(1) for w in watchers)
            azure.trigger_preempt()
            assert monitor.preempt.wait(WAIT)
        assert monitor.notice is not None and monitor.notice.source == "azure"


# --- AWS rebalance and IMDSv2 tokens ----------------------------------------------------------


def test_an_aws_rebalance_recommendation_calls_back_once_and_does_not_preempt():
    rebalances: list[Notice] = []
    called = threading.Event()

    def on_rebalance(notice: Notice) -> None:
        rebalances.append(notice)
        called.set()

    with AwsImdsEmulator() as imds:
        counting = CountingWatcher(AwsWatcher(imds.url))
        monitor = NoticeMonitor([counting], on_rebalance=on_rebalance, poll_interval_s=INTERVAL)
        with monitor:
            imds.trigger_rebalance()
            assert called.wait(WAIT)
            assert counting.wait_for_polls(counting.polls_so_far() + 10)  # it stays published
            assert not monitor.preempt.is_set()
    assert [(n.source, n.kind) for n in rebalances] == [("aws", "rebalance")]


def test_a_new_rebalance_recommendation_is_reported_again():
    with AwsImdsEmulator() as imds:
        watcher = AwsWatcher(imds.url)
        imds.trigger_rebalance("2026-05-10T12:00:00Z")
        first = watcher.poll()
        assert watcher.poll() is None
        imds.trigger_rebalance("2026-05-10T12:05:00Z")
        second = watcher.poll()
    assert first is not None and "12:00:00Z" in first.detail
    assert second is not None and "12:05:00Z" in second.detail


def test_imdsv2_refuses_a_request_without_a_token():
    with AwsImdsEmulator() as imds:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(imds.url + AwsImdsEmulator.ACTION_PATH, timeout=WAIT)
        refused.value.close()
    assert refused.value.code == 401


def test_the_aws_watcher_gets_a_token_first_and_is_never_refused():
    with AwsImdsEmulator() as imds:
        watcher = AwsWatcher(imds.url)
        for _ in range(5):
            assert watcher.poll() is None
        assert (imds.tokens_issued, imds.unauthorized) == (1, 0)


def test_the_aws_watcher_gets_a_new_token_when_the_old_one_is_refused():
    with AwsImdsEmulator() as imds:
        watcher = AwsWatcher(imds.url)
        assert watcher.poll() is None
        imds.expire_tokens()
        imds.trigger_preempt("stop")
        notice = watcher.poll()
        assert imds.tokens_issued == 2
    assert notice is not None and "stop at" in notice.detail


def test_the_aws_watcher_renews_its_token_before_it_expires():
    now = [1000.0]
    with AwsImdsEmulator() as imds:
        watcher = AwsWatcher(imds.url, token_ttl_s=100, clock=lambda: now[0])
        watcher.poll()
        now[0] += 95  # past 90% of the token's life
        watcher.poll()
        assert (imds.tokens_issued, imds.unauthorized) == (2, 0)


# --- services that do not answer ----------------------------------------------------------------


@pytest.mark.parametrize("watcher_type", [AwsWatcher, GcpWatcher, AzureWatcher])
def test_an_unreachable_service_is_warned_about_once_and_never_preempts(watcher_type, caplog):
    caplog.set_level(logging.INFO, logger="grpo_run.runner.notices")
    counting = CountingWatcher(watcher_type(closed_port_url()))
    with NoticeMonitor([counting], poll_interval_s=INTERVAL) as monitor:
        assert counting.wait_for_polls(20)
    assert not monitor.preempt.is_set()
    assert len(warnings_logged(caplog)) == 1
    assert "unreachable" in warnings_logged(caplog)[0].getMessage()


def test_a_failing_service_is_warned_about_once_and_its_notice_arrives_after_it_recovers(caplog):
    caplog.set_level(logging.INFO, logger="grpo_run.runner.notices")
    with AwsImdsEmulator() as imds:
        watcher = AwsWatcher(imds.url)
        imds.fail_with(500)
        assert [watcher.poll() for _ in range(5)] == [None] * 5
        imds.fail_with(None)
        imds.trigger_preempt()
        notice = watcher.poll()
    assert notice is not None and notice.kind == "preempt"
    assert len(warnings_logged(caplog)) == 1
    assert any("answers again" in r.getMessage() for r in caplog.records)


def test_a_service_that_goes_away_and_comes_back_still_delivers_its_notice():
    with AzureScheduledEventsEmulator() as azure:
        watcher = AzureWatcher(azure.url)
        azure.go_unreachable()
        assert watcher.poll() is None
        azure.come_back()
        azure.trigger_preempt()
        assert watcher.poll() is not None


def test_a_server_that_is_not_gcp_is_neither_a_notice_nor_detected_as_gcp():
    with AwsImdsEmulator() as not_gcp:  # answers, but not as GCP does
        watcher = GcpWatcher(not_gcp.url)
        assert watcher.poll() is None
        assert not watcher.probe()


# --- configuration ------------------------------------------------------------------------------


def test_metadata_addresses_come_from_the_environment(monkeypatch):
    imds, gcp, azure = every_cloud()
    with imds, gcp, azure:
        monkeypatch.setenv("GRPO_RUN_AWS_METADATA_URL", imds.url)
        monkeypatch.setenv("GRPO_RUN_GCP_METADATA_URL", gcp.url + "/")
        monkeypatch.setenv("GRPO_RUN_AZURE_METADATA_URL", azure.url)
        for emulator in (imds, gcp, azure):
            emulator.trigger_preempt()
        notices = [AwsWatcher().poll(), GcpWatcher().poll(), AzureWatcher().poll()]
    assert [n.source if n else None for n in notices] == ["aws", "gcp", "azure"]


def test_an_address_given_to_the_watcher_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("GRPO_RUN_AWS_METADATA_URL", closed_port_url())
    with AwsImdsEmulator() as imds:
        imds.trigger_preempt()
        assert AwsWatcher(imds.url).poll() is not None


def test_auto_detection_picks_the_clouds_whose_service_answers(monkeypatch):
    with AwsImdsEmulator() as imds, AzureScheduledEventsEmulator() as azure:
        monkeypatch.setenv("GRPO_RUN_AWS_METADATA_URL", imds.url)
        monkeypatch.setenv("GRPO_RUN_GCP_METADATA_URL", closed_port_url())
        monkeypatch.setenv("GRPO_RUN_AZURE_METADATA_URL", azure.url)
        assert [w.source for w in make_watchers("auto")] == ["aws", "azure"]
        # AWS and Azure share 169.254.169.254 in the real world: each must answer only as itself.
        monkeypatch.setenv("GRPO_RUN_AWS_METADATA_URL", azure.url)
        monkeypatch.setenv("GRPO_RUN_AZURE_METADATA_URL", imds.url)
        assert make_watchers("auto") == []


def test_auto_detection_finds_gcp_by_its_flavor_header(monkeypatch):
    with GcpMetadataEmulator() as gcp:
        monkeypatch.setenv("GRPO_RUN_AWS_METADATA_URL", closed_port_url())
        monkeypatch.setenv("GRPO_RUN_GCP_METADATA_URL", gcp.url)
        monkeypatch.setenv("GRPO_RUN_AZURE_METADATA_URL", closed_port_url())
        assert [w.source for w in make_watchers()] == ["gcp"]


def test_named_clouds_are_watched_without_probing_and_unknown_ones_refused(monkeypatch):
    monkeypatch.setenv("GRPO_RUN_GCP_METADATA_URL", closed_port_url())
    assert [w.source for w in make_watchers(["gcp", "aws"])] == ["gcp", "aws"]
    with pytest.raises(ValueError, match="unknown oci; use auto or any of aws, gcp, azure"):
        make_watchers(["oci"])


def test_a_poll_interval_beyond_two_seconds_is_refused():
    with pytest.raises(ValueError, match="poll_interval_s"):
        NoticeMonitor([], poll_interval_s=5.0)


# --- the monitor --------------------------------------------------------------------------------


def test_the_monitor_stops_promptly_between_polls():
    with AwsImdsEmulator() as imds, AzureScheduledEventsEmulator() as azure:
        watchers = [CountingWatcher(AwsWatcher(imds.url)), CountingWatcher(AzureWatcher(azure.url))]
        monitor = NoticeMonitor(watchers, poll_interval_s=2.0).start()
        assert all(w.wait_for_polls(1) for w in watchers)  # now each waits 2 s for its next poll
        started = time.monotonic()
        monitor.stop()
        assert time.monotonic() - started < 0.5
        assert not monitor.running


def test_stopping_during_a_gcp_long_poll_waits_at_most_for_the_long_poll():
    with GcpMetadataEmulator() as gcp:
        watcher = GcpWatcher(gcp.url, long_poll_s=1)
        monitor = NoticeMonitor([watcher], poll_interval_s=INTERVAL).start()
        assert gcp.wait_until_long_polled()
        started = time.monotonic()
        monitor.stop()
        assert time.monotonic() - started < 1.5
        assert not monitor.running
        assert not monitor.preempt.is_set()


def test_the_monitor_shares_the_preempt_event_it_is_given():
    shared = threading.Event()
    with AwsImdsEmulator() as imds:
        imds.trigger_preempt()
        with NoticeMonitor([AwsWatcher(imds.url)], preempt=shared, poll_interval_s=INTERVAL):
            assert shared.wait(WAIT)


def test_the_first_preempt_notice_is_the_one_remembered():
    monitor = NoticeMonitor([])
    monitor.report(Notice.now("signal", "preempt", "SIGTERM"))
    monitor.report(Notice.now("aws", "preempt", "terminate"))
    assert monitor.preempt.is_set()
    assert monitor.notice is not None and monitor.notice.source == "signal"


class BrokenWatcher:
    source = "gcp"

    def __init__(self) -> None:
        self.polls = 0

    def poll(self) -> Notice | None:
        self.polls += 1
        raise RuntimeError("a bug in a watcher")

    def probe(self) -> bool:
        return True


def test_a_watcher_that_raises_is_logged_once_and_the_others_still_deliver(caplog):
    broken = BrokenWatcher()
    with AwsImdsEmulator() as imds:
        with NoticeMonitor([broken, AwsWatcher(imds.url)], poll_interval_s=INTERVAL) as monitor:
            imds.trigger_preempt()
            assert monitor.preempt.wait(WAIT)
    assert len(logged(caplog, logging.ERROR)) == 1
    assert monitor.notice is not None and monitor.notice.source == "aws"


# --- signals ------------------------------------------------------------------------------------


def test_sigterm_becomes_a_preempt_notice_from_signal():
    monitor = NoticeMonitor([])
    restore = install_signal_handlers(monitor.preempt, on_notice=monitor.report)
    try:
        signal.raise_signal(signal.SIGTERM)
        assert monitor.preempt.wait(WAIT)
    finally:
        restore()
    assert monitor.notice is not None
    notice = monitor.notice
    assert (notice.source, notice.kind, notice.detail) == ("signal", "preempt", "SIGTERM")


def test_ctrl_c_preempts_and_a_second_ctrl_c_interrupts_at_once():
    preempt = threading.Event()
    restore = install_signal_handlers(preempt)
    try:
        signal.raise_signal(signal.SIGINT)
        assert preempt.wait(WAIT)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    finally:
        restore()


def test_restoring_puts_the_previous_handlers_back():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    restore = install_signal_handlers(threading.Event())
    assert signal.getsignal(signal.SIGTERM) is not before[0]
    restore()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_signal_handlers_can_only_be_installed_from_the_main_thread():
    errors: list[Exception] = []

    def install() -> None:
        try:
            install_signal_handlers(threading.Event())
        except ValueError as err:
            errors.append(err)

    thread = threading.Thread(target=install)
    thread.start()
    thread.join(WAIT)
    assert len(errors) == 1 and "main thread" in str(errors[0])
