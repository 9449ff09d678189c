"""Azure Blob Storage (`az://container/prefix`) through azure-storage-blob: the job's folder
(`AzureStore`) and the lease's compare-and-swap on one blob (`AzureCas`).

The account and its credentials, in this order:

* `AZURE_STORAGE_CONNECTION_STRING`: the account, its endpoint and its key (or SAS) in one
  string; how Azurite, the emulator the tests run, is reached;
* `AZURE_STORAGE_ACCOUNT`: the account's name, with DefaultAzureCredential (azure-identity): a
  VM's or AKS pod's managed identity, workload identity, `az login`, or AZURE_CLIENT_* variables.
  The blob endpoint is https://ACCOUNT.blob.core.windows.net, Azure's public cloud.

Every call makes one attempt (`retry_total=0`: azure-core would otherwise retry by itself)
under a 5 s connect and 60 s read timeout; the store's retry policy (checkpoint.retry) does the
retrying, bounded by the stop event and the notice's deadline.

The lease's compare-and-swap uses ETags, and every write of it is conditional (an upload with
no condition overwrites silently): create with `If-None-Match: *` (overwrite=False), replace and
delete with `If-Match: <ETag read>`. AzureCas proves on a probe blob before its first write that
the server refuses each of the three when its condition fails; Azurite honours them all.

A read gives the blob's age on the server's clock: the response's `Date` minus the blob's
`Last-Modified`, both from the one GET that returned the bytes and their ETag.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .cas import Conflict, Found, http_age, probe_beside
from .fsio import fsync_dir, fsync_file, temp_sibling
from .retry import StorageConfigError, describe
from .store import BucketStore, ObjectTooLarge, check_key, needs_extra, within

log = logging.getLogger(__name__)

CONNECTION_STRING_ENV = "AZURE_STORAGE_CONNECTION_STRING"
ACCOUNT_ENV = "AZURE_STORAGE_ACCOUNT"
TIMEOUTS = {"connection_timeout": 5, "read_timeout": 60}     # as for S3


def split_url(url: str) -> tuple[str, str]:
    """(container, prefix without slashes) of az://container/prefix; StorageConfigError otherwise."""
    parts = urlsplit(url)
    if parts.scheme.lower() != "az" or not parts.netloc:
        raise StorageConfigError(f"storage URL {url} names no container (expected az://container/prefix)")
    if "@" in parts.netloc or "." in parts.netloc:
        raise StorageConfigError(
            f"storage URL {url}: give the container alone, az://container/prefix, and the account in "
            f"{ACCOUNT_ENV} (or {CONNECTION_STRING_ENV}); credentials never go in the URL")
    if parts.query or parts.fragment:
        raise StorageConfigError(f"storage URL {url}: no ?query or #fragment (expected az://container/prefix)")
    return parts.netloc, parts.path.strip("/")


def container_client(url: str, container: str) -> Any:
    """The ContainerClient for `container`, from the environment (see the module); azure-core's
    own retries off. StorageConfigError when the library or the account is missing."""
    try:
        from azure.storage.blob import BlobServiceClient
    except ImportError as exc:
        raise needs_extra(url, "azure-storage-blob", "azure") from exc
    connection = os.environ.get(CONNECTION_STRING_ENV, "").strip()
    if connection:
        try:
            service = BlobServiceClient.from_connection_string(connection, retry_total=0, **TIMEOUTS)
        except ValueError as exc:
            raise StorageConfigError(f"storage {url}: {CONNECTION_STRING_ENV} is not a valid connection "
                                     f"string ({exc}); copy it from the storage account's Access keys") from None
        return service.get_container_client(container)
    account = os.environ.get(ACCOUNT_ENV, "").strip()
    if not account:
        raise StorageConfigError(
            f"storage {url}: no Azure storage account: set {ACCOUNT_ENV} to the account's name (the "
            f"node's managed identity or `az login` then signs in), or {CONNECTION_STRING_ENV}")
    try:
        from azure.identity import DefaultAzureCredential
    except ImportError as exc:
        raise needs_extra(url, "azure-identity", "azure") from exc
    # When no credential answers, azure-identity logs a dozen lines (one per credential it tried) as a
    # warning before raising; the store's error says it in one line (retry.config_reason), so only
    # azure-identity's errors are shown.
    logging.getLogger("azure.identity").setLevel(logging.ERROR)
    service = BlobServiceClient(f"https://{account}.blob.core.windows.net",
                                credential=DefaultAzureCredential(), retry_total=0, **TIMEOUTS)
    return service.get_container_client(container)


