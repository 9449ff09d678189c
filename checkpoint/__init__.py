"""Checkpoints: sealed local folders with a checksummed manifest, synced to object storage.

`manifest` seals, verifies, discovers and prunes local checkpoints; `store` is object storage
with stoppable retries; `sync` uploads in the background and downloads the newest durable one.
Imports neither `runner` nor `trainer`.
"""

from .manifest import (
    MANIFEST_NAME,
    CheckpointInvalid,
    Manifest,
    ManifestFile,
    checkpoint_dir,
    discover,
    finalize_checkpoint,
    prune,
    read_manifest,
    staging_dir,
    step_of,
    verify,
)
from .store import Store, StorageConfigError, StorageUnavailable
from .sync import Uploader, download_latest, remote_discover

__all__ = [
    "MANIFEST_NAME", "CheckpointInvalid", "Manifest", "ManifestFile", "checkpoint_dir", "discover",
    "finalize_checkpoint", "prune", "read_manifest", "staging_dir", "step_of", "verify",
    "Store", "StorageConfigError", "StorageUnavailable",
    "Uploader", "download_latest", "remote_discover",
]
