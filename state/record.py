"""The run's record: one SQLite file per job, through sqlite-utils.

What the job is, which phase it is in (and every transition, with why), each attempt on a node
and how it ended, metrics per step, the baseline and final evaluations (with how many times each
was actually computed), checkpoints and their durability, and small JSON values for diagnostics
and cost. The file is snapshotted next to the checkpoints so a fresh node can rebuild the run.

Rules:
* every write is one transaction (BEGIN IMMEDIATE ... COMMIT): a kill leaves the old or the new
  state, never half of each;
* the schema changes only by appending to MIGRATIONS; a `migrations` table records which ran,
  and an applied migration is never edited;
* timestamps are ISO-8601 UTC strings; credentials are refused, never stored.
"""

from __future__ import annotations

import enum
import json
import os
import re
import sqlite3
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

# sqlite-utils imports pandas when it is installed (datasets brings it), only to give pandas'
# Timestamp a column type; the record stores str, int and float alone. Hidden during that import it
# costs nothing, instead of ~0.35 s of every CLI command and supervisor start; pandas stays
# importable for whoever needs it (the trainer's datasets).
if "pandas" in sys.modules:
    import sqlite_utils
else:
    sys.modules["pandas"] = None        # type: ignore[assignment]  # import pandas -> ImportError
    try:
        import sqlite_utils
    finally:
        del sys.modules["pandas"]

from grpo_run.checkpoint.storage.fsio import fsync_dir, fsync_file
from grpo_run.checkpoint.storage.retry import StorageConfigError
from grpo_run.state.migrations import MIGRATIONS
from grpo_run.state.phases import ALLOWED_TRANSITIONS, AttemptEnd, InvalidTransition, Phase

RECORD_FILE = "state.db"     # the record's name, in a job's work folder and in its storage folder


EVAL_KINDS = ("baseline", "final")
BUSY_TIMEOUT_S = 30.0        # how long a connection waits for another's lock before it fails


