"""The cancel request: the object `grpo-run cancel` leaves in a job's storage folder, and that the
supervisor looks for at the moments it talks to storage (runner/jobs/cancel.py cancels; this module
is what both share, below the supervisor so that it needs nothing of the commands)."""

from __future__ import annotations

import json
import time
from typing import Any

from grpo_run.checkpoint.storage.store import ObjectStore

CANCEL_KEY = "cancel.json"      # in the job's storage folder: {"by": "cancel@HOST", "at": ISO time}


def request_cancel(store: ObjectStore, by: str) -> None:
    """Leave the cancel request in the job's folder (replacing an earlier one)."""
    body = {"by": by, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    store.put_bytes(CANCEL_KEY, (json.dumps(body) + "\n").encode())


def cancel_requested(store: ObjectStore) -> dict[str, Any] | None:
    """The job's cancel request, or None. A request whose body is unreadable still counts (someone
    who can write the folder asked), named by who wrote it as unknown. Raises StorageConfigError /
    StorageUnavailable as the store does."""
    try:
        data = store.get_bytes(CANCEL_KEY)
    except FileNotFoundError:
        return None
    try:
        body = json.loads(data)
    except ValueError:
        body = None
    return body if isinstance(body, dict) else {"by": "unknown"}
