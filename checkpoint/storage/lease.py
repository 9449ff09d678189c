"""Fencing: at most one node trains a job at a time, through a lease object in the job's folder.

Two nodes resuming the same job at once (a replacement node booting while the old one is still
alive, an operator running `grpo-run resume` by hand) race to create `lease.json` next to the
job's checkpoints. Exactly one wins and trains; the other gets `LeaseHeld`, whose message names
the winner. The winner renews the lease every `renew_every_s` (default ttl/3) from a background
thread; a lease left unrenewed for its `ttl_s` (the node died) is taken over by the next node.

    {"holder": "i-0abc", "host": "ip-10-0-0-5", "boot_id": "5f1c...", "pid_ns": "pid:[4026531836]",
     "time_ns": "time:[4026531834]", "pid": 4242, "token": "<random>", "since": "2025-01-01T00:00:00Z",
     "since_epoch": 1735689600.0, "renewed": "2025-01-01T00:00:40Z", "renewals": 2,
     "renewed_boottime": 81234.5, "ttl_s": 60.0}

Every change is a compare-and-swap on the storage itself, never read-then-write
(checkpoint.cas): S3 conditional writes (If-None-Match / If-Match on the ETag read, proven
honoured by the server on a probe object before the first write), an exclusive flock on a local
folder. gs:// and memory:// are refused (checkpoint.cas says why). A lost
compare-and-swap means another writer got there first: the lease reads again and decides anew.

When a lease has run out is never decided by comparing two machines' clocks. The times in the
body are the holder's wall clock, for people to read; nothing here compares them with anything.
Each party measures intervals on a clock of its own:

* The holder, on its own monotonic clock (`clock`; by default one that also counts time the
  machine spent suspended): its lease runs out `ttl_s` after the moment it sent its last
  successful renewal, and it stops itself before that (below).
* A taker takes the lease over once it has been unrenewed for the holder's `ttl_s`, by either
  (a) the store's clock: the object's age as the store reports it (S3, GCS, Azure: the
      response's `Date` minus the object's `Last-Modified`, both the server's). A replacement
      node booting minutes after a hard kill takes over at once; or
  (b) the holder's own clock, on the holder's machine: every write of the body carries
      `renewed_boottime`, the holder's steady clock when it sent that write, beside its boot id
      and time namespace. A taker on the same boot and in the same time namespace reads the very
      same clock, so its reading minus that one is how long the lease went unrenewed, exactly as
      the holder counts it. A local folder (file://) reports no age (its file times are the file
      server's or another node's clock: cas.LocalCas), so a node restarted on the machine of a
      holder that died takes over at once this way; or
  (c) its own clock: it has itself seen the very same version (ETag, or bytes: every renewal
      writes a new one, its `renewals` counted up) unchanged for `ttl_s`. This covers a store
      that reports no times and a folder shared by several machines (NFS), whose clocks then
      never matter; it costs a node one wait of ttl_s, which `resume --wait`'s polling absorbs
      (what this process saw is remembered across the leases it makes, per clock).
  Any one suffices: the holder sent its last renewal before the store stamped it and before the
  taker first saw it, and stops itself `renew_every_s / 2` before ttl_s have passed since.

Identity: a holder is its `holder` name, its host name, the machine's boot id
(/proc/sys/kernel/random/boot_id) and its pid namespace. Only the same holder on the same host,
same boot and same pid namespace may retake a lease at once when its recorded pid is gone (a
crashed supervisor, restarted); anywhere else that pid number means nothing, and a holder of the
same name elsewhere (another machine or container with the same host name, or this machine after
a reboot) is waited for like anyone else.

What the lease guarantees, and what it assumes:

* The holder fences itself: when renewals keep failing or hanging (storage outage, credentials
  revoked) the renewal thread reports `LeaseLost` once only `renew_every_s / 2` of the lease is
  left by its own clock, so the trainer can stop before anyone may take over. With the defaults
  (ttl 60 s, renew every 20 s) that is 50 s after the last successful renewal was sent, 10 s
  before anyone may take over; the clocks' rates (not their settings) must agree within that.
* It cannot stop a holder that is frozen (a VM paused by its hypervisor, whose clocks may not
  count the pause) and wakes after its lease was taken: the first renewal then reports
  `LeaseLost`, up to `renew_every_s` later. Writes that must never come from a stale holder go
  through checkpoint.fenced, which checks `Lease.held` first.

Raises, besides `LeaseHeld` and `LeaseLost`: `StorageConfigError` at once for configuration
errors (missing bucket, bad credentials, unsupported URL); `StorageUnavailable` when transient
errors persist past a bounded number of attempts.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .by_url import open_cas
from .cas import Conflict, Found, Unsupported
from .holder import (LeaseHeld, LeaseLost, boot_id, count as _count, describe_holder, dump as _dump, iso as _iso,
                     parse_body as _parse, pid_alive as _pid_alive, pid_namespace, public as _public,
                     time_namespace, ttl_of as _ttl)
from .retry import RetryPolicy, StorageConfigError, StorageUnavailable, backoff

log = logging.getLogger(__name__)

LEASE_KEY = "lease.json"
DEFAULT_TTL_S = 60.0
# How many times one acquire / renew / release re-reads after losing a compare-and-swap before
# giving up: each lost round means another writer succeeded, so a few rounds settle any race.
_MAX_ROUNDS = 8


def steady_clock() -> float:
    """Seconds on a clock that never jumps with the wall clock (NTP steps, an operator's `date`)
    and, on Linux, keeps counting while the machine is suspended (CLOCK_BOOTTIME), so a holder
    that wakes from a suspend knows at once that its lease has run out. Only intervals measured
    on it mean anything, and only on this machine."""
    return time.clock_gettime(_STEADY)


_STEADY = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)


def read_lease(store_url: str, key: str = LEASE_KEY) -> dict | None:
    """The job's lease for display (`grpo-run get`), or None when nobody holds it.

    The stored body without its token, plus `"age_s"`: seconds since its last renewal by the
    store's clock, and `"expired"`: whether that age has reached the holder's ttl (both None
    when the store reports no times). Raises StorageConfigError / StorageUnavailable as `Lease`
    does."""
    cas = open_cas(store_url, key)
    current = _retries(store_url, attempts=3).call("read", cas.read)
    if current is None:
        return None
    body = _public(_parse(current.data))
    age = current.age_s if current.age_s is not None else holders_clock_age(body, steady_clock)
    body["age_s"] = age
    body["expired"] = None if age is None else age >= _ttl(body, DEFAULT_TTL_S)
    return body


def holders_clock_age(body: dict, clock: Callable[[], float]) -> float | None:
    """How long the lease `body` went unrenewed by its holder's own steady clock, read here: only
    where this process reads that very clock (`clock` is steady_clock, on the holder's boot and in
    its time namespace); None anywhere else, or for a body written without it."""
    stamp = body.get("renewed_boottime")
    if (clock is not steady_clock or isinstance(stamp, bool) or not isinstance(stamp, (int, float))
            or body.get("boot_id") is None or body.get("boot_id") != boot_id()
            or body.get("time_ns") is None or body.get("time_ns") != time_namespace()):
        return None
    return max(0.0, clock() - float(stamp))


class Lease:
    """The job's lease: acquire it, keep it renewed from a thread, release it.

        lease = Lease("s3://bucket/prefix/my-job", holder=node_id)
        lease.acquire()                       # LeaseHeld: another node trains this job
        lease.start_renewing(on_lost=stop_training)
        ...
        lease.release()

    or `with Lease(...) as lease:` (acquire on enter, release on exit). `holder` names this node
    (an instance id, a hostname); the same holder on the same host, boot and pid namespace may
    retake its own lease at once after a crash (its pid is gone), anyone else only once the
    lease has gone unrenewed for its ttl.

    `clock` measures intervals on this machine (seconds; only differences are used): how long
    our own lease has left, and how long we have watched someone else's go unrenewed. The
    default, `steady_clock`, never jumps; tests inject one they move by hand. `sleep` is the
    wait between retries of transient storage errors, at most `retry_attempts` tries per
    operation, cut short when `stop` (the preemption event) is set.
    """

    def __init__(
        self,
        store_url: str,
        *,
        holder: str,
        ttl_s: float = DEFAULT_TTL_S,
        renew_every_s: float | None = None,
        clock: Callable[[], float] = steady_clock,
        key: str = LEASE_KEY,
        stop: threading.Event | None = None,
        retry_attempts: int = 5,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not isinstance(holder, str) or not holder.strip():
            raise ValueError(f"holder must name this node, e.g. its instance id (got {holder!r})")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 (got {ttl_s})")
        renew_every_s = ttl_s / 3 if renew_every_s is None else renew_every_s
        if not 0 < renew_every_s < ttl_s / 2:
            raise ValueError(f"renew_every_s must be > 0 and < ttl_s / 2 (got {renew_every_s} "
                             f"with ttl_s {ttl_s}): a lease needs a second renewal chance "
                             f"before it expires")
        self.url = store_url
        self.holder = holder
        self.ttl_s = float(ttl_s)
        self.renew_every_s = float(renew_every_s)
        self._clock = clock
        self._key = key
        self._cas = open_cas(store_url, key)
        self._calls = _retries(store_url, attempts=retry_attempts, stop=stop, sleep=sleep)
        self._host = socket.gethostname()
        self._boot_id = boot_id()
        self._pid_ns = pid_namespace()
        self._time_ns = time_namespace()
        # Set once the lease is known lost (taken over, removed, or unrenewable); cleared by a
        # successful acquire. The training loop may poll it instead of using on_lost.
        self.lost = threading.Event()
        self._lock = threading.Lock()      # one acquire / renew / release at a time
        self._body: dict | None = None     # what we last wrote; None when not held
        self._version: Any = None          # the store's version of it (S3 ETag, or the bytes)
        self._expires_at: float | None = None  # on self._clock: last renewal sent + ttl_s
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"Lease({self.url!r}, holder={self.holder!r})"

    @property
    def held(self) -> bool:
        """We hold the lease as far as we know, and by our clock it is further from running out
        than the renewal thread's safety margin (renew_every_s / 2). Check it right before work
        that a stale holder must never do, such as uploading a checkpoint."""
        expires = self._expires_at
        return (self._body is not None and expires is not None and not self.lost.is_set()
                and self._clock() < expires - self.renew_every_s / 2)

    @property
    def expires_at(self) -> float | None:
        """When our lease runs out, on our own `clock`: ttl_s after we sent the write that last
        renewed it (no one may take it over before then). None when not held."""
        return self._expires_at if self._body is not None else None

    # --- acquire / renew / release --------------------------------------------------------------

    def acquire(self) -> None:
        """Take the lease, or extend it if already ours.

        Raises LeaseHeld when someone else's lease is live (also when others kept winning
        every round of a race); takes over one unrenewed for its ttl."""
        with self._lock:
            if self.lost.is_set():  # what we hold, if anything, is not to be trusted: start over
                self._body, self._version, self._expires_at = None, None, None
            candidate = self._body["token"] if self._body else secrets.token_hex(16)
            current = None
            for _ in range(_MAX_ROUNDS):
                sent = self._clock()  # before the read, so before any write that follows it
                current = self._calls.call("read", self._cas.read)
                # Our token there: already ours, or an earlier attempt whose answer got lost.
                if current is not None and _parse(current.data).get("token") == candidate:
                    self._body, self._version = _parse(current.data), current.version
                    self.lost.clear()
                    self._renew_locked()
                    return
                body = self._new_body(candidate, sent)
                data = _dump(body)
                try:
                    if current is None:
                        version = self._calls.call("create", lambda: self._cas.create(data))
                    else:
                        theirs = _parse(current.data)
                        why = self._why_take_over(theirs, current, sent)
                        if why is None:
                            raise LeaseHeld(self.url, theirs, ttl_s=_ttl(theirs, self.ttl_s),
                                            unrenewed_s=self._unrenewed(current, sent))
                        version = self._calls.call(
                            "take over", lambda v=current.version: self._cas.replace(data, v))
                        log.warning("lease %s: took over from %s: %s", self.url,
                                    describe_holder(theirs), why)
                except Conflict:
                    continue  # another writer changed it between our read and write: look again
                self._adopt(body, version, sent)
                self.lost.clear()
                log.info("lease %s: acquired by %s for %.0fs unless renewed", self.url,
                         self.holder, self.ttl_s)
                return
            theirs = _parse(current.data) if current is not None else {}
            raise LeaseHeld(self.url, theirs)

    def renew(self) -> None:
        """Extend the lease by ttl_s from now. Raises LeaseLost if it is no longer ours (and
        sets `lost`), RuntimeError if it was never acquired, StorageUnavailable /
        StorageConfigError when storage fails (the lease is then unchanged)."""
        with self._lock:
            self._renew_locked()

    def start_renewing(self, on_lost: Callable[[LeaseLost], None],
                       on_renewed: Callable[[], None] | None = None) -> None:
        """Renew every renew_every_s from a daemon thread until release().

        `on_renewed` is called from that thread after each successful renewal: the holder's
        chance to read something of its own from storage at a pace already set (the supervisor
        looks for a cancel request); what it raises is logged, and renewing goes on.

        `on_lost` is called once, from that thread, when a renewal finds the lease taken over or
        removed, or when renewals have failed or hung until only renew_every_s / 2 of the lease
        is left (self-fencing). The thread ends after calling it. Failures before that are
        logged and retried every renew_every_s / 4."""
        if self._body is None:
            raise RuntimeError(f"lease {self.url}: acquire() before start_renewing()")
        if self._thread is not None:
            raise RuntimeError(f"lease {self.url}: already renewing")
        self._stopping.clear()
        self._thread = threading.Thread(target=self._renew_loop, args=(on_lost, on_renewed),
                                        name=f"lease-renew:{self.holder}", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still ours (a conditional delete: a
        lease someone else took over is left alone). Idempotent. Storage errors are logged, not
        raised: an unreleased lease simply runs out after ttl_s unrenewed."""
        self._stopping.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._lock:
            body, self._body, self._version, self._expires_at = self._body, None, None, None
            if body is None:
                return
            try:
                for _ in range(_MAX_ROUNDS):
                    current = self._calls.call("read", self._cas.read)
                    if current is None or _parse(current.data).get("token") != body["token"]:
                        return  # gone, or someone else's now
                    try:
                        self._calls.call("release",
                                         lambda v=current.version: self._cas.delete(v))
                        log.info("lease %s: released by %s", self.url, self.holder)
                        return
                    except Conflict:
                        continue
            except (StorageUnavailable, StorageConfigError, Unsupported) as exc:
                log.warning("lease %s: could not release (%s); another node may take it over "
                            "once it stays unrenewed for %.0fs", self.url, exc, self.ttl_s)

    def __enter__(self) -> Lease:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    # --- helpers --------------------------------------------------------------------------------

    def _renew_locked(self) -> None:
        if self.lost.is_set():
            raise LeaseLost(f"lease on {self.url} was already lost")
        if self._body is None:
            raise RuntimeError(f"lease {self.url}: not held (acquire() first)")
        sent = self._clock()  # before the write: the lease runs out ttl_s after this at the latest
        body = dict(self._body, pid=os.getpid(), renewed=_iso(time.time()),
                    renewals=_count(self._body.get("renewals")) + 1, ttl_s=self.ttl_s, **self._stamp(sent))
        data = _dump(body)
        for _ in range(_MAX_ROUNDS):
            try:
                version = self._calls.call(
                    "renew", lambda v=self._version: self._cas.replace(data, v),
                    budget_s=self.renew_every_s / 2)
            except Conflict:
                current = self._calls.call("read", self._cas.read, budget_s=self.renew_every_s / 2)
                theirs = _parse(current.data) if current is not None else None
                if theirs is not None and theirs.get("token") == body["token"]:
                    # Ours still: an earlier write of ours whose answer got lost.
                    self._version = current.version
                    continue
                self._lose()
                if theirs is None:
                    raise LeaseLost(f"lease on {self.url} was removed while {self.holder} held it; "
                                    f"stop training: another node may have started") from None
                raise LeaseLost(f"lease on {self.url} was taken over by "
                                f"{describe_holder(theirs)}; stop training", theirs) from None
            self._adopt(body, version, sent)
            return
        self._lose()
        raise LeaseLost(f"lease on {self.url}: could not renew, it kept changing under us")

    def _renew_loop(self, on_lost: Callable[[LeaseLost], None],
                    on_renewed: Callable[[], None] | None = None) -> None:
        wait = self.renew_every_s
        while not self._stopping.wait(wait):
            expires = self.expires_at
            if expires is None:
                return  # released or lost meanwhile
            # Renewed by then, or we stop: half a renewal interval of lease is left for the
            # trainer to stop before anyone else may take over.
            cutoff = expires - self.renew_every_s / 2
            try:
                self._renew_before(cutoff)
                wait = self.renew_every_s
                if on_renewed is not None:
                    try:
                        on_renewed()
                    except Exception:
                        log.exception("lease %s: on_renewed callback failed", self.url)
                continue
            except LeaseLost as exc:
                lost = exc
            except Exception as exc:  # storage trouble: try again soon while the lease covers us
                if not isinstance(exc, _Hung) and self._clock() < cutoff:
                    wait = self.renew_every_s / 4
                    log.warning("lease %s: renewal failed (%s); retrying in %.1fs, giving up in "
                                "%.1fs", self.url, exc, wait, cutoff - self._clock())
                    continue
                self._lose()
                lost = LeaseLost(f"lease on {self.url}: could not renew before it expires, in "
                                 f"{max(0.0, expires - self._clock()):.0f}s by this node's "
                                 f"clock ({exc}); stop training so that another node can take "
                                 f"over safely")
            if self._stopping.is_set():
                return  # released while renewing: nobody is waiting for the news
            log.error("%s", lost)
            try:
                on_lost(lost)
            except Exception:
                log.exception("lease %s: on_lost callback failed", self.url)
            return

    def _renew_before(self, cutoff: float) -> None:
        """renew(), but give up waiting for it at `cutoff` (by our clock): a storage call that
        hangs must not keep us training past the point where our lease may be taken."""
        done = threading.Event()
        outcome: list[BaseException] = []

        def call() -> None:
            try:
                self.renew()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                outcome.append(exc)
            finally:
                done.set()

        threading.Thread(target=call, name=f"lease-renew-call:{self.holder}", daemon=True).start()
        waited = max(0.0, cutoff - self._clock())
        if not done.wait(waited):
            raise _Hung(f"storage did not answer the renewal within {waited:.1f}s")
        if outcome:
            raise outcome[0]

    def _why_take_over(self, theirs: dict, found: Found, now: float) -> str | None:
        """Why we may take over the lease `found` (whose body is `theirs`), or None while its
        holder may still be alive. `now` is our clock's reading before the read."""
        if theirs.get("unreadable"):
            return "its lease body is unreadable (it cannot be renewed either)"
        ttl = _ttl(theirs, self.ttl_s)
        watched = _watch(self.url, self._key, found.version, now, self._clock)
        if found.age_s is not None and found.age_s >= ttl:
            return f"unrenewed for {found.age_s:.0f}s by the store's clock (ttl {ttl:.0f}s)"
        own = holders_clock_age(theirs, self._clock)
        if own is not None and own >= ttl:
            return f"unrenewed for {own:.0f}s by its holder's own clock, on this machine (ttl {ttl:.0f}s)"
        if watched >= ttl:
            return f"this node watched it unrenewed for {watched:.0f}s (ttl {ttl:.0f}s)"
        # Our own lease from before a crash or restart on this very machine: no need to wait
        # out the ttl, unless that process is still running (two supervisors on one node). The
        # pid means that process only on the same boot and in the same pid namespace.
        if (theirs.get("holder") == self.holder and theirs.get("host") == self._host
                and self._boot_id is not None and theirs.get("boot_id") == self._boot_id
                and self._pid_ns is not None and theirs.get("pid_ns") == self._pid_ns):
            pid = theirs.get("pid")
            if pid == os.getpid() or not _pid_alive(pid):
                return f"our own lease from process {pid} on this machine, which is gone"
        return None

    def _unrenewed(self, found: Found, now: float) -> float:
        """How long the lease `found` has gone unrenewed as far as we can tell: the longer of
        its age on the store's clock and how long we have watched it unchanged."""
        watched = _watch(self.url, self._key, found.version, now, self._clock)
        own = holders_clock_age(_parse(found.data), self._clock)
        return max(watched, found.age_s if found.age_s is not None else 0.0, own or 0.0)

    def _new_body(self, token: str, sent: float) -> dict:
        wall = time.time()  # for people to read; never compared with anything
        return {"holder": self.holder, "host": self._host, "boot_id": self._boot_id,
                "pid_ns": self._pid_ns, "time_ns": self._time_ns, "pid": os.getpid(), "token": token,
                "since": _iso(wall), "since_epoch": wall, "renewed": _iso(wall), "renewals": 0,
                "ttl_s": self.ttl_s, **self._stamp(sent)}

    def _stamp(self, sent: float) -> dict:
        """`renewed_boottime`: our steady clock when we sent this write (our lease runs out ttl_s
        after it), for a taker on this machine that reads the same clock (holders_clock_age).
        Only from the steady clock: an injected one means nothing to anyone else."""
        return {"renewed_boottime": sent} if self._clock is steady_clock else {}

    def _adopt(self, body: dict, version: Any, sent: float) -> None:
        self._body, self._version, self._expires_at = body, version, sent + self.ttl_s

    def _lose(self) -> None:
        self._body, self._version, self._expires_at = None, None, None
        self.lost.set()