def _wal(conn: sqlite3.Connection) -> None:
    """Switch the record to write-ahead logging (kept in the file: a no-op once done). Two
    processes opening a new record at once (the supervisor creating it, `grpo-run get` reading
    it) can each hold the read lock the switch must upgrade: SQLite then answers one of them
    "database is locked" at once, without waiting (no busy handler can break a deadlock), so
    that one lets go and asks again, for up to BUSY_TIMEOUT_S."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)

class RecordDamaged(StorageConfigError):
    """A record fetched from storage that is not a whole, plain record (`check_fetched`): never
    used. A StorageConfigError: a person must put a good copy back, and no retry helps."""


def _untrusting(conn: sqlite3.Connection) -> sqlite3.Connection:
    # A record can come from storage, which others may write: its schema's views and triggers
    # (grpo-run writes none) may call no function with side effects.
    conn.execute("PRAGMA trusted_schema=OFF")
    return conn


def check_fetched(path: str | Path, where: str) -> None:
    """Before a record fetched from storage (`where`: its key, as a person finds it) is opened for
    use: it must pass SQLite's quick_check and hold no trigger or view (the record has none;
    one would run on our writes). RecordDamaged, naming what is wrong and the fix, otherwise."""
    fix = (f"; it is not used. Put a good copy back as {where} (every node that ran the job keeps "
           f"one as {RECORD_FILE} in its work folder)")
    try:
        conn = _untrusting(sqlite3.connect(str(path)))
        try:
            problems = [row[0] for row in conn.execute("PRAGMA quick_check(5)")]
            planted = [f"{kind} {name}" for kind, name in conn.execute(
                "SELECT type, name FROM sqlite_master WHERE type IN ('trigger', 'view') ORDER BY name")]
        finally:
            conn.close()
    except sqlite3.DatabaseError as e:
        raise RecordDamaged(f"the record in storage ({where}) cannot be read as a record (SQLite: {e}){fix}") from None
    if problems != ["ok"]:
        found = "; ".join(" ".join(str(p).replace("*** in database main ***", "").split()) for p in problems)
        raise RecordDamaged(f"the record in storage ({where}) is damaged (SQLite's quick_check: {found}){fix}")
    if planted:
        raise RecordDamaged(f"the record in storage ({where}) holds what grpo-run never writes "
                            f"({', '.join(planted)}){fix}")


class Record:
    """Owns one SQLite connection to the run's record; safe to share between threads."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._in_transaction = False     # guarded by _lock
        conn = _untrusting(sqlite3.connect(str(self.path), check_same_thread=False, timeout=BUSY_TIMEOUT_S))
        _wal(conn)                                # readers (grpo-run get) never block the writer
        conn.execute("PRAGMA synchronous=FULL")   # a committed transition survives power loss
        self._conn = conn
        self.db = sqlite_utils.Database(conn)
        self._migrate()

    # --- the job and its phase -----------------------------------------------------------------

    def init_job(self, name: str, spec: dict) -> None:
        """Record the job. Idempotent for the same name (the stored spec is kept); another
        name raises ValueError: one record per job. Credentials in the spec raise ValueError."""
        if not name:
            raise ValueError("job name must not be empty")
        _refuse_credentials(spec, "spec")
        with self._write():
            row = self._job_row()
            if row is not None:
                if row["name"] != name:
                    raise ValueError(f"this record belongs to job {row['name']!r}, "
                                     f"not {name!r}")
                return
            now = utc_now()
            self.db["job"].insert({"id": 1, "name": name, "spec": _dumps(spec),
                                   "phase": Phase.PENDING.value, "message": "",
                                   "created": now, "updated": now})
            self.db["transitions"].insert({"at": now, "from_phase": None,
                                           "to_phase": Phase.PENDING.value, "message": ""})

    def set_spec(self, spec: dict) -> None:
        """Replace the stored spec (`grpo-run apply` of a changed job file). RuntimeError before
        init_job; credentials in the spec raise ValueError."""
        _refuse_credentials(spec, "spec")
        with self._write():
            if self._job_row() is None:
                raise RuntimeError("set_spec before init_job")
            self.db["job"].update(1, {"spec": _dumps(spec), "updated": utc_now()})

    def job(self) -> dict | None:
        """{"name", "spec", "phase" (a Phase), "message", "created", "updated"}, or None."""
        with self._lock:
            row = self._job_row()
        if row is None:
            return None
        return {"name": row["name"], "spec": json.loads(row["spec"]), "phase": Phase(row["phase"]),
                "message": row["message"], "created": row["created"], "updated": row["updated"]}

    def set_phase(self, phase: Phase, message: str = "") -> None:
        """Move to `phase` in one transaction, logging the transition.

        Raises InvalidTransition if ALLOWED_TRANSITIONS forbids it, RuntimeError before init_job."""
        phase = Phase(phase)
        with self._write():
            row = self._job_row()
            if row is None:
                raise RuntimeError("no job recorded: call init_job first")
            current = Phase(row["phase"])
            if phase != current and phase not in ALLOWED_TRANSITIONS[current]:
                allowed = ", ".join(sorted(p.value for p in ALLOWED_TRANSITIONS[current])) or "none"
                raise InvalidTransition(f"job {row['name']!r}: {current.value} -> {phase.value} "
                                        f"is not allowed (from {current.value}: {allowed})")
            now = utc_now()
            self.db["job"].update(1, {"phase": phase.value, "message": message, "updated": now})
            self.db["transitions"].insert({"at": now, "from_phase": current.value,
                                           "to_phase": phase.value, "message": message})

    def transitions(self) -> list[dict]:
        """Every phase change: {"at", "from", "to", "message"}, oldest first."""
        with self._lock:
            rows = list(self.db["transitions"].rows_where(order_by="id"))
        return [{"at": r["at"], "from": Phase(r["from_phase"]) if r["from_phase"] else None,
                 "to": Phase(r["to_phase"]), "message": r["message"]} for r in rows]

    # --- attempts ------------------------------------------------------------------------------

    def start_attempt(self, node: str, from_step: int | None = None) -> int:
        """A new attempt on `node` (a host or instance name) continuing from the checkpoint at
        `from_step` (0: from the start); its id. The attempt before it got at least as far as
        that checkpoint: a node lost before its record reached storage leaves a smaller to_step
        there, which is raised to `from_step`."""
        with self._write():
            if from_step:
                self._conn.execute("UPDATE attempts SET to_step = ? WHERE id = (SELECT MAX(id) FROM attempts) "
                                   "AND ended IS NOT NULL AND (to_step IS NULL OR to_step < ?)", [from_step, from_step])
            return self.db["attempts"].insert(
                {"node": node, "started": utc_now(), "ended": None, "reason": None,
                 "message": "", "from_step": from_step}).last_pk

    def end_attempt(self, attempt_id: int, reason: AttemptEnd, message: str = "", notice: str | None = None) -> None:
        """Close an attempt with its reason (state.phases.AttemptEnd) and, for a preemption, the
        notice's source (aws, gcp, azure, signal). Raises ValueError for an unknown id, a reason
        that is not an AttemptEnd, or an attempt already ended with another reason (ending it
        again the same way is a no-op)."""
        reason = AttemptEnd(reason)        # ValueError for any other string
        with self._write():
            rows = list(self.db["attempts"].rows_where("id = ?", [attempt_id]))
            if not rows:
                raise ValueError(f"no attempt {attempt_id}")
            if rows[0]["ended"] is not None:
                if rows[0]["reason"] == reason:
                    return
                raise ValueError(f"attempt {attempt_id} already ended as {rows[0]['reason']}")
            # the newest step logged since it started: a later attempt has not logged any yet
            (to_step,), = self._conn.execute("SELECT MAX(step) FROM steps WHERE logged >= ?",
                                             [rows[0]["started"]]).fetchall()
            if to_step is None:
                to_step = rows[0]["from_step"]
            self.db["attempts"].update(attempt_id, {"ended": utc_now(), "reason": reason.value,
                                                    "message": message, "to_step": to_step,
                                                    "notice": notice})

    def set_attempt_sandbox(self, attempt_id: int, mode: dict[str, str]) -> None:
        """The reward sandbox's layers in force for the attempt (Grader.sandbox_mode)."""
        with self._write():
            if not list(self.db["attempts"].rows_where("id = ?", [attempt_id])):
                raise ValueError(f"no attempt {attempt_id}")
            self.db["attempts"].update(attempt_id, {"sandbox": json.dumps(mode, sort_keys=True)})

    def attempts(self) -> list[dict]:
        """{"id", "node", "started", "ended", "reason", "message", "from_step", "to_step", "notice",
        "sandbox"} oldest first; an attempt still running (or killed without a word) has ended,
        reason and to_step None; from_step None for one recorded before grpo-run kept it; notice
        None unless a spot notice ended it; sandbox (a dict of layers) None until its trainer
        started, or for an attempt recorded before grpo-run kept it."""
        with self._lock:
            rows = [dict(r) for r in self.db["attempts"].rows_where(order_by="id")]
        for r in rows:
            r["sandbox"] = json.loads(r["sandbox"]) if r.get("sandbox") else None
        return rows

    # --- metrics -------------------------------------------------------------------------------

    def log_step(self, step: int, metrics: dict) -> None:
        """Metrics of one training step; logging a step again replaces it (a resumed run
        redoes the steps after its checkpoint)."""
        with self._write():
            self.db["steps"].upsert({"step": int(step), "metrics": _dumps(metrics),
                                     "logged": utc_now()}, pk="step")

    def add_missing_steps(self, steps: list[dict]) -> list[int]:
        """Steps ({"step": n, **metrics}) the record lacks, added in one transaction; a step it
        has is left as it is. The steps added."""
        with self._write():
            have = {r["step"] for r in self.db["steps"].rows_where(select="step")}
            now = utc_now()
            rows = [{"step": int(s["step"]), "metrics": _dumps({k: v for k, v in s.items() if k != "step"}),
                     "logged": now} for s in steps if int(s["step"]) not in have]
            if rows:
                self.db["steps"].insert_all(rows, pk="step")
        return [r["step"] for r in rows]

    def steps(self, last: int | None = None, *, logged: bool = False) -> list[dict]:
        """[{"step": n, **metrics}] ordered by step; only the newest `last` when given (the
        query stops there instead of parsing the whole history); `logged`: each with the time
        it was logged as "logged" too (a redone step: the time it was redone)."""
        with self._lock:
            if last is None:
                rows = list(self.db["steps"].rows_where(order_by="step"))
            else:
                rows = list(self.db["steps"].rows_where(order_by="step desc", limit=last))[::-1]
        return [{"step": r["step"], **json.loads(r["metrics"]), **({"logged": r["logged"]} if logged else {})}
                for r in rows]

    # --- evaluations ---------------------------------------------------------------------------

    def record_eval(self, kind: str, result: dict, *, computed: bool, fingerprint: str) -> None:
        """Store the baseline or final evaluation.

        computed=True: it was just run, so that kind's `runs` goes up by one.
        computed=False: it was reused from the cache (fingerprint matched); `runs` stays.
        Raises ValueError for a kind other than "baseline" or "final"."""
        if kind not in EVAL_KINDS:
            raise ValueError(f"eval kind must be one of {EVAL_KINDS} (got {kind!r})")
        with self._write():
            rows = list(self.db["evals"].rows_where("kind = ?", [kind]))
            runs = (rows[0]["runs"] if rows else 0) + (1 if computed else 0)
            self.db["evals"].upsert({"kind": kind, "result": _dumps(result), "runs": runs,
                                     "fingerprint": fingerprint,
                                     "source": "computed" if computed else "cache",
                                     "updated": utc_now()}, pk="kind")

    def eval(self, kind: str) -> dict | None:
        """{**result, "runs": n, "fingerprint": ..., "source": "computed"|"cache"} or None."""
        with self._lock:
            rows = list(self.db["evals"].rows_where("kind = ?", [kind]))
        if not rows:
            return None
        row = rows[0]
        return {**json.loads(row["result"]), "runs": row["runs"],
                "fingerprint": row["fingerprint"], "source": row["source"]}

    # --- samples -------------------------------------------------------------------------------

    def put_samples(self, kind: str, step: int, groups: list[dict], *, whole: bool) -> None:
        """Groups (each {"item": n, ...}) of `kind` at `step`. whole=True: they are all of that
        step's (its earlier rows go: a redone step replaces its samples); else each replaces only
        the row of its own item (an evaluation reported batch by batch)."""
        with self._write():
            if whole:
                self._conn.execute("DELETE FROM samples WHERE kind = ? AND step = ?", [kind, int(step)])
            self.db["samples"].upsert_all([{"kind": kind, "step": int(step), "item": int(g["item"]), "data": _dumps(g)}
                                           for g in groups], pk=("kind", "step", "item"))

    def drop_samples(self, kind: str, steps: list[int]) -> None:
        """The samples of `kind` at these steps, gone."""
        with self._write():
            self._conn.executemany("DELETE FROM samples WHERE kind = ? AND step = ?", [[kind, int(s)] for s in steps])

    def sample_steps(self, kind: str) -> list[int]:
        """The steps that have samples of `kind`, oldest first."""
        with self._lock:
            rows = self._conn.execute("SELECT DISTINCT step FROM samples WHERE kind = ? ORDER BY step", [kind])
            return [r[0] for r in rows.fetchall()]

    def samples(self, kind: str, steps: list[int]) -> list[dict]:
        """[{"step": n, **group}] of `kind` at these steps, by step and item."""
        if not steps:
            return []
        marks = ", ".join("?" for _ in steps)
        with self._lock:
            rows = self._conn.execute(f"SELECT step, data FROM samples WHERE kind = ? AND step IN ({marks}) "
                                      "ORDER BY step, item", [kind, *map(int, steps)]).fetchall()
        return [{"step": step, **json.loads(data)} for step, data in rows]

    # --- checkpoints ---------------------------------------------------------------------------

    def add_checkpoint(self, step: int, *, durable: bool) -> None:
        """Note a checkpoint at `step`; durable=True once its manifest is in object storage.
        Durability never reverts (a late durable=False for the same step is ignored)."""
        with self._write():
            rows = list(self.db["checkpoints"].rows_where("step = ?", [step]))
            now = utc_now()
            if rows:
                self.db["checkpoints"].update(step, {
                    "durable": int(bool(durable) or bool(rows[0]["durable"])), "updated": now})
            else:
                self.db["checkpoints"].insert({"step": int(step), "durable": int(bool(durable)),
                                               "created": now, "updated": now})

    def checkpoints(self) -> list[dict]:
        """[{"step", "durable" (bool), "created", "updated"}] ordered by step."""
        with self._lock:
            rows = list(self.db["checkpoints"].rows_where(order_by="step"))
        return [{**r, "durable": bool(r["durable"])} for r in rows]

    # --- small values --------------------------------------------------------------------------

    def set_value(self, key: str, value: Any) -> None:
        """A small JSON value (diagnostics, cost, ...). Credentials raise ValueError."""
        _refuse_credentials({key: value}, "value")
        with self._write():
            self.db["kv"].upsert({"key": key, "value": _dumps(value), "updated": utc_now()},
                                 pk="key")

    def value(self, key: str, default: Any = None) -> Any:
        with self._lock:
            rows = list(self.db["kv"].rows_where("key = ?", [key]))
        return json.loads(rows[0]["value"]) if rows else default

    # --- files ---------------------------------------------------------------------------------

    def snapshot(self, dest: Path, *, values: dict[str, Any] | None = None) -> None:
        """A consistent copy at `dest` via SQLite's backup API (safe while others write),
        written to a temporary name, fsynced and renamed: `dest` is always a whole database.
        `values`: small values the copy holds instead of the record's own (an upload's
        generation, which this record takes only once the upload has succeeded)."""
        _refuse_credentials(values or {}, "value")
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            target = sqlite3.connect(str(tmp))
            try:
                with self._lock:
                    self._conn.backup(target)
                now = utc_now()
                for key, value in (values or {}).items():
                    target.execute("INSERT OR REPLACE INTO kv (key, value, updated) VALUES (?, ?, ?)",
                                   [key, _dumps(value), now])
                target.commit()                                # (journal_mode is not changed inside a transaction)
                target.execute("PRAGMA journal_mode=DELETE")  # one self-contained file
                target.commit()
            finally:
                target.close()
            fsync_file(tmp)
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(dest.parent)

    def applied_migrations(self) -> list[str]:
        with self._lock:
            return [r["name"] for r in self.db["migrations"].rows_where(order_by="id")]

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> Record:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # --- internals -----------------------------------------------------------------------------

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Group several changes into one transaction (one commit, one fsync): all or none of
        them are in the record. Nests: inner writes join the outermost transaction."""
        with self._write():
            yield

    @contextmanager
    def _write(self) -> Iterator[None]:
        """One transaction, taken with the write lock up front (no upgrade deadlocks); inside
        `transaction` (same thread, the lock is re-entrant) it joins that one."""
        with self._lock:
            if self._in_transaction:
                yield
                return
            self._conn.execute("BEGIN IMMEDIATE")
            self._in_transaction = True
            try:
                yield
            except BaseException:
                self._conn.rollback()
                raise
            else:
                self._conn.commit()
            finally:
                self._in_transaction = False

    def _migrate(self) -> None:
        with self._write():
            self._conn.execute("""CREATE TABLE IF NOT EXISTS migrations (
                id INTEGER PRIMARY KEY,
                name TEXT NOT NULL UNIQUE,
                applied TEXT NOT NULL)""")
        done = set(self.applied_migrations())
        known = {name for name, _ in MIGRATIONS}
        unknown = done - known
        if unknown:
            raise RuntimeError(f"{self.path} was written by a newer grpo-run (migrations "
                               f"{sorted(unknown)} are unknown here): upgrade grpo-run")
        for name, statements in MIGRATIONS:
            if name in done:
                continue
            with self._write():
                # asked again under the write lock: another process opening the same new record
                # (`get tj` beside the supervisor that creates it) may have applied it meanwhile
                if name in set(self.applied_migrations()):
                    continue
                for sql in statements:
                    self._conn.execute(sql)
                self.db["migrations"].insert({"name": name, "applied": utc_now()})

    def _job_row(self) -> dict | None:
        rows = list(self.db["job"].rows_where("id = 1"))
        return rows[0] if rows else None


def utc_now() -> str:
    """Now as ISO-8601 UTC, e.g. 2026-11-29T18:48:05.123+00:00."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


