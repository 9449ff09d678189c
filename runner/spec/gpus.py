"""The GPU table and the cost arithmetic of an estimate, before anything is spent.

These fill ``status.estimate`` for ``grpo-run apply --dry-run`` (SPEC §3, §6) together with
``runner.estimate`` (memory from the model's config.json, a step's time from the job). Names are
SkyPilot's accelerator names (SPEC §6); the names grpo-run used before stay accepted as aliases.
A card not in the table is described by the job's ``spec.pricing`` (``custom_gpu``).

Cost: cost to completion = (steps x seconds/step + seconds of evaluation) x USD/hour / 3600,
rounded half-up to the cent. Step time precedence: an explicit override, else the user's
measured step time, else the model of a step (``runner.estimate.steptime``), else -- for a caller
that has no model config -- the card's SPEC §3 reference time. ``firstHoldUSD``: ``cost_estimate``.

This module imports nothing of ``runner.spec`` (the job's validation imports it).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from types import MappingProxyType
from typing import Any, Literal

__all__ = [
    "ALIASES",
    "GPUS",
    "STAND_IN",
    "CostEstimate",
    "Gpu",
    "canonical_name",
    "cost_estimate",
    "custom_gpu",
    "lookup_gpu",
    "spelled_like",
    "suggestion",
]

RateKind = Literal["on-demand", "spot", "unstated"]


@dataclass(frozen=True)
class Gpu:
    """One GPU model as the estimates see it."""

    name: str                       # SkyPilot's accelerator name, e.g. "H100"
    memory_gb: float                # decimal GB on the card
    bf16_flops: float               # peak dense bf16 tensor FLOP/s (vendor datasheet; no sparsity)
    memory_bandwidth: float         # bytes/s (vendor datasheet)
    usd_per_hour: float | None      # None: the job must give spec.pricing.usdPerHour
    rate_kind: RateKind = "unstated"
    rate_source: str = ""           # where usd_per_hour comes from, and when it was read
    reference_step_seconds: float | None = None   # SPEC §3's reference job on this card
    aliases: tuple[str, ...] = ()   # earlier names, still accepted
    listed: bool = True             # False: described by the job's spec.pricing
    figures_note: str = ""          # what a user should know about the figures, said in the estimate
    bf16_tensor_cores: bool = True  # False: bf16 runs emulated, at the FP32 rate (a T4)
    spot_usd_per_hour: float | None = None   # the same catalog's spot price (None: no sourced one)
    spot_source: str = ""           # where and when that spot price was read

    @property
    def step_seconds(self) -> float | None:
        """SPEC §3's reference step time (the name older callers use)."""
        return self.reference_step_seconds


