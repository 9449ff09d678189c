"""Fencing: at most one node trains a job at a time, through a lease object in the job's folder.

Two nodes resuming the same job at once (a replacement node booting while the old one is still
alive, an operator running `grpo-run resume` by hand) race to create `lease.json` next to the
job's checkpoints. Exactly one wins and trains; the other gets `LeaseHeld`, whose message names
the winner. The winner renews the lease every `renew_every_s` (default ttl/3) from a background
thread; a lease left unrenewed past its expiry (the node died) is taken over by the next node.

    {"holder": "i-0abc", "host": "ip-10-0-0-5", "pid": 4242, "token": "<random>",
     "since": "2025-01-01T00:00:00Z", "expires": "2025-01-01T00:01:00Z",
     "since_epoch": 1735689600.0, "expires_epoch": 1735689660.0, "ttl_s": 60.0}

Every change is a compare-and-swap on the storage itself, never read-then-write:

* S3: conditional writes. Create with `PutObject If-None-Match: *`; renew, and take over an
  expired lease, with `PutObject If-Match: <ETag read>`; release with `DeleteObject If-Match`.
  A 412 PreconditionFailed (or 409 ConditionalRequestConflict) means another writer got there
  first. AWS S3 has honoured these since 2024; SeaweedFS 4.x does too (tests/checkpoint/
  test_lease.py races eight writers against it). A server that ignored the headers would make
  this a last-writer-wins lock, so before its first write a Lease proves the server honours
  them on a probe object and refuses to go on (StorageConfigError) if it does not.
  Calls go through boto3 directly (s3fs has no conditional put); the endpoint and credentials
  come from the standard chain (`AWS_ENDPOINT_URL`, ...), as for `Store`.
* Local folder / file://: every change happens under an exclusive `flock` on the job folder
  itself (no sidecar file that a cleanup could delete while it is held); a new lease is
  published with `os.link` from a complete temporary file (fails with EEXIST like O_EXCL, and a
  reader never sees half a lease), a replacement with fsync + rename. Atomic between processes
  on one machine; over NFS it is only as good as the server's lock support.
* memory:// (unit tests): one process-wide lock.

What the lease guarantees, and what it assumes:

* Expiry is judged on the clock of the node that wants to take over, against `expires_epoch`
  written with the holder's clock (NTP keeps cloud VMs within milliseconds of each other).
* The holder fences itself: when renewals keep failing or hanging (storage outage, credentials
  revoked) the renewal thread reports `LeaseLost` once only `renew_every_s / 2` of the lease is
  left, so the trainer can stop before anyone may take over. With the defaults (ttl 60 s, renew
  every 20 s) that is 50 s after the last successful renewal, 10 s before expiry; node clocks
  must agree to well within those 10 s.
* It cannot stop a holder that is frozen (a suspended VM) and wakes after its lease was taken:
  the first renewal then reports `LeaseLost`, up to `renew_every_s` later. Checkpoint uploads
  that must never come from a stale holder should check `Lease.held` right before they start.

Raises, besides `LeaseHeld` and `LeaseLost`: `StorageConfigError` at once for configuration
errors (missing bucket, bad credentials, unsupported URL); `StorageUnavailable` when transient
errors persist past a bounded number of attempts.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

from tenacity import (
    RetryError,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    stop_when_event_set,
    wait_exponential,
)

from .fsio import TMP_MARKER, fsync_dir, temp_sibling
from .store import (
    Store,
    StorageConfigError,
    StorageUnavailable,
    _config_reason,  # one classification of storage errors for the whole package
    _describe,
    _is_transient,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

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
    cas = _open_cas(store_url, key)
    current = _Calls(store_url, attempts=3).run("read", cas.read)
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
        self._cas = _open_cas(store_url, key)
        self._calls = _Calls(store_url, attempts=retry_attempts, stop=stop, sleep=sleep)
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
                current = self._calls.run("read", self._cas.read)
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
                        version = self._calls.run("create", lambda: self._cas.create(data))
                    else:
                        theirs = _parse(current[0])
                        if not self._may_take_over(theirs, now):
                            raise LeaseHeld(self.url, theirs, now)
                        version = self._calls.run(
                            "take over", lambda v=current[1]: self._cas.replace(data, v))
                        log.warning("lease %s: took over from %s", self.url,
                                    describe_holder(theirs, now))
                except _Conflict:
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
                    current = self._calls.run("read", self._cas.read)
                    if current is None or _parse(current[0]).get("token") != body["token"]:
                        return  # gone, or someone else's now
                    try:
                        self._calls.run("release", lambda v=current[1]: self._cas.delete(v))
                        log.info("lease %s: released by %s", self.url, self.holder)
                        return
                    except _Conflict:
                        continue
            except (StorageUnavailable, StorageConfigError, _Unsupported) as exc:
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
                version = self._calls.run(
                    "renew", lambda v=self._version: self._cas.replace(data, v),
                    budget_s=self.renew_every_s / 2)
            except _Conflict:
                current = self._calls.run("read", self._cas.read, budget_s=self.renew_every_s / 2)
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


# --- compare-and-swap backends ------------------------------------------------------------------

class _Conflict(Exception):
    """The compare failed: another writer changed (or created, or removed) the lease first."""


class _Hung(TimeoutError):
    """A renewal did not finish by the time we had to stop waiting for it."""


class _Unsupported(Exception):
    """The server refused a conditional request as not implemented."""


class _Cas(Protocol):
    """One object with compare-and-swap. `version` is opaque: an ETag, or the bytes themselves."""

    def read(self) -> tuple[bytes, Any] | None: ...
    def create(self, data: bytes) -> Any: ...                 # _Conflict if it exists
    def replace(self, data: bytes, version: Any) -> Any: ...  # _Conflict unless still `version`
    def delete(self, version: Any) -> None: ...               # _Conflict unless still `version`


def _open_cas(url: str, key: str) -> _Cas:
    if not isinstance(key, str) or not key or key.startswith("/") or key.endswith("/") or \
            any(p in ("", ".", "..") for p in key.split("/")):
        raise ValueError(f"lease key must be a relative '/'-separated path (got {key!r})")
    store = Store(url)  # validates the URL: StorageConfigError for a bad or unsupported one
    if store.protocol == "s3":
        parts = urlsplit(url)
        prefix = parts.path.strip("/")
        return _S3Cas(url, parts.netloc, f"{prefix}/{key}" if prefix else key)
    if store.protocol == "file":
        raw = url.split("://", 1)[1] if "://" in url else url
        return _LocalCas(Path(os.path.abspath(os.path.expanduser(raw))) / key)
    if store.protocol == "memory":
        return _MemoryCas(store, key)
    raise StorageConfigError(f"lease on {url}: {store.protocol}:// has no compare-and-swap here; "
                             f"keep the job on s3://, a local folder, or memory://")


class _S3Cas:
    """S3 conditional writes through boto3."""

    def __init__(self, url: str, bucket: str, key: str) -> None:
        self.url, self.bucket, self.key = url, bucket, key
        self._client = _s3_client()
        self._checked = False

    def check_conditional_writes(self) -> None:
        """Prove once that the server honours If-None-Match and If-Match on PutObject, on a
        probe object beside the lease: a server that ignores them would let two nodes both
        "win". StorageConfigError if it does not."""
        if self._checked:
            return
        probe = f"{self.key.rpartition('/')[0]}/{TMP_MARKER}lease-probe-{secrets.token_hex(8)}"
        probe = probe.lstrip("/")
        put = self._client.put_object
        try:
            put(Bucket=self.bucket, Key=probe, Body=b"1", IfNoneMatch="*")
            for condition in ({"IfNoneMatch": "*"}, {"IfMatch": '"' + "0" * 32 + '"'}):
                try:
                    put(Bucket=self.bucket, Key=probe, Body=b"2", **condition)
                except Exception as exc:
                    if _s3_status(exc) in (409, 412):
                        continue
                    raise
                raise StorageConfigError(
                    f"lease on {self.url}: this S3 server does not honour conditional writes "
                    f"({'If-None-Match' if 'IfNoneMatch' in condition else 'If-Match'} on "
                    f"PutObject was ignored), so two nodes could both train this job; use AWS "
                    f"S3, SeaweedFS >= 4, or another server that supports them")
        finally:
            try:
                self._client.delete_object(Bucket=self.bucket, Key=probe)
            except Exception as exc:  # a stray probe is hidden from listings; say so only
                log.warning("lease on %s: could not delete probe %s: %s", self.url, probe,
                            _describe(exc))
        self._checked = True

    def read(self) -> tuple[bytes, Any] | None:
        try:
            reply = self._client.get_object(Bucket=self.bucket, Key=self.key)
        except Exception as exc:
            if _s3_code(exc) == "NoSuchKey":  # NoSuchBucket stays an error (a config error)
                return None
            raise
        return reply["Body"].read(), reply["ETag"]

    def create(self, data: bytes) -> Any:
        self.check_conditional_writes()
        return self._put(data, IfNoneMatch="*")

    def replace(self, data: bytes, version: Any) -> Any:
        self.check_conditional_writes()
        return self._put(data, IfMatch=version)

    def delete(self, version: Any) -> None:
        try:
            self._client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=version)
        except Exception as exc:
            code, status = _s3_code(exc), _s3_status(exc)
            if code == "NoSuchKey":
                return
            if status in (409, 412):
                raise _Conflict() from exc
            if code == "NotImplemented" or status == 501:
                raise _Unsupported(f"{self.url}: the server does not support conditional "
                                   f"DeleteObject ({_describe(exc)})") from exc
            raise

    def _put(self, data: bytes, **condition: str) -> Any:
        try:
            reply = self._client.put_object(Bucket=self.bucket, Key=self.key, Body=data,
                                             ContentType="application/json", **condition)
        except Exception as exc:
            status = _s3_status(exc)
            if status in (409, 412):  # PreconditionFailed / ConditionalRequestConflict
                raise _Conflict() from exc
            if status == 404 and _s3_code(exc) == "NoSuchKey":  # If-Match on a deleted object
                raise _Conflict() from exc
            if _s3_code(exc) == "NotImplemented" or status == 501:
                raise StorageConfigError(
                    f"lease on {self.url}: this S3 server does not support conditional writes "
                    f"(If-None-Match / If-Match on PutObject), so two nodes could both train "
                    f"({_describe(exc)})") from exc
            raise
        return reply["ETag"]


_S3_CLIENTS = threading.Lock()
_S3_LOADER: Any = None


def _s3_client() -> Any:
    """A new S3 client from the standard chain (credentials and endpoint read now, from the
    environment as it is), sharing one parsed copy of botocore's data files: parsing them is
    most of the ~130 ms a fresh client costs."""
    global _S3_LOADER
    import boto3
    import botocore.session
    from botocore.config import Config
    from botocore.loaders import create_loader

    with _S3_CLIENTS:  # creating clients is not thread-safe; using them is
        if _S3_LOADER is None:
            _S3_LOADER = create_loader()
        core = botocore.session.Session()
        core.register_component("data_loader", _S3_LOADER)
        return boto3.session.Session(botocore_session=core).client("s3", config=Config(
            retries={"total_max_attempts": 1, "mode": "standard"},  # ours decide
            connect_timeout=5, read_timeout=20))


class _LocalCas:
    """A file in a local folder; every change under an exclusive flock on that folder."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> tuple[bytes, Any] | None:
        try:
            data = self.path.read_bytes()  # writes are rename / link: never half a file
        except FileNotFoundError:
            return None
        return data, data

    def create(self, data: bytes) -> Any:
        with self._locked():
            tmp = self._write_temp(data)
            try:
                os.link(tmp, self.path)  # EEXIST if there is one: O_EXCL, with full content
            except FileExistsError:
                raise _Conflict() from None
            finally:
                tmp.unlink(missing_ok=True)
            fsync_dir(self.path.parent)
        return data

    def replace(self, data: bytes, version: Any) -> Any:
        with self._locked():
            if self.read() != (version, version):
                raise _Conflict()
            tmp = self._write_temp(data)
            try:
                os.replace(tmp, self.path)
            finally:
                tmp.unlink(missing_ok=True)
            fsync_dir(self.path.parent)
        return data

    def delete(self, version: Any) -> None:
        with self._locked():
            current = self.read()
            if current is None:
                return
            if current[0] != version:
                raise _Conflict()
            self.path.unlink()
            fsync_dir(self.path.parent)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        folder = self.path.parent
        if folder.exists() and not folder.is_dir():
            raise StorageConfigError(f"lease folder {folder} exists and is not a folder")
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released by close, also if we are killed
            yield
        finally:
            os.close(fd)

    def _write_temp(self, data: bytes) -> Path:
        tmp = temp_sibling(self.path)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp


_MEMORY_LOCK = threading.Lock()


class _MemoryCas:
    """memory:// for unit tests: one lock for the whole process."""

    def __init__(self, store: Store, key: str) -> None:
        self.store, self.key = store, key

    def read(self) -> tuple[bytes, Any] | None:
        with _MEMORY_LOCK:
            try:
                data = self.store.get_bytes(self.key)
            except FileNotFoundError:
                return None
            return data, data

    def create(self, data: bytes) -> Any:
        with _MEMORY_LOCK:
            if self.store.exists(self.key):
                raise _Conflict()
            self.store.put_bytes(self.key, data)
            return data

    def replace(self, data: bytes, version: Any) -> Any:
        with _MEMORY_LOCK:
            if not self.store.exists(self.key) or self.store.get_bytes(self.key) != version:
                raise _Conflict()
            self.store.put_bytes(self.key, data)
            return data

    def delete(self, version: Any) -> None:
        with _MEMORY_LOCK:
            if not self.store.exists(self.key):
                return
            if self.store.get_bytes(self.key) != version:
                raise _Conflict()
            self.store.delete(self.key)


# --- retries ------------------------------------------------------------------------------------

@dataclass
class _Calls:
    """Bounded retries of transient storage errors; configuration errors raised at once."""

    url: str
    attempts: int = 5
    stop: threading.Event | None = None
    sleep: Callable[[float], None] = time.sleep

    def run(self, op: str, fn: Callable[[], T], budget_s: float = 30.0) -> T:
        stop = stop_after_attempt(max(1, self.attempts)) | stop_after_delay(budget_s)
        if self.stop is not None:
            stop = stop | stop_when_event_set(self.stop)

        def attempt() -> T:
            try:
                return fn()
            except (_Conflict, _Unsupported, StorageConfigError):
                raise
            except Exception as exc:
                reason = _config_reason(exc)
                if reason is not None:
                    raise StorageConfigError(
                        f"lease on {self.url}: {reason} ({op}: {_describe(exc)})") from exc
                raise

        retrying = Retrying(
            retry=retry_if_exception(_is_transient), stop=stop,
            wait=wait_exponential(multiplier=0.25, min=0.25, max=4), sleep=self.sleep,
            before_sleep=lambda state: log.warning(
                "lease on %s: %s failed (attempt %d: %s); retrying", self.url, op,
                state.attempt_number,
                _describe(state.outcome.exception() if state.outcome else None)),
            reraise=False,
        )
        try:
            return retrying(attempt)
        except RetryError as exc:
            last = exc.last_attempt.exception()
            raise StorageUnavailable(f"lease on {self.url}: {op} failed "
                                     f"{exc.last_attempt.attempt_number} time(s): {_describe(last)}"
                                     ) from last


# --- small helpers ------------------------------------------------------------------------------

def _s3_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    return str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""


def _s3_status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    return response.get("ResponseMetadata", {}).get("HTTPStatusCode")


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
