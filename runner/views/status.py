"""`status` of a TrainingJob, read from its record: what `grpo-run get tj` shows."""

from __future__ import annotations

from typing import Any

from grpo_run.runner.text import printable
from grpo_run.state import values
from grpo_run.state.record import Record

EVAL_KEYS = ("meanReward", "rewards", "tasks", "solved", "runs", "source", "batches", "reusedBatches")


def _eval(record: Record, kind: str) -> dict[str, Any] | None:
    ev = record.eval(kind)
    return None if ev is None else {k: ev[k] for k in EVAL_KEYS if k in ev}


def _rounded(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _rounded(x) for k, x in v.items()}
    return round(v, 4) if isinstance(v, float) else v


def job_document(record: Record) -> dict[str, Any]:
    """The job as `grpo-run get tj` shows it: {apiVersion, kind, metadata, spec, status}. Raises
    LookupError for a record this instant created, its job not written into it yet."""
    job = record.job()
    if job is None:
        raise LookupError("the job's record is being created; ask again in a moment")
    spec = job["spec"]
    return {"apiVersion": spec.get("apiVersion"), "kind": spec.get("kind"), "metadata": spec.get("metadata"),
            "spec": spec.get("spec"), "status": job_status(record)}


def job_status(record: Record) -> dict[str, Any]:
    """{phase, message, step, baseline, final, diagnostics, attempts, checkpoints, lastStep}."""
    job = record.job()
    steps = record.steps()
    status: dict[str, Any] = {"phase": str(job["phase"]), "message": job.get("message") or "",
                              "step": steps[-1]["step"] if steps else 0}
    baseline, final = _eval(record, "baseline"), _eval(record, "final")
    if baseline:
        status["baseline"] = baseline
    if final:
        status["final"] = final
    if values.HELD_OUT.get(record):
        status["heldOut"] = values.HELD_OUT.get(record)     # every evalSteps, while training
    diagnostics: dict[str, Any] = {}
    if values.REWARD_SIGNAL.get(record) is not None:
        diagnostics["rewardSignal"] = values.REWARD_SIGNAL.get(record)
    if values.BASELINE_WARNING.get(record):
        diagnostics["baseline"] = values.BASELINE_WARNING.get(record)
    if diagnostics:
        status["diagnostics"] = diagnostics
    if steps:
        last = steps[-1]
        status["lastStep"] = {k: _rounded(v) for k, v in last.items()}
    ckpts = record.checkpoints()
    durable = [c["step"] for c in ckpts if c["durable"]]
    status["checkpoints"] = {"latest": ckpts[-1]["step"] if ckpts else None,
                             "latestDurable": max(durable) if durable else None}
    if values.DEVICE.get(record):
        status["device"] = values.DEVICE.get(record)
    if values.SAMPLER.get(record):
        status["sampler"] = values.SAMPLER.get(record)       # {engine, why, version, mode, startSeconds}
    if steps:
        times = sorted(s["stepSeconds"] for s in steps if "stepSeconds" in s)
        if times:
            status["medianStepSeconds"] = round(times[len(times) // 2], 4)
    if values.LEDGER.get(record) or values.JUDGE_USD.get(record):
        status["costUSD"] = round(values.spend_usd(record), 4)      # the GPU's time and the judges' priced calls
    if values.JUDGE_CALLS.get(record):
        status["judgeCalls"] = values.JUDGE_CALLS.get(record)      # the LLM judges' answered calls, whole run
    if values.JUDGE_USD.get(record):
        status["judgeCostUSD"] = {k: round(v, 4) for k, v in values.JUDGE_USD.get(record).items()}
    if values.ESTIMATE.get(record):
        status["estimate"] = values.ESTIMATE.get(record)     # what apply estimated, before anything was spent
    if values.LAST_NOTICE.get(record):
        status["lastNotice"] = values.LAST_NOTICE.get(record)
    if values.STARTUP.get(record):       # the newest node's path to its first new step (runner.supervisor.startup)
        status["startup"] = values.STARTUP.get(record)
    status["attempts"] = [{**{k: a[k] for k in ("node", "started", "ended", "reason", "notice", "message") if a.get(k)},
                           **{key: a[k] for k, key in (("from_step", "fromStep"), ("to_step", "toStep"))
                              if a.get(k) is not None},
                           **({"sandbox": a["sandbox"]} if a.get("sandbox") else {})}
                          for a in record.attempts()]
    return status


def table(docs: list[dict[str, Any]]) -> str:
    """kubectl-style table: NAME PHASE STEP BASELINE FINAL ATTEMPTS."""
    rows = [("NAME", "PHASE", "STEP", "BASELINE", "FINAL", "ATTEMPTS")]
    for d in docs:
        st = d["status"]
        total = d["spec"]["parameters"]["maxSteps"]
        rows.append((printable(d["metadata"]["name"]), st["phase"], f"{st['step']}/{total}",
                     f"{st['baseline']['meanReward']:.3f}" if "baseline" in st else "-",
                     f"{st['final']['meanReward']:.3f}" if "final" in st else "-",
                     str(len(st["attempts"]))))
    if len(rows) == 1:
        return "no jobs"
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["   ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines += [f"warning: {printable(d['metadata']['name'])}: {printable(said)}" for d in docs
              if (said := reward_signal_warning(d["status"]))]
    return "\n".join(lines)


def reward_signal_warning(status: dict[str, Any]) -> str | None:
    """diagnostics.rewardSignal.warning (most groups failed alike and taught nothing), or None:
    the table, the live view, a run's closing lines and the report all say it."""
    return ((status.get("diagnostics") or {}).get("rewardSignal") or {}).get("warning")
