"""A TCP proxy on 127.0.0.1 in front of the test S3 server, switchable while a run goes on:

    pass     bytes both ways, as they come
    delay    each chunk from the client waits `delay_s` before it is forwarded (a slow link)
    stall    connections are accepted and nothing is forwarded or answered (a hung server);
             what was sent is held until the mode changes
    deny     every request is answered 403 AccessDenied, as S3 answers revoked credentials

Switching mode closes the connections open so far, so the clients' pooled connections see the
new mode on their next request (a stalled request stays stalled until the mode changes)."""

from __future__ import annotations

import socket
import threading
import time

_DENIED = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
           b'<Message>Access Denied</Message><RequestId>grpo-run-test</RequestId></Error>')


class S3Proxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.mode = "pass"
        self.delay_s = 0.0
        self._changed = threading.Condition()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.requests_denied = 0
        self.stalled = 0                 # requests held by `stall` right now
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="s3proxy-accept").start()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set(self, mode: str, delay_s: float = 0.0) -> None:
        assert mode in ("pass", "delay", "stall", "deny"), mode
        with self._changed:
            self.mode, self.delay_s = mode, delay_s
            self._changed.notify_all()
        with self._lock:
            conns, self._open = list(self._open), set()
        for c in conns:
            _close(c)

    def close(self) -> None:
        self._closed = True
        self.set("pass")
        _close(self._listener)

    def __enter__(self) -> S3Proxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- connections -------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True, name="s3proxy-conn").start()

    def _serve(self, client: socket.socket) -> None:
        with self._lock:
            self._open.add(client)
        mode = self._wait_while_stalled()
        if mode == "deny":
            self._deny(client)
            return
        try:
            upstream = socket.create_connection(self.upstream, timeout=10)
        except OSError:
            _close(client)
            return
        with self._lock:
            self._open.add(upstream)
        threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()
        self._pump(client, upstream, True)

    def wait_stalled(self, timeout: float = 10.0) -> None:
        """Return once a request is being held by `stall` (sent, and not answered)."""
        with self._changed:
            if not self._changed.wait_for(lambda: self.stalled > 0, timeout):
                raise AssertionError(f"no request reached the stalled proxy within {timeout} s")

    def _wait_while_stalled(self) -> str:
        with self._changed:
            if self.mode == "stall" and not self._closed:
                self.stalled += 1
                self._changed.notify_all()
                try:
                    while self.mode == "stall" and not self._closed:
                        self._changed.wait()
                finally:
                    self.stalled -= 1
            return self.mode

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        try:
            while chunk := src.recv(65536):
                if from_client:
                    mode = self._wait_while_stalled()
                    if mode == "delay":
                        time.sleep(self.delay_s)
                    elif mode == "deny":
                        break
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            _close(src)
            _close(dst)

    def _deny(self, client: socket.socket) -> None:
        """Answer the request 403 as soon as its headers are in (as S3 does, before a body sent
        after `Expect: 100-continue`), then close."""
        try:
            client.settimeout(10)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = client.recv(65536)
                if not chunk:
                    return
                data += chunk
            with self._lock:
                self.requests_denied += 1
            client.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/xml\r\n"
                           b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(_DENIED) + _DENIED)
        except OSError:
            pass
        finally:
            _close(client)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass
