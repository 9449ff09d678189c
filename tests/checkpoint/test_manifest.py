"""Checkpoints: sealed locally with a checksummed manifest, trusted only when it verifies,
uploaded manifest-last, and resumed only from a remote checkpoint that downloads and verifies."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import threading
from pathlib import Path

import pytest

from grpo_run.checkpoint.manifest import (CheckpointInvalid, checkpoint_dir, discover, finalize_checkpoint, prune, staging_dir, verify)
from grpo_run.checkpoint.storage.store import Store, StorageConfigError, StorageUnavailable
from grpo_run.checkpoint.sync import RestoreStopped, Uploader, download_latest, remote_discover


def make_checkpoint(root: Path, step: int, *, weights: bytes | None = None, meta: dict | None = None) -> Path:
    """What the trainer does: fill a staging folder, then finalize it."""
    staging = staging_dir(root, step)
    (staging / "adapter").mkdir(parents=True)
    (staging / "adapter" / "adapter_model.safetensors").write_bytes(
        weights if weights is not None else f"weights at step {step}".encode() * 100)
    (staging / "adapter" / "adapter_config.json").write_text('{"r": 8}')
    (staging / "optimizer.pt").write_bytes(bytes(range(256)) * 4)
    (staging / "trainer_state.json").write_text(json.dumps({"step": step}))
    final = checkpoint_dir(root, step)
    finalize_checkpoint(staging, final, step=step, meta={"loss": 0.5, **(meta or {})})
    return final


def tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# --- sealing and verifying --------------------------------------------------------------------

def test_finalize_seals_every_file_with_size_and_sha256_and_publishes_the_folder(tmp_path):
    staging = tmp_path / "ckpt-00000025.staging"
    (staging / "adapter").mkdir(parents=True)
    (staging / "adapter" / "adapter_model.safetensors").write_bytes(b"abc" * 1000)
    (staging / "rng.pt").write_bytes(b"rng")

    manifest = finalize_checkpoint(staging, tmp_path / "ckpt-00000025", step=25,
                                   meta={"loss": 0.25})

    final = tmp_path / "ckpt-00000025"
    assert not staging.exists()
    assert {f.path: (f.size, f.sha256) for f in manifest.files} == {
        "adapter/adapter_model.safetensors": (3000, hashlib.sha256(b"abc" * 1000).hexdigest()),
        "rng.pt": (3, hashlib.sha256(b"rng").hexdigest()),
    }
    on_disk = json.loads((final / "manifest.json").read_text())
    assert on_disk["step"] == 25 and on_disk["meta"] == {"loss": 0.25}
    assert verify(final) == manifest
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-00000025"]


def test_finalize_refuses_a_final_folder_named_for_another_step(tmp_path):
    (tmp_path / "s").mkdir()
    with pytest.raises(ValueError, match="ckpt-00000025"):
        finalize_checkpoint(tmp_path / "s", tmp_path / "ckpt-00000024", step=25)


def test_finalize_refuses_a_staging_folder_with_its_own_manifest(tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "manifest.json").write_text("{}")
    with pytest.raises(ValueError, match="reserved"):
        finalize_checkpoint(tmp_path / "s", tmp_path / "ckpt-00000001", step=1)


def test_reaching_a_step_again_replaces_its_checkpoint(tmp_path):
    make_checkpoint(tmp_path, 50, weights=b"first")
    make_checkpoint(tmp_path, 50, weights=b"second")

    assert tree(tmp_path / "ckpt-00000050")["adapter/adapter_model.safetensors"] == b"second"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-00000050"]


def test_a_checkpoint_missing_its_manifest_is_invalid(tmp_path):
    final = make_checkpoint(tmp_path, 25)
    (final / "manifest.json").unlink()
    with pytest.raises(CheckpointInvalid, match="manifest.json is missing"):
        verify(final)


def test_an_unparseable_manifest_is_invalid(tmp_path):
    final = make_checkpoint(tmp_path, 25)
    (final / "manifest.json").write_text('{"step": 25, "fil')  # cut short
    with pytest.raises(CheckpointInvalid, match="not valid JSON"):
        verify(final)


def test_a_truncated_file_is_invalid(tmp_path):
    final = make_checkpoint(tmp_path, 25)
    weights = final / "adapter" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:10])
    with pytest.raises(CheckpointInvalid, match="adapter_model.safetensors is 10 bytes"):
        verify(final)


def test_a_file_with_the_wrong_checksum_is_invalid(tmp_path):
    final = make_checkpoint(tmp_path, 25)
    optimizer = final / "optimizer.pt"
    data = bytearray(optimizer.read_bytes())
    data[100] ^= 0xFF  # same size, one byte flipped
    optimizer.write_bytes(bytes(data))
    with pytest.raises(CheckpointInvalid, match="optimizer.pt sha256 mismatch"):
        verify(final)


def test_a_missing_file_is_invalid(tmp_path):
    final = make_checkpoint(tmp_path, 25)
    (final / "trainer_state.json").unlink()
    with pytest.raises(CheckpointInvalid, match="trainer_state.json is missing"):
        verify(final)


def test_a_folder_named_for_another_step_than_its_manifest_is_invalid(tmp_path):
    make_checkpoint(tmp_path, 25).rename(tmp_path / "ckpt-00000030")
    with pytest.raises(CheckpointInvalid, match="manifest says step 25"):
        verify(tmp_path / "ckpt-00000030")


# --- discovery and pruning --------------------------------------------------------------------

def test_discover_lists_verified_checkpoints_newest_first_and_names_each_it_skips(tmp_path,
                                                                                  caplog):
    for step in (25, 50, 75, 100):
        make_checkpoint(tmp_path, step)
    (tmp_path / "ckpt-00000100" / "manifest.json").unlink()
    weights = tmp_path / "ckpt-00000075" / "adapter" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1])

    with caplog.at_level(logging.WARNING):
        found = discover(tmp_path)

    assert found == [(50, tmp_path / "ckpt-00000050"), (25, tmp_path / "ckpt-00000025")]
    skipped = [r.getMessage() for r in caplog.records]
    assert any("ckpt-00000100" in m and "manifest.json is missing" in m for m in skipped)
    assert any("ckpt-00000075" in m and "bytes" in m for m in skipped)


def test_a_kill_before_the_rename_leaves_nothing_that_looks_like_a_checkpoint(tmp_path):
    make_checkpoint(tmp_path, 25)
    staging = staging_dir(tmp_path, 50)  # killed while the trainer was writing step 50
    staging.mkdir()
    (staging / "optimizer.pt").write_bytes(b"half")

    assert discover(tmp_path) == [(25, tmp_path / "ckpt-00000025")]


def test_discover_of_a_missing_root_finds_nothing(tmp_path):
    assert discover(tmp_path / "nothing-here") == []


def test_prune_keeps_the_newest_k_and_removes_older_invalid_and_leftover_folders(tmp_path):
    for step in (25, 50, 75, 100):
        make_checkpoint(tmp_path, step)
    make_checkpoint(tmp_path, 125)
    (tmp_path / "ckpt-00000125" / "optimizer.pt").write_bytes(b"corrupt")
    staging_dir(tmp_path, 150).mkdir()
    (tmp_path / "notes.txt").write_text("not ours")

    prune(tmp_path, keep=3)

    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-00000050", "ckpt-00000075", "ckpt-00000100", "notes.txt"]


def test_prune_never_removes_the_only_valid_checkpoint(tmp_path):
    make_checkpoint(tmp_path, 25)
    for step in (50, 75):
        (make_checkpoint(tmp_path, step) / "manifest.json").unlink()

    prune(tmp_path, keep=2)

    assert discover(tmp_path) == [(25, tmp_path / "ckpt-00000025")]


def test_prune_keeps_the_newest_checkpoint_with_finite_weights_even_beyond_keep(tmp_path):
    """A run gone wrong seals NaN weights (finite: false) again and again: keep-3 must not push
    the last good checkpoint out; once a newer good one is sealed, the old one goes."""
    for step, finite in ((25, True), (50, True), (75, False), (100, False), (125, False)):
        make_checkpoint(tmp_path, step, meta={"finite": finite})

    assert prune(tmp_path, keep=3) == [125, 100, 75, 50]
    assert [step for step, _ in discover(tmp_path)] == [125, 100, 75, 50]

    make_checkpoint(tmp_path, 150, meta={"finite": True})
    assert prune(tmp_path, keep=3, trusted={150}) == [150, 125, 100]


def test_prune_refuses_to_keep_fewer_than_two(tmp_path):
    with pytest.raises(ValueError, match="keep must be >= 2"):
        prune(tmp_path, keep=1)


# --- uploading --------------------------------------------------------------------------------

class FailingManifestStore(Store):
    """A store whose service fails every manifest upload: what a kill or outage mid-upload
    leaves behind."""

    def put_file(self, local, key):
        if key.endswith("manifest.json"):
            raise StorageUnavailable(f"storage {self.url}: injected outage")
        super().put_file(local, key)

    def put_bytes(self, key, data):
        if key.endswith("manifest.json"):
            raise StorageUnavailable(f"storage {self.url}: injected outage")
        super().put_bytes(key, data)


def test_an_uploaded_checkpoint_is_durable_and_identical_remotely(tmp_path):
    store = Store("memory://bucket/run")
    ckpt = make_checkpoint(tmp_path / "local", 25)

    with Uploader(store) as uploader:
        uploader.submit(ckpt)
        assert uploader.wait(timeout=30)
        assert uploader.durable_steps() == [25]

    assert remote_discover(store) == [25]
    remote = {k.removeprefix("checkpoints/ckpt-00000025/"): store.get_bytes(k)
              for k in store.list("checkpoints")}
    assert remote == tree(ckpt)


def test_an_upload_cut_short_before_the_manifest_is_never_durable(tmp_path):
    store = FailingManifestStore("memory://bucket/run")
    ckpt = make_checkpoint(tmp_path / "local", 25)

    uploader = Uploader(store)
    uploader.submit(ckpt)
    assert not uploader.wait(timeout=30)
    uploader.close()

    assert isinstance(uploader.error, StorageUnavailable)
    assert uploader.durable_steps() == []
    assert store.list("checkpoints")  # the files went up...
    assert remote_discover(store) == []  # ...but without a manifest it is not a checkpoint
    assert download_latest(store, tmp_path / "resume") is None


def test_the_remote_keeps_only_the_newest_k_checkpoints(tmp_path):
    store = Store("memory://bucket/run")
    with Uploader(store, keep=2) as uploader:
        for step in (25, 50, 75):
            uploader.submit(make_checkpoint(tmp_path / "local", step))
            assert uploader.wait(timeout=30)
        assert uploader.durable_steps() == [75, 50]

    assert remote_discover(store) == [75, 50]
    assert not any("ckpt-00000025" in key for key in store.list("checkpoints"))


def test_the_remote_keeps_the_newest_checkpoint_with_finite_weights_even_beyond_keep(tmp_path):
    store = Store("memory://bucket/run")
    with Uploader(store, keep=2) as uploader:
        for step, finite in ((25, True), (50, True), (75, False), (100, False), (125, False)):
            uploader.submit(make_checkpoint(tmp_path / "local", step, meta={"finite": finite}))
            assert uploader.wait(timeout=30)
        assert uploader.durable_steps() == [125, 100, 50]
    # a later attempt's uploader learns which are finite from the manifests in storage
    with Uploader(store, keep=2) as uploader:
        uploader.submit(make_checkpoint(tmp_path / "local", 150, meta={"finite": False}))
        assert uploader.wait(timeout=30)
        assert uploader.durable_steps() == [150, 125, 50]

    assert remote_discover(store) == [150, 125, 50]


def test_a_newer_checkpoint_supersedes_queued_older_ones(tmp_path):
    store = Store("memory://bucket/run")
    ckpts = [make_checkpoint(tmp_path / "local", step) for step in (25, 50, 75)]
    release = threading.Event()

    class SlowStore(Store):
        def put_file(self, local, key):
            release.wait(30)
            super().put_file(local, key)

    with Uploader(SlowStore("memory://bucket/run")) as uploader:
        for ckpt in ckpts:
            uploader.submit(ckpt)
        release.set()
        assert uploader.wait(timeout=30)
        newest = uploader.durable_steps()[0]

    assert newest == 75
    assert remote_discover(store)[0] == 75


class GatedStore(Store):
    """A real store whose uploads wait at the first file until `release` is set (`started` says one waits)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.started, self.release = threading.Event(), threading.Event()
        self.uploaded: list[str] = []

    def put_file(self, local, key):
        self.started.set()
        assert self.release.wait(30)
        super().put_file(local, key)
        self.uploaded.append(key)