# --- the table ----------------------------------------------------------------------------------
#
# Compute and memory: peak *dense* bf16 tensor throughput (the datasheets quote 2:4 sparsity too,
# at twice these) and memory bandwidth as NVIDIA's datasheets publish them. Written down
# 2026-12-02 from the datasheet named on each line; checked 2026-12-03 against public copies of
# those figures (the copy read is named after "seen:"; NVIDIA's own PDFs were not reachable):
#   H100 SXM5 80 GB        989.5 TFLOP/s  3.35 TB/s   (H100 Tensor Core GPU datasheet: 1,979 sparse;
#                                                       seen: glennklockwood.com/garden/processors/h100.
#                                                       SkyPilot's "H100" is also the slower PCIe card)
#   H200 SXM 141 GB        989.5 TFLOP/s  4.8 TB/s    (H200 datasheet: 1,979 sparse; the H100's
#                                                       compute; seen: aiwiki.ai/wiki/nvidia_h200)
#   B200 (HGX) 180 GB     2250 TFLOP/s    8.0 TB/s    (HGX B200 datasheet: 36 PFLOP/s sparse and
#                                                       64 TB/s for 8 GPUs; 1.44 TB of memory; seen:
#                                                       glennklockwood.com/garden/processors/B200,
#                                                       docs.vultr.com's HGX B200 hardware overview)
#   A100 SXM 80 GB         312 TFLOP/s    2.039 TB/s  (A100 datasheet, nvidia-a100-datasheet-us-
#   A100 SXM 40 GB         312 TFLOP/s    1.555 TB/s   nvidia-1758950-r4-web.pdf; seen:
#                                                       glennklockwood.com/garden/processors/A100)
#   L40S 48 GB             362.05 TFLOP/s 0.864 TB/s  (L40S datasheet: 733 sparse; seen: a reseller's
#                                                       copy of the datasheet table, store.sourcecode.com)
#   L4 24 GB               121 TFLOP/s    0.300 TB/s  (L4 datasheet: 242 with sparsity; seen:
#                                                       grokipedia.com/page/NVIDIA_L4_vs_L40S)
#   A10G 24 GB             125 TFLOP/s    0.600 TB/s  (AWS's variant of the A10. NVIDIA publishes the
#                                                       A10's datasheet only; its 125 (250 sparse) is
#                                                       used. Memory and bandwidth are the A10's too;
#                                                       baseten.co's "NVIDIA A10 vs A10G" says the
#                                                       A10G's tensor throughput is lower, so the update
#                                                       time is a lower bound there; sampling, bound by
#                                                       the bandwidth, is not affected)
#   T4 16 GB                 8.1 TFLOP/s  0.320 TB/s  (T4 datasheet: FP32 8.1, FP16 tensor 65; seen:
#                                                       sysrqmts.com/en/gpus/nvidia/tesla/t4. Turing has
#                                                       no bf16 tensor cores and the trainer computes in
#                                                       bf16 wherever torch.cuda.is_bf16_supported(),
#                                                       which on a T4 is True through emulation: its
#                                                       matmuls run at about the FP32 rate, not FP16's)
#   RTX 4090 24 GB         165.2 TFLOP/s  1.008 TB/s  (Ada Lovelace whitepaper: bf16 with FP32
#                                                       accumulate, as PyTorch multiplies; seen:
#                                                       waredb.com/processor/nvidia-geforce-rtx-4090)
#   RTX A6000 48 GB        154.8 TFLOP/s  0.768 TB/s  (RTX A6000 datasheet: 309.7 with sparsity; seen:
#                                                       servethehome.com's RTX A6000 table, Microway's
#                                                       Ampere comparison as llmperf.net quotes it)
# SkyPilot's names for them: docs.skypilot.co/en/stable/compute/gpus.html (`sky show-gpus -a`).
#
# Rates, per GPU-hour: one source for every card a cloud sells, so that cards compare. AWS
# us-east-1 from SkyPilot's own catalog (github.com/skypilot-org/skypilot-catalog,
# catalogs/v8/aws/vms.csv at commit 00148f2a): its Price column (on-demand, read 2026-12-02) and
# its SpotPrice column in availability zone use1-az6 (read 2026-12-04; the one zone that offers
# all nine instance types), the whole instance divided by its GPUs (the host's CPUs and memory
# included):
#                                   on-demand                spot (use1-az6)
#     H100       p5.48xlarge        $55.04 / 8    = $6.88    $17.6289 / 8  = $2.2036
#     H200       p5en.48xlarge      $63.296 / 8   = $7.912   $16.5551 / 8  = $2.0694
#     B200       p6-b200.48xlarge   $113.9328 / 8 = $14.2416 $21.0148 / 8  = $2.6269
#     A100-80GB  p4de.24xlarge      $27.44705 / 8 = $3.4309  $8.6505 / 8   = $1.0813
#     A100       p4d.24xlarge       $21.957642 / 8 = $2.7447 $7.8799 / 8   = $0.985
#     L40S       g6e.xlarge         $1.861                   $1.0492
#     L4         g6.xlarge          $0.8048                  $0.3988
#     A10G       g5.xlarge          $1.006                   $0.4364
#     T4         g4dn.xlarge        $0.526                   $0.2043
#   The estimate charges the on-demand price, the ceiling of a spot price (spot moves 2-3x between
#   zones and days: other us-east-1 zones in the same file ask $19.2531-55.04 for the p5.48xlarge),
#   so that a budget is never overrun by a price move; it shows the spot price beside it.
#   spec.pricing.usdPerHour charges what you pay.
# - The RTX 4090 and RTX A6000 are not sold by AWS (nor in that catalog's AWS file): they keep the
#   rates SPEC §3's reference costs imply -- rate = cost x 3600 / (1000 x step seconds), rounded to
#   the cent so that 1,000 steps reproduce SPEC's figure: RTX 4090 $0.10 x 3600 / 1200 s = $0.30/h
#   -> $0.29/h ($0.30 makes the H100 3.25x the cost per step at SPEC's $2.60/h, SPEC says 3.4x);
#   RTX A6000 $0.12 x 3600 / 1300 s = $0.332/h -> $0.33/h. SPEC does not say whether they are
#   on-demand or spot prices: "unstated", and no spot price.
# What a user sees as the rate's source.
_SPEC = "grpo-run's reference table, not a quote"
_CATALOG = "SkyPilot catalog v8 (commit 00148f2a)"
_AWS = f"AWS us-east-1 on-demand, {_CATALOG}, read 2026-12-02"
_AWS_SPOT = f"AWS us-east-1 spot in use1-az6, {_CATALOG}, read 2026-12-04"

