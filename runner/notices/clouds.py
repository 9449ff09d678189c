"""The clouds' metadata services, asked whether this node is about to go away: one Watcher per
cloud (AWS IMDSv2 spot/instance-action and rebalance recommendations, GCP instance/preempted,
Azure Scheduled Events), and `make_watchers` to pick them. The monitor that polls them and turns
a notice into the shared preemption event is runner.notices.

Base addresses come from ``GRPO_RUN_{AWS,GCP,AZURE}_METADATA_URL`` (SPEC §6) so tests can point
them at the emulators in ``tests/emulators.py``; a constructor argument wins over the variable.
Off-cloud the link-local addresses do not answer, so every request has a short timeout, and a
watcher that cannot reach its service logs one warning and lets the run go on.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from grpo_run.runner.notices.monitor import (CLOUDS, DEFAULT_REQUEST_TIMEOUT_S, MAX_GCP_LONG_POLL_S, Notice, Source, Watcher)

__all__ = ["AWS_METADATA_URL_ENV", "AZURE_METADATA_URL_ENV", "CLOUDS", "GCP_METADATA_URL_ENV",
           "AwsWatcher", "AzureWatcher", "GcpWatcher", "make_watchers"]

logger = logging.getLogger(__name__)

AWS_METADATA_URL_ENV = "GRPO_RUN_AWS_METADATA_URL"
GCP_METADATA_URL_ENV = "GRPO_RUN_GCP_METADATA_URL"
AZURE_METADATA_URL_ENV = "GRPO_RUN_AZURE_METADATA_URL"
_DEFAULT_URLS = {
    AWS_METADATA_URL_ENV: "http://169.254.169.254",
    GCP_METADATA_URL_ENV: "http://metadata.google.internal",
    AZURE_METADATA_URL_ENV: "http://169.254.169.254",
}


# --- HTTP ---------------------------------------------------------------------------------------


class _Unreachable(Exception):
    """The service gave no usable answer: no route, refused, timed out, 5xx, or garbage."""


@dataclass(frozen=True)
class _Response:
    status: int
    headers: Mapping[str, str]
    body: bytes


def _opener() -> urllib.request.OpenerDirector:
    # No proxies: an http_proxy in the environment would send link-local metadata requests to
    # the proxy, which cannot reach them (and must never see an IMDS token).
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _request(
    opener: urllib.request.OpenerDirector,
    method: str,
    url: str,
    *,
    headers: Mapping[str, str],
    timeout: float,
) -> _Response:
    """One request; an HTTP error status is a response, a network failure is ``_Unreachable``."""
    data = b"" if method in ("PUT", "POST") else None
    request = urllib.request.Request(url, data=data, headers=dict(headers), method=method)
    try:
        with opener.open(request, timeout=timeout) as response:
            return _Response(response.status, response.headers, response.read())
    except urllib.error.HTTPError as err:
        try:
            return _Response(err.code, err.headers, err.read())
        finally:
            err.close()
    except (OSError, http.client.HTTPException) as err:  # URLError, refused, reset, timeout
        raise _Unreachable(str(getattr(err, "reason", err)) or type(err).__name__) from err


def _base_url(explicit: str | None, env_var: str) -> str:
    return (explicit or os.environ.get(env_var) or _DEFAULT_URLS[env_var]).rstrip("/")


class _OutageLog:
    """Says once that a service is unreachable, and once that it is back -- not every poll."""

    def __init__(self, source: str, url: str) -> None:
        self._source = source
        self._url = url
        self._down = False

    def failed(self, why: str, hint: str = "") -> None:
        if not self._down:
            self._down = True
            logger.warning(
                "%s metadata service at %s is unreachable (%s); training goes on without %s "
                "spot notices until it answers%s",
                self._source, self._url, why, self._source, hint,
            )

    def answered(self) -> None:
        if self._down:
            self._down = False
            logger.info("%s metadata service at %s answers again", self._source, self._url)


# --- AWS ----------------------------------------------------------------------------------------


class AwsWatcher:
    """AWS EC2 spot notices through IMDSv2 (session token required on every request).

    ``spot/instance-action`` answers 404 until the instance is to be interrupted, then 200 with
    ``{"action": "terminate"|"stop"|"hibernate", "time": "...Z"}`` two minutes ahead: a preempt
    notice. ``events/recommendations/rebalance`` answers 200 ``{"noticeTime": ...}`` when the
    instance is at elevated risk: a rebalance notice, reported once per ``noticeTime``.
    """

    source: Source = "aws"
    _TOKEN_PATH = "/latest/api/token"
    _ACTION_PATH = "/latest/meta-data/spot/instance-action"
    _REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
    # Inside a container, IMDSv2's default hop limit of 1 drops the token response on the way
    # back; the symptom is exactly this timeout, so the warning names the fix.
    _HINT = (
        " (in a container on EC2, set the instance's IMDSv2 hop limit to 2: "
        "aws ec2 modify-instance-metadata-options --http-put-response-hop-limit 2)"
    )

    def __init__(
        self,
        base_url: str | None = None,
        *,
        timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        token_ttl_s: int = 21600,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 1 <= token_ttl_s <= 21600:
            raise ValueError(f"token_ttl_s: IMDSv2 allows 1..21600 seconds (got {token_ttl_s})")
        self.base_url = _base_url(base_url, AWS_METADATA_URL_ENV)
        self._timeout = timeout_s
        self._token_ttl = token_ttl_s
        self._clock = clock
        self._opener = _opener()
        self._outage = _OutageLog("aws", self.base_url)
        self._token: str | None = None
        self._token_renew_at = 0.0
        self._last_rebalance: str | None = None

    def probe(self) -> bool:
        try:
            self._fresh_token()
        except _Unreachable:
            return False
        return True

    def poll(self) -> Notice | None:
        try:
            notice = self._interruption() or self._rebalance()
        except _Unreachable as err:
            self._outage.failed(str(err), self._HINT)
            return None
        self._outage.answered()
        return notice

    def _interruption(self) -> Notice | None:
        response = self._get(self._ACTION_PATH)
        if response.status == 404:
            return None
        if response.status != 200:
            raise _Unreachable(f"HTTP {response.status} from {self._ACTION_PATH}")
        try:
            doc = json.loads(response.body)
            detail = f"{doc['action']} at {doc['time']}"
        except (ValueError, KeyError, TypeError):
            # A 200 here means the instance is going; act on it even if the body is odd.
            detail = response.body.decode(errors="replace")[:200]
        return Notice.now("aws", "preempt", f"spot instance-action: {detail}")

    def _rebalance(self) -> Notice | None:
        response = self._get(self._REBALANCE_PATH)
        if response.status == 404:
            return None
        if response.status != 200:
            raise _Unreachable(f"HTTP {response.status} from {self._REBALANCE_PATH}")
        try:
            notice_time = str(json.loads(response.body)["noticeTime"])
        except (ValueError, KeyError, TypeError):
            notice_time = response.body.decode(errors="replace")[:200]
        if notice_time == self._last_rebalance:
            return None  # the same recommendation stays up; report it once
        self._last_rebalance = notice_time
        return Notice.now("aws", "rebalance", f"rebalance recommendation at {notice_time}")

    def _get(self, path: str) -> _Response:
        response = self._get_with(self._current_token(), path)
        if response.status == 401:  # expired or revoked early (e.g. IMDS restarted): once more
            response = self._get_with(self._fresh_token(), path)
        return response

    def _get_with(self, token: str, path: str) -> _Response:
        return _request(
            self._opener, "GET", self.base_url + path,
            headers={"X-aws-ec2-metadata-token": token}, timeout=self._timeout,
        )

    def _current_token(self) -> str:
        if self._token is None or self._clock() >= self._token_renew_at:
            return self._fresh_token()
        return self._token

    def _fresh_token(self) -> str:
        requested_at = self._clock()
        response = _request(
            self._opener, "PUT", self.base_url + self._TOKEN_PATH,
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(self._token_ttl)},
            timeout=self._timeout,
        )
        if response.status != 200 or not response.body:
            raise _Unreachable(f"IMDSv2 token request got HTTP {response.status}")
        self._token = response.body.decode().strip()
        # Renew with a tenth of the lifetime to spare so a token never expires mid-poll.
        self._token_renew_at = requested_at + 0.9 * self._token_ttl
        return self._token


# --- GCP ----------------------------------------------------------------------------------------

# A long poll cannot be interrupted, so it bounds how long stopping a monitor can take.

class GcpWatcher:
    """GCP preemption through ``instance/preempted`` ("TRUE" once the VM is being preempted).

    With ``long_poll_s`` > 0 every poll after the first is a hanging GET
    (``?wait_for_change=true&last_etag=...&timeout_sec=N``) that returns as soon as the value
    changes -- a notice is seen at once -- or after N seconds unchanged. N is at most
    ``MAX_GCP_LONG_POLL_S`` so that stopping a monitor is prompt. ``long_poll_s=0`` polls plainly.
    """

    source: Source = "gcp"
    _PATH = "/computeMetadata/v1/instance/preempted"
    _HEADERS = {"Metadata-Flavor": "Google"}

    def __init__(
        self,
        base_url: str | None = None,
        *,
        timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        long_poll_s: int = 1,
    ) -> None:
        if not 0 <= long_poll_s <= MAX_GCP_LONG_POLL_S:
            raise ValueError(
                f"long_poll_s: must be 0..{MAX_GCP_LONG_POLL_S} (got {long_poll_s}) so that "
                "stopping the monitor is prompt"
            )
        self.base_url = _base_url(base_url, GCP_METADATA_URL_ENV)
        self._timeout = timeout_s
        self._long_poll = long_poll_s
        self._opener = _opener()
        self._outage = _OutageLog("gcp", self.base_url)
        self._etag: str | None = None

    def probe(self) -> bool:
        try:
            response = self._get(self.base_url + self._PATH, self._timeout)
        except _Unreachable:
            return False
        # Anything can answer on a link-local address; only GCP's server says this.
        return response.status == 200 and response.headers.get("Metadata-Flavor") == "Google"

    def poll(self) -> Notice | None:
        url, timeout = self.base_url + self._PATH, self._timeout
        if self._long_poll and self._etag:
            # Without last_etag, wait_for_change would wait for the *next* change and miss a
            # preemption that happened between two polls.
            query = {
                "wait_for_change": "true",
                "last_etag": self._etag,
                "timeout_sec": self._long_poll,
            }
            url += "?" + urllib.parse.urlencode(query)
            timeout += self._long_poll
        try:
            response = self._get(url, timeout)
            if response.status != 200:
                raise _Unreachable(f"HTTP {response.status} from {self._PATH}")
        except _Unreachable as err:
            self._etag = None  # start over with a plain GET
            self._outage.failed(str(err))
            return None
        self._outage.answered()
        self._etag = response.headers.get("ETag")
        if response.body.strip().upper() == b"TRUE":
            return Notice.now("gcp", "preempt", "instance/preempted is TRUE")
        return None

    def _get(self, url: str, timeout: float) -> _Response:
        return _request(self._opener, "GET", url, headers=self._HEADERS, timeout=timeout)


# --- Azure --------------------------------------------------------------------------------------


class AzureWatcher:
    """Azure Scheduled Events: an event of type ``Preempt`` (spot eviction) or ``Terminate``
    (the VM is being deleted) is a preempt notice; ``Freeze``, ``Reboot`` and ``Redeploy`` are
    maintenance the run survives or cannot act on, and are ignored.

    The service is switched on by the first request and that first answer can take a while;
    until it comes the watcher treats the service as unreachable (one warning) and then
    recovers by itself.
    """

    source: Source = "azure"
    _PATH = "/metadata/scheduledevents?api-version=2020-07-01"
    _VERSIONS_PATH = "/metadata/versions"
    _HEADERS = {"Metadata": "true"}
    _STOPPING_EVENTS = frozenset({"Preempt", "Terminate"})

    def __init__(
        self, base_url: str | None = None, *, timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    ) -> None:
        self.base_url = _base_url(base_url, AZURE_METADATA_URL_ENV)
        self._timeout = timeout_s
        self._opener = _opener()
        self._outage = _OutageLog("azure", self.base_url)

    def probe(self) -> bool:
        # /metadata/versions answers at once; scheduledevents may be slow on its first call.
        try:
            response = self._get(self._VERSIONS_PATH)
            return response.status == 200 and "apiVersions" in json.loads(response.body)
        except (_Unreachable, ValueError, TypeError):
            return False

    def poll(self) -> Notice | None:
        try:
            response = self._get(self._PATH)
            if response.status != 200:
                raise _Unreachable(f"HTTP {response.status} from scheduledevents")
            try:
                events = json.loads(response.body)["Events"]
            except (ValueError, KeyError, TypeError) as err:
                raise _Unreachable(f"unreadable scheduledevents document: {err}") from err
        except _Unreachable as err:
            self._outage.failed(str(err))
            return None
        self._outage.answered()
        for event in events:
            if isinstance(event, Mapping) and event.get("EventType") in self._STOPPING_EVENTS:
                return Notice.now(
                    "azure",
                    "preempt",
                    f"scheduled event {event.get('EventType')} {event.get('EventId')} "
                    f"not before {event.get('NotBefore') or 'now'}",
                )
        return None

    def _get(self, path: str) -> _Response:
        return _request(
            self._opener, "GET", self.base_url + path, headers=self._HEADERS, timeout=self._timeout
        )


# --- choosing watchers --------------------------------------------------------------------------

_WATCHERS: Mapping[str, tuple[Callable[[str | None], Watcher], str]] = {
    "aws": (AwsWatcher, AWS_METADATA_URL_ENV),
    "gcp": (GcpWatcher, GCP_METADATA_URL_ENV),
    "azure": (AzureWatcher, AZURE_METADATA_URL_ENV),
}


def make_watchers(
    clouds: str | Sequence[str] = "auto", *, base_urls: Mapping[str, str] | None = None,
    probe_timeout_s: float = 2.0,
) -> list[Watcher]:
    """Watchers for ``clouds``: a list of names from ``CLOUDS``, or ``"auto"`` for every cloud
    whose metadata service answers (probed at once, in parallel, within ``probe_timeout_s``).
    ``base_urls``: addresses by variable name (``GRPO_RUN_AWS_METADATA_URL`` ...), winning over
    the variables themselves (a job's ``spec.notices``).

    Named clouds are not probed: asking for one means wanting its warning if it doesn't answer.
    Off-cloud, "auto" finds nothing and only signals can preempt the run.

    Raises ValueError for a name not in ``CLOUDS``.
    """
    urls = dict(base_urls or {})

    def watcher(name: str) -> Watcher:
        make, var = _WATCHERS[name]
        return make(urls.get(var))

    if clouds != "auto":
        names = [clouds] if isinstance(clouds, str) else list(clouds)
        unknown = [name for name in names if name not in _WATCHERS]
        if unknown:
            raise ValueError(
                f"clouds: unknown {', '.join(unknown)}; use auto or any of {', '.join(CLOUDS)}"
            )
        return [watcher(name) for name in dict.fromkeys(names)]

    candidates = [watcher(name) for name in CLOUDS]
    answered = [False] * len(candidates)

    def probe(index: int) -> None:
        answered[index] = candidates[index].probe()

    # Daemon threads joined against one deadline: a name lookup for metadata.google.internal
    # off-cloud is not covered by the socket timeout and must not hold up the start.
    threads = [
        threading.Thread(target=probe, args=(i,), name=f"grpo-run-probe-{w.source}", daemon=True)
        for i, w in enumerate(candidates)
    ]
    deadline = time.monotonic() + probe_timeout_s
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    found = [w for w, ok in zip(candidates, answered) if ok]
    logger.info(
        "spot notices from: %s",
        ", ".join(w.source for w in found) or "no cloud metadata service (signals only)",
    )
    return found
