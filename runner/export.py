"""`grpo-run export`: the final (or newest durable) weights out of object storage."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from grpo_run.checkpoint.storage.store import Store
from grpo_run.checkpoint.sync import download_latest


def export_weights(job_url: str, out: Path) -> str:
    """Write the job's adapter (PEFT files) or full model into `out`; says which it wrote.

    Raises LookupError when the job has neither final weights nor a durable checkpoint."""
    store = Store(job_url)
    with tempfile.TemporaryDirectory(prefix="grpo-run-export.") as tmp:
        tmp = Path(tmp)
        got = download_latest(store, tmp / "final", "final")
        what = "the final weights"
        if got is not None:
            folder = got[1]
        else:
            got = download_latest(store, tmp / "checkpoints", "checkpoints")
            if got is None:
                raise LookupError(f"no final weights and no durable checkpoint at {job_url}")
            step, folder = got
            what = f"the checkpoint at step {step} (the job has not finished)"
        src = folder / "adapter" if (folder / "adapter").exists() else folder / "model"
        out.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            shutil.copy2(f, out / f.name)
    return what
