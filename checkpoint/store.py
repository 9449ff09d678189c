"""Object storage for checkpoints: one `Store` over fsspec for a storage URL.

URLs: `s3://bucket/prefix` (s3fs; the standard AWS credential chain, and `AWS_ENDPOINT_URL` /
`AWS_ENDPOINT_URL_S3` for MinIO, SeaweedFS or R2 -- botocore reads those itself), `gs://bucket/prefix`
(needs gcsfs), `file:///abs/path` or a plain local path, and `memory://name` for unit tests.

Two kinds of failure, handled oppositely:

* configuration errors (bucket missing, access denied, bad or missing credentials, bad URL) raise
  `StorageConfigError` at once: retrying cannot fix them and a run should not start on them;
* transient errors (connection refused or reset, timeouts, 5xx, throttling) are retried with
  exponential backoff until `retry_seconds` have passed or the `stop` event is set (the node is
  being preempted), then raise `StorageUnavailable`.

Anything else (a missing key, a bug) propagates unchanged. Retries live here and nowhere below:
botocore's and s3fs's own retry loops are switched off so that the stop event and the injectable
sleep govern every wait.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from tenacity import (
    RetryCallState,
    RetryError,
    Retrying,
    retry_if_exception,
    stop_after_delay,
    stop_when_event_set,
    wait_exponential,
)

from .fsio import TMP_MARKER, atomic_copy, atomic_write_bytes, fsync_dir, fsync_file, temp_sibling

log = logging.getLogger(__name__)

T = TypeVar("T")

# S3 error codes that mean "try again later" even when the HTTP status is below 500.
_THROTTLE_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
    "RequestTimeout", "RequestTimeoutException", "ServiceUnavailable", "InternalError",
    "XAmzContentSHA256Mismatch",
})
# S3 error codes that are the user's configuration, mapped to what to tell them.
_CONFIG_CODES = {
    "NoSuchBucket": "bucket does not exist",
    "InvalidBucketName": "invalid bucket name",
    "AccessDenied": "access denied (check the credentials' permissions on this bucket)",
    "AllAccessDisabled": "access denied (all access to this bucket is disabled)",
    "AccountProblem": "access denied (account problem)",
    "InvalidAccessKeyId": "bad credentials (the access key id is not known to the server)",
    "SignatureDoesNotMatch": "bad credentials (the secret key does not match the access key id)",
    "ExpiredToken": "expired credentials (refresh the session token)",
    "InvalidToken": "bad credentials (invalid session token)",
    "RequestTimeTooSkewed": "this machine's clock is too far off for request signing",
    "PermanentRedirect": "bucket is in another region (set AWS_DEFAULT_REGION or AWS_REGION)",
    "AuthorizationHeaderMalformed": "bad credentials or wrong region in the request signature",
}


class StorageConfigError(RuntimeError):
    """The storage URL cannot work as configured; raised at once, never retried.

    The message says what is wrong and names the URL (never credentials)."""


class StorageUnavailable(RuntimeError):
    """Transient storage errors persisted past the retry budget, or retries were stopped."""


class _Stopped(Exception):
    """Internal: the stop event was set between attempts."""


class Store:
    """Keys ("/"-separated, relative to the URL's root) mapped onto an fsspec filesystem.

    Owns one filesystem instance (never shared through fsspec's instance cache, listings cache
    off) so listings are never stale and concurrent use from the uploader thread is safe.

    Raises `StorageConfigError` from the constructor for a bad URL or a missing driver.
    """

    def __init__(
        self,
        url: str,
        *,
        stop: threading.Event | None = None,
        retry_seconds: float = 60.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.url = url
        self._stop = stop
        if retry_seconds < 0:
            raise ValueError(f"retry_seconds must be >= 0 (got {retry_seconds})")
        self._retry_seconds = float(retry_seconds)
        # With the real sleep and a stop event, wait on the event so a preemption ends a backoff
        # at once instead of after it.
        if sleep is time.sleep and stop is not None:
            self._sleep: Callable[[float], Any] = stop.wait
        else:
            self._sleep = sleep
        self._bucket_confirmed = False
        self.protocol, self._root, self._fs = _open_filesystem(url)
        self._local = self.protocol == "file"

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

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

    def get_bytes(self, key: str) -> bytes:
        """The object's bytes. FileNotFoundError if absent."""
        path = self._path(key)
        return self._call("get_bytes", key, lambda: self._fs.cat_file(path))

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

    # --- helpers --------------------------------------------------------------------------------

    def _path(self, key: str) -> str:
        if not isinstance(key, str) or not key or key.startswith("/") or key.endswith("/"):
            raise ValueError(f"storage key must be a relative '/'-separated path (got {key!r})")
        parts = key.split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"storage key must not contain empty, '.' or '..' parts (got {key!r})")
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
            if _config_reason(exc) is not None:
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
            if _config_reason(exc) is not None:
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

    def _call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        """Run `fn` with the retry policy; translate failures into this module's exceptions."""
        started = time.monotonic()
        stop = stop_after_delay(self._retry_seconds)
        if self._stop is not None:
            stop = stop | stop_when_event_set(self._stop)

        def attempt() -> T:
            if self._stop is not None and self._stop.is_set() and attempts_made[0] > 0:
                raise _Stopped()  # set during the backoff: no further attempt
            attempts_made[0] += 1
            try:
                return fn()
            except Exception as exc:
                last_error[0] = exc
                reason = _config_reason(exc)
                if reason is not None:
                    raise StorageConfigError(
                        f"storage {self.url}: {reason} ({op} {key!r}: {_describe(exc)})"
                    ) from exc
                raise

        attempts_made = [0]
        last_error: list[BaseException | None] = [None]
        retrying = Retrying(
            retry=retry_if_exception(_is_transient),
            stop=stop,
            wait=wait_exponential(multiplier=0.5, min=0.5, max=15),
            sleep=self._sleep,
            before_sleep=lambda state: self._log_retry(op, key, state),
            reraise=False,
        )
        try:
            return retrying(attempt)
        except RetryError as exc:
            last = exc.last_attempt.exception()
            elapsed = time.monotonic() - started
            why = ("retries stopped: preemption requested"
                   if self._stop is not None and self._stop.is_set()
                   else f"retry budget of {self._retry_seconds:g}s spent")
            raise StorageUnavailable(
                f"storage {self.url}: {op} {key!r} failed {attempts_made[0]} time(s) over "
                f"{elapsed:.1f}s ({why}): {_describe(last)}"
            ) from last
        except _Stopped:
            raise StorageUnavailable(
                f"storage {self.url}: {op} {key!r} failed {attempts_made[0]} time(s) over "
                f"{time.monotonic() - started:.1f}s (retries stopped: preemption requested): "
                f"{_describe(last_error[0])}"
            ) from last_error[0]

    def _log_retry(self, op: str, key: str, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        delay = state.next_action.sleep if state.next_action else 0.0
        log.warning("storage %s: %s %r failed (attempt %d: %s); retrying in %.1fs",
                    self.url, op, key, state.attempt_number, _describe(exc), delay)


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
            config_kwargs={
                "retries": {"total_max_attempts": 1, "mode": "standard"},
                "connect_timeout": 5,
                "read_timeout": 60,
            },
        )
        fs.retries = 1  # s3fs's own retry loop: one attempt; ours does the retrying
        return "s3", f"{bucket}{parts.path.rstrip('/')}", fs

    if scheme in ("gs", "gcs"):
        bucket = parts.netloc
        if not bucket:
            raise StorageConfigError(f"storage URL {url} names no bucket (expected gs://bucket/prefix)")
        try:
            fs = fsspec.filesystem("gs", skip_instance_cache=True, use_listings_cache=False)
        except ImportError as exc:
            raise StorageConfigError(
                f"storage {url}: gs:// needs the gcsfs package (pip install gcsfs)"
            ) from exc
        return "gs", f"{bucket}{parts.path.rstrip('/')}", fs

    raise StorageConfigError(
        f"storage URL {url}: unsupported scheme {scheme!r} "
        f"(use s3://bucket/prefix, gs://bucket/prefix, file:///path or a local path)"
    )


