"""Cost and memory estimates for a run, from a model's ``config.json`` alone (no weights).

These numbers fill ``status.estimate`` for ``grpo-run apply --dry-run`` (SPEC §3, §6).

Memory (SPEC §3): weights and trainable state only -- activations and the generation cache are
reported separately (``kvCacheGB``) and accounted for by ``fits``. Decimal gigabytes (1e9 bytes).

- frozen base weights: 2 bytes/param (16-bit) for LoRA, 0.5 bytes/param (NF4) for QLoRA;
- trained parameters: 16 bytes/param, mixed-precision Adam as counted in the ZeRO paper
  (16-bit weight + 16-bit gradient + fp32 master weight, momentum and variance). For a full
  fine-tune every weight is trained, so the weights appear here and ``weightsGB`` is 0;
- reference model: only a full fine-tune with ``beta > 0`` loads one (a frozen 16-bit copy).
  With LoRA/QLoRA the reference is the base with the adapter disabled; with ``beta == 0`` the
  KL term is off and no reference exists at all.

Rounding convention (the one that reproduces SPEC §3's Qwen3-8B example exactly):

1. A parameter count is *quoted* to one decimal of its display unit -- 8,190,735,360 is "8.2B",
   21,823,488 is "21.8M" -- and byte figures are computed from the quoted count, the way SPEC
   computes "8.2B x 2 B = 16.4 GB". An estimate is no more precise than the count it is quoted
   from. (``parameters`` / ``trainableParameters`` themselves are returned exact.)
2. Each memory component (weights, trainable state, reference) is rounded half-up to 0.01 GB,
   so that a small component such as a LoRA adapter's 0.35 GB does not vanish into 0.3 or 0.4.
3. ``totalGB`` is the sum of the rounded components, rounded half-up to 0.1 GB -- the precision
   at which it is compared with a card's memory. ``kvCacheGB`` is rounded the same way.

So Qwen3-8B LoRA r=8 is 16.40 + 0.35 = 16.75 -> 16.8 GB and QLoRA is 4.10 + 0.35 = 4.45 ->
4.5 GB, as SPEC says. Summing exact bytes would give 16.7 and 4.4 instead; that is why the
components are added as quoted and the arithmetic is done in ``Decimal`` (0.35 + 4.1 in binary
floating point is 4.4499...).

Cost (SPEC §3): cost to completion = steps x seconds/step x USD/hour / 3600, rounded half-up to
the cent. Step time precedence: an explicit override, else the user's measured step time, else
the GPU's reference step time. ``firstHoldUSD`` is defined in ``cost_estimate``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from fractions import Fraction
from types import MappingProxyType
from typing import Any, Literal

from trainer.config import METHODS

__all__ = [
    "ACTIVATION_KV_MULTIPLE",
    "GPUS",
    "LORA_TARGETS",
    "USABLE_MEMORY_FRACTION",
    "CostEstimate",
    "Gpu",
    "MemoryEstimate",
    "cost_estimate",
    "fits",
    "format_count",
    "lookup_gpu",
    "memory_estimate",
    "needed_gb",
    "quoted_count",
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

_UNITS = ((10**9, "B"), (10**6, "M"), (10**3, "K"))
_CENT = Fraction(1, 100)


def quoted_count(n: int) -> int:
    """``n`` rounded half-up to one decimal of its display unit: 8,190,735,360 -> 8,200,000,000."""
    for size, _ in _UNITS:
        if n >= size:
            step = size // 10
            return (n + step // 2) // step * step
    return n


def format_count(n: int) -> str:
    """A parameter count as SPEC writes it: ``8.2B``, ``21.8M``, ``5.0M``, ``512``."""
    q = quoted_count(n)
    for size, unit in _UNITS:
        if n >= size:
            return f"{Decimal(q) / size:.1f}{unit}"
    return str(n)


def _gb(count: int, bytes_per_param: Decimal, places: str) -> Decimal:
    return (Decimal(count) * bytes_per_param / Decimal(10**9)).quantize(
        Decimal(places), rounding=ROUND_HALF_UP
    )


def _cents_half_up(usd: Fraction) -> float:
    return math.floor(usd / _CENT + Fraction(1, 2)) / 100


def _cents_up(usd: Fraction) -> float:
    return math.ceil(usd / _CENT) / 100


# --- model shape --------------------------------------------------------------------------------

# LoRA target modules by their short names; PEFT's "q_proj" etc. are accepted too.
LORA_TARGETS: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")

# Model families whose attention normalises q and k per head (one head_dim weight each).
_QK_NORM_MODEL_TYPES = frozenset({"qwen3"})
# Model families with a bias on q, k and v although their config has no attention_bias key.
_QKV_BIAS_MODEL_TYPES = frozenset({"qwen2"})

_REQUIRED_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)


@dataclass(frozen=True)
class _Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    model_type: str
    attention_bias: bool
    mlp_bias: bool

    def linear_dims(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of one decoder layer, by LoRA short name."""
        q_width = self.heads * self.head_dim
        kv_width = self.kv_heads * self.head_dim
        return {
            "q": (self.hidden, q_width),
            "k": (self.hidden, kv_width),
            "v": (self.hidden, kv_width),
            "o": (q_width, self.hidden),
            "gate": (self.hidden, self.intermediate),
            "up": (self.hidden, self.intermediate),
            "down": (self.intermediate, self.hidden),
        }


