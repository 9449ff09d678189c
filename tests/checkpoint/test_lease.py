"""Lease: two nodes resuming one job never both train. Exactly one acquires; the other is told
who holds it; a lease left unrenewed for its ttl is taken over and its old holder learns it
lost. Against memory:// (the tests' own double: tests/checkpoint/memory_cas.py), a local folder
(real processes racing) and a real S3 (SeaweedFS, conditional writes).

Expiry is never judged by comparing two machines' clocks: a taker counts a lease unrenewed
either on the store's clock (the object's age; memory:// keeps none) or on its own, having
watched the same version unchanged for the ttl. The injected `Clock` is that own clock, and
each node gets its own: a test makes a node look at a lease, moves that node's clock, and has
it look again.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from grpo_run.checkpoint.storage.by_url import open_store
from grpo_run.checkpoint.storage.lease import Lease, LeaseHeld, LeaseLost, read_lease
from grpo_run.checkpoint.storage.store import StorageConfigError, StorageUnavailable
from tests.checkpoint.memory_cas import use_memory_cas


class Clock:
    """An injected clock (seconds; only its differences count) that moves only when a test
    moves it."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class RecordingSleep:
    def __init__(self) -> None:
        self.delays: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


@pytest.fixture(params=["memory", "local", "s3", "gs", "az"])
def job_url(request, tmp_path, monkeypatch) -> str:
    """The job's storage folder on each kind of storage."""
    if request.param == "memory":
        use_memory_cas(monkeypatch)
        return "memory://jobs/my-job"
    if request.param == "local":
        return str(tmp_path / "jobs" / "my-job")
    return request.getfixturevalue({"s3": "s3_env", "gs": "gcs_env", "az": "az_env"}[request.param]).url + "/my-job"


def storage_kind(url: str) -> str:
    return url.split("://")[0] if "://" in url else "a local folder"


def put_lease_body(url: str, body: dict) -> None:
    open_store(url).put_bytes("lease.json", json.dumps(body).encode())


def this_boot() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def this_pid_namespace() -> str:
    return os.readlink("/proc/self/ns/pid")


def watch_then_wait_out(url: str, clock: Clock, seconds: float = 61) -> None:
    """A node with `clock` looks at the lease (told it is held) and then, by its own clock,
    `seconds` pass without the lease changing."""
    with pytest.raises(LeaseHeld):
        Lease(url, holder="watching-node", clock=clock).acquire()
    clock.now += seconds


# --- one holder at a time -----------------------------------------------------------------------

def test_the_first_holder_gets_the_job_and_the_second_is_told_who_has_it(job_url):
    clock = Clock()
    Lease(job_url, holder="node-a", clock=clock).acquire()

    with pytest.raises(LeaseHeld) as held:
        Lease(job_url, holder="node-b", clock=clock).acquire()

    assert held.value.holder["holder"] == "node-a"
    message = str(held.value)
    for part in ("node-a", f"host {socket.gethostname()}", f"pid {os.getpid()}", "since",
                 "unrenewed for 60s"):
        assert part in message
    assert re.search(r"last renewed [01]s ago", message)   # S3's whole-second dates: 0 or 1
    shown = read_lease(job_url)
    assert shown["holder"] == "node-a" and shown["pid"] == os.getpid()
    assert shown["boot_id"] == this_boot() and shown["ttl_s"] == 60
    assert shown["since"].endswith("Z") and shown["renewed"] == shown["since"]
    assert shown["expired"] in (False, None)                  # None: memory:// keeps no clock
    assert "token" not in shown


def test_nobody_holds_a_job_that_was_never_leased(job_url):
    assert read_lease(job_url) is None


def test_renewal_keeps_the_job_past_the_first_expiry_and_keeps_since(job_url):
    clock, b_clock = Clock(), Clock(5.0)
    lease = Lease(job_url, holder="node-a", clock=clock)
    lease.acquire()
    first = read_lease(job_url)
    with pytest.raises(LeaseHeld):
        Lease(job_url, holder="node-b", clock=b_clock).acquire()   # node-b starts watching

    clock.now += 30
    b_clock.now += 30
    lease.renew()
    clock.now += 40  # past the first expiry, inside the renewed one
    b_clock.now += 40

    with pytest.raises(LeaseHeld):  # node-b watched 70s, but the renewal began a new version
        Lease(job_url, holder="node-b", clock=b_clock).acquire()
    shown = read_lease(job_url)
    assert shown["since_epoch"] == first["since_epoch"] and shown["since"] == first["since"]
    assert shown["renewals"] == 1 and first["renewals"] == 0
    assert lease.expires_at == clock.now - 40 + 60
    assert lease.held