# --- classifying errors -------------------------------------------------------------------------

def _client_errors(exc: BaseException | None):
    """ClientError-like exceptions (with a `.response` dict) in the cause chain of `exc`."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        response = getattr(exc, "response", None)
        if isinstance(response, dict) and "Error" in response:
            yield response
        exc = exc.__cause__ or exc.__context__


def _config_reason(exc: BaseException) -> str | None:
    """What the user must fix, if `exc` is a configuration error; None otherwise."""
    if isinstance(exc, StorageConfigError):
        return str(exc)
    try:
        from botocore import exceptions as bx
    except ImportError:  # pragma: no cover - botocore is a dependency
        bx = None
    if bx is not None:
        if isinstance(exc, (bx.NoCredentialsError, bx.PartialCredentialsError)):
            return "missing or incomplete credentials (set AWS_ACCESS_KEY_ID and " \
                   "AWS_SECRET_ACCESS_KEY, a profile, or an instance role)"
        if isinstance(exc, (bx.CredentialRetrievalError, bx.ProfileNotFound)):
            return "credentials could not be loaded"
        if isinstance(exc, bx.NoRegionError):
            return "no region configured (set AWS_DEFAULT_REGION)"
        if isinstance(exc, bx.ParamValidationError):
            return "invalid request parameters (check the bucket name in the URL)"
    for response in _client_errors(exc):
        code = str(response["Error"].get("Code", ""))
        if code in _CONFIG_CODES:
            return _CONFIG_CODES[code]
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if status in (401, 403):
            return f"access denied (HTTP {status})"
    code = getattr(exc, "code", None)  # gcsfs HttpError and friends
    if isinstance(code, int) and code in (401, 403):
        return f"access denied (HTTP {code})"
    if isinstance(exc, PermissionError):
        return "access denied"
    return None


def _is_transient(exc: BaseException) -> bool:
    """Worth another try: the network or the service hiccupped, not the configuration."""
    if isinstance(exc, (StorageConfigError, _Stopped, FileNotFoundError)):
        return False
    try:
        from botocore import exceptions as bx
        if isinstance(exc, (bx.ConnectionError, bx.HTTPClientError, bx.IncompleteReadError)):
            return True
    except ImportError:  # pragma: no cover
        pass
    try:
        import aiohttp
        if isinstance(exc, aiohttp.ClientError):
            return True
    except ImportError:  # pragma: no cover
        pass
    from fsspec.exceptions import FSTimeoutError
    if isinstance(exc, (ConnectionError, TimeoutError, FSTimeoutError)):
        return True
    for response in _client_errors(exc):
        code = str(response["Error"].get("Code", ""))
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        if code in _THROTTLE_CODES or status >= 500 or status == 429:
            return True
    code = getattr(exc, "code", None)
    if isinstance(code, int) and (code >= 500 or code == 429):
        return True
    if isinstance(exc, OSError) and exc.errno in (errno.ECONNRESET, errno.ECONNREFUSED,
                                                   errno.ETIMEDOUT, errno.EPIPE):
        return True
    return False


def _describe(exc: BaseException | None) -> str:
    if exc is None:
        return "no error"
    text = f"{exc.__class__.__name__}: {str(exc) or '-'}"
    for response in _client_errors(exc):  # the S3 error code says more than errno
        code = response["Error"].get("Code")
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return f"{text} (S3 {code}, HTTP {status})"
    return text
