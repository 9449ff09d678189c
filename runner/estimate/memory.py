"""Memory estimate for a run, from a model's ``config.json`` alone (no weights).

This fills ``status.estimate.memory`` for ``grpo-run apply --dry-run`` (SPEC §3, §6); the GPU
table and the cost arithmetic are in ``runner.spec.gpus``, a step's time in ``runner.estimate.steptime``.

Memory (SPEC §3): weights and trainable state only -- activations and the generation cache are
reported separately (``kvCacheGB`` for one group, ``samplingGB`` for the step's completions,
``updateGB`` for one micro-batch of the update) and accounted for by ``fits``. Decimal gigabytes (1e9 bytes).

Sampled by vLLM colocated (``sampler="colocate"``; docs/sampling.md), the engine holds
``gpuMemoryUtilization`` of the card (``engineGB``: its own 16-bit copy of the weights, the
adapter, its KV cache) while the step samples, and sleeps during the update (level 1: weights to
the host, KV cache dropped), so ``neededGB`` is the trainer's weights and state plus the larger
of the engine's share and the update. The share must hold the engine's weights
(``engineWeightsGB``) and one whole sequence's KV cache, or vLLM refuses to start: then ``fits``
is False. As a server (``sampler="server"``) the engine is on another GPU: nothing of it here,
and the trainer holds no KV cache of its own.

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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

from grpo_run.runner.spec.gpus import Gpu, lookup_gpu
from grpo_run.trainer.config import LOGPROB_CHUNK_ELEMENTS, METHODS, default_micro_batch

__all__ = [
    "LORA_TARGETS",
    "ModelShape",
    "USABLE_MEMORY_FRACTION",
    "MemoryEstimate",
    "fits",
    "format_count",
    "memory_estimate",
    "model_shape",
    "parameter_count",
    "quoted_count",
    "reward_model_memory",
]


# --- rounding -----------------------------------------------------------------------------------

_UNITS = ((10**9, "B"), (10**6, "M"), (10**3, "K"))


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
class ModelShape:
    """A Llama-style decoder's shape, read from its config.json (model_shape)."""

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


def model_shape(config: Mapping[str, Any]) -> ModelShape:
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
    return ModelShape(
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


def parameter_count(shape: ModelShape) -> int:
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

_FROZEN_BYTES = {"LoRA": Decimal(2), "QLoRA": Decimal("0.5")}
_TRAINED_BYTES = Decimal(16)  # mixed-precision Adam (ZeRO)
# A full fine-tune sharded with FSDP over N GPUs (trainer.distributed): the weights and their
# gradients are whole on every GPU while it samples or updates (4 of the 16 bytes), the rest
# (the optimizer's state) is 1/N on each.
_WHOLE_WHEN_SHARDED = Decimal(4)
_REFERENCE_BYTES = Decimal(2)
_KV_BYTES_PER_VALUE = 2  # 16-bit cache

# fits(): a step has two peaks that never overlap, sampling (the KV cache of every completion
# of the step at once) and the update (one micro-batch at a time, see trainer.loop):
#   update = the micro-batch's logits and their gradient (16-bit, completion positions only)
#          + the selective log-softmax's fp32 chunk, recomputed in backward (3 buffers)
#          + with gradient checkpointing: every layer's input kept, one layer's activations
#            recomputed; without: every layer's activations
#   one layer's activations ~ tokens x (6 hidden + 2 kv width + 4 intermediate) 16-bit values
#     (norm inputs, q/k/v/o, attention output, gate, up, their product, down's input)
# The card's memory minus a reserve must hold weights + trainable state + reference and the
# larger of the two.
_ACTIVATION_BYTES = 2
_LOGPROB_CHUNK_BUFFERS = 3
# The CUDA context, the allocator's fragmentation and the generation engine's own buffers.
USABLE_MEMORY_FRACTION = 0.9


def fits(needed: float, gpu: str | Gpu) -> bool:
    """Whether a run needing `needed` GB on one card (MemoryEstimate.needed_gb) fits on `gpu`:
    ``needed <= USABLE_MEMORY_FRACTION x memory``. Raises ValueError for an unknown GPU name."""
    card = gpu if isinstance(gpu, Gpu) else lookup_gpu(gpu)
    return needed <= card.memory_gb * USABLE_MEMORY_FRACTION


def _update_bytes(shape: ModelShape, micro: int, seq_tokens: int, completion_tokens: int, checkpointing: bool) -> int:
    logits = 2 * micro * (completion_tokens + 1) * shape.vocab * _ACTIVATION_BYTES
    chunk = _LOGPROB_CHUNK_BUFFERS * LOGPROB_CHUNK_ELEMENTS * 4
    kv_width = shape.kv_heads * shape.head_dim
    layer = micro * seq_tokens * (6 * shape.hidden + 2 * kv_width + 4 * shape.intermediate) * _ACTIVATION_BYTES
    if checkpointing:
        kept = shape.layers * micro * seq_tokens * shape.hidden * _ACTIVATION_BYTES + layer
    else:
        kept = shape.layers * layer
    return logits + chunk + kept


def reward_model_memory(config: Mapping[str, Any], *, sequences: int, seq_tokens: int) -> tuple[Decimal, Decimal]:
    """(weights, one scoring forward) in GB for a reward model (a sequence-classification model
    with one logit, loaded in bf16 and run without gradients) scoring `sequences` completions of
    `seq_tokens` tokens in one batch. Its weights: the decoder's parameters with a one-output head
    instead of the vocabulary's. Its forward holds one decoder layer's tensors at a time: the
    residual stream and the MLP's gate and up outputs, for the whole batch."""
    shape = model_shape(config)
    parameters = parameter_count(shape) - (0 if shape.tied else shape.vocab * shape.hidden) + shape.hidden
    weights = _gb(quoted_count(parameters), Decimal(_ACTIVATION_BYTES), "0.01")
    live = sequences * seq_tokens * (shape.hidden + 2 * shape.intermediate) * _ACTIVATION_BYTES
    return weights, _gb(live, Decimal(1), "0.1")


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
    micro_batch_size: int = 1     # completions per forward/backward in the update
    sampling_gb: float = 0.0      # the KV cache of the step's promptsPerStep x numGenerations completions
    update_gb: float = 0.0        # one micro-batch: logits, their gradient, activations
    needed_gb: float = 0.0        # total + reward models + the largest of sampling, update and scoring
    fits: bool | None = None      # None when no GPU was named
    reward_models_gb: float = 0.0  # the reward models' weights (bf16), resident the whole run
    scoring_gb: float = 0.0        # the reward models' forward over one step's completions
    fsdp_shards: int = 1           # a full fine-tune sharded over this many GPUs: the figures are one GPU's
    sampler: str = "native"        # native | colocate (vLLM on this GPU) | server (vLLM on another)
    engine_gb: float | None = None          # colocate on a named card: gpuMemoryUtilization x its memory
    engine_weights_gb: float = 0.0          # colocate: the engine's 16-bit weights and the adapter
    engine_kv_gb: float | None = None       # colocate: what the share leaves the engine for its KV cache
    engine_min_kv_gb: float = 0.0           # colocate: one whole sequence's KV cache, the least vLLM starts with
    staleness: int = 0                      # spec.parameters.staleness: sampling during the update
    policy_copies_gb: float = 0.0           # staleness: the producer's draft adapter and N + 1 snapshots

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
            "microBatchSize": self.micro_batch_size,
            "samplingGB": self.sampling_gb,
            "updateGB": self.update_gb,
            "neededGB": self.needed_gb,
            "fits": self.fits,
            # only for a job with reward models: SPEC §6's document is the same for every other
            **({"rewardModelsGB": self.reward_models_gb, "scoringGB": self.scoring_gb}
               if self.reward_models_gb else {}),
            **({"fsdpShards": self.fsdp_shards} if self.fsdp_shards > 1 else {}),
            **({"engine": self._engine()} if self.sampler != "native" else {}),
            **({"staleness": self.staleness, "policyCopiesGB": self.policy_copies_gb} if self.staleness else {}),
        }

    def _engine(self) -> dict[str, Any]:
        if self.sampler == "server":
            return {"sampler": "vllm", "mode": "server", "onThisGPU": False}
        return {"sampler": "vllm", "mode": "colocate", "engineGB": self.engine_gb,
                "engineWeightsGB": self.engine_weights_gb, "engineKvCacheGB": self.engine_kv_gb,
                "minKvCacheGB": self.engine_min_kv_gb}

    @property
    def engine_cannot_start(self) -> bool:
        """Colocated vLLM whose share of the card cannot hold its weights and one sequence's KV cache."""
        return self.engine_kv_gb is not None and self.engine_kv_gb < self.engine_min_kv_gb


