"""Fencing: at most one node trains a job at a time, through a lease object in the job's folder.

Two nodes resuming the same job at once (a replacement node booting while the old one is still
alive, an operator running `grpo-run resume` by hand) race to create `lease.json` next to the
job's checkpoints. Exactly one wins and trains; the other gets `LeaseHeld`, whose message names
the winner. The winner renews the lease every `renew_every_s` (default ttl/3) from a background
thread; a lease left unrenewed past its expiry (the node died) is taken over by the next node.

    {"holder": "i-0abc", "host": "ip-10-0-0-5", "pid": 4242, "token": "<random>",
     "since": "2025-01-01T00:00:00Z", "expires": "2025-01-01T00:01:00Z",
     "since_epoch": 1735689600.0, "expires_epoch": 1735689660.0, "ttl_s": 60.0}

Every change is a compare-and-swap on the storage itself, never read-then-write
(checkpoint.cas): S3 conditional writes (If-None-Match / If-Match on the ETag read, proven
honoured by the server on a probe object before the first write), an exclusive flock on a local
folder. gs:// and memory:// are refused (checkpoint.cas says why). A lost
compare-and-swap means another writer got there first: the lease reads again and decides anew.

What the lease guarantees, and what it assumes:

* Expiry is judged on the clock of the node that wants to take over, against `expires_epoch`
  written with the holder's clock (NTP keeps cloud VMs within milliseconds of each other).
* The holder fences itself: when renewals keep failing or hanging (storage outage, credentials
  revoked) the renewal thread reports `LeaseLost` once only `renew_every_s / 2` of the lease is
  left, so the trainer can stop before anyone may take over. With the defaults (ttl 60 s, renew
  every 20 s) that is 50 s after the last successful renewal, 10 s before expiry; node clocks
  must agree to well within those 10 s.
* It cannot stop a holder that is frozen (a suspended VM) and wakes after its lease was taken:
  the first renewal then reports `LeaseLost`, up to `renew_every_s` later. Writes that must
  never come from a stale holder go through checkpoint.fenced, which checks `Lease.held` first.

Raises, besides `LeaseHeld` and `LeaseLost`: `StorageConfigError` at once for configuration
errors (missing bucket, bad credentials, unsupported URL); `StorageUnavailable` when transient
errors persist past a bounded number of attempts.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from .cas import Conflict, Unsupported, open_cas
from .retry import RetryPolicy, StorageConfigError, StorageUnavailable, backoff

log = logging.getLogger(__name__)

LEASE_KEY = "lease.json"
# How many times one acquire / renew / release re-reads after losing a compare-and-swap before
# giving up: each lost round means another writer succeeded, so a few rounds settle any race.
_MAX_ROUNDS = 8


class LeaseHeld(RuntimeError):
    """Another live holder has the job. `holder` is its lease body (without the token); the
    message names it: holder, host, pid, since, and when the lease expires."""

    def __init__(self, url: str, holder: dict, now: float) -> None:
        self.holder = _public(holder)
        super().__init__(f"job at {url} is held by {describe_holder(holder, now)}; "
                         f"it is taken over only after that lease expires unrenewed")


class LeaseLost(RuntimeError):
    """Our lease was taken over, removed, or could not be renewed before it expired: stop
    training at once. `holder` is the new holder's lease body when there is one."""

    def __init__(self, message: str, holder: dict | None = None) -> None:
        self.holder = _public(holder) if holder is not None else None
        super().__init__(message)


def describe_holder(body: dict, now: float | None = None) -> str:
    """`i-0abc (host ip-10-0-0-5, pid 4242) since 2025-01-01T00:00:00Z, lease expires
    2025-01-01T00:01:00Z (in 41s)` -- for messages and `grpo-run get`."""
    now = time.time() if now is None else now
    expires = _epoch(body.get("expires_epoch"))
    left = expires - now
    when = f"in {left:.0f}s" if left >= 0 else f"{-left:.0f}s ago"
    return (f"{body.get('holder', '?')} (host {body.get('host', '?')}, pid {body.get('pid', '?')}) "
            f"since {body.get('since', '?')}, lease expires {body.get('expires', '?')} ({when})")


def read_lease(store_url: str, key: str = LEASE_KEY, *, clock: Callable[[], float] = time.time
               ) -> dict | None:
    """The job's lease for display (`grpo-run get`), or None when nobody holds it.

    The stored body without its token, plus `"expired": bool` by `clock`. Raises
    StorageConfigError / StorageUnavailable as `Lease` does."""
    cas = open_cas(store_url, key)
    current = _retries(store_url, attempts=3).call("read", cas.read)
    if current is None:
        return None
    body = _public(_parse(current[0]))
    body["expired"] = clock() >= _epoch(body.get("expires_epoch"))
    return body


