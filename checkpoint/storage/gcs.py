"""Google Cloud Storage (`gs://bucket/prefix`) through google-cloud-storage: the job's folder
(`GcsStore`) and the lease's compare-and-swap on one object (`GcsCas`).

Credentials are Application Default Credentials, as every Google library finds them: a node's
service account from the metadata server, workload identity on GKE, `GOOGLE_APPLICATION_CREDENTIALS`,
or `gcloud auth application-default login`. `STORAGE_EMULATOR_HOST` is honoured the way the library
honours it (anonymous credentials, that endpoint): that is how the tests reach fake-gcs-server.

Every call makes one attempt (`retry=None`: the library would otherwise retry by itself, for a
conditional write too) under a (connect, read) timeout; the store's retry policy
(checkpoint.retry) does the retrying, bounded by the stop event and the notice's deadline.

The lease's compare-and-swap uses object generations, on uploads only:

* create: upload with `ifGenerationMatch=0` (only if there is no live object);
* replace: upload with `ifGenerationMatch=<generation read>`;
* delete (a lease released): upload of an empty body with `ifGenerationMatch=<generation read>`.
  An empty lease object reads as no lease, and the next create replaces that generation.

Why no conditional DELETE: fake-gcs-server, the emulator the tests run, deletes an object whatever
`ifGenerationMatch` a DELETE carries (and ignores it on resumable uploads; tests/checkpoint/
test_gcs_store.py shows both). GCS itself honours it, but a lease that relied on it could not be
proven here, and a stale holder releasing a lease another node had taken over would let a third
one train beside it. Small conditional uploads are honoured by both, and GcsCas proves that on a
probe object before its first write, refusing a server that ignores them.

A read gives the object's age on the server's clock: the response's `Date` minus its
`Last-Modified`, both from the one GET that returned the bytes and their generation.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .cas import Conflict, Found, http_age, probe_beside
from .fsio import fsync_dir, fsync_file, temp_sibling
from .retry import StorageConfigError, config_reason, describe
from .store import BucketStore, ObjectTooLarge, check_key, needs_extra, within

log = logging.getLogger(__name__)

TIMEOUT = (5, 60)           # seconds to connect, to wait for each read: as for S3


def split_url(url: str) -> tuple[str, str]:
    """(bucket, prefix without slashes) of gs://bucket/prefix; StorageConfigError otherwise."""
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("gs", "gcs") or not parts.netloc:
        raise StorageConfigError(f"storage URL {url} names no bucket (expected gs://bucket/prefix)")
    if "@" in parts.netloc:
        raise StorageConfigError(
            f"storage URL gs://{parts.netloc.rsplit('@', 1)[-1]}{parts.path} must not carry credentials: "
            f"use Application Default Credentials (the node's service account, workload identity, "
            f"or GOOGLE_APPLICATION_CREDENTIALS)")
    if parts.query or parts.fragment:
        raise StorageConfigError(f"storage URL {url}: no ?query or #fragment (expected gs://bucket/prefix)")
    return parts.netloc, parts.path.strip("/")


class _Client:
    """One google-cloud-storage client and the last response headers each thread saw on it.

    The library keeps a download's `Date` and `Last-Modified` to itself; a response hook on the
    client's HTTP session (a requests session) records them per thread, so that a read can tell
    the object's age from the same response that brought its bytes."""

    def __init__(self, url: str) -> None:
        try:
            storage = importlib.import_module("google.cloud.storage")
        except ImportError as exc:
            raise needs_extra(url, "google-cloud-storage", "gcs") from exc
        self.url = url
        self._storage = storage
        self._made: Any = None
        self._lock = threading.Lock()
        self._seen = threading.local()

    @property
    def client(self) -> Any:
        """Made on first use, so that a URL is checked before credentials are looked for."""
        with self._lock:
            if self._made is None:
                from google.auth import exceptions as gax

                try:
                    client = self._storage.Client(project=None)   # no project: objects only, never buckets
                except gax.DefaultCredentialsError as exc:
                    # raised here, outside any store call's retry wrapper: said as the configuration
                    # error it is, so every command (get, samples, cancel, ...) prints one line
                    raise StorageConfigError(f"storage {self.url}: {config_reason(exc)}") from None
                client._http.hooks["response"].append(self._remember)
                self._made = client
            return self._made

    def bucket(self, name: str) -> Any:
        return self.client.bucket(name)

    def _remember(self, response: Any, *args: Any, **kwargs: Any) -> Any:
        self._seen.headers = response.headers
        return response

    def last_headers(self) -> Any:
        return getattr(self._seen, "headers", {})

    def confirm_bucket(self, bucket: str, folder: str, where: str) -> None:
        """StorageConfigError (starting with `where`) when `bucket` does not exist: GCS says 404 to
        a missing object and to a missing bucket alike. A one-key listing under `folder`, which
        the node's role allows (not buckets.get)."""
        from google.api_core.exceptions import NotFound

        try:
            list(self.client.list_blobs(bucket, prefix=f"{folder}/" if folder else "", max_results=1,
                                        retry=None, timeout=TIMEOUT))
        except NotFound:
            raise no_bucket(where, bucket) from None


