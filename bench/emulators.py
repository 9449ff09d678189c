"""Local emulators of the cloud metadata services that deliver spot-interruption notices (the
tests import them as tests.emulators; bench/goodput.py preempts its nodes through them).

Each emulator is a real HTTP server on 127.0.0.1 (a free port, one thread) that speaks the
service's own request and response formats, so ``runner.notices`` is tested over real HTTP:

- ``AwsImdsEmulator``: IMDSv2 -- ``PUT /latest/api/token`` with
  ``X-aws-ec2-metadata-token-ttl-seconds``, then every GET must carry a valid
  ``X-aws-ec2-metadata-token`` or gets 401; ``spot/instance-action`` and
  ``events/recommendations/rebalance`` are 404 until triggered.
- ``GcpMetadataEmulator``: ``instance/preempted`` (``Metadata-Flavor: Google`` required, else
  403), "TRUE"/"FALSE" with an ETag, and the ``wait_for_change`` / ``last_etag`` /
  ``timeout_sec`` long poll.
- ``AzureScheduledEventsEmulator``: ``/metadata/scheduledevents`` (``Metadata: true`` and an
  ``api-version`` required, else 400) and ``/metadata/versions``.

Every emulator can answer 500 (``fail_with``), stop listening (``go_unreachable``) and come
back on the same port (``come_back``). ``wait_until_served(n)`` lets a test know that n requests
were answered without sleeping. Use them as context managers:

    with AwsImdsEmulator() as imds:
        watcher = AwsWatcher(imds.url)
        imds.trigger_preempt()
"""

from __future__ import annotations

import datetime as dt
import email.utils
import json
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

__all__ = [
    "AwsImdsEmulator",
    "AzureScheduledEventsEmulator",
    "GcpMetadataEmulator",
    "Served",
    "closed_port_url",
]


