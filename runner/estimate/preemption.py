"""What spot preemptions add to a run's time and cost, at the rate of notices the user states.

A notice costs the run a restart: the supervisor checkpoints the last completed step and exits 3,
and a replacement node starts, loads the model, restores the checkpoint and goes on (the baseline
evaluation is cached in storage, so it is not run again). What one restart takes:

    restart = STARTUP_SECONDS                       a new node's boot and grpo-run's start
            + (2 B x parameters                     the model's 16-bit weights, fetched and loaded
               + trainable state) / LOAD_BYTES_PER_SECOND   and the checkpoint restored
            + step / 2                              the step in flight when the notice came
            + the vLLM engine's start-up            a job sampled by vLLM colocated (engineStartSeconds)

Both constants are stated allowances, not measurements (this project has no GPU node's restart
timed): a node that installs torch at boot (cloud-init) or pulls a large image takes longer, a
warm cache less. `spec.pricing.restartSeconds` replaces the whole figure with yours.

The rate: `spec.pricing.preemptionsPerHour`, notices per hour of the run; unset or 0 counts none
(no public figure gives a rate per hour for every card and region: AWS's Spot Instance Advisor
gives each instance type's monthly interruption frequency in buckets, <5% to >20%). With r
notices an hour and restarts of R hours, a run of T hours without them takes T' = T + r T' R, so
it expects r T / (1 - r R) restarts; at r R >= 1 it never finishes (each restart outlasts the
time between notices).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["LOAD_BYTES_PER_SECOND", "STARTUP_SECONDS", "Preemptions", "count_preemptions", "preemptions",
           "restart_seconds"]

STARTUP_SECONDS = 120.0          # allowance: a replacement node's boot, grpo-run's start, the lease
LOAD_BYTES_PER_SECOND = 200e6    # allowance: weights and checkpoint fetched from the hub or storage and loaded
WEIGHT_BYTES = 2                 # the hub's 16-bit checkpoint, whatever the method trains on it


@dataclass(frozen=True)
class Preemptions:
    """`status.estimate.preemption`."""

    per_hour: float
    restart_seconds: float
    restart_source: str               # "spec.pricing.restartSeconds" or "model"
    restarts: float | None            # expected over the run; None: it never finishes
    seconds: float                    # the time they add
    usd: float                        # what that time costs at the charged rate

    def to_dict(self) -> dict[str, Any]:
        return {"perHour": self.per_hour, "restartSeconds": self.restart_seconds,
                "restartSecondsSource": self.restart_source, "restarts": self.restarts,
                "seconds": self.seconds, "usd": self.usd}


def restart_seconds(*, parameters: int, trainable_state_gb: float, step_seconds: float) -> float:
    """One restart's time, modelled (the module's docstring): start-up, the model's 16-bit weights
    and the trainable state loaded at LOAD_BYTES_PER_SECOND, half a step lost; to 0.1 s."""
    load = (WEIGHT_BYTES * parameters + trainable_state_gb * 1e9) / LOAD_BYTES_PER_SECOND
    return round(STARTUP_SECONDS + load + step_seconds / 2, 1)


def preemptions(*, per_hour: float, restart_s: float, run_seconds: float, usd_per_hour: float,
                source: str = "model") -> Preemptions:
    """What `per_hour` notices an hour add to a run of `run_seconds` (training and evaluations)
    at `usd_per_hour`, each costing `restart_s` seconds. restarts None (and seconds, usd 0) when
    restarts would take all of the time between notices."""
    if per_hour <= 0:
        return Preemptions(per_hour, restart_s, source, 0.0, 0.0, 0.0)
    busy = per_hour * restart_s / 3600                  # the share of each hour spent restarting
    if busy >= 1:
        return Preemptions(per_hour, restart_s, source, None, 0.0, 0.0)
    restarts = per_hour * run_seconds / 3600 / (1 - busy)
    seconds = restarts * restart_s
    return Preemptions(per_hour, restart_s, source, round(restarts, 2), round(seconds, 1),
                       round(seconds * usd_per_hour / 3600, 2))


def count_preemptions(job, out: dict[str, Any], notes: list[str]) -> None:
    """`out` (status.estimate of `job`, its cost fields filled) with `preemption`: what
    spec.pricing.preemptionsPerHour notices add to the run's time and cost, counted in
    completionSeconds, costToCompletionUSD and the spot line's cost; where they take the run past
    maxCostUSD, the step it stops after, pro rata. A note for `notes` says what was added, or that
    the run would never finish."""
    pricing, memory = job.pricing, out["memory"]
    given = pricing.restartSeconds if pricing else None
    restart = given or restart_seconds(parameters=memory["parameters"], trainable_state_gb=memory["trainableStateGB"],
                                       step_seconds=out["stepSeconds"]) + (out.get("engineStartSeconds") or 0.0)
    found = preemptions(per_hour=(pricing.preemptionsPerHour or 0.0) if pricing else 0.0, restart_s=restart,
                        run_seconds=out["completionSeconds"], usd_per_hour=out["usdPerHour"],
                        source="spec.pricing.restartSeconds" if given else "model")
    out["preemption"] = found.to_dict()
    if found.restarts is None:
        notes.append(f"spec.pricing.preemptionsPerHour {found.per_hour:g}: a notice every {60 / found.per_hour:.0f} min "
                     f"on average, and each restart takes {restart / 60:.0f} min, so the run would never finish; "
                     "costToCompletionUSD leaves preemptions out")
        return
    if not found.seconds:
        return
    out["completionSeconds"] = round(out["completionSeconds"] + found.seconds, 1)
    out["costToCompletionUSD"] = round(out["costToCompletionUSD"] + found.usd, 2)
    spot = (out.get("rate") or {}).get("spot")
    if spot:
        spot["costToCompletionUSD"] = round(spot["costToCompletionUSD"] + found.seconds * spot["usdPerHour"] / 3600, 2)
    budget, cost, steps = job.maxCostUSD, out["costToCompletionUSD"], out["steps"]
    if budget is not None and cost > budget and "budgetStopsAfterStep" not in out:
        out["budgetStopsAfterStep"] = min(steps, int(steps * budget / cost))
    notes.append(f"preemptions: {found.restarts:g} expected at {found.per_hour:g} an hour (spec.pricing."
                 f"preemptionsPerHour), {restart:g} s each ({'spec.pricing.restartSeconds' if given else 'modelled'}"
                 f"): {found.seconds:g} s and ${found.usd:.2f}, in completionSeconds and costToCompletionUSD")
