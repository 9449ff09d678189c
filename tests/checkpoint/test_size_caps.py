"""Files from storage that are read whole are read only up to a size cap: whoever can write the
bucket could plant a manifest.json of gigabytes, and a node must not hold it in memory to find out."""

from __future__ import annotations

import logging
import tracemalloc

import pytest

from grpo_run.checkpoint.manifest import MAX_MANIFEST_BYTES, checkpoint_name
from grpo_run.checkpoint.storage.store import ObjectTooLarge, Store
from grpo_run.checkpoint.sync import download_latest

PLANTED = 256 << 20      # sparse: no disk, but 256 MiB of memory to whoever reads it whole


def plant(store: Store, key: str, size: int) -> None:
    path = store._path(key)
    store.put_bytes(key, b"{")
    with open(path, "r+b") as f:
        f.truncate(size)


def peak_bytes(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_an_object_past_max_bytes_is_refused_having_read_no_more_than_that(tmp_path):
    store = Store(str(tmp_path / "store"))
    plant(store, "big", PLANTED)
    store.put_bytes("small", b"12345")
    assert store.get_bytes("small", max_bytes=5) == b"12345"

    def read():
        with pytest.raises(ObjectTooLarge, match="big is larger than 1,048,576 bytes"):
            store.get_bytes("big", max_bytes=1 << 20)

    assert peak_bytes(read) < 4 << 20


def test_a_planted_huge_manifest_is_skipped_saying_so_and_never_read_whole(tmp_path, caplog):
    store = Store(str(tmp_path / "store"))
    plant(store, f"checkpoints/{checkpoint_name(2)}/manifest.json", PLANTED)
    found = []
    with caplog.at_level(logging.WARNING):
        peak = peak_bytes(lambda: found.append(download_latest(store, tmp_path / "ckpts")))
    assert found == [None]
    assert f"manifest.json is larger than {MAX_MANIFEST_BYTES:,} bytes" in caplog.text
    assert peak < MAX_MANIFEST_BYTES + (8 << 20)


def test_every_store_refuses_an_object_past_max_bytes_and_reads_one_within_it(store_env):
    from grpo_run.checkpoint.storage.by_url import open_store

    store = open_store(store_env.url)
    store.put_bytes("big", b"x" * 4096)
    store.put_bytes("empty", b"")
    with pytest.raises(ObjectTooLarge):
        store.get_bytes("big", max_bytes=4095)
    assert store.get_bytes("big", max_bytes=4096) == b"x" * 4096
    assert store.get_bytes("empty", max_bytes=10) == b""
    with pytest.raises(FileNotFoundError):
        store.get_bytes("absent", max_bytes=10)
