"""What the dashboard's pages show, read from the jobs' records in storage with the books the CLI
uses (runner.books.replica.stored_record, runner.views.status.job_document, runner.views.report.gather) and
never written to: storage is only listed and read.

A page left open polls; what it costs storage is bounded here, not by the number of pages: each
job's record is downloaded at most once per `fresh_s` while it runs (once per `settled_s` when it
has ended), the listing likewise, and every open page shares that read. A read that fails (storage
unreachable, a record that does not check out, such as one caught mid-upload) keeps the last good
state and says in one line what went wrong; it never raises into the web app.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from grpo_run.runner.home import job_store_url, work_dir
from grpo_run.runner.text import printable
from grpo_run.state.phases import TERMINAL

FRESH_S = 5.0             # a running job's record, and the listing, are read at most this often
SETTLED_S = 60.0          # an ended job's record (it changes only if it is resumed or deleted)
RETRY_S = 10.0            # a storage read gives up after this long (the page says why, and tries again later)
LOG_TAIL_BYTES = 32_000   # the end of the trainer's log a job's page shows
TERMINAL_PHASES = {str(p) for p in TERMINAL}


@dataclass
class _Cached:
    """One read's result, kept until it is stale: the last good value and the last error."""
    value: Any = None
    error: str | None = None
    read_at: float = float("-inf")
    version: int = 0                       # bumped when the value changes: the page's ETag
    lock: threading.Lock = field(default_factory=threading.Lock)


