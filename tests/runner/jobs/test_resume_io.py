"""What a resume on an empty node asks of object storage, counted: the record is downloaded
once, each file of the checkpoint it continues from once, the environment's files are not sent
back, and no checkpoint is hashed twice (the supervisor verifies what it downloads, once; the
trainer trusts that manifest)."""

from __future__ import annotations

import collections
import signal
from pathlib import Path

import pytest

from tests.runner.jobs.test_resume import STEPS, grpo_run, write_job


@pytest.fixture
def counted(monkeypatch):
    """Every Store call and every file hash in this process, by (operation, key or path)."""
    import grpo_run.checkpoint.manifest as manifest
    from grpo_run.checkpoint.storage.store import Store

    calls: collections.Counter = collections.Counter()
    for op in ("get_file", "get_bytes", "put_file", "put_bytes"):
        original = getattr(Store, op)

        def wrapped(self, *args, _op=op, _original=original, **kwargs):
            key = args[1] if _op == "put_file" else args[0]
            calls[(_op, key)] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(Store, op, wrapped)
    check = Store.check

    def counted_check(self):
        calls[("check", "")] += 1
        return check(self)

    monkeypatch.setattr(Store, "check", counted_check)
    hash_file = manifest._hash_file

    def counted_hash(path, **kwargs):
        calls[("hash", str(path))] += 1
        return hash_file(path, **kwargs)

    monkeypatch.setattr(manifest, "_hash_file", counted_hash)
    return calls


def test_a_resume_on_an_empty_node_fetches_the_record_and_each_checkpoint_file_once(
        tmp_path, monkeypatch, counted):
    from grpo_run.runner.cli.commands import main

    storage = str(tmp_path / "store")
    killed = grpo_run(tmp_path / "node-a", "apply", "-f", str(write_job(tmp_path, storage)), fault="upload@4",
                      check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    for name in ("job.yaml", "length.py", "train.jsonl", "eval.jsonl"):   # a fresh node has none of them
        (tmp_path / name).unlink()

    monkeypatch.setenv("GRPO_RUN_HOME", str(tmp_path / "node-b"))
    monkeypatch.setenv("GRPO_RUN_NOTICES", "none")
    assert main(["resume", "resumable", "--storage", storage]) == 0

    downloads = {key: n for (op, key), n in counted.items() if op in ("get_file", "get_bytes")}
    ckpt_files = {key: n for key, n in downloads.items() if key.startswith("checkpoints/") and
                  not key.endswith("manifest.json")}
    print("\ndownloads:", dict(sorted(downloads.items())))
    # the record: found (1), checked for "already succeeded" (1), fetched under the lease (1), and
    # read before each upload to compare generations (one per upload): never more
    uploads = sum(n for (op, key), n in counted.items() if op.startswith("put") and key == "state.db")
    assert 3 <= downloads["state.db"] <= 3 + uploads, (downloads["state.db"], uploads)
    assert ckpt_files and set(ckpt_files.values()) == {1}          # each checkpoint file, once
    assert counted[("check", "")] == 1
    env_files = [key for key in downloads if key.startswith("environment/")]
    assert len(env_files) == 3 and {downloads[k] for k in env_files} == {1}
    assert not [key for (op, key) in counted if op.startswith("put") and key.startswith("environment/")]

    restored = {Path(key).parts[2] for key in ckpt_files}          # checkpoints/<run id>/ckpt-N/...
    assert len(restored) == 1                                       # one checkpoint, the newest durable
    name = restored.pop()
    hashed = collections.Counter({path: n for (op, path), n in counted.items() if op == "hash"})
    restored_hashes = {p: n for p, n in hashed.items() if f"/{name}/" in p or f".partial-{name}" in p}
    assert restored_hashes and set(restored_hashes.values()) == {1}, restored_hashes
    assert max(hashed.values()) == 1, hashed.most_common(3)        # nothing hashed twice in the supervisor

    from grpo_run.state.record import Record

    with Record(tmp_path / "node-b" / "runs" / "resumable" / "state.db") as record:
        assert record.job()["phase"] == "Succeeded" and record.steps()[-1]["step"] == STEPS


def test_the_trainer_loads_its_checkpoint_without_hashing_it(tmp_path, monkeypatch):
    import grpo_run.checkpoint.manifest as manifest
    from grpo_run.checkpoint.manifest import finalize_checkpoint, newest_sealed, staging_dir

    staging = staging_dir(tmp_path, 4)
    staging.mkdir()
    (staging / "weights.bin").write_bytes(b"x" * 1000)
    finalize_checkpoint(staging, tmp_path / "ckpt-00000004", step=4)

    def no_hashing(path, **kwargs):
        raise AssertionError(f"{path} hashed again")

    monkeypatch.setattr(manifest, "_hash_file", no_hashing)
    step, folder, _ = newest_sealed(tmp_path)
    assert step == 4 and folder.name == "ckpt-00000004"
    (folder / "weights.bin").write_bytes(b"x" * 999)               # a size that disagrees is still caught
    assert newest_sealed(tmp_path) is None
