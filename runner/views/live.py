"""`grpo-run get tj NAME -w`: a live bar per phase, read from the run's record.

    tiny-arithmetic  Training  attempt 2 on node-b, from step 600
      BaselineEval  [##############################]  done       held-out 0.033 (30 tasks)
      Training      [############..................]  620/1500   41%  12.3 steps/s  ETA 1m 12s  reward 0.412
      FinalEval     [..............................]  1 batch
      spend $0.0012 so far; projected $0.0030 at completion ($2.60/h)

Steps per second are the current attempt's (its newest RATE_WINDOW steps, wall time between
their records); the ETA adds the final evaluation, estimated as long as this run's baseline
took; the projection is the spend so far plus the ETA at the attempt's hourly rate.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any

from grpo_run.state import values
from grpo_run.state.phases import TERMINAL, Phase
from grpo_run.state.record import Record

BAR = 30                  # characters of each bar
RATE_WINDOW = 20          # steps the rate is measured over


def view(record: Record) -> list[str]:
    """The job's lines (a header, a bar per phase, the spend)."""
    job = record.job()
    phase = job["phase"]
    params = job["spec"].get("spec", {}).get("parameters", {})
    total = int(params.get("maxSteps") or 0)
    attempts = record.attempts()
    current = attempts[-1] if attempts else None
    running = current is not None and current["ended"] is None and phase not in TERMINAL
    steps = record.steps(last=RATE_WINDOW, logged=True)
    step = steps[-1]["step"] if steps else 0
    mine = [s for s in steps if running and s["logged"] >= current["started"]]
    rate = _rate(mine)
    plan = values.EVAL_PLAN.get(record) or {}
    baseline, final = record.eval("baseline"), record.eval("final")
    baseline_s = _baseline_seconds(record.transitions())

    head = f"{job['name']}  {phase}"
    if current is not None:
        head += f"  attempt {len(attempts)} on {current['node']}"
        if current.get("from_step"):
            head += f", from step {current['from_step']}"
    if phase not in TERMINAL and not running:
        head += "  (no node is running it)"
    lines = [head]

    # the baseline evaluation
    if baseline:
        note = "reused" if baseline.get("source") == "cache" else "done"
        lines.append(_row("BaselineEval", 1.0, f"{note:<10} held-out {baseline['meanReward']:.3f} "
                                               f"({baseline.get('tasks', '?')} tasks)"))
    else:
        lines.append(_eval_row("BaselineEval", record, "baseline", plan, active=phase == Phase.BASELINE_EVAL))

    # training
    if total:
        fraction = min(1.0, step / total)
        text = f"{step}/{total}".ljust(10) + f" {fraction:4.0%}"
        if rate and phase == Phase.TRAINING:
            text += f"  {rate:.1f} steps/s  ETA {_duration(_eta(total - step, rate, baseline_s, final))}"
        if steps:
            recent = [s["rewardMean"] for s in steps[-10:] if "rewardMean" in s]
            if recent:
                text += f"  reward {sum(recent) / len(recent):.3f}"
        lines.append(_row("Training", fraction, text))

    # the final evaluation
    if final:
        lines.append(_row("FinalEval", 1.0, f"{'done':<10} held-out {final['meanReward']:.3f} "
                                            f"({final.get('tasks', '?')} tasks)"))
    else:
        lines.append(_eval_row("FinalEval", record, "final", plan, active=phase == Phase.FINAL_EVAL))

    # the spend
    ledger = values.LEDGER.get(record)
    spent, judges = values.spend_usd(record), values.judges_usd(record)
    if running and steps and "costUSD" in steps[-1]:
        spent = max(spent, steps[-1]["costUSD"])
    usd_per_hour = (ledger.get(str(current["id"])) or {}).get("usdPerHour") if current else None
    of_it = f", ${judges:.4f} of it judge calls" if judges else ""
    if usd_per_hour:
        text = f"  spend ${spent:.4f} so far{of_it}"
        if phase not in TERMINAL and rate:
            left = _eta(total - step, rate, baseline_s, final) if phase == Phase.TRAINING else None
            if left is not None:
                text += f"; projected ${spent + left * usd_per_hour / 3600:.4f} at completion" + \
                        (" (GPU time; judge calls to come not counted)" if judges else "")
        lines.append(text + f" (${usd_per_hour:g}/h)")
    elif judges:
        lines.append(f"  spend ${spent:.4f} so far{of_it}; no GPU rate (set spec.gpu or spec.pricing.usdPerHour)")
    else:
        lines.append("  spend: no rate (set spec.gpu or spec.pricing.usdPerHour)")
    said = (values.REWARD_SIGNAL.get(record) or {}).get("warning")
    if said:
        lines.append(f"  warning: {said}")
    return lines


def _row(name: str, fraction: float, text: str) -> str:
    filled = int(round(fraction * BAR))
    return f"  {name:<12}  [{'#' * filled}{'.' * (BAR - filled)}]  {text}"


def _eval_row(name: str, record: Record, kind: str, plan: dict[str, Any], *, active: bool) -> str:
    saved = values.EVAL_BATCHES[kind].get(record) or {}
    done = len(saved.get("batches") or {}) if active else 0
    total = plan.get("batches")
    if total:
        return _row(name, done / total, f"{done}/{total} batches" + ("" if active else "  waiting"))
    return _row(name, 0.0, f"{done} batches" if active else "waiting")


def _rate(steps: list[dict[str, Any]]) -> float | None:
    """Steps per second over the records of `steps` (one attempt's, oldest first)."""
    if len(steps) < 2:
        return None
    seconds = (_time(steps[-1]["logged"]) - _time(steps[0]["logged"])).total_seconds()
    return (steps[-1]["step"] - steps[0]["step"]) / seconds if seconds > 0 else None


def _eta(steps_left: int, rate: float, baseline_s: float | None, final: dict | None) -> float:
    """Seconds to completion: the steps left at `rate`, then a final evaluation as long as the baseline."""
    return steps_left / rate + (0.0 if final or baseline_s is None else baseline_s)


def _baseline_seconds(transitions: list[dict[str, Any]]) -> float | None:
    """How long this run's baseline evaluation took (the last BaselineEval -> Training)."""
    began = None
    for t in transitions:
        if t["to"] == Phase.BASELINE_EVAL:
            began = t["at"]
        elif t["to"] == Phase.TRAINING and t["from"] == Phase.BASELINE_EVAL and began:
            return (_time(t["at"]) - _time(began)).total_seconds()
    return None


def _duration(seconds: float) -> str:
    seconds = int(math.ceil(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m {seconds % 60:02d}s"
    return f"{seconds}s"


def _time(iso: str) -> datetime:
    return datetime.fromisoformat(iso)
