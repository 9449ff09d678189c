"""The environment files `apply` read (reward and task files), copied to the job's storage by the
supervisor once it holds the job's lease. Here, below the supervisor, so that it needs nothing of
the job file's modules (runner/jobs/envfiles.py hashes and fetches them; it imports this)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from grpo_run.checkpoint.storage.store import ObjectStore


def sha256_of(path: Path) -> str:
    """A file's sha256, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def upload_environment(uploads: tuple[tuple[str, str, str], ...], store: ObjectStore) -> None:
    """Copy the environment files `apply` read to the job's storage; call it holding the job's
    lease (through its FencedStore), so a job another node runs is never touched. Raises
    ValueError when a file changed since `apply` hashed it: the spec would describe other bytes."""
    for path, key, digest in uploads:
        if sha256_of(Path(path)) != digest:
            raise ValueError(f"{path} changed while the job was being applied (its sha256 is no longer "
                             f"{digest}): apply the job file again")
        store.put_file(Path(path), key)
