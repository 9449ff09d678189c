"""Store: keys over fsspec, configuration errors at once, transient errors retried until a
budget or the stop event, against memory://, local folders and a real S3 (SeaweedFS)."""

from __future__ import annotations

import http.client
import http.server
import logging
import re
import threading
import time
from pathlib import Path

import pytest

from grpo_run.checkpoint.storage.store import Store, StorageConfigError, StorageUnavailable


class RecordingSleep:
    """An injected sleep: remembers each delay, never waits; can act on the n-th call."""

    def __init__(self, on_call=None):
        self.delays: list[float] = []
        self.on_call = on_call

    def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)
        if self.on_call is not None:
            self.on_call(len(self.delays))


@pytest.fixture
def refusing_url(closed_port, monkeypatch) -> str:
    """An S3 URL whose endpoint refuses connections (nothing listens on that port)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "anything")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "anything")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    return "s3://some-bucket/run"


def exercise_round_trip(store: Store, tmp_path: Path) -> None:
    store.put_bytes("checkpoints/ckpt-1/manifest.json", b'{"step": 1}')
    store.put_bytes("checkpoints/ckpt-10/manifest.json", b'{"step": 10}')
    src = tmp_path / "adapter.safetensors"
    src.write_bytes(b"\x00weights" * 1000)
    store.put_file(src, "checkpoints/ckpt-1/adapter/adapter_model.safetensors")

    assert store.get_bytes("checkpoints/ckpt-1/manifest.json") == b'{"step": 1}'
    store.get_file("checkpoints/ckpt-1/adapter/adapter_model.safetensors", tmp_path / "out" / "a")
    assert (tmp_path / "out" / "a").read_bytes() == src.read_bytes()
    assert store.exists("checkpoints/ckpt-10/manifest.json")
    assert not store.exists("checkpoints/ckpt-2/manifest.json")
    assert store.list("checkpoints") == [
        "checkpoints/ckpt-1/adapter/adapter_model.safetensors",
        "checkpoints/ckpt-1/manifest.json",
        "checkpoints/ckpt-10/manifest.json",
    ]

    assert store.list("checkpoints/") == store.list("checkpoints")
    store.delete("checkpoints/ckpt-1")
    assert store.list("checkpoints") == ["checkpoints/ckpt-10/manifest.json"]
    store.delete("checkpoints/ckpt-1")  # missing is fine
    store.delete("checkpoints/ckpt-10/manifest.json")
    assert store.list("") == []
    with pytest.raises(FileNotFoundError):
        store.get_bytes("checkpoints/ckpt-10/manifest.json")


# --- memory and local stores ----------------------------------------------------------------

def test_a_memory_store_round_trips_keys(tmp_path):
    exercise_round_trip(Store("memory://unit"), tmp_path)


def test_a_local_folder_store_round_trips_keys(tmp_path):
    exercise_round_trip(Store(str(tmp_path / "store")), tmp_path)


def test_a_file_url_store_writes_whole_files_and_leaves_no_temporaries(tmp_path):
    root = tmp_path / "store"
    store = Store(f"file://{root}")
    store.put_bytes("a/b.bin", b"x" * 10)
    store.get_file("a/b.bin", tmp_path / "copy.bin")

    assert sorted(p.name for p in root.rglob("*") if p.is_file()) == ["b.bin"]
    assert sorted(p.name for p in tmp_path.glob("*.bin")) == ["copy.bin"]


def test_a_copy_killed_halfway_leaves_nothing_a_reader_takes_for_the_file(tmp_path):
    """A node killed while it copies an event file into storage leaves its temporary there. Seen
    in CI: TensorBoard, pointed at the job's storage folder, reads every name with "tfevents" in
    it, and drew the killed node's steps a second time from the half-written copy."""
    import os
    import signal
    import subprocess
    import sys

    from tensorboard.backend.event_processing.io_wrapper import IsTensorFlowEventsFile

    from tests.faults.harness import wait_until

    source, root = tmp_path / "source", tmp_path / "bucket" / "tensorboard"
    os.mkfifo(source)                                       # the copy waits here for the rest
    dest = root / "events.out.tfevents.1764700000.node-b.4242.0.1a2b3c4d.attempt2"
    child = subprocess.Popen([sys.executable, "-c", "import sys; from pathlib import Path; from grpo_run.checkpoint."
                              "storage.fsio import atomic_copy; atomic_copy(*map(Path, sys.argv[1:]))", source, dest])
    writer = os.open(source, os.O_RDWR)                     # never blocks, whatever the child does
    try:
        os.write(writer, b"half an event file")
        wait_until("the copy's temporary", lambda: root.exists() and any(root.iterdir()), child, timeout=60)
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        os.close(writer)
    left = [p.name for p in root.iterdir()]
    assert len(left) == 1 and not dest.exists(), left        # the kill left its temporary behind
    assert IsTensorFlowEventsFile(str(dest)) and not IsTensorFlowEventsFile(str(root / left[0])), left
    assert Store(str(tmp_path / "bucket")).list("tensorboard") == []


