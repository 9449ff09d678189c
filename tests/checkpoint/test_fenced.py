"""A node that lost the job's lease writes nothing more into the job's folder: no checkpoint, no
prune of the new holder's checkpoints, no record. Reads still work."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_run.checkpoint.storage.fenced import FencedStore
from grpo_run.checkpoint.storage.lease import Lease, LeaseHeld, LeaseLost
from grpo_run.checkpoint.manifest import checkpoint_dir, finalize_checkpoint, staging_dir
from grpo_run.checkpoint.storage.store import Store
from grpo_run.checkpoint.sync import Uploader
from tests.checkpoint.memory_cas import use_memory_cas

URL = "memory://jobs/fenced"


@pytest.fixture(autouse=True)
def _memory_leases(monkeypatch):
    use_memory_cas(monkeypatch)


class Clock:
    """The node's own clock (seconds; only differences count), moved by the test."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def seal(root: Path, step: int) -> Path:
    """A checkpoint as the trainer seals it."""
    staging = staging_dir(root, step)
    (staging / "adapter").mkdir(parents=True)
    (staging / "adapter" / "adapter_model.safetensors").write_bytes(f"step {step}".encode() * 100)
    finalize_checkpoint(staging, checkpoint_dir(root, step), step=step)
    return checkpoint_dir(root, step)


def stored(url: str) -> dict[str, bytes]:
    store = Store(url)
    return {key: store.get_bytes(key) for key in store.list("")}


def test_a_holder_whose_lease_was_taken_over_uploads_no_further_checkpoint(tmp_path):
    clock = Clock()
    lease = Lease(URL, holder="node-a", clock=clock)
    lease.acquire()
    with Uploader(FencedStore(Store(URL), lease), "checkpoints", keep=2) as uploads:
        uploads.submit(seal(tmp_path, 1))
        assert uploads.wait()

        node_b = Lease(URL, holder="node-b", clock=clock)
        with pytest.raises(LeaseHeld):
            node_b.acquire()                               # node-b sees node-a's lease...
        clock.now += 61                                    # ...node-a froze past its expiry...
        node_b.acquire()                                   # ...and node-b took the job over
        with pytest.raises(LeaseLost):
            lease.renew()                                  # what node-a's renewal finds on waking
        before = stored(URL)
        uploads.submit(seal(tmp_path, 2))
        uploads.submit(seal(tmp_path, 3))                  # with keep=2 it would prune ckpt 1
        assert not uploads.wait()

    assert isinstance(uploads.error, LeaseLost)
    assert stored(URL) == before                           # byte for byte: nothing written or deleted
    assert [k for k in before if k.startswith("checkpoints/")] == [
        "checkpoints/ckpt-00000001/adapter/adapter_model.safetensors",
        "checkpoints/ckpt-00000001/manifest.json"]


def test_a_holder_that_could_not_renew_in_time_stops_writing_and_can_still_read():
    clock = Clock()
    lease = Lease(URL, holder="node-a", clock=clock, ttl_s=60, renew_every_s=20)
    lease.acquire()
    store = FencedStore(Store(URL), lease)
    store.put_bytes("state.db", b"record before")

    clock.now = lease.expires_at - 10                      # renewals failed until the safety margin
    with pytest.raises(LeaseLost, match="no longer held by node-a"):
        store.put_bytes("state.db", b"record after")
    with pytest.raises(LeaseLost):
        store.delete("state.db")

    assert Store(URL).get_bytes("state.db") == b"record before"
    assert store.get_bytes("state.db") == b"record before"  # restoring harms no one


def test_a_released_lease_allows_no_more_writes(tmp_path):
    with Lease(URL, holder="node-a") as lease:
        store = FencedStore(Store(URL), lease)
        store.put_file(seal(tmp_path, 1) / "manifest.json", "manifest.json")
    with pytest.raises(LeaseLost):
        store.put_bytes("late.json", b"{}")
    assert Store(URL).list("") == ["manifest.json"]


def test_both_stores_implement_the_whole_object_store_interface_explicitly():
    """No forwarding by __getattr__: what FencedStore does with each call is written down, and a
    method added to the interface must be added to both (ABC: neither could be built otherwise)."""
    from grpo_run.checkpoint.storage.fenced import FencedStore
    from grpo_run.checkpoint.storage.store import ObjectStore, Store

    assert issubclass(Store, ObjectStore) and issubclass(FencedStore, ObjectStore)
    assert not Store.__abstractmethods__ and not FencedStore.__abstractmethods__
    assert "__getattr__" not in vars(FencedStore)
    assert set(ObjectStore.__abstractmethods__) <= set(vars(FencedStore))