def test_a_checkpoint_pruned_locally_while_it_uploads_still_becomes_durable(tmp_path):
    # The trainer keeps only its newest few checkpoints: on a busy node or a slow store the one
    # being uploaded is pruned mid-way. Its pinned hard links keep the bytes the upload reads.
    store = GatedStore("memory://bucket/run")
    local = tmp_path / "run" / "checkpoints"
    ckpt = make_checkpoint(local, 4)
    files = tree(ckpt)
    with Uploader(store, pin=tmp_path / "run" / "uploading") as uploader:
        uploader.submit(ckpt)
        assert store.started.wait(30)
        make_checkpoint(local, 8), make_checkpoint(local, 12)
        assert prune(local, keep=2) == [12, 8]           # what the trainer's writer does
        assert not ckpt.exists()
        store.release.set()
        assert uploader.wait(timeout=30)
        assert uploader.durable_steps() == [4]
    assert remote_discover(store) == [4]
    got = download_latest(store, tmp_path / "resume")
    assert got is not None and tree(got[1]) == files
    assert not (tmp_path / "run" / "uploading").exists()   # the pins go with the uploader


def test_one_checkpoint_waits_while_another_uploads_and_a_pruned_one_is_skipped(tmp_path, caplog):
    store = GatedStore("memory://bucket/run")
    local, pins = tmp_path / "checkpoints", tmp_path / "uploading"
    with Uploader(store, pin=pins) as uploader:
        uploader.submit(make_checkpoint(local, 4))
        assert store.started.wait(30)
        for step in (8, 12):
            uploader.submit(make_checkpoint(local, step))
        assert sorted(p.name for p in pins.iterdir()) == ["ckpt-00000004", "ckpt-00000012"]   # 8: superseded
        gone = make_checkpoint(local, 16)
        shutil.rmtree(gone)
        with caplog.at_level(logging.INFO, logger="grpo_run.checkpoint.sync"):
            uploader.submit(gone)                        # pruned before it was reported: skipped
        assert "removed locally" in caplog.text
        store.release.set()
        assert uploader.wait(timeout=30)
    assert remote_discover(store) == [12, 4]
    assert not any("ckpt-00000008" in key for key in store.uploaded)


