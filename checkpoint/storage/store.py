"""Object storage for a job's folder (checkpoints, the record, the lease, the baseline, the
environment files): one `ObjectStore` per storage URL, made by `open_store(url)` (checkpoint.storage.by_url).

URLs and what serves them:

* `s3://bucket/prefix`: `Store` over s3fs; the standard AWS credential chain, and
  `AWS_ENDPOINT_URL` / `AWS_ENDPOINT_URL_S3` for MinIO, SeaweedFS or R2 (botocore reads those).
* `gs://bucket/prefix`: `GcsStore` (checkpoint.storage.gcs) over google-cloud-storage;
  Application Default Credentials, `STORAGE_EMULATOR_HOST` as the library honours it.
* `az://container/prefix`: `AzureStore` (checkpoint.storage.azure) over azure-storage-blob;
  `AZURE_STORAGE_CONNECTION_STRING`, or `AZURE_STORAGE_ACCOUNT` with DefaultAzureCredential.
* `file:///abs/path` or a plain local path: `Store` over the local file system; `memory://name`
  for unit tests.

Every call goes through the package's one retry policy (checkpoint.retry): configuration errors
(bucket missing, access denied, bad or missing credentials, bad URL) raise `StorageConfigError`
at once; transient errors (connection refused or reset, timeouts, 5xx, throttling) are retried
with exponential backoff and jitter until `retry_seconds` have passed or the `stop` event is set
(the node is being preempted), then raise `StorageUnavailable`. Anything else (a missing key, a
bug) propagates unchanged. The libraries' own retry loops (botocore's, s3fs's, google-cloud-
storage's, azure-core's) are switched off where the clients are made, so that the stop event and
the injectable sleep govern every wait.

A notice also bounds every call in time (`finish_by`): a stalled server holds a request until
the client's read timeout (60 s), longer than a 30 s notice, so a call still unanswered when the
notice window ends is left to its thread and reported as StorageUnavailable.
"""

from __future__ import annotations

import abc
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from .fsio import TMP_MARKER, atomic_copy, atomic_write_bytes, fsync_dir, fsync_file, temp_sibling
from .retry import RetryPolicy, StorageConfigError, StorageUnavailable, config_reason

log = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["BucketStore", "ObjectStore", "ObjectTooLarge", "RetriedStore", "Store", "StorageConfigError",
           "StorageUnavailable", "within"]

# What spec.storage may be, for messages.
SUPPORTED_URLS = ("s3://bucket/prefix, gs://bucket/prefix, az://container/prefix, file:///path "
                  "or a local folder")


class ObjectTooLarge(ValueError):
    """An object read with `get_bytes(key, max_bytes=N)` holds more than N bytes: never read whole
    (whoever can write the bucket could plant a file of any size). Never retried."""

    def __init__(self, url: str, key: str, max_bytes: int) -> None:
        super().__init__(f"storage {url}: {key} is larger than {max_bytes:,} bytes; not read "
                         f"(a file of this kind is never that large: delete or replace it)")
        self.key, self.max_bytes = key, max_bytes


def within(data: bytes, max_bytes: int | None, url: str, key: str) -> bytes:
    """`data` (read as max_bytes + 1 bytes at most) if it is no more than `max_bytes`, else ObjectTooLarge."""
    if max_bytes is not None and len(data) > max_bytes:
        raise ObjectTooLarge(url, key, max_bytes)
    return data


