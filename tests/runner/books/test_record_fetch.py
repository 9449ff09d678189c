"""The record as a node fetches it from storage: a damaged copy is refused before anything opens
it for use, and the copies of this node's own record it set aside are kept only a few deep."""

from __future__ import annotations

import pytest

from grpo_run.checkpoint.storage.fsio import KEEP_SET_ASIDE
from grpo_run.checkpoint.storage.store import Store
from grpo_run.runner.books.replica import fetch_record, stored_record
from grpo_run.state.record import RECORD_FILE, Record, RecordDamaged


def storage_with_a_record(tmp_path) -> Store:
    store = Store(str(tmp_path / "store"))
    with Record(tmp_path / "uploaded.db") as rec:
        rec.init_job("job", {"model": "tiny"})
        rec.snapshot(tmp_path / "snapshot.db")
    store.put_file(tmp_path / "snapshot.db", RECORD_FILE)
    return store


def test_a_damaged_record_in_storage_is_refused_and_this_nodes_copy_left_alone(tmp_path):
    store = storage_with_a_record(tmp_path)
    store.put_bytes(RECORD_FILE, b"SQLite format 3\x00" + b"\xff" * 4000)      # a damaged upload
    work = tmp_path / "node"
    work.mkdir()
    (work / RECORD_FILE).write_bytes(b"this node's own copy")
    with pytest.raises(RecordDamaged, match=rf"the record in storage \({store.url}/state.db\) .*Put a good copy back"):
        fetch_record(store, work)
    assert (work / RECORD_FILE).read_bytes() == b"this node's own copy"
    assert sorted(p.name for p in work.iterdir()) == [RECORD_FILE]               # nothing fetched left behind
    with pytest.raises(RecordDamaged):
        with stored_record(store):
            pass


def test_a_node_whose_copy_is_set_aside_again_and_again_keeps_the_newest_few(tmp_path):
    store = storage_with_a_record(tmp_path)
    work = tmp_path / "node"
    work.mkdir()
    for i in range(6):                        # six restarts with a copy that is not storage's
        (work / RECORD_FILE).write_bytes(f"a damaged copy {i}".encode())
        assert fetch_record(store, work) == work / RECORD_FILE
    kept = sorted(work.glob(f".set-aside-{RECORD_FILE}-*"))
    assert sorted(p.read_bytes() for p in kept) == [f"a damaged copy {i}".encode() for i in range(6 - KEEP_SET_ASIDE, 6)]