class AzureStore(BucketStore):
    """A job's folder under az://container/prefix (see the module)."""

    protocol = "az"

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self.container_name, self.root = split_url(url)
        self._container = container_client(url, self.container_name)
        from azure.core import exceptions as ax
        self._ax = ax

    def put_file(self, local: Path, key: str) -> None:
        local = Path(local)
        if not local.is_file():
            raise FileNotFoundError(f"no such local file to upload: {local}")
        name = self._name(key)

        def attempt() -> None:
            # one Put Blob, or blocks committed by one Put Block List: never half a blob
            with open(local, "rb") as f:
                self._container.upload_blob(name, f, overwrite=True)

        self._call("put_file", key, self._container_known(attempt))

    def get_file(self, key: str, local: Path) -> None:
        local = Path(local)
        name = self._name(key)
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_sibling(local)

        def attempt() -> None:
            try:
                with open(tmp, "wb") as f:
                    self._container.download_blob(name).readinto(f)
                fsync_file(tmp)
                os.replace(tmp, local)
            finally:
                tmp.unlink(missing_ok=True)

        self._call("get_file", key, self._container_known(attempt, missing=key))
        fsync_dir(local.parent)

    def put_bytes(self, key: str, data: bytes) -> None:
        name = self._name(key)
        self._call("put_bytes", key, self._container_known(
            lambda: self._container.upload_blob(name, data, overwrite=True)))

    def get_bytes(self, key: str, max_bytes: int | None = None) -> bytes:
        name = self._name(key)

        def read() -> bytes:
            download = self._container.download_blob(name)     # its first GET tells the blob's size
            if max_bytes is not None and download.size > max_bytes:
                raise ObjectTooLarge(self.url, key, max_bytes)
            return download.readall()

        return within(self._call("get_bytes", key, self._container_known(read, missing=key)), max_bytes, self.url, key)

    def exists(self, key: str) -> bool:
        name = self._name(key)
        found = self._call("exists", key, self._container_known(
            lambda: self._container.get_blob_client(name).exists()))
        if not found:
            self._confirm_bucket()
        return bool(found)

    def _delete_name(self, name: str) -> None:
        try:
            self._container.delete_blob(name)
        except self._ax.ResourceNotFoundError as exc:
            if _code(exc) != "BlobNotFound":               # gone meanwhile is fine
                raise

    def _names(self, under: str) -> list[str]:
        return [b.name for b in self._container.list_blobs(name_starts_with=under or None)]

    def _guard(self, fn: Any) -> Any:
        return self._container_known(fn)

    def _container_known(self, fn: Any, missing: str | None = None) -> Any:
        """`fn` with Azure's 404s told apart: a missing container is a StorageConfigError, a
        missing blob (where `missing` names the key read) FileNotFoundError."""
        def attempt() -> Any:
            try:
                return fn()
            except self._ax.ResourceNotFoundError as exc:
                if _code(exc) == "ContainerNotFound":
                    raise self._no_container() from None
                if missing is not None and _code(exc) in ("BlobNotFound", ""):
                    raise FileNotFoundError(f"{self.url}: no blob {missing!r}") from None
                raise
        return attempt

    def _confirm_bucket(self) -> None:
        if self._bucket_confirmed:
            return
        under = f"{self.root}/" if self.root else None
        self._call("list", "", self._container_known(lambda: next(iter(
            self._container.list_blobs(name_starts_with=under, results_per_page=1).by_page()), None)))
        self._bucket_confirmed = True

    def _no_container(self) -> StorageConfigError:
        return no_container(f"storage {self.url}", self.container_name)


def no_container(where: str, container: str) -> StorageConfigError:
    return StorageConfigError(f"{where}: container {container!r} does not exist in this account "
                              f"(create it, or fix spec.storage)")


