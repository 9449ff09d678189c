"""How long one GRPO step takes, from what the job says and what the card can do.

One step (SPEC §1; trainer.trainer.GRPOTrainer.train_step) is sampling, then the update:

sampling  n = B x G completions decoded together, one token of each per decode step. Decoding
          is memory-bound: a decode step reads every weight once (batched: once for all n) and
          each sequence's KV cache, and does n tokens' worth of matmuls:
              LAUNCH_SECONDS x layers + max(bytes / (bandwidth x MEMORY_EFFICIENCY),
                                            flops / (peak x COMPUTE_EFFICIENCY))
          The prompts are one more such step, over n x P tokens at once (prefill).
update    forward and backward over n sequences of P + T tokens, compute-bound:
              passes x n (P + T) x forward FLOPs per token / (peak x COMPUTE_EFFICIENCY)
          passes = forward 1 + backward 1 (activation gradients; + 1 for the weights' own
          gradients in a full fine-tune) + 1 recomputed forward with gradient checkpointing,
          x numIterations (the old log-probabilities are the first iteration's, no extra pass);
          + 1 forward of the reference when beta > 0.
scoring  each reward model the job names (a one-logit classifier): one forward, no gradients,
          over the same n sequences of P + T tokens, as one pass (weights read once at 2 bytes;
          the head is hidden x 1, not the vocabulary's); counted with the update.
Both x the card's CALIBRATION (see below). Asynchronous (spec.parameters.staleness N > 0,
trainer.ahead): the producer samples step k+N while step k updates, so a step takes the slower of
the two plus the sync, the copy of the adapter the producer draws with (its fp32 bytes read and
written at the card's bandwidth). On one GPU the native decoder and the update share the card: the
model's overlap is the most it can give (bench/gpu_check.py's async section measures it). Scoring (a Python check in the grader), the optimizer
step and the host's bookkeeping are left out: next to these they are small (SPEC §5).

Forward FLOPs per token at context c: 2 x the matmul parameters (every decoder linear layer and
the output head) + 4 x layers x heads x head_dim x c (attention's scores and weighted sum).
Bytes a decode step reads: the matmul weights at 2 bytes (LoRA, Full); with QLoRA 4.5 bytes for
each 4-bit decoder weight (bitsandbytes reads the NF4 half byte, writes the 16-bit copy and the
matmul reads it back; the output head stays 16-bit) -- so QLoRA samples slower than LoRA, as it
does; plus K and V of every sequence at the mean context, 2 x layers x KV heads x head_dim x
2 bytes a token.

Token counts: P is the *expected* prompt length (the mean over the tasks, workload.py); T is
maxCompletionLength, the *maximum*: a batch decodes until its longest completion ends and, in
training, some completion of B x G nearly always runs to the limit; the update pads each
micro-batch to its longest. Every completion is counted as learning (groups whose rewards are
all equal are skipped by the update): an upper bound. An episode (spec.environment.episodes) is
maxTurns replies of T tokens at most, decoded one turn after another, each turn prefilling the
episode so far; the update passes over P + maxTurns x T. The environment's observations are not
counted: their length is the environment's, known only when it runs.

Sampled by vLLM (``StepWork.engine``): the same roofline for every pass, but CUDA graphs replace
eager PyTorch's per-layer kernel launches with one fixed cost a pass, VLLM_PASS_SECONDS (the
engine's scheduler, sampler and graph replay). It is fitted to one published figure, vLLM
sampling Qwen3-0.6B at 8,588 output tokens/s on an H100 (VLLM_ANCHOR; issue 32's anchor, which
bench/gpu_check.py measures against), read as the reference job's 32 sequences of 64 tokens:
about 1.7 ms a pass. Whether the engine is colocated or a server, the step waits for it.

Calibration. The constants are fitted to SPEC §3's reference step times -- a reference runtime's
own measured runs of the reference job, SPEC §2's example: Qwen3-0.6B, graph-coloring,
numGenerations 4, maxCompletionLength 64, LoRA r=8, beta 0, and the defaults it leaves out
(promptsPerStep 8, numIterations 1, gradient checkpointing on; prompts of 6.1 tokens, the
graph-coloring tasks' mean of 24.55 characters at 4 a token, as workload.py counts them). A least-squares fit of log step time
over the five cards (grid of 0.05 in the efficiencies, 5 us in the overhead) gives
MEMORY_EFFICIENCY 0.20, COMPUTE_EFFICIENCY 0.10 and LAUNCH_SECONDS 130 us, and leaves each card
within 5% of SPEC. The per-card CALIBRATION is that residual, SPEC / model (H100 1.005,
A100-80GB 0.983, L40S 1.041, RTX4090 1.032, A6000 0.978), so the reference job
reproduces SPEC's step times exactly; a card without a reference time is at 1 (the fitted
model alone). The efficiencies are low because a 0.6B model's matmuls are too small to fill a
data-centre GPU and the decoder runs eagerly, a kernel launch at a time: bigger models use the
card better than this, so for them the model errs long (a budget set from it is not
overspent). bench/gpu_check.py measures a step against this model; the user's own measured step
times replace it (measured.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType

from grpo_run.runner.estimate.memory import ModelShape, model_shape
from grpo_run.runner.spec.gpus import GPUS, Gpu

__all__ = [
    "CALIBRATION",
    "COMPUTE_EFFICIENCY",
    "LAUNCH_SECONDS",
    "VLLM_ANCHOR",
    "VLLM_PASS_SECONDS",
    "MEMORY_EFFICIENCY",
    "QWEN3_0_6B",
    "REFERENCE_WORK",
    "StepTime",
    "StepWork",
    "decode_seconds",
    "eval_seconds",
    "forward_flops_per_token",
    "score_seconds",
    "matmul_parameters",
    "step_time",
    "update_seconds",
    "weight_bytes",
]

MEMORY_EFFICIENCY = 0.20     # of the datasheet's memory bandwidth, reached while decoding
COMPUTE_EFFICIENCY = 0.10    # of the datasheet's dense bf16 FLOP/s, reached in matmuls
LAUNCH_SECONDS = 130e-6      # per decoder layer per decode step: kernel launches of eager PyTorch

_WEIGHT_BYTES = {"LoRA": 2.0, "Full": 2.0, "QLoRA": 4.5}   # per decoder matmul weight, per read
_HEAD_BYTES = 2.0            # the output head is never quantized
_KV_BYTES = 2                # 16-bit cache


@dataclass(frozen=True)
class StepWork:
    """What one GRPO step computes, from the job (one process's share of it)."""

    shape: ModelShape
    method: str = "LoRA"           # LoRA | QLoRA | Full
    prompts: int = 8               # B on this GPU
    generations: int = 4           # G
    prompt_tokens: float = 0.0     # expected (mean) prompt length
    completion_tokens: int = 64    # maxCompletionLength: the most a completion decodes
    num_iterations: int = 1
    beta: float = 0.0
    gradient_checkpointing: bool = True
    scorers: tuple[ModelShape, ...] = ()   # the reward models' shapes (scored once per step)
    engine: str = "native"         # what samples: native (eager PyTorch) | vllm
    turns: int = 1                 # an episode's replies at most (spec.environment.maxTurns); 1: no episodes
    staleness: int = 0             # spec.parameters.staleness: > 0 samples during the update
    adapter_parameters: int = 0    # the trainable parameters a staleness run copies every step

    @property
    def sequences(self) -> int:
        return self.prompts * self.generations

    @property
    def trained_tokens(self) -> float:
        """A sequence the update passes over: the prompt and every reply (an episode's
        observations are the environment's, of a length known only when it runs: not counted)."""
        return self.prompt_tokens + self.turns * self.completion_tokens


@dataclass(frozen=True)
class StepTime:
    """One step's time on one card; the parts before the card's calibration."""

    sample_seconds: float
    update_seconds: float
    calibration: float
    sync_seconds: float | None = None     # asynchronous: the adapter's copy (None: synchronous)

    @property
    def seconds(self) -> float:
        if self.sync_seconds is not None:      # sampling overlaps the update
            return self.calibration * (max(self.sample_seconds, self.update_seconds) + self.sync_seconds)
        return self.calibration * (self.sample_seconds + self.update_seconds)

    @property
    def sampling_share(self) -> float:
        return self.sample_seconds / (self.sample_seconds + self.update_seconds)


# --- the arithmetic -----------------------------------------------------------------------------


def matmul_parameters(shape: ModelShape) -> int:
    """Weights a token is multiplied through: every decoder linear layer and the output head."""
    per_layer = sum(i * o for i, o in shape.linear_dims().values())
    return shape.layers * per_layer + shape.vocab * shape.hidden


def forward_flops_per_token(shape: ModelShape, context: float) -> float:
    """FLOPs of one token's forward pass attending to `context` tokens."""
    return 2 * matmul_parameters(shape) + 4 * shape.layers * shape.heads * shape.head_dim * context


def weight_bytes(shape: ModelShape, method: str) -> float:
    """Bytes of weights one forward pass reads (see the module docstring for QLoRA's)."""
    decoder = matmul_parameters(shape) - shape.vocab * shape.hidden
    return decoder * _WEIGHT_BYTES[method] + shape.vocab * shape.hidden * _HEAD_BYTES


def _kv_bytes_per_token(shape: ModelShape) -> int:
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * _KV_BYTES


def _roofline(gpu: Gpu, read: float, flops: float) -> float:
    """A pass's reads or its matmuls, whichever is slower."""
    return max(read / (gpu.memory_bandwidth * MEMORY_EFFICIENCY), flops / (gpu.bf16_flops * COMPUTE_EFFICIENCY))


def _pass_seconds(shape: ModelShape, gpu: Gpu, read: float, flops: float) -> float:
    """One eager forward pass of a batch: the roofline after the layers' kernel launches."""
    return LAUNCH_SECONDS * shape.layers + _roofline(gpu, read, flops)


def _decode_rooflines(shape: ModelShape, method: str, sequences: int, prompt_tokens: float, new_tokens: int,
                      gpu: Gpu) -> tuple[float, float]:
    """(the prefill's roofline, one decode pass's) for decode_seconds."""
    weights = weight_bytes(shape, method)
    prefill = _roofline(gpu, weights, sequences * prompt_tokens * forward_flops_per_token(shape, prompt_tokens / 2))
    context = prompt_tokens + (new_tokens + 1) / 2
    step = _roofline(gpu, weights + sequences * context * _kv_bytes_per_token(shape),
                     sequences * forward_flops_per_token(shape, context))
    return prefill, step


def decode_seconds(shape: ModelShape, method: str, sequences: int, prompt_tokens: float, new_tokens: int,
                   gpu: Gpu, engine: str = "native") -> float:
    """Seconds to prefill `sequences` prompts of `prompt_tokens` and decode `new_tokens` tokens of
    each, batched (uncalibrated), by `engine` (native | vllm). The KV cache is read at the mean
    context of the decode."""
    prefill, step = _decode_rooflines(shape, method, sequences, prompt_tokens, new_tokens, gpu)
    per_pass = VLLM_PASS_SECONDS if engine == "vllm" else LAUNCH_SECONDS * shape.layers
    return (1 + new_tokens) * per_pass + prefill + new_tokens * step


def turns_seconds(shape: ModelShape, method: str, sequences: int, prompt_tokens: float, new_tokens: int,
                  gpu: Gpu, engine: str = "native", turns: int = 1) -> float:
    """decode_seconds for each of an episode's `turns` replies, one after another: each turn
    prefills the episode so far (the prompt and the replies before it) and decodes `new_tokens`."""
    return sum(decode_seconds(shape, method, sequences, prompt_tokens + t * new_tokens, new_tokens, gpu, engine)
               for t in range(turns))


def update_seconds(work: StepWork, gpu: Gpu) -> float:
    """Seconds of the update's forward and backward passes (uncalibrated)."""
    length = work.trained_tokens
    token_flops = work.sequences * length * forward_flops_per_token(work.shape, length / 2)  # one pass
    passes = 1 + (2 if work.method == "Full" else 1) + (1 if work.gradient_checkpointing else 0)
    total = work.num_iterations * passes * token_flops + (token_flops if work.beta > 0 else 0.0)
    return total / (gpu.bf16_flops * COMPUTE_EFFICIENCY)


def score_seconds(scorer: ModelShape, sequences: int, tokens: float, gpu: Gpu) -> float:
    """One reward model's forward over `sequences` of `tokens` tokens, batched (uncalibrated)."""
    head = replace(scorer, vocab=1)          # a one-logit head: hidden x 1
    return _pass_seconds(head, gpu, weight_bytes(head, "LoRA"),
                         sequences * tokens * forward_flops_per_token(head, tokens / 2))


def _uncalibrated(work: StepWork, gpu: Gpu) -> tuple[float, float]:
    sample = turns_seconds(work.shape, work.method, work.sequences, work.prompt_tokens,
                           work.completion_tokens, gpu, work.engine, work.turns)
    length = work.trained_tokens
    scoring = sum(score_seconds(s, work.sequences, length, gpu) for s in work.scorers)
    return sample, update_seconds(work, gpu) + scoring


# --- calibration --------------------------------------------------------------------------------

# Qwen/Qwen3-0.6B's config.json, the values that shape the network.
QWEN3_0_6B = MappingProxyType(dict(
    model_type="qwen3", vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True))

REFERENCE_WORK = StepWork(shape=model_shape(QWEN3_0_6B), method="LoRA", prompts=8, generations=4,
                          prompt_tokens=6.1, completion_tokens=64, num_iterations=1, beta=0.0,
                          gradient_checkpointing=True)

# SPEC's reference step time / the fitted model's, for each card SPEC gives one.
CALIBRATION = MappingProxyType({
    gpu.name: gpu.reference_step_seconds / sum(_uncalibrated(REFERENCE_WORK, gpu))
    for gpu in GPUS.values() if gpu.reference_step_seconds is not None
})


# vLLM's published rate for Qwen3-0.6B on an H100 (output tokens/s), read as the reference job's
# sequences and completion length; VLLM_PASS_SECONDS is what makes the calibrated model say it.
VLLM_ANCHOR = MappingProxyType({"tokensPerSecond": 8588, "gpu": "H100", "model": "Qwen3-0.6B"})


def _vllm_pass_seconds() -> float:
    work, gpu = REFERENCE_WORK, GPUS[VLLM_ANCHOR["gpu"]]
    target = work.sequences * work.completion_tokens / VLLM_ANCHOR["tokensPerSecond"] / CALIBRATION[gpu.name]
    prefill, step = _decode_rooflines(work.shape, work.method, work.sequences, work.prompt_tokens,
                                      work.completion_tokens, gpu)
    return (target - prefill - work.completion_tokens * step) / (1 + work.completion_tokens)


VLLM_PASS_SECONDS = _vllm_pass_seconds()


def step_time(work: StepWork, gpu: Gpu) -> StepTime:
    """One step of `work` on `gpu`: sampling and update, and the card's calibration."""
    sample, update = _uncalibrated(work, gpu)
    sync = None
    if work.staleness > 0:       # fp32 adapter read and written once
        sync = 2 * 4 * work.adapter_parameters / (gpu.memory_bandwidth * MEMORY_EFFICIENCY)
    return StepTime(sample, update, CALIBRATION.get(gpu.name, 1.0) if gpu.listed else 1.0, sync)


def eval_seconds(shape: ModelShape, method: str, *, tasks: int, batch_size: int, prompt_tokens: float,
                 completion_tokens: int, gpu: Gpu, scorers: tuple[ModelShape, ...] = (),
                 engine: str = "native", turns: int = 1) -> float:
    """One evaluation: `tasks` held-out prompts, one greedy completion each (an episode of up to
    `turns` replies), `batch_size` at a time, each batch decoding to `completion_tokens` a reply
    and scored by each reward model (calibrated like a step)."""
    if tasks <= 0:
        return 0.0

    def batch(n: int) -> float:
        return turns_seconds(shape, method, n, prompt_tokens, completion_tokens, gpu, engine, turns) + sum(
            score_seconds(s, n, prompt_tokens + turns * completion_tokens, gpu) for s in scorers)

    full, rest = divmod(tasks, batch_size)
    seconds = full * batch(batch_size)
    if rest:
        seconds += batch(rest)
    return seconds * (CALIBRATION.get(gpu.name, 1.0) if gpu.listed else 1.0)
