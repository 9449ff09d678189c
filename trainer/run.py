"""One attempt at a job on this node: restore -> baseline -> training -> final evaluation.

The phases, in order, each recorded in the run's SQLite record (state/):

    BaselineEval  held-out tasks, before any update; cached in object storage with a
                  fingerprint of what it depends on, so a resume never pays for it twice
    Training      GRPO steps; a complete checkpoint every saveSteps, uploaded off-thread
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checkpoint.manifest import checkpoint_dir, discover, finalize_checkpoint, prune, staging_dir, verify
from checkpoint.store import Store
from checkpoint.sync import Uploader, download_latest
from state.record import Phase, Record
from trainer.config import GRPOParams
from trainer.envs import Environment
from trainer.grader import RewardFunctionError
from trainer.grpo import GenerationInterrupted

log = logging.getLogger(__name__)

RECORD = "state.db"
BASELINE = "baseline.json"
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


def baseline_fingerprint(spec: RunSpec) -> str:
    """sha256 over everything the baseline evaluation depends on: the model's identity, the
    environment's reward and eval tasks, the generation settings and the seed."""
    p = spec.params
    model_id: Any = spec.model
    folder = Path(spec.model)
    if (folder / "config.json").is_file():
        # A local folder: its config and the names and sizes of its weight files (hashing
        # gigabytes of weights at every start would cost more than it protects).
        weights = sorted((f.name, f.stat().st_size) for f in folder.iterdir() if f.suffix in (".safetensors", ".bin"))
        model_id = {"config": (folder / "config.json").read_text(), "weights": weights}
    payload = {
        "model": model_id, "method": p.method, "environment": spec.env.name, "reward": spec.env.reward_ref,
        "evalTasks": list(spec.env.eval_tasks), "maxCompletionLength": p.maxCompletionLength,
        "evalTemperature": p.evalTemperature, "seed": p.seed,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


class Attempt:
    """Owns one attempt's record, store, uploader and trainer."""

    def __init__(self, spec: RunSpec, work: Path, *, stop: threading.Event | None = None,
                 progress: bool = True) -> None:
        self.spec = spec
        self.work = Path(work)
        self.stop = stop or threading.Event()
        self.progress = progress
        self.work.mkdir(parents=True, exist_ok=True)
        self.store = Store(spec.storage, stop=None)
        self.store.check()                      # a bad bucket or credentials fail before any work
        self._fetch_record()
        self.record = Record(self.work / RECORD)
        self.record.init_job(spec.name, spec.manifest)
        self._record_sync = ThreadPoolExecutor(max_workers=1, thread_name_prefix="record-sync")
        self.trainer = None
        self.uploader: Uploader | None = None

    # --- the record travels with the run ---------------------------------------------------

    def _fetch_record(self) -> None:
        """On a node that has never run this job, start from the record in storage."""
        local = self.work / RECORD
        if not local.exists() and self.store.exists(RECORD):
            self.store.get_file(RECORD, local)

    def _sync_record(self) -> None:
        snap = self.work / "state.snapshot.db"

        def upload() -> None:
            self.record.snapshot(snap)
            self.store.put_file(snap, RECORD)

        self._record_sync.submit(upload)

    def _phase(self, phase: Phase, message: str = "") -> None:
        self.record.set_phase(phase, message)
        self._sync_record()

    # --- the attempt -------------------------------------------------------------------------

    def run(self) -> Outcome:
        """Run (or continue) the job to the end or to a stop. Raises JobFailed."""
        job = self.record.job()
        if job and job["phase"] == Phase.SUCCEEDED:
            return Outcome(Phase.SUCCEEDED, self._last_step(), "the job had already succeeded; nothing to do",
                           baseline=self.record.eval("baseline"), final=self.record.eval("final"))
        self._close_dangling_attempts()
        self.attempt = self.record.start_attempt(socket.gethostname())
        self._sync_record()
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
        from trainer.loop import GRPOTrainer

        p = self.spec.params
        start = self._restore_checkpoint()
        self.trainer = GRPOTrainer(self.spec.model, self.spec.env, p, stop=self.stop)
        if start:
            restored = self.trainer.load_state(checkpoint_dir(self.work / "checkpoints", start))
            assert restored == start, (restored, start)
            log.info("resumed from the checkpoint at step %d", start)
        self.uploader = Uploader(self.store, "checkpoints", keep=self.spec.keep_checkpoints)

        baseline = self._baseline()
        if self.stop.is_set():
            return self._preempted(start)
        step = self._train(start)
        if step < p.maxSteps:
            return self._preempted(step)

        self._phase(Phase.FINAL_EVAL)
        final = self.trainer.evaluate(self.spec.env.eval_tasks).to_dict()
        self.record.record_eval("final", final, computed=True, fingerprint=baseline_fingerprint(self.spec))
        self._save_final(step)
        self.record.end_attempt(self.attempt, "Succeeded")
        self._phase(Phase.SUCCEEDED, f"final held-out reward {final['meanReward']:.3f} "
                                     f"(baseline {baseline['meanReward']:.3f})")
        return Outcome(Phase.SUCCEEDED, step, baseline=self.record.eval("baseline"), final=self.record.eval("final"))

    def _restore_checkpoint(self) -> int:
        """The newest checkpoint that verifies, local or remote; 0 when there is none."""
        root = self.work / "checkpoints"
        local = discover(root) if root.exists() else []
        remote = download_latest(self.store, root, "checkpoints")
        candidates = ([local[0][0]] if local else []) + ([remote[0]] if remote else [])
        return max(candidates, default=0)

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
            log.warning("the cached baseline does not match this job's model, tasks or generation "
                        "settings; evaluating again")
        self._phase(Phase.BASELINE_EVAL)
        ev = self.trainer.evaluate(self.spec.env.eval_tasks)
        result = ev.to_dict()
        self.record.record_eval("baseline", result, computed=True, fingerprint=fingerprint)
        self.store.put_bytes(BASELINE, json.dumps({**result, "fingerprint": fingerprint}).encode())
        if ev.no_signal:
            warning = (f"baseline held-out reward is {ev.meanReward:.0%} on every task: {NO_SIGNAL_HINT}")
            log.warning(warning)
            self.record.set_value("baselineWarning", warning)
        self._sync_record()
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
        self._phase(Phase.TRAINING)
        bar = _progress_bar(p.maxSteps, start, self.progress)
        step = start
        try:
            while step < p.maxSteps:
                if self.stop.is_set():           # preemption honoured between steps
                    break
                try:
                    metrics = self.trainer.train_step(step)
                except GenerationInterrupted:     # ... and between tokens: this step is abandoned
                    break
                step += 1
                self.record.log_step(step, metrics)
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['rewardMean']:.3f}", same=f"{metrics['identicalGroups']:.2f}",
                                len=f"{metrics['completionLength']:.1f}", refresh=False)
                if step % p.saveSteps == 0 and step < p.maxSteps:
                    self._checkpoint(step)
        finally:
            bar.close()
        self._update_reward_signal()
        return step

    def _checkpoint(self, step: int) -> Path:
        root = self.work / "checkpoints"
        final = checkpoint_dir(root, step)
        if final.exists():
            return final
        staging = staging_dir(root, step)
        staging.mkdir(parents=True, exist_ok=True)
        self.trainer.save_state(staging, step)
        self.record.add_checkpoint(step, durable=False)
        finalize_checkpoint(staging, final, step=step, meta={"job": self.spec.name})
        prune(root, keep=self.spec.keep_checkpoints)
        self.uploader.submit(final)
        self._update_reward_signal()
        self._sync_record()
        return final

    def _preempted(self, step: int) -> Outcome:
        """Checkpoint the last completed step, wait until it is durable, end as Preempted."""
        if step > 0:
            self._checkpoint(step)
            durable = self.uploader.wait()
            if durable:
                self.record.add_checkpoint(step, durable=True)
        self.record.end_attempt(self.attempt, "Preempted")
        self._phase(Phase.PREEMPTED, f"stopped after step {step}; resume continues from there")
        return Outcome(Phase.PREEMPTED, step)

    def _save_final(self, step: int) -> None:
        """Final weights sealed like a checkpoint, under final/ locally and in storage, durable
        before the job is called Succeeded."""
        root = self.work / "final"
        staging = staging_dir(root, step)
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
        self.trainer.save_weights(staging / ("model" if self.spec.params.method == "Full" else "adapter"))
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
        steps = self.record.steps()[-50:]
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
            self.record.end_attempt(self.attempt, "Failed", message)
            self._phase(Phase.FAILED, message)
        except Exception:  # the record must not hide the original error
            log.exception("could not record the failure")

    def _close_dangling_attempts(self) -> None:
        for a in self.record.attempts():
            if a["ended"] is None:
                self.record.end_attempt(a["id"], "Crashed", "the node stopped without a word (killed or lost)")

    def _last_step(self) -> int:
        steps = self.record.steps()
        return steps[-1]["step"] if steps else 0

    def _shutdown(self) -> None:
        if self.uploader is not None:
            self.uploader.close()
            for step in self.uploader.durable_steps():
                self.record.add_checkpoint(step, durable=True)
        if self.trainer is not None:
            self.trainer.close()
        self._sync_record()
        self._record_sync.shutdown(wait=True)


def _progress_bar(total: int, initial: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="training", unit="step", disable=not enabled,
                file=sys.stderr, dynamic_ncols=True, mininterval=0.5)