class Bucket:
    """The jobs under one storage URL, as the pages show them. Owns the cache of their records'
    reads; safe to call from several threads (each entry is refreshed by one thread at a time)."""

    def __init__(self, storage: str, *, fresh_s: float = FRESH_S, settled_s: float = SETTLED_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.storage = storage
        self.fresh_s, self.settled_s, self.clock = fresh_s, settled_s, clock
        self._listing = _Cached()
        self._jobs: dict[str, _Cached] = {}
        self._guard = threading.Lock()
        self.reads = 0                     # storage reads made (records and listings): the tests' meter

    # --- the two pages' data ---------------------------------------------------------------------

    def jobs(self) -> tuple[dict[str, Any], int]:
        """({"storage", "jobs": [row, ...], "error"}, version): one row per job (list_row)."""
        names = self._read(self._listing, self.fresh_s, self._list_names)
        rows, errors, version = [], [], self._listing.version
        if self._listing.error:
            errors.append(self._listing.error)
        for name in names or []:
            entry = self._job_entry(name)
            self._refresh_job(name, entry)
            version += entry.version
            if entry.value is not None:
                rows.append(entry.value["row"])
            elif entry.error:
                rows.append({"name": printable(name), "phase": "?", "error": entry.error})
        return {"storage": self.storage, "jobs": rows, "error": "; ".join(errors) or None}, version

    def job(self, name: str) -> tuple[dict[str, Any] | None, int]:
        """(one job's page data: {"row", "doc", "attempts", "steps", ...; "error"}, version); None
        when storage has never been seen to hold it."""
        names = self._read(self._listing, self.fresh_s, self._list_names) or []
        with self._guard:
            seen = name in self._jobs
        if name not in names and not seen:    # only jobs storage holds: a made-up name costs no read
            return None, 0
        entry = self._job_entry(name)
        self._refresh_job(name, entry)
        page = dict(entry.value or {"row": {"name": printable(name), "phase": "?"}})
        page["error"] = entry.error
        page["log"] = _log_tail(name)       # this machine's, read each time: it is local
        return page, entry.version

    # --- reading, cached --------------------------------------------------------------------------

    def _job_entry(self, name: str) -> _Cached:
        with self._guard:
            return self._jobs.setdefault(name, _Cached())

    def _refresh_job(self, name: str, entry: _Cached) -> None:
        settled = entry.value is not None and entry.value["row"]["phase"] in TERMINAL_PHASES
        self._read(entry, self.settled_s if settled else self.fresh_s, lambda: self._read_job(name))

    def _read(self, entry: _Cached, max_age: float, read: Callable[[], Any]) -> Any:
        with entry.lock:                   # one read at a time per entry; the others wait and share it
            if self.clock() - entry.read_at >= max_age:
                entry.read_at = self.clock()
                self.reads += 1
                try:
                    value = read()
                except Exception as e:     # noqa: BLE001 -- the page shows one line, never a traceback
                    entry.error = _one_line(e)
                else:
                    entry.error = None
                    if value != entry.value:
                        entry.value, entry.version = value, entry.version + 1
            return entry.value

    def _list_names(self) -> list[str]:
        from grpo_run.checkpoint.storage.by_url import open_store
        from grpo_run.state.record import RECORD_FILE

        # as runner.jobs.find.jobs_in, with a shorter retry: the page says why, and asks again later
        keys = open_store(self.storage, retry_seconds=RETRY_S).list("")
        return sorted({k.split("/")[0] for k in keys if k.endswith(f"/{RECORD_FILE}") and k.count("/") == 1})

    def _read_job(self, name: str) -> dict[str, Any]:
        from grpo_run.checkpoint.storage.by_url import open_store
        from grpo_run.runner.books.replica import stored_record
        from grpo_run.runner.spec.job import name_problem

        trouble = name_problem(name)             # a folder no job can be named: nothing of it is read
        if trouble:
            raise ValueError(f"{self.storage} holds a folder {name!r} that is no job's name: {trouble}")
        store = open_store(job_store_url(self.storage, name), retry_seconds=RETRY_S)
        with stored_record(store) as record:      # a scratch copy: storage is only read
            if record is None:
                raise LookupError(f"{name}: its record is gone from storage (deleted?)")
            return job_page(record)


def job_page(record) -> dict[str, Any]:
    """Everything a job's page shows, from its record (the list's row among it)."""
    from grpo_run.runner.views.status import job_document
    from grpo_run.runner.views.completions import NoSamples, eval_tasks, rows, step_groups
    from grpo_run.runner.views.live import view
    from grpo_run.runner.views.report import boundaries, gather

    doc = job_document(record)                 # LookupError while the record is being created: the last good state stays
    run = gather(record)
    status, spec = doc["status"], doc["spec"]
    samples = {}
    for kind, pick in (("step", lambda: step_groups(record, last=1)), ("final", lambda: eval_tasks(record, "final")),
                       ("baseline", lambda: eval_tasks(record, "baseline"))):
        try:
            samples[kind] = rows(pick(), kind)
        except NoSamples:
            continue
    return {"row": list_row(doc), "status": status, "spec": _public_spec(spec),
            "attempts": timeline(run["attempts"]), "steps": _series(run["steps"]),
            "heldOut": [{"step": e["step"], "meanReward": e["meanReward"]} for e in run["heldOut"] or []],
            "boundaries": [{k: b[k] for k in ("attempt", "step", "label", "redone")} for b in boundaries(run["attempts"])],
            "spend": _spend(status, spec, view(record)), "samples": samples}


def list_row(doc: dict[str, Any]) -> dict[str, Any]:
    """The jobs list's row: name, phase, step of maxSteps, spend against maxCostUSD, held-out
    baseline -> final, the sampler's engine, the nodes its attempts ran on (newest last)."""
    status, spec = doc["status"], doc["spec"]
    nodes: list[str] = []
    for a in status["attempts"]:
        if a.get("node") and a["node"] not in nodes:
            nodes.append(a["node"])
    return {"name": doc["metadata"]["name"], "phase": status["phase"], "step": status["step"],
            "maxSteps": spec["parameters"].get("maxSteps"),
            # the ledger's spend; while the first attempt runs (nothing in the ledger yet), its newest step's
            "costUSD": status.get("costUSD", (status.get("lastStep") or {}).get("costUSD")),
            "maxCostUSD": spec.get("maxCostUSD"),
            "baseline": (status.get("baseline") or {}).get("meanReward"),
            "final": (status.get("final") or {}).get("meanReward"),
            "engine": (status.get("sampler") or {}).get("engine"), "nodes": nodes,
            "attempts": len(status["attempts"]), "message": status.get("message") or ""}


def timeline(attempts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each attempt: where it ran, from which step to which, how it ended, and the time lost
    before the next one began (seconds from its end to the next start: no node was training)."""
    from datetime import datetime

    out = []
    for i, a in enumerate(attempts):
        nxt = attempts[i + 1] if i + 1 < len(attempts) else None
        lost = None
        if a["ended"] and nxt is not None:
            lost = max(0.0, (datetime.fromisoformat(nxt["started"]) - datetime.fromisoformat(a["ended"])).total_seconds())
        out.append({"id": a["id"], "node": a["node"], "started": a["started"], "ended": a["ended"],
                    "reason": a["reason"] or ("running" if a["ended"] is None else None), "notice": a.get("notice"),
                    "message": a.get("message") or "", "fromStep": a["from_step"], "toStep": a["to_step"],
                    "lostSeconds": lost})
    return out


# the charts' series: the report's panels plus the log-prob mismatch (an engine's sampler vs the update)
SERIES = ("rewardMean", "solvedGroups", "noSignalGroups", "identicalGroups", "completionLength",
          "truncatedFraction", "tokenEntropy", "gradNorm", "kl", "clipRatio", "logprobMismatch",
          "episodeTurns", "toolErrorRate", "costUSD")


def _series(steps: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Columns for the charts: "step" and each SERIES key that some step recorded (None where one did not)."""
    cols: dict[str, list[Any]] = {"step": [s["step"] for s in steps]}
    for key in SERIES:
        col = [s.get(key) if isinstance(s.get(key), (int, float)) else None for s in steps]
        if any(v is not None for v in col):
            cols[key] = col
    return cols


def _spend(status: dict[str, Any], spec: dict[str, Any], lines: list[str]) -> dict[str, Any]:
    """What was spent beside the cap, the live view's projection (its last lines: the spend) and
    what `apply` estimated before anything was spent (status.estimate, as recorded)."""
    said = [line.strip() for line in lines if line.strip().startswith("spend")]
    return {"costUSD": status.get("costUSD"), "maxCostUSD": spec.get("maxCostUSD"),
            "projection": said[0] if said else None, "estimate": status.get("estimate")}


def _public_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """The few fields the page shows; never the environment or tracking sections (they may name
    secrets' variables or endpoints)."""
    params = spec.get("parameters", {})
    return {"model": spec.get("model"), "gpu": spec.get("gpu"),
            "parameters": {k: params.get(k) for k in ("method", "maxSteps", "numGenerations", "learningRate",
                                                      "beta", "temperature") if k in params}}


def _log_tail(name: str) -> dict[str, str] | None:
    """The end of the trainer's log when the job ran on this machine (logs stay on their node)."""
    path = work_dir(name) / "logs" / "trainer.log"
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - LOG_TAIL_BYTES))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    return {"node": socket.gethostname(), "text": text.split("\n", 1)[-1] if len(text) >= LOG_TAIL_BYTES else text}


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return printable(text[:300])