def test_an_expired_lease_is_taken_over_and_the_old_holder_learns_it_lost(job_url):
    clock, b_clock = Clock(), Clock(-500.0)  # each node its own clock, set anyhow
    old = Lease(job_url, holder="node-a", clock=clock)
    old.acquire()

    new = Lease(job_url, holder="node-b", clock=b_clock)
    with pytest.raises(LeaseHeld):
        new.acquire()                      # node-b sees it and starts watching
    clock.now += 59
    b_clock.now += 59
    with pytest.raises(LeaseHeld, match="last renewed 59s ago"):
        new.acquire()                      # not yet: 59s unrenewed of 60
    b_clock.now += 2                       # node-a stopped renewing: died, or cut off
    new.acquire()

    assert read_lease(job_url)["holder"] == "node-b"
    with pytest.raises(LeaseLost) as lost:
        old.renew()
    assert "taken over by node-b" in str(lost.value)
    assert lost.value.holder["holder"] == "node-b"
    assert old.lost.is_set() and not old.held
    assert new.held
    assert read_lease(job_url)["holder"] == "node-b"  # the loser wrote nothing


def test_the_renewal_thread_reports_a_takeover_once(job_url):
    # node-a was frozen (a suspended VM) past its expiry: by its own clock no time has passed.
    frozen, later = Clock(), Clock()
    old = Lease(job_url, holder="node-a", clock=frozen, renew_every_s=0.01)
    old.acquire()
    watch_then_wait_out(job_url, later)
    Lease(job_url, holder="node-b", clock=later).acquire()

    reports: list[LeaseLost] = []
    reported = threading.Event()
    old.start_renewing(on_lost=lambda exc: (reports.append(exc), reported.set()))
    assert reported.wait(30)
    old.release()  # joins the renewal thread

    assert len(reports) == 1 and "taken over by node-b" in str(reports[0])
    assert old.lost.is_set() and not old.held
    assert read_lease(job_url)["holder"] == "node-b"


def test_the_renewal_thread_renews_before_expiry(job_url):
    clock = Clock()
    lease = Lease(job_url, holder="node-a", clock=clock, renew_every_s=0.01)
    lease.acquire()
    clock.now += 20
    renewed = threading.Event()

    def watch() -> None:  # the thread's renewal shows in storage
        while not renewed.is_set():
            if read_lease(job_url)["renewals"] >= 1:
                renewed.set()

    lease.start_renewing(on_lost=lambda exc: pytest.fail(f"lost: {exc}"))
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    assert renewed.wait(30)
    lease.release()
    assert read_lease(job_url) is None


def test_after_each_renewal_the_holder_is_called_and_its_error_does_not_stop_renewing(job_url, caplog):
    lease = Lease(job_url, holder="node-a", ttl_s=60, renew_every_s=0.01)
    lease.acquire()
    calls: list[int] = []
    twice = threading.Event()

    def on_renewed() -> None:    # the supervisor looks for a cancel request here; a failure must not cost the lease
        calls.append(read_lease(job_url)["renewals"])
        if len(calls) >= 2:
            twice.set()
        raise RuntimeError("the holder's own trouble")

    lease.start_renewing(on_lost=lambda exc: pytest.fail(f"lost: {exc}"), on_renewed=on_renewed)
    assert twice.wait(30)
    lease.release()
    assert calls[0] >= 1 and calls[1] > calls[0]      # each call after a renewal, and renewing went on
    assert "on_renewed callback failed" in caplog.text and "renewal failed" not in caplog.text   # not storage's


# --- release and re-acquire ---------------------------------------------------------------------