def test_a_checkpoint_that_no_longer_verifies_locally_is_not_uploaded(tmp_path):
    store = Store("memory://bucket/run")
    ckpt = make_checkpoint(tmp_path / "local", 25)
    (ckpt / "optimizer.pt").write_bytes(b"damaged after sealing")

    with Uploader(store) as uploader:
        uploader.submit(ckpt)
        assert not uploader.wait(timeout=30)

    assert isinstance(uploader.error, CheckpointInvalid)
    assert store.list("") == []


def test_a_storage_configuration_error_is_surfaced_not_swallowed(tmp_path):
    class MisconfiguredStore(Store):
        def put_file(self, local, key):
            raise StorageConfigError(f"storage {self.url}: bucket does not exist")

    uploader = Uploader(MisconfiguredStore("memory://bucket/run"))
    uploader.submit(make_checkpoint(tmp_path / "local", 25))
    assert not uploader.wait(timeout=30)

    assert isinstance(uploader.error, StorageConfigError)
    with pytest.raises(StorageConfigError):
        uploader.submit(make_checkpoint(tmp_path / "local", 50))
    uploader.close()


def test_the_uploader_refuses_folders_not_named_like_checkpoints(tmp_path):
    with Uploader(Store("memory://bucket/run")) as uploader:
        with pytest.raises(ValueError, match="not named like a checkpoint"):
            uploader.submit(tmp_path)