class ObjectStore(abc.ABC):
    """What the runner asks of a job's storage: keys relative to `url`, read and written whole.
    Implemented by Store (a filesystem through fsspec), GcsStore, AzureStore, and FencedStore (a
    store whose writes need the job's lease)."""

    url: str
    protocol: str                       # "s3", "gs", "az", "file", "memory"

    @abc.abstractmethod
    def put_file(self, local: Path, key: str) -> None: ...

    @abc.abstractmethod
    def get_file(self, key: str, local: Path) -> None: ...

    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None: ...

    @abc.abstractmethod
    def get_bytes(self, key: str, max_bytes: int | None = None) -> bytes:
        """The object's bytes; FileNotFoundError if absent. `max_bytes`: ObjectTooLarge when it
        holds more, having read max_bytes + 1 bytes at most."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]: ...

    @abc.abstractmethod
    def delete(self, prefix_or_key: str) -> None: ...

    @abc.abstractmethod
    def check(self) -> None:
        """Raise StorageConfigError or StorageUnavailable when the store cannot be used."""

    @abc.abstractmethod
    def finish_by(self, deadline: float | None) -> None:
        """Every call from now on gives up at `deadline` (time.monotonic()); None: no deadline."""


class RetriedStore(ObjectStore):
    """What every store shares: the retry policy around each call, the notice's deadline, the
    keys' rules and the check before a run. A subclass does one attempt per operation and says
    how it confirms that its bucket (container) exists (`_confirm_bucket`)."""

    def __init__(self, url: str, *, stop: threading.Event | None = None, retry_seconds: float = 60.0,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.url = url
        if retry_seconds < 0:
            raise ValueError(f"retry_seconds must be >= 0 (got {retry_seconds})")
        # With the real sleep and a stop event the policy waits on the event, so a preemption
        # ends a backoff at once instead of after it.
        self._retry = RetryPolicy(f"storage {url}", budget_s=float(retry_seconds), stop=stop,
                                  sleep=sleep, logger=log)
        self._bucket_confirmed = False
        self._deadline: float | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def check(self) -> None:
        """Fail fast, before a run starts, if this store cannot be written, read and listed.

        Writes, reads back and deletes a small probe object under the root.
        Raises StorageConfigError (bucket missing, access denied, credentials) or
        StorageUnavailable (the service did not answer within the retry budget)."""
        probe = f"{TMP_MARKER}probe-{uuid.uuid4().hex}"
        payload = b"grpo-run storage check\n"
        self.put_bytes(probe, payload)
        try:
            if self.get_bytes(probe) != payload:
                raise StorageConfigError(
                    f"storage {self.url}: a probe object read back different bytes than written"
                )
            self._bucket_confirmed = False
            self._confirm_bucket()  # listing permission too
        finally:
            self.delete(probe)

    def _confirm_bucket(self) -> None:
        """Prove once that the bucket exists and can be listed under our prefix (a one-key
        listing), where a missing bucket and a missing key look alike; StorageConfigError when
        it cannot. Nothing to prove by default."""

    def finish_by(self, deadline: float | None) -> None:
        """From now on every call ends by `deadline` (a time.monotonic() value; None: no bound),
        the ones already in flight included: one not answered by then is abandoned to its thread
        with StorageUnavailable, and none is started after it. For a notice window: what is not
        in storage when the node goes away never will be, and the exit must not wait for it."""
        self._deadline = deadline

    def _call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        """Run `fn` under the retry policy (checkpoint.retry): StorageConfigError at once,
        StorageUnavailable once transient errors outlast the budget, the stop event or the
        deadline (finish_by)."""
        what = f"{op} {key!r}"
        if self._retry.stop is None:         # nothing can set a deadline that matters here
            return self._retry.call(what, fn)
        if self._deadline is not None and self._deadline <= time.monotonic():
            raise StorageUnavailable(f"storage {self.url}: {what} not tried: the notice window is over")
        return self._within_deadline(lambda: self._retry.call(what, fn), f"storage {self.url}: {what}")

    def _within_deadline(self, fn: Callable[[], T], what: str) -> T:
        """fn() in a daemon thread, waited for until it ends or the deadline passes (a deadline
        set while it runs counts: a notice can come mid-call); then StorageUnavailable, the
        thread left to finish or to die with the process."""
        done: list[tuple[bool, Any]] = []
        finished = threading.Event()

        def run() -> None:
            try:
                done.append((True, fn()))
            except BaseException as e:      # handed to the caller's thread
                done.append((False, e))
            finished.set()

        threading.Thread(target=run, name="storage-call", daemon=True).start()
        while not finished.wait(_DEADLINE_POLL_S):
            if self._deadline is not None and time.monotonic() >= self._deadline:
                raise StorageUnavailable(f"{what}: no answer by the end of the notice window; given up")
        ok, value = done[0]
        if ok:
            return value
        raise value


class BucketStore(RetriedStore):
    """A store on a bucket's object names under `root` ("" or a prefix): a key is the name
    ROOT/KEY, a folder every name under NAME/ (GCS, Azure Blob). A subclass lists names under a
    prefix (`_names`), deletes one name with a missing one fine (`_delete_name`), and may say what
    its client's errors mean around each call (`_guard`)."""

    root: str

    def _name(self, key: str) -> str:
        check_key(key)
        return f"{self.root}/{key}" if self.root else key

    def _names(self, under: str) -> list[str]:
        raise NotImplementedError

    def _delete_name(self, name: str) -> None:
        raise NotImplementedError

    def _guard(self, fn: Callable[[], T]) -> Callable[[], T]:
        return fn

    def list(self, prefix: str = "") -> list[str]:
        prefix = prefix.strip("/")
        under = f"{self._name(prefix)}/" if prefix else (f"{self.root}/" if self.root else "")
        found = self._call("list", prefix, self._guard(lambda: self._names(under)))
        if not found:
            self._confirm_bucket()
        return relative_keys(self.root, found)

    def delete(self, prefix_or_key: str) -> None:
        """Remove a key, or everything under a folder prefix (whole path components). Missing
        is fine."""
        prefix_or_key = prefix_or_key.strip("/")
        name = self._name(prefix_or_key)

        def attempt() -> None:
            for each in self._names(name):        # one listing finds the key and its folder
                if in_folder(name, each):
                    self._delete_name(each)

        self._call("delete", prefix_or_key, self._guard(attempt))