def test_a_failed_download_leaves_the_local_file_untouched(tmp_path):
    local = tmp_path / "kept.bin"
    local.write_bytes(b"previous")

    with pytest.raises(FileNotFoundError):
        Store("memory://unit").get_file("missing.bin", local)

    assert local.read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir()] == ["kept.bin"]


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "a//b", "trailing/", "./a"])
def test_keys_must_be_relative_paths(key):
    with pytest.raises(ValueError):
        Store("memory://unit").get_bytes(key)


@pytest.mark.parametrize("url, says", [
    ("ftp://host/path", "unsupported scheme"),
    ("s3://", "names no bucket"),
    ("", "empty"),
])
def test_a_bad_url_fails_at_once_and_names_it(url, says):
    with pytest.raises(StorageConfigError, match=says):
        Store(url)


def test_credentials_in_the_url_are_refused_and_never_echoed():
    with pytest.raises(StorageConfigError) as info:
        Store("s3://AKIDEXAMPLE:SuperSecret123@bucket/prefix")

    assert "SuperSecret123" not in str(info.value)
    assert "s3://bucket/prefix" in str(info.value)


def test_check_passes_on_a_writable_store_and_leaves_nothing_behind():
    store = Store("memory://unit")
    store.check()
    assert store.list("") == []


# --- real S3 (SeaweedFS) --------------------------------------------------------------------

def test_an_s3_store_round_trips_keys_with_only_the_standard_aws_variables(s3_env, tmp_path):
    # the endpoint comes from AWS_ENDPOINT_URL alone: nothing is passed to the Store
    exercise_round_trip(Store(s3_env.url), tmp_path)


def test_s3_listings_are_never_stale(s3_env):
    store = Store(s3_env.url)
    other_writer = s3_env.server.client()
    assert store.list("checkpoints") == []

    other_writer.put_object(Bucket=s3_env.bucket, Key="run/checkpoints/ckpt-1/x", Body=b"1")
    assert store.list("checkpoints") == ["checkpoints/ckpt-1/x"]
    assert store.exists("checkpoints/ckpt-1/x")

    other_writer.delete_object(Bucket=s3_env.bucket, Key="run/checkpoints/ckpt-1/x")
    assert store.list("checkpoints") == []
    assert not store.exists("checkpoints/ckpt-1/x")


def test_check_passes_on_a_good_bucket_and_leaves_nothing_behind(s3_env):
    store = Store(s3_env.url)
    store.check()
    assert store.list("") == []


def test_a_missing_bucket_fails_at_once_without_retrying(s3_env):
    sleep = RecordingSleep()
    store = Store("s3://no-such-bucket-here/run", sleep=sleep)

    with pytest.raises(StorageConfigError, match="bucket does not exist") as info:
        store.check()

    assert "s3://no-such-bucket-here/run" in str(info.value)
    assert sleep.delays == []


