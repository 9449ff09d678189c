"""The run's books, kept by the supervisor: the SQLite record on this node (state/) and its copy
in object storage (which copy is the record: replica.py), the cost ledger and the budget
(ledger.py), the cached baseline and the evaluation batches a stopped attempt finished
(evals.py), the trackers (trackers.py).

`Books` is the one writer of the run's record: what the supervisor learns (from the trainer's
events, from storage, from a notice) goes in through its methods, and the small values it keeps
are named in state/values.py.

Storage layout of a job's folder that this package writes: `state.db` (a snapshot of the record,
refreshed at every phase change, within DURABLE_SYNC_S of a durable checkpoint and at most every
RECORD_SYNC_S otherwise), `baseline.json` (the baseline evaluation with its fingerprint) and, with
spec.tracking.tensorboard true, `tensorboard/` (the event files, copied with each snapshot).
"""

from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from grpo_run.checkpoint.storage.store import ObjectStore
from grpo_run.runner.books import replays
from grpo_run.runner.books.evals import Evals
from grpo_run.runner.books.ledger import Ledger
from grpo_run.runner.books.replica import StaleRecord, fetch_record, generation_of, upload_number
from grpo_run.runner.books.sample_books import SampleBooks
from grpo_run.runner.books.trackers import Trackers, open_trackers
from grpo_run.state import values
from grpo_run.state.phases import ALLOWED_TRANSITIONS, AttemptEnd, Phase
from grpo_run.state.record import RECORD_FILE, Record
from grpo_run.trainer.protocol import Budget, EvalSummary

log = logging.getLogger(__name__)

RECORD_SYNC_S = 10.0         # the record's upload between phase changes, at most this often
DURABLE_SYNC_S = 2.0         # ... and after a durable checkpoint, at most this often (fast tiny runs
                             # seal several a second: an upload after each kept the store busy)
REWARD_WINDOW = 50           # steps the reward-signal diagnostic looks back over


@dataclass(frozen=True)
class CarryOver:
    """What the run's first trainer chose and every later one keeps: another count of threads or
    micro-batch size would round the arithmetic differently (None: not chosen yet)."""
    cpu_threads: int | None
    micro_batch_size: int | None


# How close_dangling_attempts ends an attempt whose node went away without a word (SIGKILL, the
# OOM killer, a hang someone stopped, a spot reclaim with no notice): lost_without_progress
# counts these.
NODE_LOST = "the node stopped without a word (killed or lost)"

