"""The held-out evaluations' books: the baseline cache (the record's, else `baseline.json` in the
job's storage folder, with the samples the baseline kept), the evaluation batches a stopped
attempt finished, the held-out curve and the size of one evaluation. A result is reused only for
the fingerprint it was computed for (runner.books.fingerprint)."""

from __future__ import annotations

import json
import logging
from typing import Any

from pydantic import ValidationError

from grpo_run.checkpoint.storage.store import ObjectStore, ObjectTooLarge
from grpo_run.state import values
from grpo_run.state.record import Record
from grpo_run.trainer.protocol import EvalSummary, SampleGroup

log = logging.getLogger(__name__)

BASELINE = "baseline.json"
# The summary and at most sampleEvalTasks (32) samples of capped text: far below this. One larger
# was not written by us (whoever can write the bucket could plant one) and is never read whole.
MAX_BASELINE_BYTES = 16 << 20
NO_SIGNAL_HINT = ("GRPO cannot learn from it: every group would get identical rewards. "
                  "Fine-tune with SFT first, or pick a task the base model sometimes solves.")


class Evals:
    def __init__(self, record: Record, store: ObjectStore) -> None:
        self.record = record
        self.store = store

    def cached_baseline(self, fingerprint: str) -> tuple[EvalSummary, list[dict[str, Any]] | None] | None:
        """The baseline computed earlier for this very fingerprint (the record's, else the one in
        storage), recorded as reused, with the samples to put back in the record: storage's
        cache's ([] when it has none), None for the record's own (its samples are still there);
        None when it must be computed (said why when a cache for other settings was there)."""
        cached = self.record.eval("baseline")
        stored = None
        if cached is None or cached.get("fingerprint") != fingerprint:
            try:
                doc = json.loads(self.store.get_bytes(BASELINE, max_bytes=MAX_BASELINE_BYTES))
                if isinstance(doc, dict):
                    cached = stored = doc
            except FileNotFoundError:
                pass
            except ObjectTooLarge:
                log.warning("storage's %s is larger than %s bytes: not read; the baseline is evaluated again",
                            BASELINE, f"{MAX_BASELINE_BYTES:,}")
            except ValueError:                 # not JSON (UnicodeDecodeError is a ValueError too)
                log.warning("storage's %s is not JSON: ignored; the baseline is evaluated again", BASELINE)
        if cached is not None and cached.get("fingerprint") == fingerprint:
            try:
                result = EvalSummary.model_validate({k: cached[k] for k in EvalSummary.model_fields if k in cached})
            except ValidationError as e:
                problem = e.errors()[0]
                where = str(problem["loc"][0]) if problem["loc"] else "the document"  # a field, never a key
                log.warning("%s does not read as a baseline (%s: %s): ignored; the baseline is evaluated again",
                            f"storage's {BASELINE}" if stored is not None else "the record's baseline", where,
                            problem["msg"])
                return None
            self.record.record_eval("baseline", result.to_dict(), computed=False, fingerprint=fingerprint)
            log.info("baseline evaluation reused from the cache (fingerprint %s)", fingerprint[:12])
            return result, _stored_samples(stored) if stored is not None else None
        if cached is not None:
            log.warning("the cached baseline was computed for another model, environment, eval tasks or "
                        "generation settings; evaluating again")
        return None

    def record_computed(self, kind: str, result: EvalSummary, fingerprint: str, *, no_signal: bool) -> None:
        """An evaluation the trainer just ran (counted: status.baseline.runs)."""
        self.record.record_eval(kind, result.to_dict(), computed=True, fingerprint=fingerprint)
        if kind == "baseline" and no_signal:
            warning = f"baseline held-out reward is {result.meanReward:.0%} on every task: {NO_SIGNAL_HINT}"
            log.warning(warning)
            values.BASELINE_WARNING.set(self.record, warning)

    def cache_baseline(self, result: EvalSummary, fingerprint: str) -> None:
        """The baseline beside the record in storage, with the samples it kept (the record's), for
        a job submitted again after its record was deleted."""
        kept = [{k: v for k, v in g.items() if k != "step"}
                for g in self.record.samples("baseline", self.record.sample_steps("baseline"))]
        self.store.put_bytes(BASELINE, json.dumps({**result.to_dict(), "fingerprint": fingerprint, "samples": kept}).encode())

    def add_held_out(self, step: int, result: EvalSummary) -> None:
        """An evaluation on the held-out tasks after `step` (every evalSteps): the curve `get tj`
        shows as status.heldOut while the job runs."""
        curve = [e for e in values.HELD_OUT.get(self.record) if e["step"] != step]
        curve.append({"step": step, **result.model_dump(include={"meanReward", "rewards", "solved"}, exclude_none=True)})
        values.HELD_OUT.set(self.record, sorted(curve, key=lambda e: e["step"]))

    def batches(self, kind: str, fingerprint: str) -> dict[int, dict[str, list[float]]]:
        """Evaluation batches of `kind` an earlier attempt finished for this fingerprint."""
        saved = values.EVAL_BATCHES[kind].get(self.record) or {}
        if saved.get("fingerprint") != fingerprint:
            return {}
        return {int(i): r for i, r in saved["batches"].items()}

    def add_batch(self, kind: str, fingerprint: str, batch: int, rewards: dict[str, list[float]]) -> None:
        """Keep batch `batch`'s scores ({reward name: one per task}) for a resume to reuse."""
        saved = values.EVAL_BATCHES[kind].get(self.record) or {}
        if saved.get("fingerprint") != fingerprint:
            saved = {"fingerprint": fingerprint, "batches": {}}
        saved["batches"][str(batch)] = rewards
        values.EVAL_BATCHES[kind].set(self.record, saved)

    def plan(self, tasks: int, batch_size: int) -> None:
        """How big one held-out evaluation is, for `get tj -w`'s evaluation bars."""
        values.EVAL_PLAN.set(self.record, {"tasks": tasks, "batches": -(-tasks // batch_size)})


def _stored_samples(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The samples a cached baseline kept, each checked as the trainer's Samples event is; none
    (said why) when they do not read as such. A cache written before it kept samples has none."""
    try:
        return [SampleGroup.model_validate(g).model_dump() for g in doc.get("samples", [])]
    except (TypeError, ValueError) as e:      # pydantic's ValidationError is a ValueError
        log.warning("the cached baseline's samples are unreadable (%s); the reused baseline has none",
                    str(e).splitlines()[0])
        return []
