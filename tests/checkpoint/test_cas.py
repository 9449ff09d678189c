"""Compare-and-swap, the lease's primitive: every backend refuses a write against a version that
is no longer current, and says so with Conflict (the unit tests' memory:// double too); gs:// and
memory:// are refused with the reason. A read says how old the object is on the store's own
clock, which is what a lease's expiry is judged on."""

from __future__ import annotations

import datetime as dt
import os
import time

import pytest

import grpo_run.checkpoint.storage.by_url as by_url
import grpo_run.checkpoint.storage.cas as storage_cas
from grpo_run.checkpoint.storage.by_url import open_store
from grpo_run.checkpoint.storage.cas import Conflict
from grpo_run.checkpoint.storage.store import StorageConfigError
from tests.checkpoint.memory_cas import use_memory_cas


@pytest.fixture(params=["memory", "local", "s3", "gs", "az"])
def url(request, tmp_path, monkeypatch) -> str:
    if request.param == "memory":
        use_memory_cas(monkeypatch)       # the unit tests' double, held to the same contract
        return "memory://jobs/cas"
    if request.param == "local":
        return str(tmp_path / "jobs" / "cas")
    return request.getfixturevalue({"s3": "s3_env", "gs": "gcs_env", "az": "az_env"}[request.param]).url + "/cas"


def test_a_write_against_a_stale_version_is_a_conflict_and_changes_nothing(url):
    cas = by_url.open_cas(url, "lease.json")
    assert cas.read() is None

    first = cas.create(b"one")
    with pytest.raises(Conflict):
        cas.create(b"again")                      # exists already
    assert cas.read()[:2] == (b"one", first)

    second = cas.replace(b"two", first)
    with pytest.raises(Conflict):
        cas.replace(b"three", first)              # someone else's write came in between
    with pytest.raises(Conflict):
        cas.delete(first)
    assert cas.read()[:2] == (b"two", second)

    cas.delete(second)
    assert cas.read() is None
    with pytest.raises(Conflict):
        cas.replace(b"four", second)              # removed meanwhile
    assert cas.read() is None
    assert cas.create(b"five") is not None        # free again


def test_two_objects_under_one_url_are_independent(url):
    a, b = by_url.open_cas(url, "a.json"), by_url.open_cas(url, "b.json")
    a.create(b"a")
    b.create(b"b")
    assert a.read()[0] == b"a" and b.read()[0] == b"b"


def test_a_local_object_tells_no_age_whatever_its_file_time_says(tmp_path):
    # Its file time is the file server's clock (NFS) or another node's: this machine's time minus
    # it would compare two clocks. The lease ages a folder's lease by its holder's renewals.
    cas = by_url.open_cas(str(tmp_path / "job"), "lease.json")
    cas.create(b"one")
    path = tmp_path / "job" / "lease.json"
    os.utime(path, (time.time() - 120, time.time() - 120))   # stamped by a clock two minutes behind
    assert cas.read() == (b"one", b"one", None)


def test_the_s3_age_is_date_minus_last_modified_less_a_second_for_whole_second_dates():
    modified = dt.datetime(2026, 1, 1, 10, 0, 0, tzinfo=dt.timezone.utc)
    reply = {"LastModified": modified,
             "ResponseMetadata": {"HTTPHeaders": {"date": "Thu, 01 Jan 2026 10:01:05 GMT"}}}
    assert storage_cas._s3_age(reply) == 64.0
    assert storage_cas._s3_age({"LastModified": modified}) is None          # no Date: no age
    assert storage_cas._s3_age(dict(reply, ResponseMetadata={"HTTPHeaders": {"date": "soon"}})) is None


