"""The run's books, kept by the supervisor: the SQLite record on this node (state/) and its copy
in object storage, the cost ledger and the budget, the cached baseline and the evaluation
batches a stopped attempt finished.

Storage layout of a job's folder that this module writes: `state.db` (a snapshot of the record,
refreshed at every phase change, within DURABLE_SYNC_S of a durable checkpoint and at most every
RECORD_SYNC_S otherwise), `baseline.json` (the baseline evaluation with its fingerprint) and, with
spec.tracking.tensorboard true, `tensorboard/` (the event files, copied with each snapshot).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

from grpo_run.checkpoint.storage.store import Store
from grpo_run.runner.books.trackers import Trackers, open_trackers
from grpo_run.state.record import RECORD_FILE, Record
from grpo_run.state.phases import Phase

log = logging.getLogger("grpo_run.runner.supervisor.supervisor")

BASELINE = "baseline.json"
RECORD_SYNC_S = 10.0         # the record's upload between phase changes, at most this often
DURABLE_SYNC_S = 2.0         # ... and after a durable checkpoint, at most this often (fast tiny runs
                             # seal several a second: an upload after each kept the store busy)
CHECKPOINT_RESERVE_S = 5.0   # budget held back for the last checkpoint, its upload and the exit
REWARD_WINDOW = 50           # steps the reward-signal diagnostic looks back over
NO_SIGNAL_HINT = ("GRPO cannot learn from it: every group would get identical rewards. "
                  "Fine-tune with SFT first, or pick a task the base model sometimes solves.")


def fetch_record(store: Store, work: Path) -> Path | None:
    """The job's record on this node: the local one if there is one (this node ran the job),
    else downloaded from storage, once. None when storage has none either (a new job)."""
    local = Path(work) / RECORD_FILE
    if local.exists():
        return local
    try:
        store.get_file(RECORD_FILE, local)
    except FileNotFoundError:
        return None
    return local


class Books:
    """Owns the job's Record on this node, its uploads, and the ledger of the current attempt."""

    def __init__(self, store: Store, work: Path, *, name: str, manifest: dict[str, Any],
                 usd_per_hour: float | None, max_cost_usd: float | None) -> None:
        self.store = store
        self.work = Path(work)
        self.usd_per_hour = usd_per_hour
        self.max_cost_usd = max_cost_usd
        fetch_record(store, self.work)
        self.record = Record(self.work / RECORD_FILE)
        self.record.init_job(name, manifest)
        self._apply_spec_changes(name, manifest)
        # This run's identity, in every checkpoint's manifest: a checkpoint left in storage by an
        # earlier run under the same name (its record deleted, the job submitted again) is not ours.
        self.run_id: str = self.record.value("runId") or uuid.uuid4().hex
        if self.record.value("runId") is None:
            self.record.set_value("runId", self.run_id)
        self._sync_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="record-sync")
        self._last_sync = 0.0
        self._queued: Future | None = None
        self._open = False         # an attempt of this process is running (its ledger entry grows)
        self._durable_waits = False  # a durable checkpoint's record upload was put off (DURABLE_SYNC_S)
        self.attempt: int | None = None
        self.tracking = (manifest.get("spec") or {}).get("tracking")
        self.trackers = Trackers([])       # opened per attempt (spec.tracking)
        self._t0 = time.monotonic()
        self._earlier_usd = 0.0

    def _apply_spec_changes(self, name: str, manifest: dict[str, Any]) -> None:
        """`apply` of an edited job file continues the job under the new spec (kubectl apply);
        a finished job is not reopened. Raises ValueError for that case."""
        job = self.record.job()
        if job["spec"] == manifest:
            return
        changed = sorted(_diff(job["spec"], manifest))
        if job["phase"] == Phase.SUCCEEDED:
            raise ValueError(f"job {name!r} already succeeded with a different spec (changed: "
                             f"{', '.join(changed)}); give the new job its own metadata.name")
        log.warning("job %s continues with a changed spec: %s", name, ", ".join(changed))
        self.record.set_spec(manifest)

    # --- the copy in storage ---------------------------------------------------------------------

    def sync(self, *, wait: bool = False) -> None:
        """Upload a snapshot of the record, in the background unless `wait`."""
        def upload() -> None:      # one worker: snapshots never race each other
            self.trackers.flush()  # the trackers' files with the record they follow
            snap = self.work / "state.snapshot.db"
            self.record.snapshot(snap)
            self.store.put_file(snap, RECORD_FILE)

        self._last_sync = time.monotonic()
        self._durable_waits = False
        if self._open:             # the spend so far goes with it: a node killed later has it counted
            self.write_ledger()
        queued = self._queued
        if not wait and queued is not None and not queued.running() and not queued.done():
            return             # one not yet begun will snapshot what is here now: no pile-up
        done: Future = self._sync_pool.submit(upload)
        self._queued = done
        if wait:
            done.result()

    def sync_soon(self, within: float | None = None) -> None:
        """Upload the record unless it was uploaded less than `within` seconds ago (default
        RECORD_SYNC_S; DURABLE_SYNC_S while a durable checkpoint waits for its record upload)."""
        if within is None:
            within = DURABLE_SYNC_S if self._durable_waits else RECORD_SYNC_S
        if time.monotonic() - self._last_sync >= within:
            self.update_reward_signal()
            self.sync()

    def sync_after_durable(self) -> None:
        """A checkpoint became durable: the record with its steps goes up now, or within
        DURABLE_SYNC_S of the last upload (the next step's sync_soon sends it)."""
        self._durable_waits = True
        self.sync_soon(DURABLE_SYNC_S)

    def phase(self, phase: Phase, message: str = "") -> None:
        """Phase changes are rare and are what a new node reads first: wait until stored."""
        self.record.set_phase(phase, message)
        self.sync(wait=True)

    def close(self) -> None:
        self._sync_pool.shutdown(wait=True)
        self.trackers.close()
        self.record.close()

    # --- attempts and the ledger -----------------------------------------------------------------

    def close_dangling_attempts(self) -> None:
        """Attempts a lost node left open end as Crashed; their spend runs at least to the newest
        step they logged (the ledger in storage may be older than that step)."""
        ledger = dict(self.record.value("ledger", {}) or {})
        for a in self.record.attempts():
            if a["ended"] is not None:
                continue
            steps = [s for s in self.record.steps(logged=True) if s["logged"] >= a["started"]]
            entry = ledger.get(str(a["id"]))
            if steps and entry:
                seconds = (_time(steps[-1]["logged"]) - _time(a["started"]))
                if seconds > entry["seconds"]:
                    rate = entry.get("usdPerHour") or 0.0
                    ledger[str(a["id"])] = {**entry, "seconds": round(seconds, 3), "usd": round(seconds * rate / 3600, 6)}
            with self.record.transaction():
                self.record.set_value("ledger", ledger)
                self.record.end_attempt(a["id"], "Crashed", "the node stopped without a word (killed or lost)")

    def start_attempt(self, node: str, from_step: int | None = None) -> int:
        ledger = self.record.value("ledger", {}) or {}
        self._earlier_usd = sum(v["usd"] for v in ledger.values())
        self._t0 = time.monotonic()
        self.attempt = self.record.start_attempt(node, from_step)
        self._open = True
        if self.tracking:
            self._sync_pool.submit(self.trackers.close).result()    # a restarted trainer's attempt
            self.trackers = open_trackers(self.tracking, job_store=self.store, work=self.work,
                                          name=self.record.job()["name"], run_id=self.run_id,
                                          attempt=self.attempt, record=self.record)
        self.write_ledger()
        self.sync(wait=True)
        return self.attempt

    def end_attempt(self, reason: str, message: str = "", notice: str | None = None) -> None:
        with self.record.transaction():
            self.write_ledger()
            self.record.end_attempt(self.attempt, reason, message, notice)
        self._open = False

    def attempt_usd(self) -> float:
        return (time.monotonic() - self._t0) * (self.usd_per_hour or 0.0) / 3600

    def spent_usd(self) -> float:
        """Every attempt's wall time at the GPU's rate: earlier attempts from the ledger, this one live."""
        return self._earlier_usd + self.attempt_usd()

    def write_ledger(self) -> None:
        ledger = dict(self.record.value("ledger", {}) or {})
        ledger[str(self.attempt)] = {"seconds": round(time.monotonic() - self._t0, 3),
                                     "usd": round(self.attempt_usd(), 6), "usdPerHour": self.usd_per_hour}
        self.record.set_value("ledger", ledger)

    def stop_by(self) -> float | None:
        """maxCostUSD as a time: the time.monotonic() past which no training step may end, so the
        spend (every attempt's wall time x the rate) stays within it. What the stop itself costs
        — the last checkpoint, its upload, the exit — is held back (CHECKPOINT_RESERVE_S)."""
        limit, rate = self.max_cost_usd, self.usd_per_hour
        if not limit or not rate:
            return None
        return self._t0 + (limit - self._earlier_usd) * 3600 / rate - CHECKPOINT_RESERVE_S

    # --- steps and checkpoints -------------------------------------------------------------------

    def log_step(self, step: int, metrics: dict[str, Any]) -> None:
        metrics = {**metrics, "costUSD": round(self.spent_usd(), 6)}
        self.record.log_step(step, metrics)
        self.trackers.step(step, metrics)

    def update_reward_signal(self) -> None:
        steps = self.record.steps(last=REWARD_WINDOW)
        if not steps:
            return
        frac = sum(s["identicalGroups"] for s in steps) / len(steps)
        signal = {"identicalGroupFraction": round(frac, 4), "window": len(steps)}
        if frac >= 0.5:
            signal["warning"] = (f"{frac:.0%} of groups in the last {len(steps)} steps had identical rewards "
                                 "and taught nothing; raise numGenerations or temperature, or use an easier task")
        self.record.set_value("rewardSignal", signal)

    # --- evaluations -----------------------------------------------------------------------------

    def cached_baseline(self, fingerprint: str) -> dict[str, Any] | None:
        """The baseline computed earlier for this very fingerprint (the record's, else the one in
        storage), recorded as reused; None when it must be computed (said why when a cache for
        other settings was there)."""
        cached = self.record.eval("baseline")
        if cached is None or cached.get("fingerprint") != fingerprint:
            try:
                doc = json.loads(self.store.get_bytes(BASELINE))
                cached = doc if isinstance(doc, dict) else cached
            except FileNotFoundError:
                pass
        if cached is not None and cached.get("fingerprint") == fingerprint:
            result = {k: cached[k] for k in ("meanReward", "rewards", "tasks", "solved", "batches", "reusedBatches")
                      if k in cached}
            self.record.record_eval("baseline", result, computed=False, fingerprint=fingerprint)
            self.trackers.evaluation("baseline", 0, result)
            log.info("baseline evaluation reused from the cache (fingerprint %s)", fingerprint[:12])
            return result
        if cached is not None:
            why = ("the cached baseline was computed for another model, environment, eval tasks or "
                   "generation settings; evaluating again")
            log.warning(why)
            self.record.set_value("baselineCache", why)
        return None

    def record_eval(self, kind: str, result: dict[str, Any], fingerprint: str, *, no_signal: bool) -> None:
        self.record.record_eval(kind, result, computed=True, fingerprint=fingerprint)
        last = self.record.steps(last=1)
        self.trackers.evaluation(kind, 0 if kind == "baseline" else (last[0]["step"] if last else 0), result)
        if kind == "baseline" and no_signal:
            warning = f"baseline held-out reward is {result['meanReward']:.0%} on every task: {NO_SIGNAL_HINT}"
            log.warning(warning)
            self.record.set_value("baselineWarning", warning)
        self.sync(wait=True)     # the record first: it counts the computation (status.baseline.runs)
        if kind == "baseline":
            # then the cache beside it; a node lost between the two leaves the baseline in the
            # record, where a resume finds it first (the other order lost the count of runs)
            self.store.put_bytes(BASELINE, json.dumps({**result, "fingerprint": fingerprint}).encode())

    def add_held_out(self, step: int, result: dict[str, Any]) -> None:
        """An evaluation on the held-out tasks after `step` (every evalSteps): the curve `get tj`
        shows as status.heldOut while the job runs."""
        curve = [e for e in self.record.value("heldOut") or [] if e["step"] != step]
        curve.append({"step": step, **{k: result[k] for k in ("meanReward", "rewards", "solved") if k in result}})
        self.record.set_value("heldOut", sorted(curve, key=lambda e: e["step"]))
        self.trackers.evaluation("heldOut", step, result)
        self.sync_soon()

    def eval_batches(self, kind: str, fingerprint: str) -> dict[int, dict[str, list[float]]]:
        """Evaluation batches of `kind` an earlier attempt finished for this fingerprint."""
        saved = self.record.value(f"evalBatches.{kind}") or {}
        if saved.get("fingerprint") != fingerprint:
            return {}
        return {int(i): r for i, r in saved["batches"].items()}

    def add_eval_batch(self, kind: str, fingerprint: str, batch: int, rewards: dict[str, list[float]]) -> None:
        """Keep batch `batch`'s scores ({reward name: one per task}) for a resume to reuse."""
        saved = self.record.value(f"evalBatches.{kind}") or {}
        if saved.get("fingerprint") != fingerprint:
            saved = {"fingerprint": fingerprint, "batches": {}}
        saved["batches"][str(batch)] = rewards
        self.record.set_value(f"evalBatches.{kind}", saved)
        self.sync_soon()


def _time(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def _diff(old: Any, new: Any, path: str = "") -> list[str]:
    """Dotted paths where two manifests differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in set(old) | set(new):
            out += _diff(old.get(key), new.get(key), f"{path}.{key}" if path else key)
        return out
    return [] if old == new else [path]
