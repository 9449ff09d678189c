"""One attempt at a job on this node: restore -> baseline -> training -> final evaluation.

The phases, in order, each recorded in the run's SQLite record (state/):

    BaselineEval  held-out tasks, before any update; cached in object storage with a
                  fingerprint of what it depends on, so a resume never pays for it twice
    Training      GRPO steps; a complete checkpoint every saveSteps, written and uploaded by
                  the checkpoint writer process (checkpoint.writer)
    FinalEval     the same held-out tasks, after training
    Succeeded     final weights in storage

Where a stop request (preemption) is honoured: `_train` checks `stop` before every step, and the
sampler checks it between tokens. Either way the last *completed* step is checkpointed, made
durable, and the attempt ends as Preempted.

Local layout (`work`): state.db, checkpoints/ckpt-NNNNNNNN/, final/. Object storage (the job's
folder): state.db (the record, refreshed at every phase change and checkpoint), baseline.json,
checkpoints/ckpt-NNNNNNNN/ (manifest.json uploaded last), final/.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from checkpoint.manifest import checkpoint_dir, discover, finalize_checkpoint, staging_dir
from checkpoint.store import StorageConfigError, Store
from checkpoint.sync import Uploader, download_latest
from checkpoint.writer import CheckpointWriter
from state.record import Phase, Record
from trainer.config import GRPOParams, parse_parameters, to_yaml_dict
from trainer.envs import Environment
from trainer.grader import RewardFunctionError
from trainer.grpo import GenerationInterrupted
from trainer.loop import GRPOTrainer
from trainer.snapshot import pack, state_files

log = logging.getLogger(__name__)
progress_log = logging.getLogger("trainer.progress")   # the attempt's log file, not the terminal

RECORD = "state.db"
BASELINE = "baseline.json"
RECORD_SYNC_S = 10.0         # the record's upload after checkpoints, at most this often
CHECKPOINT_RESERVE_S = 5.0   # budget held back for the final checkpoint and its upload
NO_SIGNAL_HINT = ("GRPO cannot learn from it: every group would get identical rewards. "
                  "Fine-tune with SFT first, or pick a task the base model sometimes solves.")


@dataclass(frozen=True)
class RunSpec:
    """What one attempt needs, resolved by the caller (runner) from the TrainingJob."""
    name: str
    manifest: dict[str, Any]         # the job as the user wrote it, defaults filled (never credentials)
    model: str                       # what from_pretrained takes: a hub id or a folder
    env: Environment
    params: GRPOParams
    storage: str                     # URL of this job's folder in object storage
    keep_checkpoints: int = 3
    model_name: str | None = None    # the model as the user named it (saved adapters say this)
    usd_per_hour: float | None = None  # the GPU's rate, for the cost ledger (None: cost unknown)
    max_cost_usd: float | None = None  # spec.maxCostUSD: stop cleanly before a step would pass it

    def to_json(self) -> str:
        env = self.env
        return json.dumps({
            "name": self.name, "manifest": self.manifest, "model": self.model, "storage": self.storage,
            "keep_checkpoints": self.keep_checkpoints, "model_name": self.model_name,
            "usd_per_hour": self.usd_per_hour, "max_cost_usd": self.max_cost_usd,
            "params": to_yaml_dict(self.params),
            "env": {"name": env.name, "reward_ref": env.reward_ref, "train_tasks": list(env.train_tasks),
                    "eval_tasks": list(env.eval_tasks), "search_path": list(env.search_path)},
        })

    @classmethod
    def from_json(cls, text: str) -> "RunSpec":
        doc = json.loads(text)
        problems: list[str] = []
        params = parse_parameters(doc.pop("params"), "params", problems)
        if problems:
            raise ValueError("; ".join(problems))
        e = doc.pop("env")
        env = Environment(name=e["name"], reward_ref=e["reward_ref"], train_tasks=tuple(e["train_tasks"]),
                          eval_tasks=tuple(e["eval_tasks"]), search_path=tuple(e["search_path"]))
        return cls(env=env, params=params, **doc)


@dataclass
class Outcome:
    phase: Phase
    step: int
    message: str = ""
    baseline: dict[str, Any] | None = None
    final: dict[str, Any] | None = None
    extras: dict[str, Any] = field(default_factory=dict)


class JobFailed(RuntimeError):
    """The attempt ended as Failed; str() says why (for a reward function, its own error)."""


def model_identity(model: str) -> Any:
    """What names a model's weights: a hub id as given; for a folder, its config and a sampled
    hash of every weight file (64 KiB at 64 evenly spaced offsets, plus the size). Re-saving
    trained weights into the same folder changes it; copying the folder to a new node does not.
    Hashing every byte of a 16 GB model at each start would cost more than it protects."""
    folder = Path(model)
    if not (folder / "config.json").is_file():
        return model
    files = {}
    for f in sorted(folder.iterdir()):
        if f.suffix not in (".safetensors", ".bin", ".pt", ".gguf"):
            continue
        size, h = f.stat().st_size, hashlib.sha256()
        with open(f, "rb") as fh:
            for i in range(64):
                fh.seek(size * i // 64)
                h.update(fh.read(64 * 1024))
        files[f.name] = [size, h.hexdigest()]
    return {"config": json.loads((folder / "config.json").read_text()), "weights": files}


def reward_identity(ref: str) -> str:
    """A file reward by its content (the same file fetched to another path on a new node is the
    same reward); a module reward by its name."""
    module, _, func = ref.rpartition(":")
    if module.endswith(".py") and Path(module).is_file():
        return f"sha256:{hashlib.sha256(Path(module).read_bytes()).hexdigest()}:{func}"
    return ref


def baseline_fingerprint(spec: RunSpec) -> str:
    """sha256 over everything the baseline evaluation depends on: the model's identity, the
    environment's reward and eval tasks, the generation settings and the seed."""
    p = spec.params
    payload = {
        "model": model_identity(spec.model), "method": p.method, "environment": spec.env.name,
        "reward": reward_identity(spec.env.reward_ref), "evalTasks": list(spec.env.eval_tasks),
        "maxCompletionLength": p.maxCompletionLength, "evalTemperature": p.evalTemperature, "seed": p.seed,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


class Attempt:
    """Owns one attempt's record, store, uploader and trainer."""

    def __init__(self, spec: RunSpec, work: Path, *, stop: threading.Event | None = None,
                 progress: bool = True) -> None:
        self.spec = spec
        self.work = Path(work)
        self.stop = stop or threading.Event()
        # Set (from a signal handler: a plain attribute, no lock) to checkpoint at the next step
        # boundary without stopping: the supervisor's answer to a rebalance recommendation.
        self.checkpoint_requested = False
        self.progress = progress
        self._t0 = time.monotonic()
        self.work.mkdir(parents=True, exist_ok=True)
        self.store = Store(spec.storage, stop=None)
        self.store.check()                      # a bad bucket or credentials fail before any work
        self._fetch_record()
        self.record = Record(self.work / RECORD)
        self.record.init_job(spec.name, spec.manifest)
        self._apply_spec_changes()
        self._record_sync = ThreadPoolExecutor(max_workers=1, thread_name_prefix="record-sync")
        self._writer: CheckpointWriter | None = None
        self._last_checkpoint = 0
        self._last_record_sync = 0.0
        self._ledger: dict[str, Any] | None = None   # the record's cost ledger (read on first use)
        self._noted_durable: set[int] = set()    # durable checkpoints already marked in the record
        self.trainer = None
        self.budget_exceeded = False

    def _apply_spec_changes(self) -> None:
        """`apply` of an edited job file continues the job under the new spec (kubectl apply);
        a finished job is not reopened. Raises ValueError for that case."""
        job = self.record.job()
        if job["spec"] == self.spec.manifest:
            return
        changed = sorted(_diff(job["spec"], self.spec.manifest))
        if job["phase"] == Phase.SUCCEEDED:
            raise ValueError(f"job {self.spec.name!r} already succeeded with a different spec (changed: "
                             f"{', '.join(changed)}); give the new job its own metadata.name")
        log.warning("job %s continues with a changed spec: %s", self.spec.name, ", ".join(changed))
        self.record.set_spec(self.spec.manifest)

    # --- the record travels with the run ---------------------------------------------------

    def _fetch_record(self) -> None:
        """On a node that has never run this job, start from the record in storage."""
        local = self.work / RECORD
        if not local.exists() and self.store.exists(RECORD):
            self.store.get_file(RECORD, local)

    def _sync_record(self, wait: bool = False) -> None:
        """Upload a snapshot of the record, in the background unless `wait`."""
        snap = self.work / "state.snapshot.db"

        def upload() -> None:
            self.record.snapshot(snap)
            self.store.put_file(snap, RECORD)

        self._last_record_sync = time.monotonic()
        done = self._record_sync.submit(upload)
        if wait:
            done.result()

    def _phase(self, phase: Phase, message: str = "") -> None:
        """Phase changes are rare and are what a new node reads first: wait until stored."""
        self.record.set_phase(phase, message)
        self._sync_record(wait=True)

    # --- the attempt -------------------------------------------------------------------------

    def run(self) -> Outcome:
        """Run (or continue) the job to the end or to a stop. Raises JobFailed."""
        job = self.record.job()
        if job and job["phase"] == Phase.SUCCEEDED:
            return Outcome(Phase.SUCCEEDED, self._last_step(), "the job had already succeeded; nothing to do",
                           baseline=self.record.eval("baseline"), final=self.record.eval("final"))
        self._close_dangling_attempts()
        self.attempt = self.record.start_attempt(socket.gethostname())
        self._t0 = time.monotonic()
        self._sync_record(wait=True)
        try:
            outcome = self._run()
        except RewardFunctionError as e:
            self._fail(f"reward function failed: {e}")
            raise JobFailed(f"reward function failed: {e}") from None
        except BaseException as e:  # anything else: record it, then let the caller see the real error
            self._fail(f"{type(e).__name__}: {e}")
            raise
        finally:
            self._shutdown()
        return outcome

    def _run(self) -> Outcome:

        p = self.spec.params
        logs = self.work / "logs" / "trainer.log"
        # Started first: its imports and its store's first request overlap the model's loading.
        self._writer = CheckpointWriter(self.work / "checkpoints", self.spec.storage, keep=self.spec.keep_checkpoints,
                                        meta={"job": self.spec.name}, log_file=logs if logs.exists() else None)
        start, durable = self._restore_checkpoint()
        self.trainer = GRPOTrainer(self.spec.model, self.spec.env, p, stop=self.stop,
                                   model_name=self.spec.model_name)
        device = self.trainer.device
        self.record.set_value("device", f"cuda:{torch.cuda.get_device_name(device)}" if device.type == "cuda" else "cpu")
        if start:
            folder = checkpoint_dir(self.work / "checkpoints", start)
            self.trainer.load_state(folder)
            log.info("resumed from the checkpoint at step %d", start)
            self.record.set_value("resumedFrom", start)
            if not durable:                  # written here before a crash, never uploaded
                self._writer.upload(start)

        baseline = self._baseline()
        if self.stop.is_set():
            return self._stopped(start, Phase.PREEMPTED, "Preempted",
                                 f"stopped after step {start}; resume continues from there")
        step = self._train(start)
        if self.budget_exceeded:
            return self._stopped(step, Phase.BUDGET_EXCEEDED, "BudgetExceeded",
                                 f"spent ${self._spent_usd():.4f} of maxCostUSD ${self.spec.max_cost_usd}; "
                                 f"stopped after step {step} with a checkpoint (resume with a larger budget)")
        if step < p.maxSteps:
            return self._stopped(step, Phase.PREEMPTED, "Preempted",
                                 f"stopped after step {step}; resume continues from there")

        self._phase(Phase.FINAL_EVAL)
        log.info("final evaluation on the same %d held-out tasks", len(self.spec.env.eval_tasks))
        final = self.trainer.evaluate(self.spec.env.eval_tasks).to_dict()
        self.record.record_eval("final", final, computed=True, fingerprint=baseline_fingerprint(self.spec))
        self._save_final(step)
        self._write_ledger()
        self.record.end_attempt(self.attempt, "Succeeded")
        self._phase(Phase.SUCCEEDED, f"final held-out reward {final['meanReward']:.3f} "
                                     f"(baseline {baseline['meanReward']:.3f})")
        return Outcome(Phase.SUCCEEDED, step, baseline=self.record.eval("baseline"), final=self.record.eval("final"))

    def _restore_checkpoint(self) -> tuple[int, bool]:
        """(the newest checkpoint's step that verifies, local or remote, 0 when none; whether it
        is durable in storage). Partial or corrupt ones are skipped with a warning naming them."""
        root = self.work / "checkpoints"
        remote = download_latest(self.store, root, "checkpoints")
        local = discover(root) if root.exists() else []
        newest_local = local[0][0] if local else 0
        newest_remote = remote[0] if remote else 0
        return max(newest_local, newest_remote), newest_remote >= newest_local

    def _baseline(self) -> dict[str, Any]:
        fingerprint = baseline_fingerprint(self.spec)
        cached = self.record.eval("baseline")
        if cached is None or cached.get("fingerprint") != fingerprint:
            cached = self._baseline_from_store(fingerprint)
        if cached is not None and cached.get("fingerprint") == fingerprint:
            result = {k: cached[k] for k in ("meanReward", "tasks", "solved") if k in cached}
            self.record.record_eval("baseline", result, computed=False, fingerprint=fingerprint)
            log.info("baseline evaluation reused from the cache (fingerprint %s)", fingerprint[:12])
            return result
        if cached is not None:
            why = ("the cached baseline was computed for another model, environment, eval tasks or "
                   "generation settings; evaluating again")
            log.warning(why)
            self.record.set_value("baselineCache", why)
        self._phase(Phase.BASELINE_EVAL)
        log.info("baseline evaluation on %d held-out tasks", len(self.spec.env.eval_tasks))
        ev = self.trainer.evaluate(self.spec.env.eval_tasks)
        result = ev.to_dict()
        log.info("baseline held-out mean reward %.3f (%d of %d tasks solved)", ev.meanReward, ev.solved, ev.tasks)
        self.record.record_eval("baseline", result, computed=True, fingerprint=fingerprint)
        self.store.put_bytes(BASELINE, json.dumps({**result, "fingerprint": fingerprint}).encode())
        if ev.no_signal:
            warning = (f"baseline held-out reward is {ev.meanReward:.0%} on every task: {NO_SIGNAL_HINT}")
            log.warning(warning)
            self.record.set_value("baselineWarning", warning)
        self._sync_record(wait=True)
        return result

    def _baseline_from_store(self, fingerprint: str) -> dict[str, Any] | None:
        try:
            doc = json.loads(self.store.get_bytes(BASELINE))
        except FileNotFoundError:
            return None
        return doc if isinstance(doc, dict) else None

    def _train(self, start: int) -> int:
        """Steps start..maxSteps-1; returns the number of completed steps (less on a stop)."""
        p = self.spec.params
        if start >= p.maxSteps:          # killed during the final evaluation: nothing left to train
            return start
        self._phase(Phase.TRAINING)
        bar = _progress_bar(p.maxSteps, start, self.progress)
        step, last_step_seconds = start, 0.0
        try:
            while step < p.maxSteps:
                if self.stop.is_set():           # preemption honoured between steps
                    break
                if self._over_budget(last_step_seconds):
                    self.budget_exceeded = True
                    break
                if self.checkpoint_requested and step > start:
                    self.checkpoint_requested = False
                    self._checkpoint(step)
                try:
                    metrics = self.trainer.train_step(step)
                except GenerationInterrupted:     # ... and between tokens: this step is abandoned
                    break
                step += 1
                last_step_seconds = metrics["stepSeconds"]
                metrics["costUSD"] = round(self._spent_usd(), 6)
                with self.record.transaction():      # one commit per step, the writer's news included
                    self.record.log_step(step, metrics)
                    failure = self._note_writer_events(self._writer.poll())
                if failure is not None:
                    raise failure
                if step % max(1, p.maxSteps // 20) == 0:
                    progress_log.info("step %d/%d reward %.3f identical-groups %.2f length %.1f loss %.4f",
                                      step, p.maxSteps, metrics["rewardMean"], metrics["identicalGroups"],
                                      metrics["completionLength"], metrics["loss"])
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['rewardMean']:.3f}", same=f"{metrics['identicalGroups']:.2f}",
                                len=f"{metrics['completionLength']:.1f}", refresh=False)
                if step % p.saveSteps == 0 and step < p.maxSteps:
                    self._checkpoint(step)
        finally:
            bar.close()
        self._update_reward_signal()
        return step

    def _checkpoint(self, step: int) -> None:
        """Checkpoint after `step` completed steps. The training thread only copies the state
        into the checkpoint writer's shared buffer (waiting while the writer still reads the
        previous one); writing, fsync, the manifest and the upload happen in the writer process,
        so training waits on neither the disk nor the network, nor on their Python (the GIL)."""
        layout, _ = pack(state_files(self.trainer, step), self._writer.buffer)
        self._writer.submit(step, layout)
        self._last_checkpoint = step
        # The record's copy in storage trails by at most RECORD_SYNC_S between phase changes:
        # uploading the whole database after every checkpoint cost more than the checkpoint.
        if time.monotonic() - self._last_record_sync >= RECORD_SYNC_S:
            self._update_reward_signal()
            self._sync_record()

    def _note_writer_events(self, events: list[dict[str, Any]]) -> Exception | None:
        """Put what the checkpoint writer reports into the record (call inside a transaction).
        Returns the error that must stop the run: a checkpoint that could not be written, or a
        storage configuration error. A failed upload alone is retried with the next checkpoint."""
        failure = None
        for event in events:
            if "sealed" in event:
                self.record.add_checkpoint(event["sealed"], durable=False)
                self._write_ledger()
            elif "upload" in event:
                for step in event["durable"]:
                    if step not in self._noted_durable:
                        self.record.add_checkpoint(step, durable=True)
                        self._noted_durable.add(step)
                if event["config"]:
                    failure = StorageConfigError(event["error"])
            elif "failed" in event:
                failure = (StorageConfigError if event["config"] else RuntimeError)(
                    f"checkpoint {event['failed']} could not be written: {event['error']}")
        return failure

    def _stopped(self, step: int, phase: Phase, reason: str, message: str) -> Outcome:
        """Checkpoint the last completed step, wait until it is durable, end the attempt."""
        durable = None
        if step > 0:
            if self._last_checkpoint != step:
                self._checkpoint(step)
            else:
                self._writer.upload(step)      # written already; make sure of its upload
            with self.record.transaction():
                failure = self._note_writer_events(self._writer.wait_upload(step))
            if failure is not None:
                raise failure
            if step in self._noted_durable:
                durable = step
        self._write_ledger()
        self.record.end_attempt(self.attempt, reason, message)
        self._phase(phase, message)
        return Outcome(phase, step, message, extras={"durableStep": durable})

    # --- cost ------------------------------------------------------------------------------------

    def _attempt_usd(self) -> float:
        rate = self.spec.usd_per_hour or 0.0
        return (time.monotonic() - self._t0) * rate / 3600

    def _spent_usd(self) -> float:
        """Every attempt's wall time at the GPU's rate: earlier attempts from the ledger, this one live."""
        earlier = sum(v["usd"] for k, v in self._read_ledger().items() if k != str(self.attempt))
        return earlier + self._attempt_usd()

    def _read_ledger(self) -> dict[str, Any]:
        if self._ledger is None:     # read once: only this attempt writes the ledger now
            self._ledger = dict(self.record.value("ledger", {}) or {})
        return self._ledger

    def _write_ledger(self) -> None:
        ledger = self._read_ledger()
        ledger[str(self.attempt)] = {"seconds": round(time.monotonic() - self._t0, 3),
                                     "usd": round(self._attempt_usd(), 6),
                                     "usdPerHour": self.spec.usd_per_hour}
        self.record.set_value("ledger", ledger)

    def _over_budget(self, next_step_seconds: float) -> bool:
        """Would the next step (assumed as long as the last) and the checkpoint that must follow
        it take the spend past maxCostUSD? The stop itself costs time — writing the checkpoint
        and waiting until it is durable — so that much is held back (CHECKPOINT_RESERVE_S)."""
        limit, rate = self.spec.max_cost_usd, self.spec.usd_per_hour
        if not limit or not rate:
            return False
        return self._spent_usd() + (next_step_seconds + CHECKPOINT_RESERVE_S) * rate / 3600 > limit

    def _save_final(self, step: int) -> None:
        """Final weights sealed like a checkpoint, under final/ locally and in storage, durable
        before the job is called Succeeded."""
        root = self.work / "final"
        staging = staging_dir(root, step)
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
        self.trainer.save_weights(staging)
        final = checkpoint_dir(root, step)
        if final.exists():
            shutil.rmtree(final)
        finalize_checkpoint(staging, final, step=step, meta={"job": self.spec.name, "final": True})
        uploader = Uploader(self.store, "final", keep=2)
        try:
            uploader.submit(final)
            if not uploader.wait():
                raise RuntimeError(f"the final weights could not be uploaded: {uploader.error}")
        finally:
            uploader.close()

    def _update_reward_signal(self) -> None:
        steps = self.record.steps(last=50)   # on the training thread: the window only
        if not steps:
            return
        frac = sum(s["identicalGroups"] for s in steps) / len(steps)
        signal = {"identicalGroupFraction": round(frac, 4), "window": len(steps)}
        if frac >= 0.5:
            signal["warning"] = (f"{frac:.0%} of groups in the last {len(steps)} steps had identical rewards "
                                 "and taught nothing; raise numGenerations or temperature, or use an easier task")
        self.record.set_value("rewardSignal", signal)

    def _fail(self, message: str) -> None:
        try:
            self._write_ledger()
            self.record.end_attempt(self.attempt, "Failed", message)
            self._phase(Phase.FAILED, message)
        except Exception:  # the record must not hide the original error
            log.exception("could not record the failure")

    def _close_dangling_attempts(self) -> None:
        for a in self.record.attempts():
            if a["ended"] is None:
                self.record.end_attempt(a["id"], "Crashed", "the node stopped without a word (killed or lost)")

    def _last_step(self) -> int:
        steps = self.record.steps(last=1)
        return steps[-1]["step"] if steps else 0

    def _shutdown(self) -> None:
        if self._writer is not None:
            events = self._writer.close()
            with self.record.transaction():
                self._note_writer_events(events)      # what is durable; errors were reported already
        if self.trainer is not None:
            self.trainer.close()
        self._sync_record()
        self._record_sync.shutdown(wait=True)


def _diff(old: Any, new: Any, path: str = "") -> list[str]:
    """Dotted paths where two manifests differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in set(old) | set(new):
            out += _diff(old.get(key), new.get(key), f"{path}.{key}" if path else key)
        return out
    return [] if old == new else [path]


def _progress_bar(total: int, initial: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="training", unit="step", disable=not enabled,
                file=sys.stderr, dynamic_ncols=True, mininterval=0.5)