def no_bucket(where: str, bucket: str) -> StorageConfigError:
    return StorageConfigError(f"{where}: bucket {bucket!r} does not exist (create it, or fix spec.storage)")


class GcsStore(BucketStore):
    """A job's folder under gs://bucket/prefix (see the module)."""

    protocol = "gs"

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.bucket_name, self.root = split_url(url)
        self._gcs = _Client(url)
        from google.api_core import exceptions as gx
        self._gx = gx

    def _blob(self, key: str) -> Any:
        return self._gcs.bucket(self.bucket_name).blob(self._name(key))

    def put_file(self, local: Path, key: str) -> None:
        local = Path(local)
        if not local.is_file():
            raise FileNotFoundError(f"no such local file to upload: {local}")
        # One object appears only once all of it is uploaded (a resumable upload is finalised by
        # its last chunk): a reader never sees part of it.
        self._call("put_file", key, self._uploading(lambda: self._blob(key).upload_from_filename(
            str(local), retry=None, timeout=TIMEOUT)))

    def get_file(self, key: str, local: Path) -> None:
        local = Path(local)
        blob = self._blob(key)
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_sibling(local)

        def attempt() -> None:
            try:
                blob.download_to_filename(str(tmp), retry=None, timeout=TIMEOUT)  # crc32c checked
                fsync_file(tmp)
                os.replace(tmp, local)
            except self._gx.NotFound:
                raise self._missing(key) from None
            finally:
                tmp.unlink(missing_ok=True)

        self._call("get_file", key, attempt)
        fsync_dir(local.parent)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._call("put_bytes", key, self._uploading(lambda: self._blob(key).upload_from_string(
            data, retry=None, timeout=TIMEOUT)))

    def get_bytes(self, key: str, max_bytes: int | None = None) -> bytes:
        blob = self._blob(key)

        def attempt() -> bytes:
            try:
                if max_bytes is not None:
                    blob.reload(retry=None, timeout=TIMEOUT)      # its size, before a byte of it
                    if (blob.size or 0) > max_bytes:
                        raise ObjectTooLarge(self.url, key, max_bytes)
                    if blob.size:          # a ranged read: the object may have grown since
                        return blob.download_as_bytes(start=0, end=max_bytes, retry=None, timeout=TIMEOUT)
                return blob.download_as_bytes(retry=None, timeout=TIMEOUT)
            except self._gx.NotFound:
                raise self._missing(key) from None

        return within(self._call("get_bytes", key, attempt), max_bytes, self.url, key)

    def exists(self, key: str) -> bool:
        blob = self._blob(key)
        found = self._call("exists", key, lambda: blob.exists(retry=None, timeout=TIMEOUT))
        if not found:
            self._confirm_bucket()
        return bool(found)

    def _delete_name(self, name: str) -> None:
        try:
            self._gcs.bucket(self.bucket_name).blob(name).delete(retry=None, timeout=TIMEOUT)
        except self._gx.NotFound:                          # gone meanwhile
            pass

    def _uploading(self, upload: Any) -> Any:
        """`upload` with its 404 told for what it is: an upload has no object to miss, only a
        bucket."""
        def attempt() -> None:
            try:
                upload()
            except self._gx.NotFound:
                raise no_bucket(f"storage {self.url}", self.bucket_name) from None
        return attempt

    def _names(self, under: str) -> list[str]:
        client = self._gcs.client
        try:
            return [b.name for b in client.list_blobs(self.bucket_name, prefix=under, retry=None,
                                                       timeout=TIMEOUT)]
        except self._gx.NotFound:
            raise no_bucket(f"storage {self.url}", self.bucket_name) from None

    def _missing(self, key: str) -> Exception:
        """FileNotFoundError for a missing object, StorageConfigError for a missing bucket (GCS
        says 404 to both)."""
        self._confirm_bucket_now()
        return FileNotFoundError(f"{self.url}: no object {key!r}")

    def _confirm_bucket(self) -> None:
        if not self._bucket_confirmed:
            self._call("list", "", self._confirm_bucket_now)

    def _confirm_bucket_now(self) -> None:
        self._gcs.confirm_bucket(self.bucket_name, self.root, f"storage {self.url}")
        self._bucket_confirmed = True


