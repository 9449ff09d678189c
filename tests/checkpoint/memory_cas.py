"""memory:// leases for unit tests: a compare-and-swap double under one process-wide lock.

grpo_run has no compare-and-swap for memory:// (checkpoint/storage/cas.py refuses it, as it
refuses gs://). `use_memory_cas(monkeypatch)` lets one test take leases on memory:// URLs:
`open_cas`, where the cas and lease modules look it up, hands out a MemoryCas for those and the
real backends for everything else."""

from __future__ import annotations

import threading
from typing import Any

import pytest

import grpo_run.checkpoint.storage.by_url as by_url_module
import grpo_run.checkpoint.storage.lease as lease_module
from grpo_run.checkpoint.storage.cas import Cas, Conflict, Found
from grpo_run.checkpoint.storage.store import Store

_LOCK = threading.Lock()


class MemoryCas:
    """One object of a memory:// store: every compare-and-swap under one lock for the process.
    It keeps no clock, so a read reports no age (as an S3 server that sent no dates would): a
    lease on it is judged on the taker's own clock alone."""

    def __init__(self, store: Store, key: str) -> None:
        store.fs_path(key)  # the key's validation, as for the real backends
        self.store, self.key = store, key

    def read(self) -> Found | None:
        with _LOCK:
            try:
                data = self.store.get_bytes(self.key)
            except FileNotFoundError:
                return None
            return Found(data, data, None)

    def create(self, data: bytes) -> Any:
        with _LOCK:
            if self.store.exists(self.key):
                raise Conflict()
            self.store.put_bytes(self.key, data)
            return data

    def replace(self, data: bytes, version: Any) -> Any:
        with _LOCK:
            if not self.store.exists(self.key) or self.store.get_bytes(self.key) != version:
                raise Conflict()
            self.store.put_bytes(self.key, data)
            return data

    def delete(self, version: Any) -> None:
        with _LOCK:
            if not self.store.exists(self.key):
                return
            if self.store.get_bytes(self.key) != version:
                raise Conflict()
            self.store.delete(self.key)


def use_memory_cas(monkeypatch: pytest.MonkeyPatch) -> None:
    """For the rest of this test, leases (and open_cas) on memory:// URLs use a MemoryCas."""
    real = by_url_module.open_cas

    def open_cas(url: str, key: str) -> Cas:
        if isinstance(url, str) and url.lower().startswith("memory://"):
            return MemoryCas(Store(url), key)
        return real(url, key)

    monkeypatch.setattr(by_url_module, "open_cas", open_cas)
    monkeypatch.setattr(lease_module, "open_cas", open_cas)