# --- downloading ------------------------------------------------------------------------------

def upload(store: Store, *ckpts: Path, keep: int = 3) -> None:
    with Uploader(store, keep=keep) as uploader:
        for ckpt in ckpts:
            uploader.submit(ckpt)
            assert uploader.wait(timeout=60), uploader.error


def test_resume_downloads_the_newest_checkpoint_byte_for_byte(tmp_path):
    store = Store("memory://bucket/run")
    local = tmp_path / "node-a"
    upload(store, make_checkpoint(local, 25), make_checkpoint(local, 50))

    step, folder = download_latest(store, tmp_path / "node-b")

    assert (step, folder) == (50, tmp_path / "node-b" / "ckpt-00000050")
    assert tree(folder) == tree(local / "ckpt-00000050")
    assert [p.name for p in (tmp_path / "node-b").iterdir()] == ["ckpt-00000050"]


def test_a_verified_local_copy_is_reused_without_downloading(tmp_path):
    store = Store("memory://bucket/run")
    upload(store, make_checkpoint(tmp_path / "node-a", 25))
    _, folder = download_latest(store, tmp_path / "node-b")
    marker = folder / "not-in-the-manifest.txt"
    marker.write_text("a download would have replaced this folder")

    assert download_latest(store, tmp_path / "node-b") == (25, folder)
    assert marker.exists()