@pytest.mark.parametrize("operation", [
    lambda s: s.get_bytes("k"), lambda s: s.put_bytes("k", b"1"), lambda s: s.exists("k"),
    lambda s: s.list("checkpoints"), lambda s: s.delete("checkpoints"),
])
def test_every_operation_reports_a_missing_bucket_as_configuration(s3_env, operation):
    sleep = RecordingSleep()
    with pytest.raises(StorageConfigError, match="bucket does not exist"):
        operation(Store("s3://no-such-bucket-here/run", sleep=sleep))
    assert sleep.delays == []


def test_a_wrong_secret_fails_at_once_and_is_never_echoed(s3_env, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-xyz")
    sleep = RecordingSleep()

    with pytest.raises(StorageConfigError, match="bad credentials") as info:
        Store(s3_env.url, sleep=sleep).check()

    assert "not-the-secret-xyz" not in str(info.value)
    assert s3_env.server.secret_key not in str(info.value)
    assert sleep.delays == []


def test_an_unknown_access_key_fails_at_once(s3_env, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody")
    with pytest.raises(StorageConfigError, match="bad credentials"):
        Store(s3_env.url, sleep=RecordingSleep()).check()


def test_missing_credentials_fail_at_once(s3_env, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    sleep = RecordingSleep()

    with pytest.raises(StorageConfigError, match="missing or incomplete credentials"):
        Store(s3_env.url, sleep=sleep).check()
    assert sleep.delays == []


# --- transient errors -----------------------------------------------------------------------

def test_a_refused_connection_is_retried_with_backoff_then_reported_unavailable(refusing_url):
    url = refusing_url
    sleep = RecordingSleep()
    store = Store(url, retry_seconds=1.0, sleep=sleep)

    with pytest.raises(StorageUnavailable, match="retry budget") as info:
        store.get_bytes("checkpoints/ckpt-00000025/manifest.json")

    assert url in str(info.value)
    assert len(sleep.delays) >= 2
    assert sleep.delays[:3] == sorted(sleep.delays[:3])  # backing off, not hammering
    assert sleep.delays[1] > sleep.delays[0]


def test_the_stop_event_ends_retries_at_once(refusing_url):
    stop = threading.Event()
    stop.set()
    sleep = RecordingSleep()

    with pytest.raises(StorageUnavailable, match="preemption requested"):
        Store(refusing_url, stop=stop, retry_seconds=600, sleep=sleep).list("")

    assert sleep.delays == []


def test_a_preemption_during_a_backoff_ends_retries_without_another_attempt(refusing_url):
    stop = threading.Event()
    sleep = RecordingSleep(on_call=lambda n: stop.set() if n == 2 else None)

    with pytest.raises(StorageUnavailable, match="failed 2 time"):
        Store(refusing_url, stop=stop, retry_seconds=600, sleep=sleep).list("")

    assert len(sleep.delays) == 2


@pytest.mark.slow  # waits through real backoffs (0.5s + 1s + 2s) before the preemption
def test_a_preemption_cuts_a_real_backoff_short(refusing_url):
    stop = threading.Event()
    long_backoff = threading.Event()

    class OnLongBackoff(logging.Handler):
        def emit(self, record):  # the fourth backoff: 4 s plus jitter
            waited = re.search(r"retrying in (\d+\.\d)s", record.getMessage())
            if waited and float(waited.group(1)) >= 4.0:
                long_backoff.set()

    handler = OnLongBackoff()
    logging.getLogger("grpo_run.checkpoint.storage.store").addHandler(handler)
    store = Store(refusing_url, stop=stop, retry_seconds=600)  # the real sleep
    outcome: list[BaseException] = []
    worker = threading.Thread(target=lambda: outcome.extend(_raised(lambda: store.list(""))),
                              daemon=True)  # a failed wait must not keep pytest for 600 s
    try:
        worker.start()
        assert long_backoff.wait(30)
        preempted_at = time.monotonic()
        stop.set()
        worker.join(30)
    finally:
        logging.getLogger("grpo_run.checkpoint.storage.store").removeHandler(handler)

    assert time.monotonic() - preempted_at < 2.0  # not the 4s the backoff had left
    assert isinstance(outcome[0], StorageUnavailable)
    assert "preemption requested" in str(outcome[0])


def _raised(fn) -> list[BaseException]:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - handed to the test thread
        return [exc]
    return []


class FlakyS3Proxy:
    """A reverse proxy in front of the test S3 that answers the first `failures` requests with
    an S3 error (e.g. 503 SlowDown), then forwards faithfully."""

    def __init__(self, upstream_port: int, status: int, code: str, failures: int):
        self.failures = failures
        self.seen = 0
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                proxy.seen += 1
                if proxy.seen <= proxy.failures:
                    payload = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code>"
                               f"<Message>injected</Message></Error>").encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(payload)
                    return
                upstream = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=30)
                upstream.request(self.command, self.path, body=body, headers=dict(self.headers))
                response = upstream.getresponse()
                data = response.read()
                self.send_response(response.status)
                for name, value in response.getheaders():
                    if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                upstream.close()

            do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _handle

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("status, code", [(503, "SlowDown"), (500, "InternalError")])
def test_server_errors_and_throttling_are_ridden_out(s3_env, monkeypatch, status, code):
    Store(s3_env.url).put_bytes("checkpoints/ckpt-00000025/manifest.json", b"manifest")
    proxy = FlakyS3Proxy(s3_env.server.port, status, code, failures=2)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
    sleep = RecordingSleep()
    try:
        data = Store(s3_env.url, sleep=sleep).get_bytes("checkpoints/ckpt-00000025/manifest.json")
    finally:
        proxy.close()

    assert data == b"manifest"
    assert len(sleep.delays) == 2


def test_a_service_that_keeps_failing_is_reported_unavailable(s3_env, monkeypatch):
    proxy = FlakyS3Proxy(s3_env.server.port, 503, "ServiceUnavailable", failures=10**9)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
    try:
        with pytest.raises(StorageUnavailable, match=r"Service Unavailable .*HTTP 503"):
            Store(s3_env.url, retry_seconds=0.3, sleep=RecordingSleep()).get_bytes("k")
    finally:
        proxy.close()


@pytest.mark.slow
def test_an_s3_outage_is_ridden_out_when_the_server_comes_back(make_s3_server, monkeypatch):
    server = make_s3_server()
    bucket = server.create_bucket()
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    Store(f"s3://{bucket}/run").put_bytes("checkpoints/ckpt-00000025/manifest.json", b"m")
    server.stop()  # the outage

    # the server comes back while the store is backing off for the second time
    sleep = RecordingSleep(on_call=lambda n: server.start() if n == 2 else None)
    data = Store(f"s3://{bucket}/run", sleep=sleep).get_bytes(
        "checkpoints/ckpt-00000025/manifest.json")

    assert data == b"m"
    assert len(sleep.delays) == 2


def test_a_call_to_a_stalled_server_is_given_up_when_the_notice_window_ends(s3_env, monkeypatch):
    """A stalled server answers nothing until botocore's 60 s read timeout; after a notice the
    store ends every call by the window's end instead, the one already in flight when the notice
    came included, and starts none after it."""
    from tests.faults.s3proxy import S3Proxy

    notice = threading.Event()
    with S3Proxy(s3_env.server.port) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint_url)
        store = Store(s3_env.url, stop=notice)
        store.put_bytes("before", b"stored")                  # the connection works
        proxy.set("stall")
        outcome: list[BaseException] = []

        def upload() -> None:
            try:
                store.put_bytes("record", b"never answered")
            except StorageUnavailable as e:
                outcome.append(e)

        in_flight = threading.Thread(target=upload)
        in_flight.start()
        proxy.wait_stalled()                                  # the request is out, unanswered
        started = time.monotonic()
        notice.set()
        store.finish_by(started + 2.0)
        in_flight.join(10)
        assert not in_flight.is_alive() and "notice window" in str(outcome[0])
        assert time.monotonic() - started < 5.0
        with pytest.raises(StorageUnavailable, match="not tried"):
            store.get_bytes("before")
        proxy.set("pass")
        store.finish_by(None)
        assert store.get_bytes("before") == b"stored"