def _shape(config: Mapping[str, Any]) -> _Shape:
    # Multimodal configs keep the language model's shape under text_config.
    if "hidden_size" not in config and isinstance(config.get("text_config"), Mapping):
        config = config["text_config"]
    missing = [key for key in _REQUIRED_KEYS if config.get(key) is None]
    if missing:
        raise ValueError(
            f"model config: missing {', '.join(missing)}; the estimate reads a Llama-style "
            "decoder config.json (hidden_size, intermediate_size, num_hidden_layers, "
            "num_attention_heads, vocab_size)"
        )
    if config.get("num_experts") or config.get("num_local_experts"):
        # Counting experts as one dense MLP would understate memory several-fold; refuse rather
        # than print a number that looks authoritative.
        raise ValueError(
            "model config: mixture-of-experts models are not estimated yet; "
            "pass a dense model's config.json"
        )
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    return _Shape(
        hidden=hidden,
        intermediate=int(config["intermediate_size"]),
        layers=int(config["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        vocab=int(config["vocab_size"]),
        # transformers' default for tie_word_embeddings is True.
        tied=bool(config.get("tie_word_embeddings", True)),
        model_type=str(config.get("model_type", "")),
        attention_bias=bool(config.get("attention_bias", False)),
        mlp_bias=bool(config.get("mlp_bias", False)),
    )


def _parameter_count(shape: _Shape) -> int:
    dims = shape.linear_dims()
    per_layer = sum(i * o for i, o in dims.values())
    if shape.attention_bias:
        per_layer += sum(dims[name][1] for name in ("q", "k", "v", "o"))
    elif shape.model_type in _QKV_BIAS_MODEL_TYPES:
        per_layer += sum(dims[name][1] for name in ("q", "k", "v"))
    if shape.mlp_bias:
        per_layer += sum(dims[name][1] for name in ("gate", "up", "down"))
    per_layer += 2 * shape.hidden  # input and post-attention norms (RMSNorm: weight only)
    if shape.model_type in _QK_NORM_MODEL_TYPES:
        per_layer += 2 * shape.head_dim
    embeddings = shape.vocab * shape.hidden * (1 if shape.tied else 2)  # + untied lm_head
    final_norm = shape.hidden
    return embeddings + shape.layers * per_layer + final_norm


def _normalise_targets(targets: Sequence[str]) -> tuple[str, ...]:
    if isinstance(targets, str):
        targets = [targets]
    names: list[str] = []
    unknown: list[str] = []
    for target in targets:
        if target == "all-linear":
            names.extend(LORA_TARGETS)
            continue
        short = target.removesuffix("_proj")
        (names if short in LORA_TARGETS else unknown).append(short)
    if unknown:
        raise ValueError(
            f"lora targets: unknown {', '.join(unknown)}; use any of "
            f"{', '.join(LORA_TARGETS)} (or their _proj names, or all-linear)"
        )
    return tuple(dict.fromkeys(names))  # a module named twice is still adapted once


# --- memory -------------------------------------------------------------------------------------

Method = Literal["LoRA", "QLoRA", "Full"]
_FROZEN_BYTES = {"LoRA": Decimal(2), "QLoRA": Decimal("0.5")}
_TRAINED_BYTES = Decimal(16)  # mixed-precision Adam (ZeRO)
_REFERENCE_BYTES = Decimal(2)
_KV_BYTES_PER_VALUE = 2  # 16-bit cache

# fits(): the card's memory minus a reserve must hold weights, trainable state, the group's KV
# cache and the update's activations. Activations do not shrink with quantisation; like the KV
# cache they grow with the tokens of a group (num_generations x sequence length) and with the
# model's depth and width, so the allowance is a multiple of the group's KV cache. For
# Qwen-family models the update's logits alone (16-bit, an fp32 log-softmax and their gradient
# over a ~152k vocabulary, ~1.2 MB per token) are 8-11x the KV cache per token and the
# checkpointed layer inputs 0.5-2x; 15x adds the recomputed layer and allocator peaks. It is
# calibrated, not derived: it makes SPEC §3's sizing guideline hold -- 8B QLoRA with a group of
# 8 x 1,024 tokens needs 4.5 + 16 x 1.2 = 23.7 GB: a 48 GB card (43.2 GB usable), not a 24 GB
# RTX 4090 (21.6 GB usable).
ACTIVATION_KV_MULTIPLE = 15
# The CUDA context, the allocator's fragmentation and the generation engine's own buffers.
USABLE_MEMORY_FRACTION = 0.9


def needed_gb(total_gb: float, kv_gb: float) -> float:
    """Memory a run needs on one card: ``total_gb`` plus the KV cache plus activations."""
    return total_gb + kv_gb * (1 + ACTIVATION_KV_MULTIPLE)


def fits(total_gb: float, kv_gb: float, gpu: str | Gpu) -> bool:
    """Whether a run of ``total_gb`` (weights + state) and ``kv_gb`` (a group's KV cache) fits
    on ``gpu``: ``needed_gb(total, kv) <= USABLE_MEMORY_FRACTION x memory``.

    Raises ValueError for an unknown GPU name.
    """
    card = gpu if isinstance(gpu, Gpu) else lookup_gpu(gpu)
    return needed_gb(total_gb, kv_gb) <= card.memory_gb * USABLE_MEMORY_FRACTION


@dataclass(frozen=True)
class MemoryEstimate:
    """SPEC §6 ``status.estimate.memory``; see the module docstring for the rounding."""

    parameters: int  # exact count from the config
    trainable_parameters: int  # exact
    weights_gb: float
    trainable_state_gb: float
    reference_gb: float
    total_gb: float  # weights + trainable state + reference
    kv_cache_bytes_per_token: int
    kv_cache_gb: float  # one group: num_generations x (prompt + completion) tokens
    fits: bool | None = None  # None when no GPU was named

    def to_dict(self) -> dict[str, Any]:
        return {
            "parameters": self.parameters,
            "trainableParameters": self.trainable_parameters,
            "weightsGB": self.weights_gb,
            "trainableStateGB": self.trainable_state_gb,
            "referenceGB": self.reference_gb,
            "totalGB": self.total_gb,
            "kvCacheBytesPerToken": self.kv_cache_bytes_per_token,
            "kvCacheGB": self.kv_cache_gb,
            "fits": self.fits,
        }


def memory_estimate(
    config: Mapping[str, Any],
    *,
    method: Method,
    lora_r: int,
    lora_targets: Sequence[str] = LORA_TARGETS,
    beta: float,
    num_generations: int,
    max_completion_length: int,
    prompt_tokens: int = 0,
    gpu: str | Gpu | None = None,
) -> MemoryEstimate:
    """Memory for weights and trainable state of one run, from a HF ``config.json`` dict.

    ``lora_r`` and ``lora_targets`` are ignored for ``method="Full"``. With ``gpu`` the
    estimate's ``fits`` is filled in (see ``fits``); without it ``fits`` is None.

    Raises ValueError for an unknown method, GPU or LoRA target, a non-positive rank, group
    size or completion length, a negative beta or prompt length, and a config without the
    Llama-style keys the count needs (all missing keys are named at once).
    """
    if method not in METHODS:
        raise ValueError(f"method: must be one of {', '.join(METHODS)} (got {method!r})")
    if method != "Full" and lora_r < 1:
        raise ValueError(f"lora.r: must be >= 1 (got {lora_r})")
    if beta < 0:
        raise ValueError(f"beta: must be >= 0 (got {beta})")
    if num_generations < 1:
        raise ValueError(f"numGenerations: must be >= 1 (got {num_generations})")
    if max_completion_length < 1:
        raise ValueError(f"maxCompletionLength: must be >= 1 (got {max_completion_length})")
    if prompt_tokens < 0:
        raise ValueError(f"prompt tokens: must be >= 0 (got {prompt_tokens})")
    card = lookup_gpu(gpu) if isinstance(gpu, str) else gpu

    shape = _shape(config)
    parameters = _parameter_count(shape)
    quoted = quoted_count(parameters)

    if method == "Full":
        trainable = parameters
        weights = Decimal("0.00")  # every weight is trained: counted in the trainable state
        reference = _gb(quoted, _REFERENCE_BYTES, "0.01") if beta > 0 else Decimal("0.00")
    else:
        dims = shape.linear_dims()
        per_layer = sum(sum(dims[name]) for name in _normalise_targets(lora_targets)) * lora_r
        trainable = per_layer * shape.layers
        weights = _gb(quoted, _FROZEN_BYTES[method], "0.01")
        reference = Decimal("0.00")  # the base with the adapter disabled
    state = _gb(quoted_count(trainable), _TRAINED_BYTES, "0.01")
    total = (weights + state + reference).quantize(Decimal("0.1"), rounding=ROUND_HALF_UP)

    kv_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * _KV_BYTES_PER_VALUE  # K, V
    group_tokens = num_generations * (prompt_tokens + max_completion_length)
    kv_gb = _gb(kv_per_token * group_tokens, Decimal(1), "0.1")

    return MemoryEstimate(
        parameters=parameters,
        trainable_parameters=trainable,
        weights_gb=float(weights),
        trainable_state_gb=float(state),
        reference_gb=float(reference),
        total_gb=float(total),
        kv_cache_bytes_per_token=kv_per_token,
        kv_cache_gb=float(kv_gb),
        fits=None if card is None else fits(float(total), float(kv_gb), card),
    )


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
) -> CostEstimate:
    """What ``steps`` training steps on ``gpu`` will cost, before anything is spent.

    Step time: ``step_seconds`` (the user's explicit override) wins, then
    ``measured_step_seconds`` (learned from the user's own runs), then the GPU's reference.
    ``usd_per_hour`` overrides the table's rate.

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