GPUS: Mapping[str, Gpu] = MappingProxyType({
    gpu.name: gpu
    for gpu in (
        Gpu("H100", 80.0, 989.5e12, 3.35e12, 6.88, "on-demand", _AWS + ", p5.48xlarge / 8", 0.45,
            ("H100-SXM-80GB",), spot_usd_per_hour=2.2036, spot_source=_AWS_SPOT + ", p5.48xlarge / 8"),
        Gpu("H200", 141.0, 989.5e12, 4.8e12, 7.912, "on-demand", _AWS + ", p5en.48xlarge / 8",
            spot_usd_per_hour=2.0694, spot_source=_AWS_SPOT + ", p5en.48xlarge / 8"),
        Gpu("B200", 180.0, 2250e12, 8.0e12, 14.2416, "on-demand", _AWS + ", p6-b200.48xlarge / 8",
            spot_usd_per_hour=2.6269, spot_source=_AWS_SPOT + ", p6-b200.48xlarge / 8"),
        Gpu("A100-80GB", 80.0, 312e12, 2.039e12, 3.4309, "on-demand", _AWS + ", p4de.24xlarge / 8", 0.7,
            spot_usd_per_hour=1.0813, spot_source=_AWS_SPOT + ", p4de.24xlarge / 8"),
        Gpu("A100", 40.0, 312e12, 1.555e12, 2.7447, "on-demand", _AWS + ", p4d.24xlarge / 8",
            spot_usd_per_hour=0.985, spot_source=_AWS_SPOT + ", p4d.24xlarge / 8"),
        Gpu("L40S", 48.0, 362.05e12, 0.864e12, 1.861, "on-demand", _AWS + ", g6e.xlarge", 1.0,
            spot_usd_per_hour=1.0492, spot_source=_AWS_SPOT + ", g6e.xlarge"),
        Gpu("L4", 24.0, 121e12, 0.300e12, 0.8048, "on-demand", _AWS + ", g6.xlarge",
            spot_usd_per_hour=0.3988, spot_source=_AWS_SPOT + ", g6.xlarge"),
        Gpu("A10G", 24.0, 125e12, 0.600e12, 1.006, "on-demand", _AWS + ", g5.xlarge",
            figures_note="NVIDIA publishes no figures for the A10G: the A10's are used, and the A10G's tensor "
                         "throughput is lower, so the update may take longer than this",
            spot_usd_per_hour=0.4364, spot_source=_AWS_SPOT + ", g5.xlarge"),
        Gpu("T4", 16.0, 8.1e12, 0.320e12, 0.526, "on-demand", _AWS + ", g4dn.xlarge",
            figures_note="a T4 has no bf16 tensor cores: the trainer's bf16 matmuls run at about its FP32 rate "
                         "(8.1 TFLOP/s), not its FP16 tensor rate (65)", bf16_tensor_cores=False,
            spot_usd_per_hour=0.2043, spot_source=_AWS_SPOT + ", g4dn.xlarge"),
        Gpu("RTX4090", 24.0, 165.2e12, 1.008e12, 0.29, "unstated", _SPEC, 1.2, ("RTX-4090",)),
        Gpu("A6000", 48.0, 154.8e12, 0.768e12, 0.33, "unstated", _SPEC, 1.3, ("RTX-A6000",)),
    )
})

# A card outside the table without its figures in spec.pricing: the smallest dense bf16 FLOP/s and
# bandwidth of the listed cards with bf16 tensor cores (both the L4's: 121 TFLOP/s, 0.3 TB/s).
STAND_IN: tuple[float, float] = (min(g.bf16_flops for g in GPUS.values() if g.bf16_tensor_cores),
                                 min(g.memory_bandwidth for g in GPUS.values() if g.bf16_tensor_cores))

# Every accepted name -> its table name.
ALIASES: Mapping[str, str] = MappingProxyType(
    {name: gpu.name for gpu in GPUS.values() for name in (gpu.name, *gpu.aliases)})


def canonical_name(name: str) -> str | None:
    """The table name for `name` (itself, or what an alias stands for); None when not listed."""
    return ALIASES.get(name)


def _squash(text: str) -> str:
    return "".join(ch for ch in text.lower() if ch.isalnum())


