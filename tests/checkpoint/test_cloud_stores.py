"""gs:// and az:// stores against the real emulators on 127.0.0.1 (fake-gcs-server, Azurite):
the same keys as S3, configuration errors at once and in words to act on, transient ones
retried, a stalled server given up at the notice window's end."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from grpo_run.checkpoint.storage.by_url import open_store
from grpo_run.checkpoint.storage.store import StorageConfigError, StorageUnavailable
from tests.checkpoint.test_store import RecordingSleep, exercise_round_trip
from tests.cloud_stores import point_at_azurite, point_at_gcs

CLOUDS = ["gcs_env", "az_env"]


@pytest.fixture(params=CLOUDS)
def cloud(request):
    return request.getfixturevalue(request.param)


def test_the_store_round_trips_keys_with_only_the_clouds_own_variables(cloud, tmp_path):
    exercise_round_trip(open_store(cloud.url), tmp_path)


def test_check_passes_and_leaves_nothing_behind(cloud):
    store = open_store(cloud.url)
    store.check()
    assert store.list("") == []


def test_listings_are_never_stale_and_a_sibling_prefix_is_not_ours(cloud, tmp_path):
    store = open_store(cloud.url)
    neighbour = open_store(cloud.url + "-2")        # run-2 beside run: never listed as ours
    neighbour.put_bytes("checkpoints/x", b"1")
    assert store.list("") == []
    open_store(cloud.url).put_bytes("checkpoints/ckpt-1/x", b"1")    # another writer
    assert store.list("checkpoints") == ["checkpoints/ckpt-1/x"]
    open_store(cloud.url).delete("checkpoints")
    assert store.list("checkpoints") == [] and neighbour.list("") == ["checkpoints/x"]


@pytest.mark.parametrize("operation", [
    lambda s: s.get_bytes("k"), lambda s: s.put_bytes("k", b"1"), lambda s: s.exists("k"),
    lambda s: s.list("checkpoints"), lambda s: s.delete("checkpoints"), lambda s: s.check(),
])
def test_every_operation_reports_a_missing_bucket_as_configuration(cloud, operation):
    sleep = RecordingSleep()
    url = f"{cloud.scheme}://no-such-{cloud.bucket}/run"
    with pytest.raises(StorageConfigError, match="does not exist") as info:
        operation(open_store(url, sleep=sleep))
    assert url in str(info.value) and "create it, or fix spec.storage" in str(info.value)
    assert sleep.delays == []


def test_a_wrong_azure_key_fails_at_once_and_is_never_echoed(azurite, monkeypatch):
    wrong = "d3Jvbmcta2V5LW5vdC10aGUtYWNjb3VudHMtb3duLWtleS0xMjM0NTY3ODkwYWI="
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite.connection_string(key=wrong))
    sleep = RecordingSleep()
    with pytest.raises(StorageConfigError, match="Azure refused the credentials") as info:
        open_store(f"az://{azurite.create_container()}/run", sleep=sleep).check()
    assert wrong not in str(info.value) and azurite.account.key not in str(info.value)
    assert sleep.delays == []


def test_gcs_without_any_credentials_says_how_to_give_them():
    # no STORAGE_EMULATOR_HOST, no GOOGLE_APPLICATION_CREDENTIALS, no metadata server
    sleep = RecordingSleep()
    with pytest.raises(StorageConfigError, match=r"no Google credentials found.*GOOGLE_APPLICATION_CREDENTIALS"):
        open_store("gs://some-bucket/run", sleep=sleep).check()
    assert sleep.delays == []


def test_azure_without_an_account_names_the_variables():
    with pytest.raises(StorageConfigError, match="set AZURE_STORAGE_ACCOUNT.*AZURE_STORAGE_CONNECTION_STRING"):
        open_store("az://container/run")


def test_a_malformed_connection_string_is_named_and_not_echoed(monkeypatch):
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", "AccountKey=s3cr3t;nonsense")
    with pytest.raises(StorageConfigError, match="AZURE_STORAGE_CONNECTION_STRING is not a valid") as info:
        open_store("az://container/run")
    assert "s3cr3t" not in str(info.value)


@pytest.mark.parametrize("url, module, extra", [("gs://bucket/run", "google.cloud.storage", "gcs"),
                                                ("az://container/run", "azure.storage.blob", "azure")])
def test_a_store_whose_library_is_missing_names_the_extra(url, module, extra, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)        # import fails as if not installed
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", "unused")
    with pytest.raises(StorageConfigError, match=rf"pip install 'grpo-run\[{extra}\]'"):
        open_store(url)


@pytest.mark.parametrize("url, says", [
    ("gs://", "names no bucket"), ("az://", "names no container"),
    ("az://account.blob.core.windows.net/run", "give the container alone"),
    ("gs://bucket/run?x=1", r"no \?query"),
])
def test_a_bad_url_fails_at_once_and_names_it(url, says):
    with pytest.raises(StorageConfigError, match=says):
        open_store(url)


def test_credentials_in_a_gs_url_are_refused_and_never_echoed():
    with pytest.raises(StorageConfigError) as info:
        open_store("gs://key:SuperSecret123@bucket/prefix")
    assert "SuperSecret123" not in str(info.value) and "gs://bucket/prefix" in str(info.value)


@pytest.mark.parametrize("scheme", ["gs", "az"])
def test_an_emulator_that_does_not_answer_is_retried_then_unavailable(scheme, closed_port, monkeypatch):
    if scheme == "gs":
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{closed_port}")
    else:
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING",
                           f"DefaultEndpointsProtocol=http;AccountName=a;AccountKey=a2V5;"
                           f"BlobEndpoint=http://127.0.0.1:{closed_port}/a;")
    sleep = RecordingSleep()
    with pytest.raises(StorageUnavailable, match="retry budget"):
        open_store(f"{scheme}://bucket/run", retry_seconds=1.0, sleep=sleep).get_bytes("k")
    assert len(sleep.delays) >= 2 and sleep.delays[1] > sleep.delays[0]


def private_store(kind, make_gcs_server, make_azurite, monkeypatch):
    """(a server of this test's own, a storage URL on it), the environment pointed at it."""
    if kind == "gcs":
        server = make_gcs_server()
        point_at_gcs(monkeypatch, server)
        return server, f"gs://{server.create_bucket()}/run"
    server = make_azurite()
    point_at_azurite(monkeypatch, server)
    return server, f"az://{server.create_container()}/run"


@pytest.mark.parametrize("kind", ["gcs", "azurite"])
def test_a_stalled_server_is_given_up_when_the_notice_window_ends(kind, make_gcs_server, make_azurite, monkeypatch):
    server, url = private_store(kind, make_gcs_server, make_azurite, monkeypatch)
    store = open_store(url, stop=threading.Event())
    store.put_bytes("k", b"1")
    os.kill(server.process.pid, signal.SIGSTOP)            # accepts, never answers
    try:
        started = time.monotonic()
        store.finish_by(started + 1.0)
        with pytest.raises(StorageUnavailable, match="notice window"):
            store.get_bytes("k")
        assert time.monotonic() - started < 3.0
    finally:
        os.kill(server.process.pid, signal.SIGCONT)


@pytest.mark.parametrize("kind", ["gcs", "azurite"])
def test_an_outage_is_ridden_out_when_the_server_comes_back(kind, make_gcs_server, make_azurite, monkeypatch):
    server, url = private_store(kind, make_gcs_server, make_azurite, monkeypatch)
    store = open_store(url, retry_seconds=60)
    store.put_bytes("k", b"before")
    server.stop()
    back = threading.Timer(1.5, server.start)             # same port, same folder
    back.start()
    try:
        assert store.get_bytes("k") == b"before"
        store.put_bytes("k", b"after")
        assert store.get_bytes("k") == b"after"
    finally:
        back.join()