class Books:
    """Owns the job's Record on this node, its uploads, the ledger and the evaluations' books."""

    def __init__(self, store: ObjectStore, work: Path, *, name: str, manifest: dict[str, Any],
                 usd_per_hour: float | None, max_cost_usd: float | None,
                 tracking: dict[str, Any] | None = None, after_upload: Callable[[], None] | None = None,
                 estimate: dict[str, Any] | None = None) -> None:
        self.store = store
        self._after_upload = after_upload   # called after each record upload (the supervisor: a cancel request?)
        self.work = Path(work)
        self.name = name
        fetch_record(store, self.work)
        self.record = Record(self.work / RECORD_FILE)
        # Who uploads from here (random per Books), and the number of this record's newest upload
        # that reached storage: the next goes up as one more, once storage's is known not newer.
        self._writer = uuid.uuid4().hex
        self._uploaded = upload_number(values.GENERATION.get(self.record))
        self.record.init_job(name, manifest)
        self._apply_spec_changes(name, manifest)
        # This run's identity, in every checkpoint's manifest: a checkpoint left in storage by an
        # earlier run under the same name (its record deleted, the job submitted again) is not ours.
        self.run_id: str = values.RUN_ID.get(self.record) or uuid.uuid4().hex
        if values.RUN_ID.get(self.record) is None:
            values.RUN_ID.set(self.record, self.run_id)
        if estimate is not None:     # this apply's estimate: what the job's spend is later set against
            values.ESTIMATE.set(self.record, {k: estimate[k] for k in values.ESTIMATE_KEYS if k in estimate})
        self.ledger = Ledger(self.record, usd_per_hour=usd_per_hour, max_cost_usd=max_cost_usd)
        self.evals = Evals(self.record, store)
        self.samples = SampleBooks(self.record)
        self._sync_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="record-sync")
        self._last_sync = 0.0
        self._first_step_due = False  # the attempt's first step is uploaded at once (log_step)
        self._queued: Future | None = None
        self._durable_waits = False  # a durable checkpoint's record upload was put off (DURABLE_SYNC_S)
        self.tracking = tracking     # spec.tracking as this node writes it (not the stored spec's: runner.jobs.stored)
        self.trackers = Trackers([])       # opened per attempt (spec.tracking)

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
            generation = self._next_generation()
            snap = self.work / "state.snapshot.db"
            self.record.snapshot(snap, values={values.GENERATION.key: generation})
            self.store.put_file(snap, RECORD_FILE)
            values.GENERATION.set(self.record, generation)      # storage has this copy now
            self._uploaded = generation["number"]
            if self._after_upload is not None:
                self._after_upload()

        self._last_sync = time.monotonic()
        self._durable_waits = False
        if self.ledger.running:    # the spend so far goes with it: a node killed later has it counted
            self.ledger.write()
        queued = self._queued
        if not wait and queued is not None and not queued.running() and not queued.done():
            return             # one not yet begun will snapshot what is here now: no pile-up
        done: Future = self._sync_pool.submit(upload)
        self._queued = done
        if wait:
            done.result()

    def _next_generation(self) -> values.Generation:
        """The generation the next upload carries, once storage's copy is read. Raises StaleRecord
        when storage's is newer than this node's last upload and was uploaded by someone else."""
        check = self.work / f".{RECORD_FILE}.in-storage"
        try:
            self.store.get_file(RECORD_FILE, check)
        except FileNotFoundError:
            stored = None
        else:
            try:
                stored = generation_of(check)
            finally:
                check.unlink(missing_ok=True)
        if stored is not None and stored["number"] > self._uploaded:
            if stored["writer"] != self._writer:
                message = (f"storage holds a newer record of job {self.name} (upload {stored['number']}) than "
                           f"this node's (its last upload: {self._uploaded}): another node has written it "
                           f"since; this node's is not uploaded, which would roll the job back (steps, attempts, "
                           f"the cost ledger), and this node stops; `grpo-run resume` continues from storage's")
                log.error("%s", message)
                raise StaleRecord(message)
            self._uploaded = stored["number"]        # this node's own upload, whose answer was lost
        return {"number": self._uploaded + 1, "writer": self._writer}

    def sync_soon(self, within: float | None = None) -> None:
        """Upload the record unless it was uploaded less than `within` seconds ago (default
        RECORD_SYNC_S; DURABLE_SYNC_S while a durable checkpoint waits for its record upload)."""
        if within is None:
            within = DURABLE_SYNC_S if self._durable_waits else RECORD_SYNC_S
        if time.monotonic() - self._last_sync >= within:
            self.update_reward_signal()
            self.sync()

    def enter_phase(self, phase: Phase) -> None:
        """The job is in `phase` now; returns once storage has the record that says so (phase
        changes are rare, and what a new node reads first)."""
        self.record.set_phase(phase)
        self.sync(wait=True)

    def finish(self, phase: Phase, reason: AttemptEnd, message: str, notice: str | None = None) -> None:
        """The attempt (if one still runs: a crashed one was ended before its restart) ends as
        `reason` and the job moves to `phase`, in one transaction; returns once storage has the
        record."""
        with self.record.transaction():
            if self.ledger.running:
                self.end_attempt(reason, message, notice)
            self.record.set_phase(phase, message)
        self.sync(wait=True)

    def abandon(self, message: str) -> None:
        """The record cannot go where the run went (InvalidTransition): this process's attempt
        ends Failed with `message` (also one a `finish` that raised left open: its transaction was
        rolled back), and the job moves to Failed where its phase allows (a Succeeded or Cancelled
        job keeps its phase); returns once storage has the record."""
        with self.record.transaction():
            attempt = self.ledger.attempt
            if attempt is not None and any(a["id"] == attempt and a["ended"] is None for a in self.record.attempts()):
                self.ledger.write()
                self.record.end_attempt(attempt, AttemptEnd.FAILED, message)
            current = self.record.job()["phase"]
            if current == Phase.FAILED or Phase.FAILED in ALLOWED_TRANSITIONS[current]:
                self.record.set_phase(Phase.FAILED, message)
        self.ledger.running = False
        self.sync(wait=True)

    def succeeded(self) -> bool:
        """The record (storage's, fetched under the lease) says the job succeeded: nothing to run."""
        return self.record.job()["phase"] == Phase.SUCCEEDED

    def close(self) -> None:
        self._sync_pool.shutdown(wait=True)
        self.trackers.close()
        self.record.close()

    # --- attempts and the ledger -----------------------------------------------------------------

    def close_dangling_attempts(self) -> None:
        """Attempts a lost node left open end as Crashed, charged up to the newest step they logged."""
        for a in self.record.attempts():
            if a["ended"] is None:
                with self.record.transaction():
                    self.ledger.charge_lost(a)
                    self.record.end_attempt(a["id"], AttemptEnd.CRASHED, NODE_LOST)

    def lost_without_progress(self) -> tuple[int, int]:
        """(how many, from which step): the newest attempts, in a row, whose node was lost (closed
        by close_dangling_attempts) before storage heard of a completed step of theirs (an
        attempt's first step is uploaded at once: log_step), all from the same checkpoint. Any
        other ending (a notice, a failure, a trainer crash the supervisor saw) or an attempt that
        completed a step ends the run."""
        count, start = 0, None
        for a in reversed(self.record.attempts()):
            if a["reason"] != AttemptEnd.CRASHED or a["message"] != NODE_LOST or (a["to_step"] or 0) > (a["from_step"] or 0):
                break
            if start is not None and (a["from_step"] or 0) != start:
                break
            start = a["from_step"] or 0
            count += 1
        return count, start or 0

    def preempted_without_progress(self) -> int:
        """How many of the newest attempts, in a row, ended Preempted without completing a step."""
        count = 0
        for a in reversed(self.record.attempts()):
            if a["reason"] != AttemptEnd.PREEMPTED or (a["to_step"] or 0) > (a["from_step"] or 0):
                break
            count += 1
        return count

    def start_attempt(self, node: str, from_step: int | None = None) -> int:
        """An attempt on `node` from the checkpoint at `from_step`; returns once storage has it."""
        attempt = self.record.start_attempt(node, from_step)
        self.ledger.start(attempt)
        if self.tracking:
            self._sync_pool.submit(self.trackers.close).result()    # a restarted trainer's attempt
            self.trackers = open_trackers(self.tracking, job_store=self.store, work=self.work,
                                          name=self.record.job()["name"], run_id=self.run_id,
                                          attempt=attempt, record=self.record)
        self.ledger.write()
        self.sync(wait=True)
        self._first_step_due = True
        return attempt

    def end_attempt(self, reason: AttemptEnd, message: str = "", notice: str | None = None) -> None:
        with self.record.transaction():
            self.ledger.write()
            self.record.end_attempt(self.ledger.attempt, reason, message, notice)
        self.ledger.running = False

    def spent_usd(self) -> float:
        return self.ledger.spent_usd()

    def budget(self) -> Budget | None:
        return self.ledger.budget()

    # --- what the trainer and the node report ---------------------------------------------------

    def sampler(self) -> str | None:
        """The engine the run samples with (native | vllm), None before its first start chose one."""
        return (values.SAMPLER.get(self.record) or {}).get("engine")

    def choose_sampler(self, engine: str, why: str) -> None:
        """The engine for the whole run, chosen once: every attempt after samples with it."""
        with self.record.transaction():
            values.SAMPLER.set(self.record, {"engine": engine, "why": why})

    def trainer_started(self, device: str, micro_batch_size: int, cpu_threads: int,
                        sandbox: dict[str, str] | None = None, sampler: dict | None = None) -> None:
        """The trainer's choices; the first trainer's threads are the run's (carry_over); the
        reward sandbox's layers it runs with, on its attempt."""
        with self.record.transaction():
            if sandbox and self.ledger.attempt is not None:
                self.record.set_attempt_sandbox(self.ledger.attempt, sandbox)
            values.DEVICE.set(self.record, device)
            if sampler:
                values.SAMPLER.set(self.record, {**(values.SAMPLER.get(self.record) or {}), **sampler})
            values.MICRO_BATCH_SIZE.set(self.record, micro_batch_size)
            if cpu_threads and values.CPU_THREADS.get(self.record) is None:
                values.CPU_THREADS.set(self.record, cpu_threads)

    def carry_over(self) -> CarryOver:
        return CarryOver(cpu_threads=values.CPU_THREADS.get(self.record) or None,
                         micro_batch_size=values.MICRO_BATCH_SIZE.get(self.record) or None)

    def episode_digests(self) -> dict[int, list[str]]:
        """The digests of the steps a resume may replay (runner.books.replays), for the trainer's plan."""
        return replays.recorded(self.record)

    def judge_calls(self) -> dict[str, int]:
        """{judge reward: the run's answered calls so far}, for the next trainer to count on from."""
        return values.JUDGE_CALLS.get(self.record)

    def judge_usd(self) -> dict[str, float]:
        """{priced judge reward: the run's spend on its calls so far}, likewise."""
        return values.JUDGE_USD.get(self.record)

    def note_judge_calls(self, calls: dict[str, int], usd: dict[str, float]) -> None:
        """The trainer's running count of each judge's calls and their price (the run's, not only
        its own): the price goes in the cost ledger's total."""
        with self.record.transaction():
            values.JUDGE_CALLS.set(self.record, {**self.judge_calls(), **calls})
            if usd:
                values.JUDGE_USD.set(self.record, {**self.judge_usd(), **{k: round(v, 6) for k, v in usd.items()}})
        self.sync_soon()

    def record_startup(self, path: dict[str, Any]) -> None:
        """This node's path to its first new step (runner.supervisor.startup), on its attempt."""
        values.STARTUP.set(self.record, {"attempt": self.ledger.attempt, **path})

    def record_notice(self, source: str, seconds: float, durable_step: int) -> None:
        """A spot notice: where it came from and how long after it the last step was durable."""
        values.LAST_NOTICE.set(self.record, {"source": source, "noticeToDurableSeconds": round(seconds, 3),
                                             "durableStep": durable_step})

    # --- steps and checkpoints -------------------------------------------------------------------

    def log_step(self, step: int, metrics: dict[str, Any], episode_digests: list[str] | None = None) -> None:
        """A completed step, with what the run has cost so far (and its episodes' digests, for a
        resume that replays it: runner.books.replays); uploaded within RECORD_SYNC_S."""
        metrics = {**metrics, "costUSD": round(self.spent_usd(), 6)}
        with self.record.transaction():
            self.record.log_step(step, metrics)
            if episode_digests:
                replays.keep(self.record, step, episode_digests)
        self.trackers.step(step, metrics)
        if self._first_step_due:     # storage hears at once that this attempt made progress: a node lost
            self._first_step_due = False     # later is not counted as lost without it (lost_without_progress)
            self.sync()
        else:
            self.sync_soon()

    def add_samples(self, kind: str, step: int, groups: list[dict[str, Any]]) -> None:
        """What the model wrote (runner.books.sample_books); uploaded with the record, and to the trackers."""
        self.samples.add(kind, step, groups)
        self.trackers.samples(kind, step, groups)

    def fill_in_steps(self, steps: list[dict[str, Any]], samples: dict[int, list[dict[str, Any]]] | None = None) -> None:
        """The metrics a restored checkpoint holds ([{"step": n, **metrics}]): steps the record
        lacks are added (a node lost within DURABLE_SYNC_S of that checkpoint becoming durable
        left them out of storage's record, and the resume starts after them); steps it has stay.
        `samples` ({step: groups}, the checkpoint's newest steps'): those of the steps added."""
        with self.record.transaction():
            added = self.record.add_missing_steps(steps)
            for step in added:
                if samples and step in samples:
                    self.samples.add("step", step, samples[step])
        if added:
            log.info("steps %s were missing from the record; filled in from the checkpoint", _ranges(added))

    def note_sealed(self, step: int) -> None:
        """A checkpoint sealed on this node's disk, not yet in storage."""
        self.record.add_checkpoint(step, durable=False)

    def note_durable(self, steps: Iterable[int]) -> None:
        """Checkpoints whose manifests are in storage. The record with them goes up now, or
        within DURABLE_SYNC_S of the last upload (the next step's sync_soon sends it): a node
        lost later leaves storage a record with every step up to the checkpoint a resume
        starts from."""
        with self.record.transaction():
            for step in steps:
                self.record.add_checkpoint(step, durable=True)
                replays.forget_through(self.record, step)
        self._durable_waits = True
        self.sync_soon(DURABLE_SYNC_S)

    def update_reward_signal(self) -> None:
        """status.diagnostics.rewardSignal over the newest REWARD_WINDOW steps: the groups whose G
        rewards were identical, split into solved (every completion scored 1 on the first reward:
        nothing left to learn there, which is fine) and no signal (all failed alike: the warning,
        with the fix). A step logged before the split counts its identical groups as no signal."""
        steps = self.record.steps(last=REWARD_WINDOW)
        if not steps:
            return
        n = len(steps)
        identical = sum(s["identicalGroups"] for s in steps) / n
        solved = sum(s.get("solvedGroups", 0.0) for s in steps) / n
        no_signal = sum(s.get("noSignalGroups", s["identicalGroups"]) for s in steps) / n
        signal: values.RewardSignal = {"identicalGroupFraction": round(identical, 4), "window": n,
                                       "solvedGroupFraction": round(solved, 4),
                                       "noSignalGroupFraction": round(no_signal, 4)}
        if no_signal >= 0.5:
            signal["warning"] = (f"{no_signal:.0%} of groups in the last {n} steps failed alike (identical rewards, "
                                 "not solved) and taught nothing; raise numGenerations or temperature, or use an "
                                 "easier task")
        elif solved >= 0.5:
            signal["note"] = (f"{solved:.0%} of groups in the last {n} steps were solved (every completion scored 1): "
                              "nothing left to learn there, which is fine; the held-out reward says whether it "
                              "generalises")
        values.REWARD_SIGNAL.set(self.record, signal)

    # --- evaluations (evals.py) -----------------------------------------------------------------

    def cached_baseline(self, fingerprint: str, sample_tasks: int) -> EvalSummary | None:
        """The baseline computed earlier for this fingerprint, recorded as reused; None: compute it.
        Reused from storage's cache (the record was deleted), the samples it kept come back into
        the record: those of the first `sample_tasks` held-out tasks (sampleEvalTasks now), or
        fewer when the baseline kept fewer (it is not computed again for its samples)."""
        with self.record.transaction():
            cached = self.evals.cached_baseline(fingerprint)
            if cached is None:
                return None
            result, stored = cached
            groups = [g for g in stored or [] if g["item"] < sample_tasks]
            if stored is not None:
                self.samples.replace("baseline", 0, groups)
        if groups:
            self.trackers.samples("baseline", 0, groups)
        wanted = min(sample_tasks, result.tasks)
        if stored is not None and len(groups) < wanted:
            log.info("the cached baseline kept the completions of %d of the %d held-out tasks sampleEvalTasks now "
                     "keeps: the final evaluation's others have no baseline answer beside them (the baseline is "
                     "not run again for them)", len(groups), wanted)
        self.trackers.evaluation("baseline", 0, result.to_dict())
        return result

    def record_eval(self, kind: str, result: EvalSummary, fingerprint: str, *, no_signal: bool) -> None:
        self.evals.record_computed(kind, result, fingerprint, no_signal=no_signal)
        last = self.record.steps(last=1)
        self.trackers.evaluation(kind, 0 if kind == "baseline" else (last[0]["step"] if last else 0),
                                 result.to_dict())
        self.sync(wait=True)     # the record first: it counts the computation (status.baseline.runs)
        if kind == "baseline":
            # then the cache beside it; a node lost between the two leaves the baseline in the
            # record, where a resume finds it first (the other order lost the count of runs)
            self.evals.cache_baseline(result, fingerprint)

    def evaluation(self, kind: str) -> dict[str, Any] | None:
        return self.record.eval(kind)

    def add_held_out(self, step: int, result: EvalSummary) -> None:
        self.evals.add_held_out(step, result)
        self.trackers.evaluation("heldOut", step, result.to_dict())
        self.sync_soon()

    def eval_batches(self, kind: str, fingerprint: str) -> dict[int, dict[str, list[float]]]:
        return self.evals.batches(kind, fingerprint)

    def add_eval_batch(self, kind: str, fingerprint: str, batch: int, rewards: dict[str, list[float]]) -> None:
        self.evals.add_batch(kind, fingerprint, batch, rewards)
        self.sync_soon()

    def plan_evaluations(self, tasks: int, batch_size: int) -> None:
        self.evals.plan(tasks, batch_size)


def _diff(old: Any, new: Any, path: str = "") -> list[str]:
    """Dotted paths where two manifests differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in set(old) | set(new):
            out += _diff(old.get(key), new.get(key), f"{path}.{key}" if path else key)
        return out
    return [] if old == new else [path]


def _ranges(steps: list[int]) -> str:
    """[3, 4, 5, 9] as "3-5, 9"."""
    out: list[str] = []
    for step in sorted(steps):
        if out and int(out[-1].rpartition("-")[2]) == step - 1:
            out[-1] = f"{out[-1].partition('-')[0]}-{step}"
        else:
            out.append(str(step))
    return ", ".join(out)
