"""Compare-and-swap on one object: the primitive under the job's lease (checkpoint.lease).

`open_cas(url, key)` returns a `Cas` for the object `key` under a storage URL. Every change is a
compare-and-swap on the storage itself, never read-then-write; `version` is opaque to callers.
A read also says how long ago the object was written, measured on the store's own clock (both
ends of the interval from the one party), so that a lease can be judged without comparing two
machines' wall clocks: S3 gives its response's `Date` minus the object's `Last-Modified`. A local
folder says nothing (age None): the file's modification time is stamped by whoever serves the
folder (an NFS server's clock, or another node's), and this machine's time minus it would compare
two clocks; the lease ages a folder's lease by its holder's own renewals instead (lease.py).

* s3://: conditional writes through the Store's own s3fs filesystem (one client, one set of
  credentials and timeouts): create with `pipe_file(mode="create")` (PutObject
  `If-None-Match: *`), replace with `PutObject If-Match: <ETag read>`, delete with
  `DeleteObject If-Match`. A 412 PreconditionFailed (or 409 ConditionalRequestConflict) is a
  `Conflict`: another writer got there first. AWS S3 has honoured these since 2024; SeaweedFS 4.x
  does too. A server that ignored the headers would make the lease a last-writer-wins lock, so
  before its first write an S3Cas proves the server honours them on a probe object and refuses
  to go on (StorageConfigError) if it does not.
* local folder / file://: every change under an exclusive `flock` on the folder itself (no
  sidecar file that a cleanup could delete while it is held); a new object is published with
  `os.link` from a complete temporary file (EEXIST like O_EXCL, and a reader never sees half of
  it), a replacement with fsync + rename. Atomic between processes on one machine; over NFS only
  as good as the server's lock support.
* gs://: generation preconditions on uploads (checkpoint.storage.gcs, which says why a release
  is an upload there too).
* az://: ETag conditions on uploads and deletes (checkpoint.storage.azure).
* memory:// (or any other) is refused: unit tests bring their own double
  (tests/checkpoint/memory_cas.py).

These calls make one attempt each; the lease retries them under the package's retry policy.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import email.utils
import fcntl
import logging
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from .fsio import TMP_MARKER, fsync_dir, temp_sibling
from .retry import StorageConfigError, describe, s3_code, s3_status
from .store import Store

log = logging.getLogger(__name__)


class Conflict(Exception):
    """The compare failed: another writer changed (or created, or removed) the object first."""


class Unsupported(Exception):
    """The server refused a conditional request as not implemented."""


class Found(NamedTuple):
    """What a read found. `age_s`: seconds since the object was last written, both ends on the
    store's own clock, cut down rather than rounded up (S3 loses a second to its whole-second
    dates; a local file system's coarse timestamps may add a few milliseconds); None when the
    store does not say."""

    data: bytes
    version: Any
    age_s: float | None


class Cas(Protocol):
    """One object with compare-and-swap. `version` is opaque: an ETag, or the bytes themselves."""

    def read(self) -> Found | None: ...                       # None when there is none
    def create(self, data: bytes) -> Any: ...                 # Conflict if it exists
    def replace(self, data: bytes, version: Any) -> Any: ...  # Conflict unless still `version`
    def delete(self, version: Any) -> None: ...               # Conflict unless still `version`


class S3Cas:
    """S3 conditional requests through the store's s3fs filesystem (its retries are off)."""

    def __init__(self, store: Store, key: str) -> None:
        self.url = store.url
        self.fs, self.path = store.fs_path(key)
        self.bucket, self.key, _ = self.fs.split_path(self.path)
        self._checked = False

    def check_conditional_writes(self) -> None:
        """Prove once that the server honours If-None-Match and If-Match on PutObject, on a
        probe object beside the lease: a server that ignores them would let two nodes both
        "win". StorageConfigError if it does not."""
        if self._checked:
            return
        probe = probe_beside(self.path)
        try:
            self.fs.pipe_file(probe, b"1", mode="create")
            for condition in ({"mode": "create"}, {"IfMatch": '"' + "0" * 32 + '"'}):
                try:
                    self.fs.pipe_file(probe, b"2", **condition)
                except Exception as exc:
                    if _is_conflict(exc):
                        continue
                    raise
                raise StorageConfigError(
                    f"lease on {self.url}: this S3 server does not honour conditional writes "
                    f"({'If-None-Match' if 'mode' in condition else 'If-Match'} on PutObject "
                    f"was ignored), so two nodes could both train this job; use AWS S3, "
                    f"SeaweedFS >= 4, or another server that supports them")
        finally:
            try:
                self.fs.rm_file(probe)
            except Exception as exc:  # a stray probe is hidden from listings; say so only
                log.warning("lease on %s: could not delete probe %s: %s", self.url, probe,
                            describe(exc))
        self._checked = True

    def read(self) -> Found | None:
        # One GET for the bytes, their ETag and their age together: an ETag read separately
        # could belong to a newer object than the bytes, and a replace against it would then
        # succeed.
        try:
            reply = self.fs.call_s3("get_object", Bucket=self.bucket, Key=self.key)
        except FileNotFoundError as exc:
            if s3_code(exc) == "NoSuchKey":  # NoSuchBucket stays an error (a config error)
                return None
            raise
        from fsspec.asyn import sync

        body = reply["Body"]
        try:
            data = sync(self.fs.loop, body.read)
        finally:
            body.close()
        return Found(data, reply["ETag"], _s3_age(reply))

    def create(self, data: bytes) -> Any:
        self.check_conditional_writes()
        return self._put(data, mode="create")

    def replace(self, data: bytes, version: Any) -> Any:
        self.check_conditional_writes()
        return self._put(data, IfMatch=version)

    def delete(self, version: Any) -> None:
        try:
            self.fs.call_s3("delete_object", Bucket=self.bucket, Key=self.key, IfMatch=version)
        except Exception as exc:
            if s3_code(exc) == "NoSuchKey":
                return
            if _is_conflict(exc):
                raise Conflict() from exc
            if _not_implemented(exc):
                raise Unsupported(f"{self.url}: the server does not support conditional "
                                  f"DeleteObject ({describe(exc)})") from exc
            raise
        finally:
            self.fs.invalidate_cache(self.path)

    def _put(self, data: bytes, **condition: str) -> Any:
        try:
            reply = self.fs.pipe_file(self.path, data, ContentType="application/json",
                                      **condition)
        except Exception as exc:
            if _is_conflict(exc):
                raise Conflict() from exc
            if s3_status(exc) == 404 and s3_code(exc) == "NoSuchKey":  # If-Match, object gone
                raise Conflict() from exc
            if _not_implemented(exc):
                raise StorageConfigError(
                    f"lease on {self.url}: this S3 server does not support conditional writes "
                    f"(If-None-Match / If-Match on PutObject), so two nodes could both train "
                    f"({describe(exc)})") from exc
            raise
        return reply["ETag"]