@pytest.mark.parametrize("env", ["s3_env", "gcs_env", "az_env"])
def test_an_object_is_aged_on_the_servers_clock_not_ours(request, env, monkeypatch):
    cas = by_url.open_cas(request.getfixturevalue(env).url + "/cas", "lease.json")
    cas.create(b"one")
    monkeypatch.setattr(time, "time", lambda: 2_000_000_000.0)   # our wall clock is years off
    age = cas.read().age_s
    assert age is not None and -1 <= age < 5                     # the server's Date and Last-Modified


def test_the_age_is_date_minus_last_modified_less_a_second_for_whole_second_dates():
    assert storage_cas.http_age("Thu, 01 Jan 2026 10:01:05 GMT", "Thu, 01 Jan 2026 10:00:00 GMT") == 64.0
    assert storage_cas.http_age(None, "Thu, 01 Jan 2026 10:00:00 GMT") is None
    assert storage_cas.http_age("soon", "Thu, 01 Jan 2026 10:00:00 GMT") is None


def test_a_released_gcs_lease_reads_as_none_and_is_created_over(gcs_env):
    # GCS releases by a conditional upload of an empty body (checkpoint.storage.gcs says why)
    cas = by_url.open_cas(gcs_env.url, "lease.json")
    version = cas.create(b"mine")
    cas.delete(version)
    assert cas.read() is None
    other = by_url.open_cas(gcs_env.url, "lease.json")      # a node that never saw it:
    with pytest.raises(Conflict):
        other.create(b"theirs")                                   # a create in the dark loses,
    assert other.read() is None                                   # the lease reads again (as it does)
    assert other.create(b"theirs") is not None                    # and takes the released one
    with pytest.raises(Conflict):
        cas.create(b"mine again")                                 # the release it saw is gone
    assert cas.read().data == b"theirs"


def test_fake_gcs_server_ignores_the_precondition_of_a_delete_which_the_lease_never_uses(gcs_env):
    # Why a GCS lease is released by an upload: the emulator deletes whatever generation a DELETE
    # names. If this starts failing, the emulator honours it now (docs/reliability.md says so).
    from google.cloud import storage

    blob = storage.Client(project=None).bucket(gcs_env.bucket).blob("run/x")
    blob.upload_from_string(b"1", if_generation_match=0)
    stale = int(blob.generation) - 1
    blob.delete(if_generation_match=stale, retry=None)           # GCS itself: 412
    assert not blob.exists()


@pytest.mark.parametrize("env, says", [("gcs_env", "does not honour generation preconditions"),
                                       ("az_env", "does not honour conditional requests")])
def test_a_server_that_ignores_preconditions_is_refused_before_the_first_write(request, env, says):
    cloud = request.getfixturevalue(env)
    cas = by_url.open_cas(cloud.url, "lease.json")
    with pytest.MonkeyPatch.context() as patch:
        if env == "gcs_env":
            from google.cloud.storage import Blob

            real = Blob.upload_from_string

            def unconditional(self, data, *args, if_generation_match=None, **kwargs):
                return real(self, data, *args, **kwargs)              # as a server that ignores it
            patch.setattr(Blob, "upload_from_string", unconditional)
        else:
            from azure.storage.blob import BlobClient

            real = BlobClient.upload_blob

            def unconditional(self, data, *args, **kwargs):
                kwargs.pop("etag", None), kwargs.pop("match_condition", None)
                return real(self, data, *args, **{**kwargs, "overwrite": True})
            patch.setattr(BlobClient, "upload_blob", unconditional)
        with pytest.raises(StorageConfigError, match=says):
            cas.create(b"mine")
    assert cas.read() is None
    assert open_store(cloud.url).list() == []                      # the probe is gone too


def test_memory_storage_has_no_compare_and_swap():
    with pytest.raises(StorageConfigError, match=r"memory:// has no compare-and-swap.*s3://bucket/prefix, gs://"):
        by_url.open_cas("memory://jobs/cas", "lease.json")


def test_a_key_must_be_a_relative_path(tmp_path):
    with pytest.raises(ValueError):
        by_url.open_cas(str(tmp_path / "jobs" / "cas"), "../lease.json")