def test_release_deletes_only_our_own_lease(job_url):
    clock = Clock()
    old = Lease(job_url, holder="node-a", clock=clock)
    old.acquire()
    watch_then_wait_out(job_url, clock)
    new = Lease(job_url, holder="node-b", clock=clock)
    new.acquire()

    old.release()
    assert read_lease(job_url)["holder"] == "node-b"

    new.release()
    new.release()  # idempotent
    assert read_lease(job_url) is None
    Lease(job_url, holder="node-c", clock=clock).acquire()  # free at once, no waiting out a ttl


def test_a_with_block_holds_the_job_and_gives_it_back(job_url):
    clock = Clock()
    with Lease(job_url, holder="node-a", clock=clock) as lease:
        assert lease.held
        with pytest.raises(LeaseHeld):
            Lease(job_url, holder="node-b", clock=clock).acquire()
    assert read_lease(job_url) is None


def test_the_same_holder_may_acquire_again(job_url):
    clock = Clock()
    lease = Lease(job_url, holder="node-a", clock=clock)
    lease.acquire()
    since = read_lease(job_url)["since_epoch"]

    clock.now += 10
    lease.acquire()  # idempotent: extends, keeps since
    shown = read_lease(job_url)
    assert shown["since_epoch"] == since and shown["renewals"] == 1
    assert lease.expires_at == clock.now + 60

    # The same node after a restart (a new Lease, this very process): no waiting out the ttl.
    restarted = Lease(job_url, holder="node-a", clock=clock)
    restarted.acquire()
    assert restarted.held
    with pytest.raises(LeaseLost):
        lease.renew()  # the pre-restart instance no longer holds it


def test_the_same_holder_waits_while_its_other_process_on_this_host_lives(tmp_path):
    url = str(tmp_path / "job")
    clock = Clock()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead = int(gone.stdout)
    body = {"holder": "node-a", "host": socket.gethostname(), "boot_id": this_boot(),
            "pid_ns": this_pid_namespace(), "pid": os.getppid(), "token": "theirs",
            "since": "-", "renewed": "-", "ttl_s": 60}
    put_lease_body(url, body)
    with pytest.raises(LeaseHeld):  # a second supervisor on this node: its pid is alive
        Lease(url, holder="node-a", clock=clock).acquire()
    for elsewhere in ({"host": "elsewhere"},                  # another node, same holder name
                      {"boot_id": "0" * 8 + this_boot()[8:]},  # same host name, another machine
                      {"boot_id": None},                       # a body that names no boot
                      {"pid_ns": "pid:[1]"}):                  # another container on this machine
        put_lease_body(url, dict(body, pid=dead, **elsewhere))  # there, that pid means nothing
        with pytest.raises(LeaseHeld):
            Lease(url, holder="node-a", clock=clock).acquire()

    put_lease_body(url, dict(body, pid=dead))
    Lease(url, holder="node-a", clock=clock).acquire()  # that process crashed: ours to retake
    assert read_lease(url)["pid"] == os.getpid()


@pytest.mark.trust
def test_a_same_named_host_with_another_boot_id_is_waited_for_until_its_lease_runs_out(job_url, figures):
    clock = Clock()
    put_lease_body(job_url, {"holder": "node-a", "host": socket.gethostname(),
                             "boot_id": "another-machine-or-an-earlier-boot", "pid": 999_999_999,
                             "pid_ns": this_pid_namespace(), "token": "theirs", "ttl_s": 60})
    lease = Lease(job_url, holder="node-a", clock=clock)
    with pytest.raises(LeaseHeld, match="boot another"):
        lease.acquire()
    clock.now += 61                     # watched unrenewed for its ttl: now it is ours
    lease.acquire()
    assert read_lease(job_url)["boot_id"] == this_boot()
    figures.add("trust", actor="ordinary failure", tried=f"another machine with this host name holds the lease ({storage_kind(job_url)})",
                protection="a holder is known by boot id and PID namespace too", outcome="waited for its ttl", held=True)


# --- expiry without comparing two machines' clocks ----------------------------------------------