def _s3_age(reply: dict) -> float | None:
    """The object's age on the server's clock from a GetObject reply (see http_age)."""
    modified = reply.get("LastModified")
    served = reply.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    if not isinstance(modified, dt.datetime):
        return None
    return http_age(served, modified)


def http_age(served: str | None, modified: str | dt.datetime | None) -> float | None:
    """An object's age on the server's clock: the response's `Date` header minus the object's
    `Last-Modified`, both stamped by the server. Both are HTTP dates in whole seconds (each cut
    down, by up to a second), so one second is taken off: the result never overstates the age.
    None when the server sends either one not at all or unreadable."""
    try:
        served_at = email.utils.parsedate_to_datetime(served)            # type: ignore[arg-type]
        if not isinstance(modified, dt.datetime):
            modified = email.utils.parsedate_to_datetime(modified)       # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    if served_at.tzinfo is None or modified.tzinfo is None:
        return None
    return (served_at - modified).total_seconds() - 1.0


def probe_beside(path: str) -> str:
    """A fresh name for a conditional-write probe in the folder of `path`, hidden from listings."""
    folder = path.rpartition("/")[0]
    return f"{folder}/{TMP_MARKER}lease-probe-{secrets.token_hex(8)}" if folder else \
        f"{TMP_MARKER}lease-probe-{secrets.token_hex(8)}"


def _is_conflict(exc: BaseException) -> bool:
    """412 PreconditionFailed or 409 ConditionalRequestConflict: another writer was first."""
    return s3_status(exc) in (409, 412)


def _not_implemented(exc: BaseException) -> bool:
    return s3_code(exc) == "NotImplemented" or s3_status(exc) == 501


class LocalCas:
    """A file in a local folder; every change under an exclusive flock on that folder."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> Found | None:
        # Writes are rename / link, so never half a file. No age: the file's modification time
        # is the file server's stamp (on NFS, the server's clock; on a folder another node also
        # writes, that node's), and this machine's time.time() minus it would judge a lease by
        # two clocks. The lease ages it by its holder's own renewals (checkpoint.storage.lease).
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        return Found(data, data, None)

    def create(self, data: bytes) -> Any:
        with self._locked():
            tmp = self._write_temp(data)
            try:
                os.link(tmp, self.path)  # EEXIST if there is one: O_EXCL, with full content
            except FileExistsError:
                raise Conflict() from None
            finally:
                tmp.unlink(missing_ok=True)
            fsync_dir(self.path.parent)
        return data

    def replace(self, data: bytes, version: Any) -> Any:
        with self._locked():
            current = self.read()
            if current is None or current.data != version:
                raise Conflict()
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
            if current.data != version:
                raise Conflict()
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