def test_a_notice_stops_a_restore_between_two_files_and_leaves_nothing_half_downloaded(tmp_path):
    store = Store("memory://bucket/run")
    upload(store, make_checkpoint(tmp_path / "node-a", 25))
    notice = threading.Event()
    fetched = []
    get_file = store.get_file

    def first_file_then_a_notice(key, local):
        get_file(key, local)
        fetched.append(key)
        notice.set()

    store.get_file = first_file_then_a_notice
    with pytest.raises(RestoreStopped, match="after 1 of 4 files"):
        download_latest(store, tmp_path / "node-b", stop=notice)
    assert len(fetched) == 1
    assert list((tmp_path / "node-b").iterdir()) == []          # no partial folder, no checkpoint
    store.get_file = get_file
    assert download_latest(store, tmp_path / "node-b", stop=threading.Event())[0] == 25   # later, in full


def test_nothing_to_resume_from_is_none(tmp_path):
    assert download_latest(Store("memory://bucket/run"), tmp_path / "resume") is None


def test_an_outage_during_resume_is_an_error_not_a_reason_to_go_back(tmp_path, monkeypatch,
                                                                      closed_port):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    stop = threading.Event()
    stop.set()  # no retries: one attempt
    with pytest.raises(StorageUnavailable):
        download_latest(Store("s3://bucket/run", stop=stop), tmp_path / "resume")


# --- against real S3 (SeaweedFS) -------------------------------------------------------------

def test_checkpoints_round_trip_through_s3(s3_env, tmp_path):
    store = Store(s3_env.url)
    local = tmp_path / "node-a"
    upload(store, make_checkpoint(local, 25), make_checkpoint(local, 50), make_checkpoint(local, 75),
           make_checkpoint(local, 100), keep=3)

    assert remote_discover(store) == [100, 75, 50]
    step, folder = download_latest(store, tmp_path / "node-b")
    assert step == 100
    assert tree(folder) == tree(local / "ckpt-00000100")


def test_a_partial_upload_in_s3_is_never_resumed_from(s3_env, tmp_path):
    store = Store(s3_env.url)
    local = tmp_path / "node-a"
    upload(store, make_checkpoint(local, 25))
    # killed mid-upload of step 50: files without a manifest
    for path, data in tree(make_checkpoint(local, 50)).items():
        if path != "manifest.json":
            store.put_bytes(f"checkpoints/ckpt-00000050/{path}", data)

    assert remote_discover(store) == [25]
    step, folder = download_latest(store, tmp_path / "node-b")
    assert step == 25
    assert tree(folder) == tree(local / "ckpt-00000025")