@pytest.mark.trust
def test_a_taker_whose_clock_is_ten_minutes_ahead_does_not_take_a_renewed_lease(job_url, figures):
    holder_clock = Clock()
    taker_clock = Clock(holder_clock.now + 600)  # ten minutes ahead of the holder's
    holder = Lease(job_url, holder="node-a", clock=holder_clock)
    holder.acquire()
    taker = Lease(job_url, holder="node-b", clock=taker_clock)

    for _ in range(6):                           # two minutes of the holder renewing on time
        with pytest.raises(LeaseHeld):
            taker.acquire()
        holder_clock.now += 20
        taker_clock.now += 20
        holder.renew()
    assert holder.held and read_lease(job_url)["holder"] == "node-a"
    figures.add("trust", actor="ordinary failure", tried=f"a taker whose clock is 10 minutes ahead ({storage_kind(job_url)})",
                protection="expiry judged on the store's clock or the taker's own watch", outcome="the live holder kept it",
                held=True)


@pytest.mark.trust
def test_a_freshly_written_lease_claiming_it_expired_long_ago_is_not_taken_at_once(job_url, figures):
    # What the holder's wall clock wrote is no reason to take over: how long it went unrenewed is.
    put_lease_body(job_url, {"holder": "node-a", "host": "elsewhere", "pid": 1, "token": "theirs",
                             "since": "2001-01-01T00:00:00Z", "expires": "2001-01-01T00:01:00Z",
                             "since_epoch": 978307200.0, "expires_epoch": 978307260.0,
                             "ttl_s": 60})
    with pytest.raises(LeaseHeld):
        Lease(job_url, holder="node-b", clock=Clock()).acquire()
    assert read_lease(job_url)["holder"] == "node-a"
    figures.add("trust", actor="bucket writer", tried=f"a fresh lease claiming it expired in 2001 ({storage_kind(job_url)})",
                protection="the lease's age, not the times it claims", outcome="not taken at once", held=True)


def test_what_one_clock_watched_does_not_count_on_another(job_url):
    Lease(job_url, holder="node-a", clock=Clock()).acquire()
    with pytest.raises(LeaseHeld):
        Lease(job_url, holder="node-b", clock=Clock(0.0)).acquire()     # watched from 0 on one
    with pytest.raises(LeaseHeld):
        Lease(job_url, holder="node-c", clock=Clock(1000.0)).acquire()  # 1000 on another: no wait yet


def test_a_holder_times_its_lease_on_a_clock_that_no_wall_clock_step_moves(tmp_path):
    # An NTP step or an operator's `date` must not end (or stretch) a lease: by default its
    # intervals are measured on CLOCK_BOOTTIME (monotonic, and counting a suspend, so a holder
    # that wakes from one knows its lease has run out), not on time.time().
    lease = Lease(str(tmp_path / "job"), holder="node-a")
    before = time.clock_gettime(time.CLOCK_BOOTTIME)
    lease.acquire()
    after = time.clock_gettime(time.CLOCK_BOOTTIME)
    assert before + 60 <= lease.expires_at <= after + 60
    assert lease.held


def test_a_lease_whose_holder_on_this_machine_went_unrenewed_for_its_ttl_is_taken_at_first_sight(tmp_path):
    # A folder says nothing of its files' age (cas.LocalCas); the holder's own steady clock does,
    # read on the same boot: node-a's last write was sent two minutes ago by it, and it was killed.
    url = str(tmp_path / "job")
    put_lease_body(url, {"holder": "node-a", "host": "elsewhere", "pid": 1, "token": "theirs", "ttl_s": 60,
                         "boot_id": this_boot(), "time_ns": os.readlink("/proc/self/ns/time"),
                         "renewed_boottime": time.clock_gettime(time.CLOCK_BOOTTIME) - 120})
    assert 119 <= read_lease(url)["age_s"] < 125 and read_lease(url)["expired"]
    Lease(url, holder="node-b").acquire()               # restarted here since: no waiting
    assert read_lease(url)["holder"] == "node-b"


