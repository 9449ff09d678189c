"""One retry policy for every storage call in the package (the Store's, the lease's), and the
classification of storage errors it rests on.

    policy = RetryPolicy("storage s3://bucket/run", budget_s=60, stop=preempt)
    data = policy.call("get_bytes 'k'", lambda: fs.cat_file(path))

* configuration errors (bucket missing, access denied, bad or missing credentials) raise
  `StorageConfigError` at once: retrying cannot fix them and a run should not start on them;
* transient errors (refused or reset connections, timeouts, 5xx, throttling) are tried again
  after an exponential backoff with jitter until `stop_after_delay(budget_s)` |
  `stop_after_attempt(attempts)` | `stop_when_event_set(stop)` says enough, then raise
  `StorageUnavailable`; a stop event set during a backoff ends the retries without another try;
* anything else (a missing key, a lost compare-and-swap, a bug) propagates unchanged.

One log line per retry, on the caller's logger. The sleep is injectable so that tests never wait;
by default it is `stop.wait`, so a preemption ends a backoff the moment it comes. Libraries'
own retry loops (botocore's, s3fs's) are switched off where the filesystems are made, so that
this policy governs every wait.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tenacity import (
    RetryCallState,
    RetryError,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    stop_when_event_set,
    wait_exponential,
    wait_random,
)
from tenacity.wait import wait_base

log = logging.getLogger(__name__)

T = TypeVar("T")


class StorageConfigError(RuntimeError):
    """The storage URL cannot work as configured; raised at once, never retried.

    The message says what is wrong and names the URL (never credentials)."""


class StorageUnavailable(RuntimeError):
    """Transient storage errors persisted past the retry budget, or retries were stopped."""


def backoff(first_s: float, max_s: float) -> wait_base:
    """The one backoff: `first_s`, doubling after each try, at most `max_s`, plus up to
    `first_s / 4` of random jitter so that nodes failing together do not retry in step."""
    return wait_exponential(multiplier=first_s, min=first_s, max=max_s) + wait_random(0, first_s / 4)


def nth_wait(wait: wait_base, n: int) -> float:
    """The wait before try n + 1, for a loop that is not tenacity's own (the supervisor's
    restarts of a trainer)."""
    state = RetryCallState(None, None, (), {})  # type: ignore[arg-type] - no Retrying behind it
    state.attempt_number = max(1, n)
    return float(wait(state))


class _Stopped(Exception):
    """The stop event was set during a backoff: no further try."""


@dataclass(frozen=True)
class RetryPolicy:
    """How one owner of storage calls retries them. `where` starts every message and log line
    ("storage s3://bucket/run", "lease on s3://bucket/run/job"); `passthrough` exceptions
    (a lost compare-and-swap) are the caller's answers, neither classified nor retried."""

    where: str
    budget_s: float = 60.0
    stop: threading.Event | None = None
    sleep: Callable[[float], Any] | None = None   # None (or time.sleep): stop.wait, else time.sleep
    attempts: int | None = None                   # None: as many as the budget allows
    wait: wait_base = field(default_factory=lambda: backoff(0.5, 15.0))
    logger: logging.Logger = log
    passthrough: tuple[type[BaseException], ...] = ()

    def call(self, op: str, fn: Callable[[], T], *, budget_s: float | None = None) -> T:
        """`fn()` under this policy. Raises StorageConfigError at once for a configuration
        error; StorageUnavailable when transient errors outlast the budget (`budget_s` for this
        call, else the policy's), the attempts, or the stop event; anything else unchanged."""
        budget = self.budget_s if budget_s is None else budget_s
        stop = stop_after_delay(budget)
        if self.attempts is not None:
            stop = stop | stop_after_attempt(max(1, self.attempts))
        if self.stop is not None:
            stop = stop | stop_when_event_set(self.stop)
        started = time.monotonic()
        tries = 0
        last: BaseException | None = None

        def attempt() -> T:
            nonlocal tries, last
            if tries and self.stop is not None and self.stop.is_set():
                raise _Stopped()  # set during the backoff
            tries += 1
            try:
                return fn()
            except self.passthrough:
                raise
            except Exception as exc:
                last = exc
                reason = config_reason(exc)
                if reason is not None and not isinstance(exc, StorageConfigError):
                    raise StorageConfigError(
                        f"{self.where}: {reason} ({op}: {describe(exc)})") from exc
                raise

        retrying = Retrying(
            retry=retry_if_exception(lambda e: not isinstance(e, (_Stopped, *self.passthrough))
                                     and is_transient(e)),
            stop=stop, wait=self.wait, sleep=self._sleeper(),
            before_sleep=lambda state: self._log_retry(op, state), reraise=False)
        try:
            return retrying(attempt)
        except (RetryError, _Stopped):
            if self.stop is not None and self.stop.is_set():
                why = "retries stopped: preemption requested"
            elif self.attempts is not None and tries >= self.attempts:
                why = f"{tries} attempts made"
            else:
                why = f"retry budget of {budget:g}s spent"
            raise StorageUnavailable(
                f"{self.where}: {op} failed {tries} time(s) over {time.monotonic() - started:.1f}s "
                f"({why}): {describe(last)}") from last

    def _sleeper(self) -> Callable[[float], Any]:
        if self.sleep is not None and self.sleep is not time.sleep:
            return self.sleep
        return self.stop.wait if self.stop is not None else time.sleep

    def _log_retry(self, op: str, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        delay = state.next_action.sleep if state.next_action else 0.0
        self.logger.warning("%s: %s failed (attempt %d: %s); retrying in %.1fs", self.where, op,
                            state.attempt_number, describe(exc), delay)


# --- classifying errors -------------------------------------------------------------------------

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


def client_errors(exc: BaseException | None) -> Iterator[dict]:
    """The `.response` dicts of ClientError-like exceptions in the cause chain of `exc` (s3fs
    raises OSError / FileNotFoundError with botocore's ClientError as the cause)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        response = getattr(exc, "response", None)
        if isinstance(response, dict) and "Error" in response:
            yield response
        exc = exc.__cause__ or exc.__context__


def s3_code(exc: BaseException) -> str:
    """The S3 error code (`NoSuchKey`, `PreconditionFailed`, ...) behind `exc`, or ""."""
    for response in client_errors(exc):
        return str(response["Error"].get("Code", ""))
    return ""


def s3_status(exc: BaseException) -> int | None:
    """The HTTP status of the S3 answer behind `exc`, or None."""
    for response in client_errors(exc):
        return response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return None


def config_reason(exc: BaseException) -> str | None:
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
    for response in client_errors(exc):
        code = str(response["Error"].get("Code", ""))
        if code in _CONFIG_CODES:
            return _CONFIG_CODES[code]
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if status in (401, 403):
            return f"access denied (HTTP {status})"
    cloud = _cloud_config_reason(exc)
    if cloud is not None:
        return cloud
    code = _http_status(exc)  # google-api-core's and azure-core's errors
    if code in (401, 403):
        return f"access denied (HTTP {code})"
    if isinstance(exc, PermissionError):
        return "access denied"
    return None


def is_transient(exc: BaseException) -> bool:
    """Worth another try: the network or the service hiccupped, not the configuration."""
    if isinstance(exc, (StorageConfigError, FileNotFoundError)):
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
    for response in client_errors(exc):
        code = str(response["Error"].get("Code", ""))
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        if code in _THROTTLE_CODES or status >= 500 or status == 429:
            return True
    code = _http_status(exc)
    if code is not None and (code >= 500 or code in (408, 429)):
        return True
    if _cloud_transient(exc):
        return True
    if isinstance(exc, OSError) and exc.errno in (errno.ECONNRESET, errno.ECONNREFUSED,
                                                   errno.ETIMEDOUT, errno.EPIPE):
        return True
    return False


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status of a google-api-core error (`.code`) or an azure-core one (`.status_code`)."""
    for attribute in ("code", "status_code"):
        value = getattr(exc, attribute, None)
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value < 600:
            return value
    return None


def _azure_code(exc: BaseException) -> str:
    """azure-core's `error_code` ("AuthorizationFailure", "BlobNotFound"), a str or an enum; ""."""
    code = getattr(exc, "error_code", None)
    return str(getattr(code, "value", code) or "")


def _cloud_config_reason(exc: BaseException) -> str | None:
    """Credentials errors of google-auth and azure-core / azure-identity, in words to act on."""
    try:
        from google.auth import exceptions as gax
    except ImportError:
        gax = None
    if gax is not None:
        if isinstance(exc, gax.DefaultCredentialsError):
            return ("no Google credentials found (attach a service account to the node, use workload "
                    "identity on GKE, set GOOGLE_APPLICATION_CREDENTIALS, or run "
                    "`gcloud auth application-default login`)")
        if isinstance(exc, gax.RefreshError):
            return "Google credentials could not be refreshed (revoked, expired or not allowed)"
    try:
        from azure.core import exceptions as ax
    except ImportError:
        ax = None
    if ax is not None and isinstance(exc, ax.HttpResponseError) and _azure_code(exc) in (
            "AuthenticationFailed", "AuthorizationFailure", "InvalidAuthenticationInfo"):
        return "Azure refused the credentials (check the account key, or the identity's role on the container)"
    if ax is not None and isinstance(exc, ax.ClientAuthenticationError):
        # azure-identity's: one credential unavailable, or DefaultAzureCredential's chain of them all
        if type(exc).__name__ == "CredentialUnavailableError" or str(exc).startswith(
                "DefaultAzureCredential failed to retrieve a token"):
            return ("no Azure credential found (a managed identity on the VM or AKS pod, `az login`, "
                    "or AZURE_STORAGE_CONNECTION_STRING)")
        return "Azure refused the credentials (check the account key, or the identity's role on the container)"
    return None


def _cloud_transient(exc: BaseException) -> bool:
    """A connection that failed or timed out under google-cloud-storage (requests, google-auth's
    transport) or azure-core."""
    try:
        import requests
        if isinstance(exc, (requests.ConnectionError, requests.Timeout,
                            requests.exceptions.ChunkedEncodingError)):
            return True
    except ImportError:  # pragma: no cover - a dependency of google-auth
        pass
    try:
        from google.auth import exceptions as gax
        if isinstance(exc, gax.TransportError):
            return True
    except ImportError:
        pass
    try:
        from azure.core import exceptions as ax
        if isinstance(exc, (ax.ServiceRequestError, ax.ServiceResponseError, ax.IncompleteReadError)):
            return True
    except ImportError:
        pass
    return False


def describe(exc: BaseException | None) -> str:
    """`ClassName: message (S3 Code, HTTP status)` for messages; never credentials."""
    if exc is None:
        return "no error"
    # the first line: a cloud library's message can run to a dozen (azure-identity's, one per credential)
    text = f"{exc.__class__.__name__}: {(str(exc).strip().splitlines() or ['-'])[0][:300]}"
    for response in client_errors(exc):  # the S3 error code says more than errno
        code = response["Error"].get("Code")
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return f"{text} (S3 {code}, HTTP {status})"
    status = _http_status(exc)
    if status is not None:                 # google-api-core's and azure-core's: their first line
        code = _azure_code(exc)
        first = (str(exc).strip().splitlines() or ["-"])[0][:200]
        return f"{exc.__class__.__name__}: {first} ({f'{code}, ' if code else ''}HTTP {status})"
    return text