def test_a_corrupted_object_in_s3_is_skipped_for_the_previous_checkpoint(s3_env, tmp_path,
                                                                         caplog):
    store = Store(s3_env.url)
    local = tmp_path / "node-a"
    upload(store, make_checkpoint(local, 25), make_checkpoint(local, 50))
    key = "run/checkpoints/ckpt-00000050/adapter/adapter_model.safetensors"
    s3 = s3_env.server.client()
    data = s3.get_object(Bucket=s3_env.bucket, Key=key)["Body"].read()
    s3.put_object(Bucket=s3_env.bucket, Key=key, Body=data[: len(data) // 2])  # truncated

    with caplog.at_level(logging.WARNING):
        step, folder = download_latest(store, tmp_path / "node-b")

    assert step == 25
    assert tree(folder) == tree(local / "ckpt-00000025")
    assert any("ckpt-00000050" in r.getMessage() and "adapter_model.safetensors" in r.getMessage()
               for r in caplog.records if r.levelno == logging.WARNING)
    assert [p.name for p in (tmp_path / "node-b").iterdir()] == ["ckpt-00000025"]


def test_a_bit_flip_in_s3_is_caught_by_the_checksum(s3_env, tmp_path, caplog):
    store = Store(s3_env.url)
    local = tmp_path / "node-a"
    upload(store, make_checkpoint(local, 25), make_checkpoint(local, 50))
    key = "run/checkpoints/ckpt-00000050/optimizer.pt"
    s3 = s3_env.server.client()
    data = bytearray(s3.get_object(Bucket=s3_env.bucket, Key=key)["Body"].read())
    data[0] ^= 0x01
    s3.put_object(Bucket=s3_env.bucket, Key=key, Body=bytes(data))

    with caplog.at_level(logging.WARNING):
        step, _ = download_latest(store, tmp_path / "node-b")

    assert step == 25
    assert any("ckpt-00000050" in r.getMessage() and "sha256 mismatch" in r.getMessage()
               for r in caplog.records)


def test_a_manifest_naming_a_missing_object_is_skipped_and_named(s3_env, tmp_path, caplog):
    store = Store(s3_env.url)
    local = tmp_path / "node-a"
    upload(store, make_checkpoint(local, 25), make_checkpoint(local, 50))
    store.delete("checkpoints/ckpt-00000050/optimizer.pt")

    with caplog.at_level(logging.WARNING):
        step, _ = download_latest(store, tmp_path / "node-b")

    assert step == 25
    assert any("ckpt-00000050" in r.getMessage() and "partial" in r.getMessage()
               for r in caplog.records)


def test_an_unparseable_remote_manifest_is_skipped_and_named(s3_env, tmp_path, caplog):
    store = Store(s3_env.url)
    local = tmp_path / "node-a"
    upload(store, make_checkpoint(local, 25), make_checkpoint(local, 50))
    store.put_bytes("checkpoints/ckpt-00000050/manifest.json", b'{"step": 50, "fi')

    with caplog.at_level(logging.WARNING):
        step, _ = download_latest(store, tmp_path / "node-b")

    assert step == 25
    assert any("ckpt-00000050" in r.getMessage() and "not valid JSON" in r.getMessage()
               for r in caplog.records)


def test_an_uploader_over_a_missing_bucket_reports_the_configuration_error(s3_env, tmp_path):
    uploader = Uploader(Store("s3://no-such-bucket-here/run"))
    uploader.submit(make_checkpoint(tmp_path, 25))
    assert not uploader.wait(timeout=30)
    uploader.close()

    assert isinstance(uploader.error, StorageConfigError)
    assert "bucket does not exist" in str(uploader.error)


def test_checkpoint_imports_neither_runner_nor_trainer():
    import subprocess
    import sys

    code = ("import sys, grpo_run.checkpoint.storage.store, grpo_run.checkpoint.manifest, grpo_run.checkpoint.sync; "
            "print(sorted(m for m in sys.modules if m.split('.')[:2] in (['grpo_run', 'runner'], ['grpo_run', 'trainer'])))")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