@pytest.mark.trust
def test_a_folder_shared_by_machines_never_ages_a_lease_by_their_clocks_or_its_file_times(tmp_path, monkeypatch,
                                                                                          figures):
    # An NFS folder: the file server stamps the lease two minutes behind, and the taker's wall
    # clock is ten minutes ahead. Neither may make a live lease look expired; only its holder's
    # renewals age it, watched on the taker's own clock.
    url = str(tmp_path / "job")
    holder_clock = Clock()
    holder = Lease(url, holder="node-a", clock=holder_clock)
    holder.acquire()
    two_minutes_ago = time.time() - 120
    os.utime(tmp_path / "job" / "lease.json", (two_minutes_ago, two_minutes_ago))
    monkeypatch.setattr(time, "time", lambda: two_minutes_ago + 720)
    with pytest.raises(LeaseHeld):
        Lease(url, holder="node-b").acquire()                        # this machine, its steady clock
    from grpo_run.checkpoint.storage import lease as lease_module
    monkeypatch.setattr(lease_module, "boot_id", lambda: "another-machine")
    taker_clock = Clock()
    taker = Lease(url, holder="node-c", clock=taker_clock)
    for _ in range(6):                                               # two minutes of renewals on time
        with pytest.raises(LeaseHeld):
            taker.acquire()
        holder_clock.now += 20
        taker_clock.now += 20
        holder.renew()
    assert holder.held and read_lease(url)["holder"] == "node-a"
    watch_then_wait_out(url, taker_clock)                            # then it stops renewing (killed)
    taker.acquire()
    assert read_lease(url)["holder"] == "node-c"
    figures.add("trust", actor="ordinary failure", tried="a folder (NFS) whose file times and a taker's wall clock "
                "are minutes apart", protection="a folder's lease aged by its holder's renewals, watched on the "
                "taker's own clock", outcome="the live holder kept it; the dead one was waited out", held=True)


def test_a_lease_the_server_says_went_unrenewed_for_its_ttl_is_taken_at_first_sight(store_env):
    # The server's Date against the object's Last-Modified, whatever our wall clock says: a
    # holder whose promise is ttl 1s is taken over by a node that never saw it before, once the
    # server counts the lease that old (whole-second dates: 2-3 s).
    url = f"{store_env.url}/aged"
    put_lease_body(url, {"holder": "node-a", "host": "elsewhere", "pid": 1, "token": "theirs",
                         "ttl_s": 1.0, "expires_epoch": 4_000_000_000.0})  # "expires" in 2096
    with pytest.raises(LeaseHeld):
        Lease(url, holder="node-b", clock=Clock()).acquire()
    deadline = time.monotonic() + 20
    while not read_lease(url)["expired"]:                 # the store's own verdict
        assert time.monotonic() < deadline, read_lease(url)
        time.sleep(0.2)
    Lease(url, holder="node-c", clock=Clock()).acquire()  # first sight, its own clock unmoved
    assert read_lease(url)["holder"] == "node-c"


def test_an_unreadable_lease_counts_as_expired(job_url):
    open_store(job_url).put_bytes("lease.json", b"{not json")
    Lease(job_url, holder="node-a").acquire()
    assert read_lease(job_url)["holder"] == "node-a"


# --- races --------------------------------------------------------------------------------------

def race(leases: list[Lease]) -> tuple[list[str], list[LeaseHeld]]:
    """Every lease tries to acquire at the same moment; (winners' holders, refusals)."""
    start = threading.Barrier(len(leases))
    won: list[str] = []
    refused: list[LeaseHeld] = []
    errors: list[BaseException] = []

    def contend(lease: Lease) -> None:
        start.wait(30)
        try:
            lease.acquire()
            won.append(lease.holder)
        except LeaseHeld as exc:
            refused.append(exc)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=contend, args=(lease,)) for lease in leases]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return won, refused


def test_nodes_racing_for_a_job_over_a_store_exactly_one_wins(store_env):
    for r in range(3):  # the first round in a fresh bucket, the others in a warm one
        url = f"{store_env.url}/race-{r}"
        won, refused = race([Lease(url, holder=f"node-{i}") for i in range(8)])

        assert len(won) == 1, won
        assert len(refused) == 7
        assert all(exc.holder["holder"] == won[0] and won[0] in str(exc) for exc in refused)
        assert read_lease(url)["holder"] == won[0]