def memory_estimate(
    config: Mapping[str, Any],
    *,
    method: str,
    lora_r: int,
    lora_targets: Sequence[str] = LORA_TARGETS,
    beta: float,
    num_generations: int,
    max_completion_length: int,
    prompt_tokens: int = 0,
    prompts_per_step: int = 1,
    micro_batch_size: int | None = None,
    gradient_checkpointing: bool = True,
    gpu: str | Gpu | None = None,
    reward_models: Sequence[Mapping[str, Any]] = (),
    shards: int = 1,
    sampler: str = "native",
    engine_share: float = 0.3,
    staleness: int = 0,
) -> MemoryEstimate:
    """Memory for weights and trainable state of one run, from a HF ``config.json`` dict.

    ``method`` is one of ``trainer.config.METHODS``; ``lora_r`` and ``lora_targets`` are ignored
    for ``method="Full"``. ``micro_batch_size`` None: the trainer's own choice for ``gpu``
    (trainer.config.default_micro_batch). With ``gpu`` the estimate's ``fits`` is filled in (see
    ``fits``); without it ``fits`` is None. ``reward_models``: the config.json of each reward model
    the job names (reward_model_memory), counted in ``neededGB``. ``shards``: the GPUs a full
    fine-tune is sharded over with FSDP (one per process); the figures are then one GPU's, its
    trainable state the whole weights and gradients plus 1/shards of the rest (a LoRA or QLoRA
    adapter is replicated: ignored). ``sampler``: ``native`` (the trainer decodes), ``colocate``
    (vLLM on this GPU, holding ``engine_share`` of it: spec.parameters.vllm.gpuMemoryUtilization)
    or ``server`` (vLLM on another GPU); see the module docstring.

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

    shape = model_shape(config)
    parameters = parameter_count(shape)
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
    per_param = _TRAINED_BYTES
    if method == "Full" and shards > 1:
        per_param = _WHOLE_WHEN_SHARDED + (_TRAINED_BYTES - _WHOLE_WHEN_SHARDED) / shards
    state = _gb(quoted_count(trainable), per_param, "0.01")
    total = (weights + state + reference).quantize(Decimal("0.1"), rounding=ROUND_HALF_UP)

    kv_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * _KV_BYTES_PER_VALUE  # K, V
    group_tokens = num_generations * (prompt_tokens + max_completion_length)
    kv_gb = _gb(kv_per_token * group_tokens, Decimal(1), "0.1")
    completions = prompts_per_step * num_generations
    seq_tokens = prompt_tokens + max_completion_length
    sampling = _gb(kv_per_token * completions * seq_tokens, Decimal(1), "0.1")
    micro = micro_batch_size or default_micro_batch(
        completions, max_completion_length + 1, shape.vocab, _ACTIVATION_BYTES,
        None if card is None else int(card.memory_gb * 1e9))
    micro = min(micro, completions)
    update = _gb(_update_bytes(shape, micro, seq_tokens, max_completion_length, gradient_checkpointing),
                 Decimal(1), "0.1")
    scorers = [reward_model_memory(c, sequences=completions, seq_tokens=seq_tokens) for c in reward_models]
    scorer_weights = sum((w for w, _ in scorers), Decimal("0.00"))
    scoring = max((f for _, f in scorers), default=Decimal("0.0"))
    engine = engine_kv = None
    engine_weights = min_kv = Decimal("0.00")
    if sampler == "colocate":
        # the engine's copy: every weight at 16 bits (QLoRA is not handed to vLLM), the adapter too
        engine_weights = _gb(quoted, Decimal(2), "0.01") + _gb(quoted_count(trainable) if method != "Full" else 0,
                                                                Decimal(2), "0.01")
        min_kv = _gb(kv_per_token * seq_tokens, Decimal(1), "0.01")
        if card is not None:
            engine = (Decimal(str(engine_share)) * Decimal(str(card.memory_gb))).quantize(
                Decimal("0.1"), rounding=ROUND_HALF_UP)
            engine_kv = engine - engine_weights
    copies = Decimal("0.00")
    if staleness:
        # the producer's draft (its own adapter, the base shared) and the snapshots of versions
        # k-N..k it draws with, fp32; its KV cache is held while the update runs, not after it
        copies = _gb(quoted_count(trainable) * (staleness + 2), Decimal(4), "0.01")
        needed = total + scorer_weights + copies + max(sampling + update, scoring)
    elif sampler == "native":
        needed = total + scorer_weights + max(sampling, update, scoring)
    else:
        # the engine samples: colocated, its share while it is awake (asleep during the update);
        # as a server, elsewhere
        needed = total + scorer_weights + max(engine or Decimal(0), update, scoring)

    return MemoryEstimate(
        parameters=parameters,
        trainable_parameters=trainable,
        weights_gb=float(weights),
        trainable_state_gb=float(state),
        reference_gb=float(reference),
        total_gb=float(total),
        kv_cache_bytes_per_token=kv_per_token,
        kv_cache_gb=float(kv_gb),
        micro_batch_size=micro,
        sampling_gb=float(sampling),
        update_gb=float(update),
        reward_models_gb=float(scorer_weights),
        scoring_gb=float(scoring),
        needed_gb=float(needed),
        fits=None if card is None else fits(float(needed), card) and not (
            engine_kv is not None and engine_kv < min_kv),
        fsdp_shards=shards if method == "Full" and shards > 1 else 1,
        sampler=sampler,
        engine_gb=None if engine is None else float(engine),
        engine_weights_gb=float(engine_weights),
        engine_kv_gb=None if engine_kv is None else float(engine_kv),
        engine_min_kv_gb=float(min_kv),
        staleness=staleness,
        policy_copies_gb=float(copies),
    )