def _code(exc: BaseException) -> str:
    code = getattr(exc, "error_code", None)           # a str, or azure's StorageErrorCode enum
    return str(getattr(code, "value", code) or "")


class AzureCas:
    """The lease blob's compare-and-swap on ETags (see the module)."""

    def __init__(self, url: str, key: str) -> None:
        container, root = split_url(url)
        self.url = url
        self.name = f"{root}/{check_key(key)}" if root else key
        self._container = container_client(url, container)
        self._checked = False
        from azure.core import MatchConditions
        from azure.core import exceptions as ax
        self._ax, self._match = ax, MatchConditions

    def check_conditional_writes(self) -> None:
        """Prove once, on a probe blob beside the lease, that the server refuses a create over an
        existing blob, and a replace and a delete with an ETag that is not the blob's.
        StorageConfigError if it does not: two nodes could both "win" the lease."""
        if self._checked:
            return
        probe = probe_beside(self.name)
        blob = self._container.get_blob_client(probe)
        stale = '"0x0"'
        try:
            blob.upload_blob(b"1", overwrite=False)
            tries = (("If-None-Match: * on an upload", lambda: blob.upload_blob(b"2", overwrite=False)),
                     ("If-Match on an upload", lambda: blob.upload_blob(
                         b"2", overwrite=True, etag=stale, match_condition=self._match.IfNotModified)),
                     ("If-Match on a delete", lambda: blob.delete_blob(
                         etag=stale, match_condition=self._match.IfNotModified)))
            for kind, attempt in tries:
                try:
                    attempt()
                except (self._ax.ResourceExistsError, self._ax.ResourceModifiedError):
                    continue
                raise StorageConfigError(
                    f"lease on {self.url}: this storage server does not honour conditional requests "
                    f"({kind} was ignored), so two nodes could both train this job; use Azure Blob "
                    f"Storage or a server that honours them")
        finally:
            try:
                blob.delete_blob()
            except Exception as exc:  # a stray probe is hidden from listings; say so only
                log.warning("lease on %s: could not delete probe %s: %s", self.url, probe, describe(exc))
        self._checked = True

    def read(self) -> Found | None:
        seen: dict[str, Any] = {}
        try:
            download = self._container.download_blob(
                self.name, raw_response_hook=lambda r: seen.update(headers=r.http_response.headers))
            data = download.readall()
        except self._ax.ResourceNotFoundError as exc:
            if _code(exc) == "ContainerNotFound":
                raise self._no_container() from None
            return None
        return Found(data, download.properties.etag, _age(seen.get("headers", {})))

    def create(self, data: bytes) -> Any:
        self.check_conditional_writes()
        return self._write(lambda blob: blob.upload_blob(data, overwrite=False))

    def replace(self, data: bytes, version: Any) -> Any:
        self.check_conditional_writes()
        return self._write(lambda blob: blob.upload_blob(
            data, overwrite=True, etag=version, match_condition=self._match.IfNotModified))

    def delete(self, version: Any) -> None:
        self.check_conditional_writes()
        try:
            self._container.get_blob_client(self.name).delete_blob(
                etag=version, match_condition=self._match.IfNotModified)
        except self._ax.ResourceNotFoundError as exc:
            if _code(exc) == "ContainerNotFound":
                raise self._no_container() from None
            return
        except self._ax.ResourceModifiedError:
            raise Conflict() from None

    def _write(self, put: Any) -> Any:
        try:
            reply = put(self._container.get_blob_client(self.name))
        except (self._ax.ResourceExistsError, self._ax.ResourceModifiedError):
            raise Conflict() from None
        except self._ax.ResourceNotFoundError as exc:
            if _code(exc) == "ContainerNotFound":
                raise self._no_container() from None
            raise
        return reply["etag"]

    def _no_container(self) -> StorageConfigError:
        return no_container(f"lease on {self.url}", self._container.container_name)


def _age(headers: Any) -> float | None:
    """The age from one response's `Date` and `Last-Modified` (checkpoint.cas.http_age)."""
    return http_age(headers.get("Date"), headers.get("Last-Modified"))