def spelled_like(name: str) -> str | None:
    """The table name `name` spells in another case or spacing (`h100`, `rtx 4090`), or None."""
    wanted = _squash(name)
    return next((table_name for accepted, table_name in ALIASES.items() if wanted and _squash(accepted) == wanted),
                None)


def suggestion(name: str) -> str | None:
    """The table name `name` most likely means: `spelled_like`, else a very close spelling
    (`A100-80G`), else the longest table name it begins with (`H100-PCIe`), else a close spelling
    (`H10`), else None."""
    found = spelled_like(name)
    if found or not _squash(name):
        return found
    wanted = _squash(name)
    squashed = {_squash(accepted): table_name for accepted, table_name in ALIASES.items()}
    close = difflib.get_close_matches(wanted, squashed, n=1, cutoff=0.85)       # A100-80G
    prefixes = [s for s in squashed if wanted.startswith(s)]                    # H100-PCIe, L4-24GB
    if not close and prefixes:
        return squashed[max(prefixes, key=len)]
    close = close or difflib.get_close_matches(wanted, squashed, n=1, cutoff=0.75)
    return squashed[close[0]] if close else None


def lookup_gpu(name: str) -> Gpu:
    """The table entry for `name` (a table name or an alias).

    Raises ValueError for any other name, with a did-you-mean when one is close and the names
    allowed.
    """
    found = canonical_name(name)
    if found is not None:
        return GPUS[found]
    guess = suggestion(name)
    raise ValueError(f"gpu: unknown GPU {name!r}" + (f": did you mean {guess}?" if guess else ".")
                     + f" Use one of {', '.join(GPUS)} (SkyPilot's names), or describe another card "
                     "with spec.pricing: {usdPerHour: ..., memoryGB: ...}")


def custom_gpu(name: str, *, usd_per_hour: float, memory_gb: float, bf16_tflops: float | None = None,
               memory_bandwidth_gbps: float | None = None) -> Gpu:
    """A card the table does not list, as the job's spec.pricing describes it. Without its
    throughput figures the step model cannot place it: it gets the slowest figures of the listed
    cards with bf16 tensor cores (STAND_IN), an upper bound on the step time of any such card. A
    card without them (a V100, a T4) multiplies bf16 at its FP32 rate: slower than that."""
    slowest_flops, slowest_bandwidth = STAND_IN
    return Gpu(name, memory_gb=memory_gb,
               bf16_flops=bf16_tflops * 1e12 if bf16_tflops else slowest_flops,
               memory_bandwidth=memory_bandwidth_gbps * 1e9 if memory_bandwidth_gbps else slowest_bandwidth,
               usd_per_hour=usd_per_hour, rate_kind="unstated", rate_source="spec.pricing", listed=False)


# --- rounding -----------------------------------------------------------------------------------

_CENT = Fraction(1, 100)


def _cents_half_up(usd: Fraction) -> float:
    return math.floor(usd / _CENT + Fraction(1, 2)) / 100


def _cents_up(usd: Fraction) -> float:
    return math.ceil(usd / _CENT) / 100


# --- cost ---------------------------------------------------------------------------------------

StepSecondsSource = Literal["override", "measured", "model", "reference"]


@dataclass(frozen=True)
class CostEstimate:
    """SPEC §6 ``status.estimate`` cost fields."""

    gpu: str
    steps: int
    step_seconds: float
    step_seconds_source: StepSecondsSource
    usd_per_hour: float
    cost_to_completion_usd: float  # training and evaluations, rounded half-up to the cent
    first_hold_usd: float          # rounded up to the cent; see cost_estimate
    eval_seconds: float = 0.0      # every evaluation of the run together
    training_usd: float = 0.0      # the steps alone, rounded half-up to the cent
    eval_usd: float = 0.0          # the evaluations alone, rounded half-up to the cent
    start_seconds: float = 0.0     # the sampling engine's start-up, once (vLLM)
    start_usd: float = 0.0         # its cost, rounded half-up to the cent

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
            "evalSeconds": self.eval_seconds,
            "trainingUSD": self.training_usd,
            "evalUSD": self.eval_usd,
            **({"engineStartSeconds": self.start_seconds, "engineStartUSD": self.start_usd}
               if self.start_seconds else {}),
        }