def test_nodes_racing_to_take_over_an_expired_lease_over_a_store_exactly_one_wins(store_env):
    url = f"{store_env.url}/expired"
    Lease(url, holder="dead-node", ttl_s=1.0).acquire()   # then killed: never renewed
    deadline = time.monotonic() + 20
    while not read_lease(url)["expired"]:                 # the server counts it unrenewed for 1s
        assert time.monotonic() < deadline, read_lease(url)
        time.sleep(0.2)
    later = Clock()

    won, refused = race([Lease(url, holder=f"node-{i}", clock=later) for i in range(8)])

    assert len(won) == 1, won
    assert all(exc.holder["holder"] == won[0] for exc in refused)
    assert read_lease(url)["holder"] == won[0]


def test_threads_racing_over_a_local_folder_exactly_one_wins(tmp_path):
    url = str(tmp_path / "job")
    won, refused = race([Lease(url, holder=f"node-{i}") for i in range(8)])
    assert len(won) == 1 and len(refused) == 7


def _contend_in_process(url_fresh: str, url_expired: str, holder: str, start, results) -> None:
    """In a child process: race for a fresh job, then for one with an expired lease."""
    for url in (url_fresh, url_expired):
        start.wait(60)
        try:
            Lease(url, holder=holder).acquire()
            results.put((url, holder, "won"))
        except LeaseHeld as exc:
            results.put((url, holder, exc.holder["holder"]))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            results.put((url, holder, f"error: {exc!r}"))


def test_processes_racing_over_a_local_folder_exactly_one_wins(tmp_path):
    fresh, expired = str(tmp_path / "fresh"), f"file://{tmp_path / 'expired'}"
    put_lease_body(expired, {"holder": "dead-node", "host": "elsewhere", "pid": 1, "token": "theirs", "ttl_s": 60,
                             "boot_id": this_boot(), "time_ns": os.readlink("/proc/self/ns/time"),
                             "renewed_boottime": time.clock_gettime(time.CLOCK_BOOTTIME) - 3600})  # an hour ago
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_contend_in_process,
                         args=(fresh, expired, f"node-{i}", start, results)) for i in range(4)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in range(8)]
    for p in procs:
        p.join(60)

    for url in (fresh, expired):
        mine = [(holder, outcome) for u, holder, outcome in outcomes if u == url]
        winners = [holder for holder, outcome in mine if outcome == "won"]
        assert len(winners) == 1, mine
        assert all(outcome == winners[0] for holder, outcome in mine if holder != winners[0]), mine
        assert read_lease(url)["holder"] == winners[0]


# --- storage failures ---------------------------------------------------------------------------

def test_a_missing_bucket_fails_at_once(s3_env):
    sleep = RecordingSleep()
    with pytest.raises(StorageConfigError, match="bucket does not exist"):
        Lease(f"s3://no-such-bucket-{s3_env.bucket}/run", holder="node-a", sleep=sleep).acquire()
    with pytest.raises(StorageConfigError, match="bucket does not exist"):
        read_lease(f"s3://no-such-bucket-{s3_env.bucket}/run")
    assert sleep.delays == []


def test_bad_credentials_fail_at_once(s3_env, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    sleep = RecordingSleep()
    with pytest.raises(StorageConfigError, match="bad credentials"):
        Lease(s3_env.url, holder="node-a", sleep=sleep).acquire()
    assert sleep.delays == []


def test_an_s3_server_that_ignores_conditional_writes_is_refused(s3_env, monkeypatch):
    import s3fs

    real_set_session = s3fs.S3FileSystem.set_session

    def strip(request, **_):  # as a server that ignores the headers would behave
        for header in ("If-None-Match", "If-Match"):
            if header in request.headers:
                del request.headers[header]

    async def client_whose_conditions_vanish(self, *args, **kwargs):
        client = await real_set_session(self, *args, **kwargs)
        client.meta.events.register("before-sign.s3.PutObject", strip,
                                    unique_id="conditions-vanish")
        return client

    monkeypatch.setattr(s3fs.S3FileSystem, "set_session", client_whose_conditions_vanish)
    with pytest.raises(StorageConfigError, match="does not honour conditional writes"):
        Lease(s3_env.url, holder="node-a").acquire()
    assert read_lease(s3_env.url) is None
    assert open_store(s3_env.url).list() == []  # and the probe is gone


def test_an_unreachable_store_is_retried_a_bounded_number_of_times(closed_port, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "anything")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "anything")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    sleep = RecordingSleep()
    with pytest.raises(StorageUnavailable, match="3 time"):
        Lease("s3://bucket/run", holder="node-a", retry_attempts=3, sleep=sleep).acquire()
    assert len(sleep.delays) == 2