# Keys whose values are secrets, compared without case, "_", "-" or ".".
_SECRET_KEYS = frozenset({
    "secret", "secretkey", "secretaccesskey", "awssecretaccesskey", "sessiontoken",
    "awssessiontoken", "password", "passwd", "apikey", "accesstoken", "authtoken", "token",
    "privatekey", "credentials", "hftoken",
    # Azure: a connection string holds AccountKey= or SharedAccessSignature=; a SAS token signs URLs
    "connectionstring", "azurestorageconnectionstring", "accountkey", "sharedaccesskey",
    "sharedaccesssignature", "sastoken", "azurestoragesastoken",
})
_URL_USERINFO = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://[^/@\s]+:[^/@\s]*@")
# a URL signed with a SAS token (`?sv=...&sig=...`), or a connection string's secret part
_AZURE_SECRET = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://\S*[?&]sig=|(AccountKey|SharedAccessSignature)=", re.IGNORECASE)


def _refuse_credentials(value: Any, where: str) -> None:
    """ValueError naming the place if `value` holds something that looks like a credential."""
    if isinstance(value, dict):
        for key, item in value.items():
            normal = re.sub(r"[_\-.\s]", "", str(key)).lower()
            if normal in _SECRET_KEYS and item not in (None, ""):
                raise ValueError(f"{where}.{key}: looks like a credential; the run's record never "
                                 f"stores credentials (use the environment)")
            _refuse_credentials(item, f"{where}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _refuse_credentials(item, f"{where}[{i}]")
    elif isinstance(value, str) and _URL_USERINFO.match(value):
        raise ValueError(f"{where}: a URL with a password in it; the run's record never stores "
                         f"credentials (use the environment)")
    elif isinstance(value, str) and _AZURE_SECRET.search(value):
        raise ValueError(f"{where}: an Azure account key or SAS signature (AccountKey=, "
                         f"SharedAccessSignature= or a URL's sig=); the run's record never stores "
                         f"credentials (use the environment)")


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item") and callable(obj.item):  # numpy / torch scalars; .item() syncs a GPU
        try:
            return obj.item()
        except (TypeError, ValueError):
            pass
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, enum.Enum):
        return obj.value
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def _dumps(value: Any) -> str:
    return json.dumps(value, default=_json_default, sort_keys=True)