def check_key(key: str) -> str:
    """`key` when it is a relative "/"-separated path with no empty, "." or ".." parts;
    ValueError otherwise."""
    if not isinstance(key, str) or not key or key.startswith("/") or key.endswith("/"):
        raise ValueError(f"storage key must be a relative '/'-separated path (got {key!r})")
    if any(p in ("", ".", "..") for p in key.split("/")):
        raise ValueError(f"storage key must not contain empty, '.' or '..' parts (got {key!r})")
    return key


def relative_keys(root: str, names: list[str]) -> list[str]:
    """Object names under `root` ("" or a prefix without slashes) as sorted keys relative to it,
    temporaries (TMP_MARKER) left out: a listing of a bucket-backed store."""
    cut = len(root) + 1 if root else 0
    return sorted(n[cut:] for n in names if TMP_MARKER not in n.rsplit("/", 1)[-1])


def in_folder(name: str, each: str) -> bool:
    """Whether object `each` is `name` itself or under the folder `name`: never NAME-2 for NAME."""
    return each == name or each.startswith(f"{name}/")


def needs_extra(url: str, module: str, extra: str) -> StorageConfigError:
    """The error for a store whose client library is missing: the extra that installs it."""
    return StorageConfigError(
        f"storage {url}: {url.split(':', 1)[0]}:// needs the {module} package, which is not installed "
        f"here: pip install 'grpo-run[{extra}]' (in a checkout: scripts/setup --test installs it)")