def cost_estimate(
    *,
    gpu: str | Gpu,
    steps: int,
    usd_per_hour: float | None = None,
    step_seconds: float | None = None,
    measured_step_seconds: float | None = None,
    model_step_seconds: float | None = None,
    eval_seconds: float = 0.0,
    baseline_seconds: float = 0.0,
    save_steps: int = 25,
    max_cost_usd: float | None = None,
    gpus: int = 1,
    start_seconds: float = 0.0,
) -> CostEstimate:
    """What ``steps`` training steps and the run's evaluations on ``gpu`` will cost.

    Step time: ``step_seconds`` (the user's explicit override) wins, then
    ``measured_step_seconds`` (learned from the user's own runs), then ``model_step_seconds``
    (the model of a step), then the card's SPEC §3 reference time. ``eval_seconds`` is every
    evaluation of the run together (baseline, every evalSteps, final). ``usd_per_hour``
    overrides the table's rate. Rates are per GPU; ``gpus`` of them (one per process of the
    node) are charged together, and ``usd_per_hour`` of the answer is theirs.

    ``firstHoldUSD`` -- the first budget hold -- is what the run puts at risk before its first
    durable checkpoint: the baseline evaluation (``baseline_seconds``, a part of
    ``eval_seconds``), the sampling engine's start-up (``start_seconds``: vLLM's, paid once before
    anything else) and the first ``save_steps`` steps (or all steps, if fewer), rounded *up*
    to the cent so a hold never under-covers its spend, and capped at ``max_cost_usd`` since the
    run stops there anyway.

    Raises ValueError for an unknown GPU (naming the allowed ones), negative steps, a
    non-positive save interval or step time, a card with no rate and no ``usd_per_hour``, or a
    negative rate, budget or evaluation time.
    """
    card = gpu if isinstance(gpu, Gpu) else lookup_gpu(gpu)
    if isinstance(steps, bool) or steps < 0:
        raise ValueError(f"steps: must be >= 0 (got {steps!r})")
    if save_steps < 1:
        raise ValueError(f"saveSteps: must be >= 1 (got {save_steps})")
    for name, value in (("stepSeconds", step_seconds), ("measured step seconds", measured_step_seconds),
                        ("model step seconds", model_step_seconds)):
        if value is not None and not value > 0:
            raise ValueError(f"{name}: must be > 0 (got {value})")
    for name, value in (("usdPerHour", usd_per_hour), ("maxCostUSD", max_cost_usd), ("evalSeconds", eval_seconds),
                        ("baseline seconds", baseline_seconds), ("engine start seconds", start_seconds)):
        if value is not None and not value >= 0:
            raise ValueError(f"{name}: must be >= 0 (got {value})")

    source: StepSecondsSource
    if step_seconds is not None:
        seconds, source = step_seconds, "override"
    elif measured_step_seconds is not None:
        seconds, source = measured_step_seconds, "measured"
    elif model_step_seconds is not None:
        seconds, source = model_step_seconds, "model"
    elif card.reference_step_seconds is not None:
        seconds, source = card.reference_step_seconds, "reference"
    else:
        raise ValueError(f"stepSeconds: {card.name} has no reference step time; give the model's config "
                         "or spec.pricing.stepSeconds")
    rate = card.usd_per_hour if usd_per_hour is None else usd_per_hour
    if rate is None:
        raise ValueError(f"spec.pricing.usdPerHour: {card.name} has no rate in the table; give yours")
    if gpus != 1:
        rate = float(Fraction(str(rate)) * gpus)

    # Exact rational arithmetic on the decimal values as written: binary floating point cannot
    # hold $0.325 (1,000 x 0.45 s x $2.60/h) exactly, so which cent it rounds to would depend on
    # the order of the operations.
    per_second = Fraction(str(rate)) / 3600
    usd_per_step = Fraction(str(seconds)) * per_second
    eval_usd = Fraction(str(eval_seconds)) * per_second
    start_usd = Fraction(str(start_seconds)) * per_second
    first_hold = _cents_up(Fraction(str(baseline_seconds)) * per_second + start_usd
                           + usd_per_step * min(save_steps, steps))
    if max_cost_usd is not None:
        first_hold = min(first_hold, max_cost_usd)

    return CostEstimate(
        gpu=card.name,
        steps=steps,
        step_seconds=seconds,
        step_seconds_source=source,
        usd_per_hour=rate,
        cost_to_completion_usd=_cents_half_up(usd_per_step * steps + eval_usd + start_usd),
        first_hold_usd=first_hold,
        eval_seconds=eval_seconds,
        training_usd=_cents_half_up(usd_per_step * steps),
        eval_usd=_cents_half_up(eval_usd),
        start_seconds=start_seconds,
        start_usd=_cents_half_up(start_usd),
    )
