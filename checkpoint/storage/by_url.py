"""A storage URL to what serves it: `open_store(url)` for a job's folder, `open_cas(url, key)` for
the lease's compare-and-swap object. The one place that knows every scheme's module (store for
s3:// and local folders, gcs, azure, cas), so that none of them imports another's."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .cas import Cas, LocalCas, S3Cas
from .retry import StorageConfigError
from .store import SUPPORTED_URLS, RetriedStore, Store


def _scheme(url: str) -> str:
    return urlsplit(url).scheme.lower() if isinstance(url, str) and "://" in url else ""


def open_store(url: str, *, stop: threading.Event | None = None, retry_seconds: float = 60.0,
               sleep: Callable[[float], None] = time.sleep) -> RetriedStore:
    """The store for a storage URL (checkpoint.storage.store lists them). StorageConfigError for a
    bad URL, an unsupported scheme, or a store whose client library is not installed (naming the
    extra)."""
    kwargs: dict[str, Any] = dict(stop=stop, retry_seconds=retry_seconds, sleep=sleep)
    scheme = _scheme(url)
    if scheme in ("gs", "gcs"):
        from .gcs import GcsStore
        return GcsStore(url, **kwargs)
    if scheme == "az":
        from .azure import AzureStore
        return AzureStore(url, **kwargs)
    return Store(url, **kwargs)


def open_cas(url: str, key: str) -> Cas:
    """The compare-and-swap object `key` under the storage URL. StorageConfigError for a bad or
    unsupported URL, ValueError for a key that is not a relative path."""
    scheme = _scheme(url)
    if scheme in ("gs", "gcs"):
        from .gcs import GcsCas
        return GcsCas(url, key)
    if scheme == "az":
        from .azure import AzureCas
        return AzureCas(url, key)
    store = Store(url)  # validates the URL: StorageConfigError for a bad or unsupported one
    if store.protocol == "s3":
        return S3Cas(store, key)
    if store.protocol == "file":
        return LocalCas(Path(store.fs_path(key)[1]))
    raise StorageConfigError(f"lease on {url}: {store.protocol}:// has no compare-and-swap here; "
                             f"keep the job on {SUPPORTED_URLS}")