class Store(RetriedStore):
    """Keys ("/"-separated, relative to the URL's root) mapped onto an fsspec filesystem.

    Owns one filesystem instance (never shared through fsspec's instance cache, listings cache
    off) so listings are never stale and concurrent use from the uploader thread is safe.

    Raises `StorageConfigError` from the constructor for a bad URL or a missing driver.
    """

    def __init__(self, url: str, *, stop: threading.Event | None = None, retry_seconds: float = 60.0,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        super().__init__(url, stop=stop, retry_seconds=retry_seconds, sleep=sleep)
        self.protocol, self._root, self._fs = _open_filesystem(url)
        self._local = self.protocol == "file"

    # --- public operations ---------------------------------------------------------------------

    def put_file(self, local: Path, key: str) -> None:
        """Upload `local` to `key`, replacing it. FileNotFoundError if `local` is missing."""
        local = Path(local)
        if not local.is_file():
            raise FileNotFoundError(f"no such local file to upload: {local}")
        path = self._path(key)
        if self._local:
            self._call("put_file", key, lambda: atomic_copy(local, Path(path)))
        else:
            self._call("put_file", key, lambda: self._fs.put_file(str(local), path))

    def get_file(self, key: str, local: Path) -> None:
        """Download `key` to `local` through a temporary name, fsynced, then renamed into place.

        FileNotFoundError if the key is absent; `local` is untouched then."""
        local = Path(local)
        path = self._path(key)
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_sibling(local)

        def attempt() -> None:
            try:
                self._fs.get_file(path, str(tmp))
                fsync_file(tmp)
                os.replace(tmp, local)
            finally:
                tmp.unlink(missing_ok=True)

        self._call("get_file", key, attempt)
        fsync_dir(local.parent)

    def put_bytes(self, key: str, data: bytes) -> None:
        path = self._path(key)
        if self._local:
            self._call("put_bytes", key, lambda: atomic_write_bytes(Path(path), data))
        else:
            self._call("put_bytes", key, lambda: self._fs.pipe_file(path, data))

    def get_bytes(self, key: str, max_bytes: int | None = None) -> bytes:
        """The object's bytes. FileNotFoundError if absent; ObjectTooLarge past `max_bytes`."""
        path = self._path(key)
        if max_bytes is None:
            return self._call("get_bytes", key, lambda: self._fs.cat_file(path))

        def bounded() -> bytes:
            with self._fs.open(path, "rb") as f:
                return f.read(max_bytes + 1)

        return within(self._call("get_bytes", key, bounded), max_bytes, self.url, key)

    def exists(self, key: str) -> bool:
        path = self._path(key)
        found = self._call("exists", key, lambda: self._fs.exists(path))
        if not found:
            # s3fs answers a HEAD on a missing bucket with a bare 404: make sure that is not the
            # reason before saying "absent".
            self._confirm_bucket()
        return bool(found)

    def list(self, prefix: str = "") -> list[str]:
        """Keys under `prefix` (a folder; "" for everything), recursive, sorted."""
        prefix = prefix.strip("/")
        path = self._path(prefix) if prefix else self._root
        found = self._call("list", prefix, lambda: self._find(path))
        if not found:
            self._confirm_bucket()
        return found

    def delete(self, prefix_or_key: str) -> None:
        """Remove a key, or everything under a folder prefix. Missing is fine.

        A folder prefix matches whole path components: deleting `ckpt-1` never touches `ckpt-10`.
        The root itself ("") cannot be deleted this way (ValueError)."""
        prefix_or_key = prefix_or_key.strip("/")
        path = self._path(prefix_or_key)
        self._call("delete", prefix_or_key, lambda: self._rm(path))

    def fs_path(self, key: str) -> tuple[Any, str]:
        """(this store's fsspec filesystem, its path for `key`), for a primitive this class does
        not wrap: the lease's compare-and-swap (checkpoint.cas). Calls made on them bypass the
        retry policy. ValueError for a key that is not a relative path."""
        return self._fs, self._path(key)

    # --- helpers --------------------------------------------------------------------------------

    def _path(self, key: str) -> str:
        check_key(key)
        return f"{self._root.rstrip('/')}/{key}" if self._root.rstrip("/") else f"/{key}"

    def _relative(self, path: str) -> str:
        path = self._fs._strip_protocol(path)
        root = self._root.rstrip("/")
        if root and not path.startswith(root + "/"):
            raise RuntimeError(f"listing of {self.url} returned {path!r} outside the root")
        return path[len(root) + 1:] if root else path.lstrip("/")

    def _find(self, path: str) -> list[str]:
        self._fs.invalidate_cache()
        try:
            found = self._fs.find(path, withdirs=False, detail=True)
        except FileNotFoundError as exc:
            if config_reason(exc) is not None:
                raise
            return []
        # s3fs answers an empty prefix that is still a "directory" (SeaweedFS keeps emptied
        # folders) with that directory itself, despite withdirs=False: files only.
        keys = [self._relative(p) for p, info in found.items() if info.get("type") == "file"]
        return sorted(k for k in keys if TMP_MARKER not in k.rsplit("/", 1)[-1])

    def _rm(self, path: str) -> None:
        self._fs.invalidate_cache()
        try:
            if self._fs.isdir(path):
                self._fs.rm(path, recursive=True)
            else:
                self._fs.rm_file(path)
        except FileNotFoundError as exc:
            if config_reason(exc) is not None:
                raise
        finally:
            self._fs.invalidate_cache()

    def _confirm_bucket(self) -> None:
        """For s3, prove once that the bucket exists and can be listed under our prefix (a
        one-key listing); no-op elsewhere. StorageConfigError when it cannot."""
        if self._bucket_confirmed or self.protocol != "s3":
            return
        bucket, _, prefix = self._root.partition("/")
        prefix = f"{prefix}/" if prefix else ""
        self._call("list", "", lambda: self._fs.call_s3(
            "list_objects_v2", Bucket=bucket, Prefix=prefix, MaxKeys=1))
        self._bucket_confirmed = True

_DEADLINE_POLL_S = 0.1       # how soon a call in flight notices that the window ended


_BOTOCORE_LOADER: Any = None


def _aws_session() -> Any:
    """A new aiobotocore session (credentials and endpoint are read when its client is made,
    from the environment as it is then) sharing one parsed copy of botocore's data files:
    parsing them is most of what a fresh client costs, and every Store and lease makes one.
    Clients are made on fsspec's one event-loop thread, so the loader is never used by two
    threads at once."""
    global _BOTOCORE_LOADER
    from aiobotocore.session import AioSession
    from botocore.loaders import create_loader

    if _BOTOCORE_LOADER is None:
        _BOTOCORE_LOADER = create_loader()
    session = AioSession()
    session.register_component("data_loader", _BOTOCORE_LOADER)
    return session


# --- opening a URL ------------------------------------------------------------------------------

def _open_filesystem(url: str) -> tuple[str, str, Any]:
    """(protocol, root path inside the filesystem, filesystem). StorageConfigError on a bad URL."""
    import fsspec

    if not isinstance(url, str) or not url.strip():
        raise StorageConfigError(f"storage URL is empty (got {url!r})")
    parts = urlsplit(url) if "://" in url else None
    if parts is not None and ("@" in parts.netloc or parts.password):
        shown = f"{parts.scheme}://{parts.netloc.rsplit('@', 1)[-1]}{parts.path}"
        raise StorageConfigError(
            f"storage URL {shown} must not carry credentials: use the standard environment "
            f"(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, a profile, or an instance role)"
        )
    scheme = parts.scheme.lower() if parts is not None else ""

    if scheme in ("", "file", "local"):
        raw = url.split("://", 1)[1] if parts is not None else url
        root = os.path.abspath(os.path.expanduser(raw))
        fs = fsspec.filesystem("file", skip_instance_cache=True)
        if os.path.exists(root) and not os.path.isdir(root):
            raise StorageConfigError(f"storage {url}: {root} exists and is not a folder")
        return "file", root, fs

    if scheme == "memory":
        fs = fsspec.filesystem("memory", skip_instance_cache=True)
        root = fs._strip_protocol(url).rstrip("/") or "/"
        return "memory", root, fs

    if scheme in ("s3", "s3a"):
        bucket = parts.netloc
        if not bucket:
            raise StorageConfigError(f"storage URL {url} names no bucket (expected s3://bucket/prefix)")
        import s3fs

        # The endpoint: botocore reads AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL (and endpoint_url
        # in the AWS config file) itself when endpoint_url is not given, so it is not passed here.
        fs = s3fs.S3FileSystem(
            skip_instance_cache=True,
            use_listings_cache=False,
            session=_aws_session(),
            config_kwargs={
                "retries": {"total_max_attempts": 1, "mode": "standard"},
                "connect_timeout": 5,
                "read_timeout": 60,
            },
        )
        fs.retries = 1  # s3fs's own retry loop: one attempt; ours does the retrying
        return "s3", f"{bucket}{parts.path.rstrip('/')}", fs

    raise StorageConfigError(
        f"storage URL {url}: unsupported scheme {scheme!r} "
        f"(use {SUPPORTED_URLS})"
    )
