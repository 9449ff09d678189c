"""Writes to a job's folder only while this node holds the job's lease.

A holder can lose its lease without stopping at once: a VM frozen past its expiry wakes up still
training, or renewals fail until the self-fencing margin is used up. Another node may own the
job by then, and a checkpoint, a record or a prune from the stale holder would overwrite or
delete what the new holder wrote. So every write checks `Lease.held` right before it starts:

    store = FencedStore(open_store(url), lease)
    Uploader(store, "checkpoints")           # each file, the manifest, each prune: fenced
    store.put_file(snapshot, "state.db")     # LeaseLost once the lease is lost

Reads pass through unchanged (restoring a checkpoint harms no one). The check cannot stop a
single write already under way, and it knows of a takeover only once a renewal has found it
(`Lease.held`: at most `renew_every_s` later for a holder that was frozen).
"""

from __future__ import annotations

from pathlib import Path

from .lease import Lease, LeaseLost
from .store import ObjectStore


class FencedStore(ObjectStore):
    """A Store whose put_file, put_bytes and delete raise LeaseLost, writing nothing, once
    `lease` is no longer held. Reads, `url`, `protocol` and the deadline are the wrapped Store's."""

    def __init__(self, store: ObjectStore, lease: Lease) -> None:
        self.store = store
        self.lease = lease
        self.url = store.url
        self.protocol = store.protocol

    def __repr__(self) -> str:
        return f"FencedStore({self.store!r}, {self.lease!r})"

    # reads: unchanged (restoring a checkpoint harms no one)

    def get_file(self, key: str, local: Path) -> None:
        self.store.get_file(key, local)

    def get_bytes(self, key: str, max_bytes: int | None = None) -> bytes:
        return self.store.get_bytes(key, max_bytes)

    def exists(self, key: str) -> bool:
        return self.store.exists(key)

    def list(self, prefix: str = "") -> list[str]:
        return self.store.list(prefix)

    def check(self) -> None:
        self.store.check()

    def finish_by(self, deadline: float | None) -> None:
        self.store.finish_by(deadline)

    # writes: fenced

    def put_file(self, local: Path, key: str) -> None:
        self._check(f"upload of {key}")
        self.store.put_file(local, key)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._check(f"upload of {key}")
        self.store.put_bytes(key, data)

    def delete(self, prefix_or_key: str) -> None:
        self._check(f"delete of {prefix_or_key}")
        self.store.delete(prefix_or_key)

    def _check(self, what: str) -> None:
        if not self.lease.held:
            raise LeaseLost(f"lease on {self.lease.url} is no longer held by {self.lease.holder} "
                            f"(taken over, or not renewed in time): the {what} was refused so "
                            f"that a stale holder writes nothing into the job's folder")