class _Hung(TimeoutError):
    """A renewal did not finish by the time we had to stop waiting for it."""


# What this process has seen of each lease: (url, key) -> (version, first seen, clock). A
# version watched unchanged for the holder's ttl was not renewed in that time, whatever anyone's
# wall clock says. Kept for the process, not the Lease object, because a node waiting for a job
# (`resume --wait`) makes a new Lease for every try; a reading counts only on the clock it was
# taken on.
_WATCHED: dict[tuple[str, str], tuple[Any, float, Callable[[], float]]] = {}
_WATCHED_LOCK = threading.Lock()


@contextmanager
def held(store_url: str, holder: str) -> Iterator[Lease]:
    """The job's lease, held for the block and released after it (without renewals: for a short
    write such as a submit or a cancel). Raises LeaseHeld when another holder has it."""
    lease = Lease(store_url, holder=holder)
    lease.acquire()
    try:
        yield lease
    finally:
        lease.release()


def _watch(url: str, key: str, version: Any, now: float, clock: Callable[[], float]) -> float:
    """How long (on `clock`) this process has watched `version` of the lease unchanged: 0 the
    first time it sees that version, which starts the watch."""
    with _WATCHED_LOCK:
        seen = _WATCHED.get((url, key))
        if seen is None or seen[0] != version or seen[2] is not clock:
            _WATCHED[(url, key)] = (version, now, clock)
            return 0.0
        return max(0.0, now - seen[1])


def _retries(url: str, *, attempts: int, stop: threading.Event | None = None,
             sleep: Callable[[float], None] | None = None) -> RetryPolicy:
    """The package's retry policy (checkpoint.retry) for lease calls: at most `attempts` tries
    within 30 s (a renewal: within half a renewal interval), backing off from 0.25 s to 4 s. A
    lost compare-and-swap is an answer, not an error: never retried here."""
    return RetryPolicy(f"lease on {url}", budget_s=30.0, stop=stop, sleep=sleep,
                       attempts=attempts, wait=backoff(0.25, 4.0), logger=log,
                       passthrough=(Conflict, Unsupported))