class GcsCas:
    """The lease object's compare-and-swap on generations (see the module)."""

    def __init__(self, url: str, key: str) -> None:
        bucket, root = split_url(url)
        self.url = url
        self.name = f"{root}/{check_key(key)}" if root else key
        self._gcs = _Client(url)
        self._bucket_name = bucket
        self._released: int | None = None        # the generation of an empty (released) lease read
        self._checked = False
        from google.api_core import exceptions as gx
        self._gx = gx

    def _blob(self, name: str | None = None) -> Any:
        return self._gcs.bucket(self._bucket_name).blob(name or self.name)

    def check_conditional_writes(self) -> None:
        """Prove once, on a probe object beside the lease, that the server refuses an upload
        whose generation precondition fails (both kinds the lease uses). StorageConfigError if
        it does not: two nodes could both "win" the lease."""
        if self._checked:
            return
        probe = probe_beside(self.name)
        blob = self._blob(probe)
        try:
            blob.upload_from_string(b"1", if_generation_match=0, retry=None, timeout=TIMEOUT)
            for kind, generation in (("ifGenerationMatch=0 on an existing object", 0),
                                     ("ifGenerationMatch=<an older generation>", int(blob.generation) - 1)):
                try:
                    self._blob(probe).upload_from_string(b"2", if_generation_match=generation,
                                                         retry=None, timeout=TIMEOUT)
                except self._gx.PreconditionFailed:
                    continue
                raise StorageConfigError(
                    f"lease on {self.url}: this storage server does not honour generation "
                    f"preconditions ({kind} was ignored on an upload), so two nodes could both "
                    f"train this job; use Google Cloud Storage or a server that honours them")
        finally:
            try:
                self._blob(probe).delete(retry=None, timeout=TIMEOUT)
            except Exception as exc:  # a stray probe is hidden from listings; say so only
                log.warning("lease on %s: could not delete probe %s: %s",
                            self.url, probe, describe(exc))
        self._checked = True

    def read(self) -> Found | None:
        blob = self._blob()
        try:
            data = blob.download_as_bytes(retry=None, timeout=TIMEOUT)
        except self._gx.NotFound:
            self._released = None
            self._confirm_bucket()
            return None
        generation = int(blob.generation)     # from the same response's X-Goog-Generation
        if not data:
            self._released = generation
            return None
        return Found(data, generation, _age(self._gcs.last_headers()))

    def create(self, data: bytes) -> Any:
        self.check_conditional_writes()
        # over a released (empty) lease read just before, else only where there is none
        return self._upload(data, self._released or 0)

    def replace(self, data: bytes, version: Any) -> Any:
        self.check_conditional_writes()
        return self._upload(data, int(version))

    def delete(self, version: Any) -> None:
        self.check_conditional_writes()
        self._upload(b"", int(version))

    def _confirm_bucket(self) -> None:
        self._gcs.confirm_bucket(self._bucket_name, self.name.rpartition("/")[0], f"lease on {self.url}")

    def _upload(self, data: bytes, generation: int) -> int:
        blob = self._blob()
        try:
            blob.upload_from_string(data, content_type="application/json", if_generation_match=generation,
                                    retry=None, timeout=TIMEOUT)
        except self._gx.PreconditionFailed:
            raise Conflict() from None
        except self._gx.NotFound:
            self._confirm_bucket()              # StorageConfigError for a missing bucket
            raise Conflict() from None          # else the generation named is gone
        self._released = None
        return int(blob.generation)


def _age(headers: Any) -> float | None:
    """The age from one response's `Date` and `Last-Modified` (checkpoint.cas.http_age)."""
    return http_age(headers.get("Date"), headers.get("Last-Modified"))
