"""What spot preemptions add to a run's time and cost, at the rate of notices the user states.

A notice costs the run a restart: the supervisor checkpoints the last completed step and exits 3,
and a replacement node boots, starts grpo-run, loads the model (and starts the engine) beside the
checkpoint's fetch, and trains again (the baseline evaluation is cached in storage, so it is not
run again). One restart, in parts (`status.estimate.preemption.parts`, each with its source):

    boot             the replacement node's boot and grpo-run's install   BOOT_SECONDS, an allowance
    start            grpo-run's own start: interpreter and imports,       GRPO_RUN_START_SECONDS,
                     storage, lease, record, the trainer's start,          measured here
                     graders (everything but the model's)                  (bench/fresh_node.py)
    model load       the model's 16-bit weights fetched and loaded         2 B x parameters at
                                                                           LOAD_BYTES_PER_SECOND, an allowance
    engine start     vLLM's start, for a job it samples                    engineStartSeconds (the
                                                                           estimate's: your runs, or published)
    checkpoint fetch the trainable state fetched from storage, beside      trainable state at
                     the model's load and the engine's start: it counts    LOAD_BYTES_PER_SECOND
                     only where it is the longer
    lost step        the step in flight when the notice came: half a step  the estimate's step time
                     on average

    restart = boot + start + max(model load + engine start, checkpoint fetch) + lost step

Nothing here is a rate this project measured on a cloud node: BOOT_SECONDS and
LOAD_BYTES_PER_SECOND are stated allowances, each replaced by the job's own figure
(spec.pricing.bootSeconds, spec.pricing.loadBytesPerSecond); GRPO_RUN_START_SECONDS was measured
on a CPU machine (a GPU node's CUDA imports add to it); `spec.pricing.restartSeconds` replaces
the whole figure with yours.

The rate: `spec.pricing.preemptionsPerHour`, notices per hour of the run; unset or 0 counts none
(no public figure gives a rate per hour for every card and region: AWS's Spot Instance Advisor
gives each instance type's monthly interruption frequency in buckets, <5% to >20%). With r
notices an hour and restarts of R hours, a run of T hours without them takes T' = T + r T' R, so
it expects r T / (1 - r R) restarts; at r R >= 1 it never finishes (each restart outlasts the
time between notices).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["BOOT_SECONDS", "GRPO_RUN_START_SECONDS", "LOAD_BYTES_PER_SECOND", "Preemptions", "RestartPart",
           "count_preemptions", "preemptions", "restart_parts", "restart_seconds"]

# Allowance, not a measurement: a replacement node's boot and grpo-run's install (cloud-init's pip
# install of torch, or an image pull), the figure the estimate allowed for a whole start before
# its parts were measured. This project has timed no cloud node's boot: spec.pricing.bootSeconds.
BOOT_SECONDS = 120.0
BOOT_SOURCE = "allowance (not measured: a cloud node's boot and install); spec.pricing.bootSeconds sets yours"
# Measured: bench/fresh_node.py, the demo resumed on an empty home (2 CPU cores shared with other work,
# load average about 3; docs/reliability.md, "The fresh node's path to its first new step"): the median
# path to the first new step less the model's build and load, the engine's start and the step itself
# (5.19 s over 3 fresh nodes).
GRPO_RUN_START_SECONDS = 5.2
START_SOURCE = "measured: bench/fresh_node.py on a 2-core CPU machine (docs/reliability.md)"
# Allowance, not a measurement: weights and checkpoints fetched from the hub or storage and loaded.
LOAD_BYTES_PER_SECOND = 200e6
LOAD_SOURCE = "allowance (not measured: 200 MB/s from the hub or storage); spec.pricing.loadBytesPerSecond sets yours"
WEIGHT_BYTES = 2                 # the hub's 16-bit checkpoint, whatever the method trains on it


@dataclass(frozen=True)
class RestartPart:
    """One part of a restart (`status.estimate.preemption.parts`)."""
    part: str
    seconds: float
    source: str
    overlapped: bool = False          # runs beside the model's load and the engine's start: counted where longer

    def to_dict(self) -> dict[str, Any]:
        return {"part": self.part, "seconds": self.seconds, "source": self.source,
                **({"overlapped": True} if self.overlapped else {})}


@dataclass(frozen=True)
class Preemptions:
    """`status.estimate.preemption`."""

    per_hour: float
    restart_seconds: float
    restart_source: str               # "spec.pricing.restartSeconds" or "model"
    restarts: float | None            # expected over the run; None: it never finishes
    seconds: float                    # the time they add
    usd: float                        # what that time costs at the charged rate
    parts: tuple[RestartPart, ...] = field(default=())   # the modelled restart's parts (none when given whole)

    def to_dict(self) -> dict[str, Any]:
        return {"perHour": self.per_hour, "restartSeconds": self.restart_seconds,
                "restartSecondsSource": self.restart_source, "restarts": self.restarts,
                "seconds": self.seconds, "usd": self.usd,
                **({"parts": [p.to_dict() for p in self.parts]} if self.parts else {})}


def restart_parts(*, parameters: int, trainable_state_gb: float, step_seconds: float, engine_start_s: float = 0.0,
                  engine_source: str = "", boot_s: float | None = None,
                  load_bytes_per_s: float | None = None) -> tuple[RestartPart, ...]:
    """One restart's parts (the module's docstring), each to 0.1 s. `boot_s`, `load_bytes_per_s`:
    the job's own (spec.pricing), over the allowances."""
    rate = load_bytes_per_s or LOAD_BYTES_PER_SECOND
    load_source = "spec.pricing.loadBytesPerSecond" if load_bytes_per_s else LOAD_SOURCE
    parts = [RestartPart("boot", round(boot_s if boot_s is not None else BOOT_SECONDS, 1),
                         "spec.pricing.bootSeconds" if boot_s is not None else BOOT_SOURCE),
             RestartPart("start", GRPO_RUN_START_SECONDS, START_SOURCE),
             RestartPart("model load", round(WEIGHT_BYTES * parameters / rate, 1),
                         f"2 B x {parameters:,} parameters at {rate / 1e6:g} MB/s: {load_source}")]
    if engine_start_s:
        parts.append(RestartPart("engine start", round(engine_start_s, 1), engine_source))
    parts += [RestartPart("checkpoint fetch", round(trainable_state_gb * 1e9 / rate, 1),
                          f"the trainable state, {trainable_state_gb:g} GB, at {rate / 1e6:g} MB/s: {load_source}",
                          overlapped=True),
              RestartPart("lost step", round(step_seconds / 2, 1),
                          "half of the estimate's step: the step in flight when the notice came, on average")]
    return tuple(parts)