class Lease:
    """The job's lease: acquire it, keep it renewed from a thread, release it.

        lease = Lease("s3://bucket/prefix/my-job", holder=node_id)
        lease.acquire()                       # LeaseHeld: another node trains this job
        lease.start_renewing(on_lost=stop_training)
        ...
        lease.release()

    or `with Lease(...) as lease:` (acquire on enter, release on exit). `holder` names this node
    (an instance id, a hostname); the same holder on the same host may retake its own lease at
    once after a crash (its pid is gone), anyone else only once it has expired.

    `clock` (epoch seconds) is injectable for tests; `sleep` is the wait between retries of
    transient storage errors, at most `retry_attempts` tries per operation, cut short when
    `stop` (the preemption event) is set.
    """

    def __init__(
        self,
        store_url: str,
        *,
        holder: str,
        ttl_s: float = 60.0,
        renew_every_s: float | None = None,
        clock: Callable[[], float] = time.time,
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
        self._cas = open_cas(store_url, key)
        self._calls = _retries(store_url, attempts=retry_attempts, stop=stop, sleep=sleep)
        self._host = socket.gethostname()
        # Set once the lease is known lost (taken over, removed, or unrenewable); cleared by a
        # successful acquire. The training loop may poll it instead of using on_lost.
        self.lost = threading.Event()
        self._lock = threading.Lock()      # one acquire / renew / release at a time
        self._body: dict | None = None     # what we last wrote; None when not held
        self._version: Any = None          # the store's version of it (S3 ETag, or the bytes)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"Lease({self.url!r}, holder={self.holder!r})"

    @property
    def held(self) -> bool:
        """We hold the lease as far as we know, and by our clock it is further from expiry than
        the renewal thread's safety margin (renew_every_s / 2). Check it right before work that
        a stale holder must never do, such as uploading a checkpoint."""
        body = self._body
        return (body is not None and not self.lost.is_set()
                and self._clock() < body["expires_epoch"] - self.renew_every_s / 2)

    @property
    def expires_epoch(self) -> float | None:
        body = self._body
        return None if body is None else body["expires_epoch"]

    # --- acquire / renew / release --------------------------------------------------------------

    def acquire(self) -> None:
        """Take the lease, or extend it if already ours.

        Raises LeaseHeld when someone else's lease is live (also when others kept winning
        every round of a race); takes over an expired one."""
        with self._lock:
            if self.lost.is_set():  # what we hold, if anything, is not to be trusted: start over
                self._body, self._version = None, None
            candidate = self._body["token"] if self._body else secrets.token_hex(16)
            current = None
            for _ in range(_MAX_ROUNDS):
                now = self._clock()
                current = self._calls.call("read", self._cas.read)
                # Our token there: already ours, or an earlier attempt whose answer got lost.
                if current is not None and _parse(current[0]).get("token") == candidate:
                    self._adopt(_parse(current[0]), current[1])
                    self.lost.clear()
                    self._renew_locked()
                    return
                body = self._new_body(candidate, since=now, now=now)
                data = _dump(body)
                try:
                    if current is None:
                        version = self._calls.call("create", lambda: self._cas.create(data))
                    else:
                        theirs = _parse(current[0])
                        if not self._may_take_over(theirs, now):
                            raise LeaseHeld(self.url, theirs, now)
                        version = self._calls.call(
                            "take over", lambda v=current[1]: self._cas.replace(data, v))
                        log.warning("lease %s: took over from %s", self.url,
                                    describe_holder(theirs, now))
                except Conflict:
                    continue  # another writer changed it between our read and write: look again
                self._adopt(body, version)
                self.lost.clear()
                log.info("lease %s: acquired by %s until %s", self.url, self.holder,
                         body["expires"])
                return
            theirs = _parse(current[0]) if current is not None else {}
            raise LeaseHeld(self.url, theirs, self._clock())

    def renew(self) -> None:
        """Extend the lease by ttl_s from now. Raises LeaseLost if it is no longer ours (and
        sets `lost`), RuntimeError if it was never acquired, StorageUnavailable /
        StorageConfigError when storage fails (the lease is then unchanged)."""
        with self._lock:
            self._renew_locked()

    def start_renewing(self, on_lost: Callable[[LeaseLost], None]) -> None:
        """Renew every renew_every_s from a daemon thread until release().

        `on_lost` is called once, from that thread, when a renewal finds the lease taken over or
        removed, or when renewals have failed or hung until only renew_every_s / 2 of the lease
        is left (self-fencing). The thread ends after calling it. Failures before that are
        logged and retried every renew_every_s / 4."""
        if self._body is None:
            raise RuntimeError(f"lease {self.url}: acquire() before start_renewing()")
        if self._thread is not None:
            raise RuntimeError(f"lease {self.url}: already renewing")
        self._stopping.clear()
        self._thread = threading.Thread(target=self._renew_loop, args=(on_lost,),
                                        name=f"lease-renew:{self.holder}", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still ours (a conditional delete: a
        lease someone else took over is left alone). Idempotent. Storage errors are logged, not
        raised: an unreleased lease simply expires after ttl_s."""
        self._stopping.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._lock:
            body, self._body, self._version = self._body, None, None
            if body is None:
                return
            try:
                for _ in range(_MAX_ROUNDS):
                    current = self._calls.call("read", self._cas.read)
                    if current is None or _parse(current[0]).get("token") != body["token"]:
                        return  # gone, or someone else's now
                    try:
                        self._calls.call("release", lambda v=current[1]: self._cas.delete(v))
                        log.info("lease %s: released by %s", self.url, self.holder)
                        return
                    except Conflict:
                        continue
            except (StorageUnavailable, StorageConfigError, Unsupported) as exc:
                log.warning("lease %s: could not release (%s); it expires by itself at %s",
                            self.url, exc, body["expires"])

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
        now = self._clock()
        body = dict(self._body, pid=os.getpid(), expires=_iso(now + self.ttl_s),
                    expires_epoch=now + self.ttl_s, ttl_s=self.ttl_s)
        data = _dump(body)
        for _ in range(_MAX_ROUNDS):
            try:
                version = self._calls.call(
                    "renew", lambda v=self._version: self._cas.replace(data, v),
                    budget_s=self.renew_every_s / 2)
            except Conflict:
                current = self._calls.call("read", self._cas.read, budget_s=self.renew_every_s / 2)
                theirs = _parse(current[0]) if current is not None else None
                if theirs is not None and theirs.get("token") == body["token"]:
                    # Ours still: an earlier write of ours whose answer got lost.
                    self._version = current[1]
                    continue
                self._lose()
                if theirs is None:
                    raise LeaseLost(f"lease on {self.url} was removed while {self.holder} held it; "
                                    f"stop training: another node may have started") from None
                raise LeaseLost(f"lease on {self.url} was taken over by "
                                f"{describe_holder(theirs, now)}; stop training", theirs) from None
            self._adopt(body, version)
            return
        self._lose()
        raise LeaseLost(f"lease on {self.url}: could not renew, it kept changing under us")

    def _renew_loop(self, on_lost: Callable[[LeaseLost], None]) -> None:
        wait = self.renew_every_s
        while not self._stopping.wait(wait):
            expires = self.expires_epoch
            if expires is None:
                return  # released or lost meanwhile
            # Renewed by then, or we stop: half a renewal interval of lease is left for the
            # trainer to stop before anyone else may take over (and absorbs clock skew).
            cutoff = expires - self.renew_every_s / 2
            try:
                self._renew_before(cutoff)
                wait = self.renew_every_s
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
                lost = LeaseLost(f"lease on {self.url}: could not renew before it expires at "
                                 f"{_iso(expires)} ({exc}); stop training so that another node "
                                 f"can take over safely")
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
        if not done.wait(max(0.0, cutoff - self._clock())):
            raise _Hung(f"storage did not answer the renewal before {_iso(cutoff)}")
        if outcome:
            raise outcome[0]

    def _may_take_over(self, theirs: dict, now: float) -> bool:
        if now >= _epoch(theirs.get("expires_epoch")):
            return True
        # Our own lease from before a crash or restart on this very machine: no need to wait
        # out the ttl, unless that process is still running (two supervisors on one node).
        if theirs.get("holder") == self.holder and theirs.get("host") == self._host:
            pid = theirs.get("pid")
            return pid == os.getpid() or not _pid_alive(pid)
        return False

    def _new_body(self, token: str, *, since: float, now: float) -> dict:
        return {"holder": self.holder, "host": self._host, "pid": os.getpid(), "token": token,
                "since": _iso(since), "expires": _iso(now + self.ttl_s),
                "since_epoch": since, "expires_epoch": now + self.ttl_s, "ttl_s": self.ttl_s}

    def _adopt(self, body: dict, version: Any) -> None:
        self._body, self._version = body, version

    def _lose(self) -> None:
        self._body, self._version = None, None
        self.lost.set()


class _Hung(TimeoutError):
    """A renewal did not finish by the time we had to stop waiting for it."""


def _retries(url: str, *, attempts: int, stop: threading.Event | None = None,
             sleep: Callable[[float], None] | None = None) -> RetryPolicy:
    """The package's retry policy (checkpoint.retry) for lease calls: at most `attempts` tries
    within 30 s (a renewal: within half a renewal interval), backing off from 0.25 s to 4 s. A
    lost compare-and-swap is an answer, not an error: never retried here."""
    return RetryPolicy(f"lease on {url}", budget_s=30.0, stop=stop, sleep=sleep,
                       attempts=attempts, wait=backoff(0.25, 4.0), logger=log,
                       passthrough=(Conflict, Unsupported))


# --- small helpers ------------------------------------------------------------------------------

def _pid_alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _parse(data: bytes) -> dict:
    """A lease body; an unreadable one counts as expired (it cannot be renewed either)."""
    try:
        body = json.loads(data)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        log.warning("lease body is not a JSON object (%r...); treating it as expired", data[:80])
        return {"holder": "?", "expires_epoch": 0.0, "unreadable": True}
    return body


def _public(body: dict) -> dict:
    return {k: v for k, v in body.items() if k != "token"}


def _dump(body: dict) -> bytes:
    return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()


def _epoch(value: object) -> float:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0.0


def _iso(epoch: float) -> str:
    return dt.datetime.fromtimestamp(epoch, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