def test_a_holder_that_cannot_renew_stops_itself_before_its_lease_expires(tmp_path):
    job = tmp_path / "job"
    clock = Clock()
    lease = Lease(str(job), holder="node-a", clock=clock, ttl_s=60, renew_every_s=0.01)
    lease.acquire()
    expires = lease.expires_at
    job.rename(tmp_path / "moved")
    job.write_text("storage is broken now")  # every renewal fails from here on

    reports: list[LeaseLost] = []
    reported = threading.Event()
    clock.now = expires - 0.005  # past the point where we must have renewed
    lease.start_renewing(on_lost=lambda exc: (reports.append(exc), reported.set()))
    assert reported.wait(30)
    lease.release()

    assert len(reports) == 1 and "could not renew before it expires" in str(reports[0])
    assert lease.lost.is_set() and not lease.held


class PausableProxy:
    """A TCP proxy in front of the S3 server whose traffic can be held (a network partition or a
    hung server: requests neither answered nor refused) and let go again."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.flowing = threading.Event()
        self.flowing.set()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                self.flowing.wait()  # held: bytes wait here until let go
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        """Drop every connection (a server waits for open ones when it stops)."""
        self.flowing.set()
        self._listener.close()
        for sock in self._sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


def test_a_holder_whose_storage_hangs_stops_itself_before_its_lease_expires(s3_env, monkeypatch):
    proxy = PausableProxy(s3_env.server.port)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
    try:
        clock = Clock()
        lease = Lease(f"{s3_env.url}/hang", holder="node-a", clock=clock, ttl_s=60,
                      renew_every_s=0.2)
        lease.acquire()
        proxy.flowing.clear()  # from now on storage answers nothing
        clock.now = lease.expires_at - 0.1 - 0.05  # 50 ms before we must stop waiting

        reports: list[LeaseLost] = []
        reported = threading.Event()
        lease.start_renewing(on_lost=lambda exc: (reports.append(exc), reported.set()))
        assert reported.wait(30)
        assert len(reports) == 1 and "did not answer" in str(reports[0])
        assert lease.lost.is_set() and not lease.held
        proxy.flowing.set()  # let the held renewal finish so that release() is not kept waiting
        lease.release()
    finally:
        proxy.close()


# --- settings -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, fix", [
    (dict(holder=""), "holder must name this node"),
    (dict(holder="n", ttl_s=0), "ttl_s must be > 0"),
    (dict(holder="n", ttl_s=60, renew_every_s=30), "renew_every_s must be > 0 and < ttl_s / 2"),
])
def test_bad_settings_name_the_fix(kwargs, fix):
    with pytest.raises(ValueError, match=fix):
        Lease("memory://job", **kwargs)


def test_storage_without_compare_and_swap_is_refused():
    with pytest.raises(StorageConfigError):
        Lease("memory://bucket/job", holder="node-a")


def test_a_local_lease_is_one_complete_file(tmp_path):
    Lease(f"file://{tmp_path}", holder="node-a").acquire()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lease.json"]
    body = json.loads((tmp_path / "lease.json").read_text())
    assert set(body) >= {"holder", "host", "boot_id", "pid_ns", "pid", "token", "since",
                         "renewed", "renewals", "ttl_s"}
    assert "expires_epoch" not in body      # nothing in it for another machine's clock to judge
    assert len(body["token"]) == 32


def test_held_holds_the_lease_for_the_block_only_and_refuses_a_job_another_holds(tmp_path):
    from grpo_run.checkpoint.storage.lease import held

    url = str(tmp_path / "job")
    with held(url, "submit@laptop"):
        assert read_lease(url)["holder"] == "submit@laptop"
        with pytest.raises(LeaseHeld):
            Lease(url, holder="node-b").acquire()
    assert read_lease(url) is None or read_lease(url).get("holder") != "submit@laptop"    # released
    node = Lease(url, holder="node-b")
    node.acquire()
    try:
        with pytest.raises(LeaseHeld), held(url, "cancel@laptop"):
            pytest.fail("the block runs only under the lease")
    finally:
        node.release()