def restart_seconds(parts: tuple[RestartPart, ...] | None = None, **kwargs: Any) -> float:
    """One restart's time from its parts (restart_parts(**kwargs) when not given): the parts in a
    row, the checkpoint's fetch beside the model's load and the engine's start; to 0.1 s."""
    parts = restart_parts(**kwargs) if parts is None else parts
    beside = sum(p.seconds for p in parts if p.overlapped)
    loading = sum(p.seconds for p in parts if p.part in ("model load", "engine start"))
    rest = sum(p.seconds for p in parts if not p.overlapped and p.part not in ("model load", "engine start"))
    return round(rest + max(loading, beside), 1)


def preemptions(*, per_hour: float, restart_s: float, run_seconds: float, usd_per_hour: float,
                source: str = "model", parts: tuple[RestartPart, ...] = ()) -> Preemptions:
    """What `per_hour` notices an hour add to a run of `run_seconds` (training and evaluations)
    at `usd_per_hour`, each costing `restart_s` seconds (made of `parts`, when modelled).
    restarts None (and seconds, usd 0) when restarts would take all of the time between notices."""
    if per_hour <= 0:
        return Preemptions(per_hour, restart_s, source, 0.0, 0.0, 0.0, parts)
    busy = per_hour * restart_s / 3600                  # the share of each hour spent restarting
    if busy >= 1:
        return Preemptions(per_hour, restart_s, source, None, 0.0, 0.0, parts)
    restarts = per_hour * run_seconds / 3600 / (1 - busy)
    seconds = restarts * restart_s
    return Preemptions(per_hour, restart_s, source, round(restarts, 2), round(seconds, 1),
                       round(seconds * usd_per_hour / 3600, 2), parts)


def count_preemptions(job, out: dict[str, Any], notes: list[str]) -> None:
    """`out` (status.estimate of `job`, its cost fields filled) with `preemption`: what
    spec.pricing.preemptionsPerHour notices add to the run's time and cost, counted in
    completionSeconds, costToCompletionUSD and the spot line's cost; where they take the run past
    maxCostUSD, the step it stops after, pro rata. A note for `notes` says what was added, or that
    the run would never finish."""
    pricing, memory = job.pricing, out["memory"]
    given = pricing.restartSeconds if pricing else None
    parts: tuple[RestartPart, ...] = ()
    if not given:
        parts = restart_parts(parameters=memory["parameters"], trainable_state_gb=memory["trainableStateGB"],
                              step_seconds=out["stepSeconds"], engine_start_s=out.get("engineStartSeconds") or 0.0,
                              engine_source="the estimate's engineStartSeconds (the median of your vLLM runs of this "
                                            "model on this card, else a published start-up)",
                              boot_s=pricing.bootSeconds if pricing else None,
                              load_bytes_per_s=pricing.loadBytesPerSecond if pricing else None)
    restart = given or restart_seconds(parts)
    found = preemptions(per_hour=(pricing.preemptionsPerHour or 0.0) if pricing else 0.0, restart_s=restart,
                        run_seconds=out["completionSeconds"], usd_per_hour=out["usdPerHour"],
                        source="spec.pricing.restartSeconds" if given else "model", parts=parts)
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
    each = "spec.pricing.restartSeconds" if given else "modelled: " + parts_text(parts)
    notes.append(f"preemptions: {found.restarts:g} expected at {found.per_hour:g} an hour (spec.pricing."
                 f"preemptionsPerHour), {restart:g} s each ({each}): {found.seconds:g} s and ${found.usd:.2f}, in "
                 f"completionSeconds and costToCompletionUSD")


def parts_text(parts: tuple[RestartPart, ...] | list[dict[str, Any]]) -> str:
    """The parts in a few words: "boot 120 s + start 5.5 s + model load 82 s + lost step 50.5 s;
    checkpoint fetch 1.8 s beside the load"."""
    rows = [p.to_dict() if isinstance(p, RestartPart) else p for p in parts]
    row = " + ".join(f"{p['part']} {p['seconds']:g} s" for p in rows if not p.get("overlapped"))
    beside = ", ".join(f"{p['part']} {p['seconds']:g} s" for p in rows if p.get("overlapped"))
    return row + (f"; {beside} beside the load" if beside else "")