def closed_port_url() -> str:
    """An http://127.0.0.1 address nothing listens on: connections are refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _utc_iso(seconds_from_now: float) -> str:
    when = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=seconds_from_now)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Served:
    """One answered request, for tests that assert on what the service saw."""

    method: str
    path: str  # without the query
    status: int


_Reply = tuple[int, Mapping[str, str], bytes]


class _Emulator:
    """An HTTP server on 127.0.0.1 in a thread; subclasses implement ``_answer``."""

    def __init__(self) -> None:
        self._lock = threading.Condition()  # guards state; notified on every change and reply
        self._failing: int | None = None
        self._closing = False
        self._port = 0
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.served: list[Served] = []

    # --- lifecycle ---

    def start(self) -> _Emulator:
        emulator = self

        class Handler(BaseHTTPRequestHandler):
            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                parts = urlsplit(self.path)
                query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
                status, headers, body = emulator._reply(
                    self.command, parts.path, query, self.headers
                )
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                with emulator._lock:
                    emulator.served.append(Served(self.command, parts.path, status))
                    emulator._lock.notify_all()

            do_GET = do_PUT = do_POST = _handle

            def log_message(self, format: str, *args: Any) -> None:
                pass  # keep test output clean

        server = ThreadingHTTPServer(("127.0.0.1", self._port), Handler)
        server.daemon_threads = True
        self._port = server.server_address[1]
        self._server = server
        with self._lock:
            self._closing = False
        # A short poll interval so that shutdown() returns promptly.
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True,
            name=f"{type(self).__name__}-{self._port}",
        )
        self._thread.start()
        return self

    def close(self) -> None:
        with self._lock:
            self._closing = True  # wakes long polls so they answer and let go
            self._lock.notify_all()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    # --- faults ---

    def fail_with(self, status: int | None = 500) -> None:
        """Answer every request with ``status`` (None: answer normally again)."""
        with self._lock:
            self._failing = status

    def go_unreachable(self) -> None:
        """Stop listening: connections to ``url`` are refused until ``come_back()``."""
        self.close()

    def come_back(self) -> None:
        """Listen again on the same port, with the state as it was."""
        self.start()

    # --- synchronisation ---

    def wait_until_served(self, count: int, timeout: float = 5.0) -> bool:
        """Block until at least ``count`` requests have been answered in all."""
        with self._lock:
            return self._lock.wait_for(lambda: len(self.served) >= count, timeout)

    def statuses(self, path: str) -> list[int]:
        with self._lock:
            return [s.status for s in self.served if s.path == path]

    # --- answering ---

    def _reply(self, method: str, path: str, query: Mapping[str, str], headers: Any) -> _Reply:
        with self._lock:
            failing = self._failing
        if failing is not None:
            return failing, {"Content-Type": "text/plain"}, b"emulated failure"
        return self._answer(method, path, query, headers)

    def _answer(self, method: str, path: str, query: Mapping[str, str], headers: Any) -> _Reply:
        raise NotImplementedError


def _text(status: int, body: str, **headers: str) -> _Reply:
    return status, {"Content-Type": "text/plain", **headers}, body.encode()


def _json(status: int, doc: Any, **headers: str) -> _Reply:
    return status, {"Content-Type": "application/json", **headers}, json.dumps(doc).encode()


class AwsImdsEmulator(_Emulator):
    """EC2 instance metadata, IMDSv2 only (as instances launched with HttpTokens=required)."""

    TOKEN_PATH = "/latest/api/token"
    ACTION_PATH = "/latest/meta-data/spot/instance-action"
    REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"

    def __init__(self) -> None:
        super().__init__()
        self._tokens: dict[str, float] = {}  # token -> expiry (monotonic)
        self._instance_action: dict[str, str] | None = None
        self._rebalance: dict[str, str] | None = None
        self.tokens_issued = 0

    def trigger_preempt(self, action: str = "terminate", seconds_from_now: float = 120) -> None:
        """Schedule a spot interruption (``action``: terminate, stop or hibernate)."""
        with self._lock:
            self._instance_action = {"action": action, "time": _utc_iso(seconds_from_now)}
            self._lock.notify_all()

    def trigger_rebalance(self, notice_time: str | None = None) -> None:
        """Publish a rebalance recommendation (a new ``notice_time`` is a new recommendation)."""
        with self._lock:
            self._rebalance = {"noticeTime": notice_time or _utc_iso(0)}
            self._lock.notify_all()

    def expire_tokens(self) -> None:
        """Invalidate every token issued so far: their next use gets 401."""
        with self._lock:
            self._tokens.clear()

    @property
    def unauthorized(self) -> int:
        """How many requests were refused with 401."""
        with self._lock:
            return sum(1 for s in self.served if s.status == 401)

    def _answer(self, method: str, path: str, query: Mapping[str, str], headers: Any) -> _Reply:
        if path == self.TOKEN_PATH:
            if method != "PUT":
                return _text(405, "Method Not Allowed")
            try:
                ttl = int(headers.get("X-aws-ec2-metadata-token-ttl-seconds", ""))
            except ValueError:
                return _text(400, "Bad Request")
            if not 1 <= ttl <= 21600:
                return _text(400, "Bad Request")
            token = secrets.token_urlsafe(32)
            with self._lock:
                self._tokens[token] = time.monotonic() + ttl
                self.tokens_issued += 1
            return _text(200, token, **{"X-aws-ec2-metadata-token-ttl-seconds": str(ttl)})

        if method != "GET":
            return _text(405, "Method Not Allowed")
        token = headers.get("X-aws-ec2-metadata-token")
        with self._lock:
            expiry = self._tokens.get(token or "")
            if expiry is None or expiry <= time.monotonic():
                return _text(401, "Unauthorized")
            action, rebalance = self._instance_action, self._rebalance
        if path == self.ACTION_PATH and action is not None:
            return _text(200, json.dumps(action))
        if path == self.REBALANCE_PATH and rebalance is not None:
            return _text(200, json.dumps(rebalance))
        return _text(404, "Not Found")


class GcpMetadataEmulator(_Emulator):
    """GCE metadata server: ``instance/preempted`` with ETags and long polling."""

    PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
    _FLAVOR = {"Metadata-Flavor": "Google"}

    def __init__(self) -> None:
        super().__init__()
        self._preempted = False
        self._etag = secrets.token_hex(8)
        self.long_polls = 0

    def trigger_preempt(self) -> None:
        """The VM is being preempted: the value turns TRUE and hanging GETs return at once."""
        with self._lock:
            self._preempted = True
            self._etag = secrets.token_hex(8)
            self._lock.notify_all()

    def wait_until_long_polled(self, count: int = 1, timeout: float = 5.0) -> bool:
        """Block until at least ``count`` long polls have arrived (answered or still hanging)."""
        with self._lock:
            return self._lock.wait_for(lambda: self.long_polls >= count, timeout)

    def _answer(self, method: str, path: str, query: Mapping[str, str], headers: Any) -> _Reply:
        if headers.get("Metadata-Flavor") != "Google":
            return _text(403, "Missing Metadata-Flavor:Google header.", **self._FLAVOR)
        if path != self.PREEMPTED_PATH:
            return _text(404, "Not Found", **self._FLAVOR)
        if method != "GET":
            return _text(405, "Method Not Allowed", **self._FLAVOR)
        with self._lock:
            if query.get("wait_for_change") == "true":
                self.long_polls += 1
                self._lock.notify_all()
                last_etag = query.get("last_etag")
                timeout = float(query.get("timeout_sec", 60))
                # With last_etag: answer at once if the value already moved on; otherwise (and
                # without one) hang until it changes, the timeout passes, or we shut down.
                if last_etag is None or last_etag == self._etag:
                    waited_on = self._etag
                    self._lock.wait_for(lambda: self._etag != waited_on or self._closing, timeout)
            value, etag = self._preempted, self._etag
        return _text(200, "TRUE" if value else "FALSE", ETag=etag, **self._FLAVOR)


class AzureScheduledEventsEmulator(_Emulator):
    """Azure IMDS Scheduled Events."""

    EVENTS_PATH = "/metadata/scheduledevents"
    VERSIONS_PATH = "/metadata/versions"

    def __init__(self) -> None:
        super().__init__()
        self._events: list[dict[str, Any]] = []
        self._incarnation = 1

    def trigger_preempt(self, event_id: str | None = None) -> str:
        """Schedule a spot eviction; returns its EventId."""
        return self.add_event("Preempt", event_id=event_id, not_before_s=30)

    def add_event(
        self, event_type: str, *, event_id: str | None = None, not_before_s: float = 300
    ) -> str:
        """Schedule any event type (Freeze, Reboot, Redeploy, Preempt, Terminate)."""
        event_id = event_id or str(uuid.uuid4()).upper()
        not_before = email.utils.formatdate(time.time() + not_before_s, usegmt=True)
        event = {
            "EventId": event_id,
            "EventStatus": "Scheduled",
            "EventType": event_type,
            "ResourceType": "VirtualMachine",
            "Resources": ["grpo-run-node"],
            "NotBefore": not_before,
            "Description": f"Emulated {event_type} event",
            "EventSource": "Platform",
            "DurationInSeconds": -1 if event_type == "Preempt" else 5,
        }
        with self._lock:
            self._events.append(event)
            self._incarnation += 1
            self._lock.notify_all()
        return event_id

    def _answer(self, method: str, path: str, query: Mapping[str, str], headers: Any) -> _Reply:
        if (headers.get("Metadata") or "").lower() != "true":
            return _json(400, {"error": "Bad request. Required metadata header not specified"})
        if path == self.VERSIONS_PATH and method == "GET":
            return _json(200, {"apiVersions": ["2019-08-01", "2020-07-01", "2021-02-01"]})
        if path != self.EVENTS_PATH:
            return _json(404, {"error": "Not found"})
        if "api-version" not in query:
            error = "Bad request. api-version was not specified in the request"
            return _json(400, {"error": error})
        if method != "GET":
            return _json(200, {})  # approvals (POST StartRequests) are accepted and ignored
        with self._lock:
            doc = {"DocumentIncarnation": self._incarnation, "Events": list(self._events)}
        return _json(200, doc)
