"""The model of a step (runner/estimate/steptime.py): one step of a small config by hand, SPEC's
reference step times, and how the time moves with the method and the passes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from grpo_run.runner.estimate.memory import model_shape
from grpo_run.runner.estimate.steptime import (CALIBRATION, COMPUTE_EFFICIENCY, LAUNCH_SECONDS, MEMORY_EFFICIENCY,
                                               REFERENCE_WORK, StepWork, eval_seconds, matmul_parameters, step_time,
                                               update_seconds)
from grpo_run.runner.spec.gpus import GPUS, Gpu

SMALL = model_shape({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100, "tie_word_embeddings": True})
# A card with round figures, outside the table so no calibration applies.
ROUND = Gpu("ROUND", memory_gb=16, bf16_flops=1e12, memory_bandwidth=1e10, usd_per_hour=1.0, listed=False)


def test_one_step_of_a_small_config_by_hand():
    work = StepWork(shape=SMALL, method="LoRA", prompts=2, generations=2, prompt_tokens=10, completion_tokens=6,
                    num_iterations=1, beta=0.0, gradient_checkpointing=True)
    assert (MEMORY_EFFICIENCY, COMPUTE_EFFICIENCY, LAUNCH_SECONDS) == (0.2, 0.1, 130e-6)
    # matmul weights: per layer q 64x64 + k 64x32 + v 64x32 + o 64x64 + gate, up, down 3 x 64x128
    # = 36,864; x 2 layers + the head 100 x 64 = 80,128
    assert matmul_parameters(SMALL) == 80_128
    # forward FLOPs per token at context c: 2 x 80,128 + 4 x 2 layers x 4 heads x 16 x c = 160,256 + 512 c
    bandwidth, flops = 1e10 * 0.2, 1e12 * 0.1          # what the model reaches: 2e9 B/s, 1e11 FLOP/s
    launch = 130e-6 * 2                                 # per pass: 2 layers
    weights = 2 * 80_128                                # 16-bit, read once per pass
    kv_per_token = 2 * 2 * 2 * 16 * 2                   # K, V x 2 layers x 2 KV heads x 16 x 2 B = 256
    n = 4                                               # 2 prompts x 2 completions
    # sampling: the prefill (4 x 10 prompt tokens at mean context 5), a pass bound by its reads
    prefill = launch + max(weights / bandwidth, n * 10 * (160_256 + 512 * 5) / flops)    # 80.128 us vs 65.13 us
    # then 6 decode steps, each reading the weights and 4 KV caches at the mean context 10 + 7/2 = 13.5
    decode = launch + max((weights + n * 13.5 * kv_per_token) / bandwidth, n * (160_256 + 512 * 13.5) / flops)
    sample = prefill + 6 * decode
    assert sample == pytest.approx(340.128e-6 + 6 * 347.04e-6)
    # update: 4 sequences of 16 tokens, forward at mean context 8; LoRA with checkpointing = 3 passes
    update = 3 * n * 16 * (160_256 + 512 * 8) / flops
    assert update == pytest.approx(315.55584e-6)

    timed = step_time(work, ROUND)

    assert timed.sample_seconds == pytest.approx(sample)
    assert timed.update_seconds == pytest.approx(update)
    assert timed.calibration == 1.0
    assert timed.seconds == pytest.approx(2737.92384e-6)


def test_the_reference_job_takes_spec_s_step_time_on_every_reference_card():
    for name, seconds in (("H100", 0.45), ("A100-80GB", 0.7), ("L40S", 1.0), ("RTX4090", 1.2), ("A6000", 1.3)):
        assert step_time(REFERENCE_WORK, GPUS[name]).seconds == pytest.approx(seconds)


def test_the_fitted_model_alone_is_within_5_percent_of_spec_on_every_reference_card():
    # the per-card calibration only takes up a residual: the efficiencies explain SPEC's table
    assert set(CALIBRATION) == {"H100", "A100-80GB", "L40S", "RTX4090", "A6000"}
    assert all(0.95 <= factor <= 1.05 for factor in CALIBRATION.values()), dict(CALIBRATION)
    assert step_time(REFERENCE_WORK, GPUS["L4"]).calibration == 1.0          # no reference: the model alone


def test_the_update_counts_its_passes():
    work = StepWork(shape=SMALL, prompts=2, generations=2, prompt_tokens=10, completion_tokens=6)
    lora = update_seconds(work, ROUND)                                                      # 3 passes
    assert update_seconds(replace(work, method="Full"), ROUND) == pytest.approx(lora * 4 / 3)   # weight gradients
    assert update_seconds(replace(work, gradient_checkpointing=False), ROUND) == pytest.approx(lora * 2 / 3)
    assert update_seconds(replace(work, num_iterations=2), ROUND) == pytest.approx(lora * 2)
    assert update_seconds(replace(work, beta=0.04), ROUND) == pytest.approx(lora * 4 / 3)      # the reference's forward


def test_qlora_samples_slower_than_lora_since_every_read_dequantizes():
    lora = step_time(REFERENCE_WORK, GPUS["H100"])
    qlora = step_time(replace(REFERENCE_WORK, method="QLoRA"), GPUS["H100"])
    assert qlora.sample_seconds > lora.sample_seconds and qlora.update_seconds == lora.update_seconds


def test_an_evaluation_decodes_its_tasks_in_batches():
    one = eval_seconds(SMALL, "LoRA", tasks=64, batch_size=64, prompt_tokens=10, completion_tokens=6, gpu=ROUND)
    assert eval_seconds(SMALL, "LoRA", tasks=128, batch_size=64, prompt_tokens=10, completion_tokens=6,
                        gpu=ROUND) == pytest.approx(2 * one)
    assert eval_seconds(SMALL, "LoRA", tasks=0, batch_size=64, prompt_tokens=10, completion_tokens=6, gpu=ROUND) == 0
