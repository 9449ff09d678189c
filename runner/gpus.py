"""The GPU table and the cost estimate for a run, before anything is spent.

These fill ``status.estimate`` for ``grpo-run apply --dry-run`` (SPEC §3, §6), together with
the memory estimate from the model's config.json (``runner.memory``, which sizes a run against
this table's cards).

Cost (SPEC §3): cost to completion = steps x seconds/step x USD/hour / 3600, rounded half-up to
the cent. Step time precedence: an explicit override, else the user's measured step time, else
the GPU's reference step time. ``firstHoldUSD`` is defined in ``cost_estimate``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from types import MappingProxyType
from typing import Any, Literal

__all__ = [
    "GPUS",
    "CostEstimate",
    "Gpu",
    "cost_estimate",
    "lookup_gpu",
]


# --- GPUs ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gpu:
    """One GPU model as the estimates see it."""

    name: str  # SPEC §6 name, e.g. "H100-SXM-80GB"
    memory_gb: float  # decimal GB on the card
    usd_per_hour: float  # on-demand-ish market rate; users override with their own
    step_seconds: float  # reference seconds per GRPO training step


# Step times are SPEC §3's reference step times (a reference runtime's own measured runs). SPEC
# states only the H100's rate ($2.60/h); every other rate is derived from SPEC's "cost of 1,000
# steps" and the step time -- rate = cost x 3600 / (1000 x step seconds) -- and rounded to the
# cent so that 1,000 steps reproduce SPEC's figure to the cent:
#   A100 80 GB  $0.21 x 3600 / 700 s  = $1.08/h  (exact)
#   L40S        $0.22 x 3600 / 1000 s = $0.792/h -> $0.79/h ($0.2194 per 1,000 steps)
#   RTX 4090    $0.10 x 3600 / 1200 s = $0.30/h  -> $0.29/h: $0.30 also gives $0.10 but makes the
#               H100 3.25x the cost per step, and SPEC says 3.4x; $0.29 satisfies both
#               ($0.0967 per 1,000 steps; H100/4090 cost per step 3.36x).
#   RTX A6000   $0.12 x 3600 / 1300 s = $0.332/h -> $0.33/h ($0.1192 per 1,000 steps)
# Memory sizes are the cards' nominal capacities.
GPUS: Mapping[str, Gpu] = MappingProxyType(
    {
        gpu.name: gpu
        for gpu in (
            Gpu("H100-SXM-80GB", memory_gb=80.0, usd_per_hour=2.60, step_seconds=0.45),
            Gpu("A100-80GB", memory_gb=80.0, usd_per_hour=1.08, step_seconds=0.7),
            Gpu("L40S", memory_gb=48.0, usd_per_hour=0.79, step_seconds=1.0),
            Gpu("RTX-4090", memory_gb=24.0, usd_per_hour=0.29, step_seconds=1.2),
            Gpu("RTX-A6000", memory_gb=48.0, usd_per_hour=0.33, step_seconds=1.3),
        )
    }
)


def lookup_gpu(name: str) -> Gpu:
    """The table entry for ``name``.

    Raises ValueError for a name not in ``GPUS``, naming the allowed ones.
    """
    try:
        return GPUS[name]
    except KeyError:
        allowed = ", ".join(GPUS)
        raise ValueError(f"gpu: unknown GPU {name!r}; use one of {allowed}") from None


# --- rounding -----------------------------------------------------------------------------------

_CENT = Fraction(1, 100)


def _cents_half_up(usd: Fraction) -> float:
    return math.floor(usd / _CENT + Fraction(1, 2)) / 100


def _cents_up(usd: Fraction) -> float:
    return math.ceil(usd / _CENT) / 100


# --- cost ---------------------------------------------------------------------------------------

StepSecondsSource = Literal["reference", "override", "measured"]


@dataclass(frozen=True)
class CostEstimate:
    """SPEC §6 ``status.estimate`` cost fields."""

    gpu: str
    steps: int
    step_seconds: float
    step_seconds_source: StepSecondsSource
    usd_per_hour: float
    cost_to_completion_usd: float  # rounded half-up to the cent
    first_hold_usd: float  # rounded up to the cent; see cost_estimate

    @property
    def usd_per_step(self) -> float:
        return self.step_seconds * self.usd_per_hour / 3600

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu,
            "steps": self.steps,
            "stepSeconds": self.step_seconds,
            "stepSecondsSource": self.step_seconds_source,
            "usdPerHour": self.usd_per_hour,
            "costToCompletionUSD": self.cost_to_completion_usd,
            "firstHoldUSD": self.first_hold_usd,
        }


def cost_estimate(
    *,
    gpu: str,
    steps: int,
    usd_per_hour: float | None = None,
    step_seconds: float | None = None,
    measured_step_seconds: float | None = None,
    save_steps: int = 25,
    max_cost_usd: float | None = None,
    gpus: int = 1,
) -> CostEstimate:
    """What ``steps`` training steps on ``gpu`` will cost, before anything is spent.

    Step time: ``step_seconds`` (the user's explicit override) wins, then
    ``measured_step_seconds`` (learned from the user's own runs), then the GPU's reference.
    ``usd_per_hour`` overrides the table's rate. Rates are per GPU; ``gpus`` of them (one per
    process of the node) are charged together, and ``usd_per_hour`` of the answer is theirs.
    The step time is not divided among them: no speed-up from more processes is assumed.

    ``firstHoldUSD`` -- the first budget hold -- is what the run puts at risk before its first
    durable checkpoint: the cost of the first ``save_steps`` steps (or of all steps, if fewer),
    rounded *up* to the cent so a hold never under-covers its spend, and capped at
    ``max_cost_usd`` since the run stops there anyway. Later holds cover one save interval each.

    Raises ValueError for an unknown GPU (naming the allowed ones), negative steps, a
    non-positive save interval or step time, or a negative rate or budget.
    """
    card = lookup_gpu(gpu)
    if isinstance(steps, bool) or steps < 0:
        raise ValueError(f"steps: must be >= 0 (got {steps!r})")
    if save_steps < 1:
        raise ValueError(f"saveSteps: must be >= 1 (got {save_steps})")
    for name, value in (
        ("stepSeconds", step_seconds),
        ("measured step seconds", measured_step_seconds),
    ):
        if value is not None and not value > 0:
            raise ValueError(f"{name}: must be > 0 (got {value})")
    for name, value in (("usdPerHour", usd_per_hour), ("maxCostUSD", max_cost_usd)):
        if value is not None and not value >= 0:
            raise ValueError(f"{name}: must be >= 0 (got {value})")

    source: StepSecondsSource
    if step_seconds is not None:
        seconds, source = step_seconds, "override"
    elif measured_step_seconds is not None:
        seconds, source = measured_step_seconds, "measured"
    else:
        seconds, source = card.step_seconds, "reference"
    rate = card.usd_per_hour if usd_per_hour is None else usd_per_hour
    if gpus != 1:
        rate = float(Fraction(str(rate)) * gpus)

    # Exact rational arithmetic on the decimal values as written: binary floating point cannot
    # hold $0.325 (1,000 x 0.45 s x $2.60/h) exactly, so which cent it rounds to would depend on
    # the order of the operations.
    usd_per_step = Fraction(str(seconds)) * Fraction(str(rate)) / 3600
    first_hold = _cents_up(usd_per_step * min(save_steps, steps))
    if max_cost_usd is not None:
        first_hold = min(first_hold, max_cost_usd)

    return CostEstimate(
        gpu=card.name,
        steps=steps,
        step_seconds=seconds,
        step_seconds_source=source,
        usd_per_hour=rate,
        cost_to_completion_usd=_cents_half_up(usd_per_step * steps),
        first_hold_usd=first_hold,
    )
