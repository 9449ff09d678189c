"""Cost and memory estimates reproduce SPEC §3's worked examples."""

from __future__ import annotations

import pytest

from runner.estimate import (
    GPUS,
    CostEstimate,
    cost_estimate,
    fits,
    format_count,
    lookup_gpu,
    memory_estimate,
)

# Qwen/Qwen3-8B config.json (the keys the estimate reads, plus some it must ignore).
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "max_position_embeddings": 40960,
    "model_type": "qwen3",
    "rms_norm_eps": 1e-06,
    "torch_dtype": "bfloat16",
}

QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "model_type": "qwen3",
}

# SPEC §3's group: 8 completions x 1,024 tokens.
GROUP = {"num_generations": 8, "max_completion_length": 1024}


def qwen3_8b(method: str, beta: float = 0.0, **overrides):
    return memory_estimate(QWEN3_8B, method=method, lora_r=8, beta=beta, **{**GROUP, **overrides})


def gigabytes(estimate):
    """(weights, trainable state, total) in GB."""
    return estimate.weights_gb, estimate.trainable_state_gb, estimate.total_gb


# --- memory: SPEC §3's Qwen3-8B example, number by number -------------------------------------


def test_qwen3_8b_has_8_2b_parameters_exactly_as_transformers_counts_them():
    # 8,190,735,360 is what Qwen3ForCausalLM built from this config on the meta device reports.
    estimate = qwen3_8b("LoRA")
    assert estimate.parameters == 8_190_735_360
    assert format_count(estimate.parameters) == "8.2B"


def test_rank_8_lora_on_all_seven_projections_trains_606_208_params_per_layer_21_8m_in_all():
    estimate = qwen3_8b("LoRA")
    assert estimate.trainable_parameters == 606_208 * 36
    assert format_count(estimate.trainable_parameters) == "21.8M"
    assert estimate.trainable_state_gb == 0.35


def test_lora_needs_16_8_gb_a_16_bit_base_plus_the_adapters_adam_state():
    estimate = qwen3_8b("LoRA")
    assert gigabytes(estimate) == (16.4, 0.35, 16.8)


def test_qlora_needs_4_5_gb_an_nf4_base_plus_the_adapters_adam_state():
    estimate = qwen3_8b("QLoRA")
    assert gigabytes(estimate) == (4.1, 0.35, 4.5)


def test_full_fine_tune_needs_131_2_gb_with_every_weight_in_the_trainable_state():
    estimate = qwen3_8b("Full")
    assert estimate.trainable_parameters == estimate.parameters
    assert gigabytes(estimate) == (0.0, 131.2, 131.2)
    assert estimate.reference_gb == 0.0


def test_full_fine_tune_with_a_kl_penalty_adds_a_16_bit_reference_for_147_6_gb():
    estimate = qwen3_8b("Full", beta=0.04)
    assert (estimate.reference_gb, estimate.total_gb) == (16.4, 147.6)


@pytest.mark.parametrize("method", ["LoRA", "QLoRA"])
def test_a_kl_penalty_costs_adapters_no_reference_weights(method):
    assert qwen3_8b(method, beta=0.04).reference_gb == 0.0
    assert qwen3_8b(method, beta=0.04).total_gb == qwen3_8b(method).total_gb


def test_kv_cache_is_147_456_bytes_per_token_and_about_1_2_gb_for_8_x_1024_tokens():
    estimate = qwen3_8b("LoRA")
    assert estimate.kv_cache_bytes_per_token == 147_456
    assert estimate.kv_cache_gb == 1.2


def test_the_kv_cache_covers_the_prompt_too():
    assert qwen3_8b("LoRA", prompt_tokens=1024).kv_cache_gb == 2.4


def test_to_dict_uses_the_status_estimate_memory_keys():
    assert qwen3_8b("QLoRA", gpu="L40S").to_dict() == {
        "parameters": 8_190_735_360,
        "trainableParameters": 21_823_488,
        "weightsGB": 4.1,
        "trainableStateGB": 0.35,
        "referenceGB": 0.0,
        "totalGB": 4.5,
        "kvCacheBytesPerToken": 147_456,
        "kvCacheGB": 1.2,
        "fits": True,
    }


def test_fits_is_left_open_when_no_gpu_is_named():
    assert qwen3_8b("QLoRA").fits is None


# --- memory: other shapes ----------------------------------------------------------------------


def test_tied_embeddings_are_counted_once_so_qwen3_0_6b_has_0_6b_parameters():
    estimate = memory_estimate(QWEN3_0_6B, method="LoRA", lora_r=8, beta=0.0, **GROUP)
    assert estimate.parameters == 596_049_920
    assert estimate.parameters == pytest.approx(0.6e9, rel=0.01)
    assert format_count(estimate.parameters) == "596.0M"
    untied = memory_estimate(
        {**QWEN3_0_6B, "tie_word_embeddings": False}, method="LoRA", lora_r=8, beta=0.0, **GROUP
    )
    assert untied.parameters - estimate.parameters == 151_936 * 1024


def test_head_dim_defaults_to_hidden_over_heads_and_kv_heads_to_heads():
    llama_like = {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "vocab_size": 32000,
    }
    estimate = memory_estimate(llama_like, method="LoRA", lora_r=8, beta=0.0, **GROUP)
    assert estimate.kv_cache_bytes_per_token == 2 * 16 * 32 * 64 * 2


def test_lora_targets_accept_peft_module_names_and_count_only_what_is_adapted():
    attention_only = qwen3_8b("LoRA", lora_targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    # (4096+4096) + 2 x (4096+1024) + (4096+4096) = 26,624 per layer at r=1
    assert attention_only.trainable_parameters == 26_624 * 8 * 36


def test_an_unknown_lora_target_is_named_with_the_allowed_ones():
    with pytest.raises(ValueError, match="unknown qkv.*use any of q, k, v, o, gate, up, down"):
        qwen3_8b("LoRA", lora_targets=["qkv"])


def test_a_config_without_the_needed_keys_names_every_missing_key():
    with pytest.raises(ValueError, match="missing intermediate_size, vocab_size"):
        memory_estimate(
            {k: v for k, v in QWEN3_8B.items() if k not in ("intermediate_size", "vocab_size")},
            method="LoRA", lora_r=8, beta=0.0, **GROUP,
        )


def test_an_unknown_method_is_refused_with_the_allowed_ones():
    with pytest.raises(ValueError, match="LoRA, QLoRA, Full"):
        qwen3_8b("DoRA")


# --- fits --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpu", "expected"),
    [
        ("L40S", True),
        ("RTX-A6000", True),
        ("A100-80GB", True),
        ("H100-SXM-80GB", True),
        ("RTX-4090", False),
    ],
)
def test_an_8b_qlora_run_is_sized_for_a_48_gb_card_not_a_24_gb_rtx_4090(gpu, expected):
    assert qwen3_8b("QLoRA", gpu=gpu).fits is expected


def test_an_8b_full_fine_tune_fits_no_single_card():
    assert not any(qwen3_8b("Full", gpu=name).fits for name in GPUS)


def test_a_0_6b_lora_run_fits_a_24_gb_card():
    estimate = memory_estimate(QWEN3_0_6B, method="LoRA", lora_r=8, beta=0.0, **GROUP)
    assert fits(estimate.total_gb, estimate.kv_cache_gb, "RTX-4090")


def test_longer_completions_can_stop_a_run_from_fitting():
    assert qwen3_8b("QLoRA", gpu="L40S").fits
    assert not qwen3_8b("QLoRA", gpu="L40S", max_completion_length=4096).fits


# --- cost --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpu", "usd"),
    [
        ("H100-SXM-80GB", 0.33),
        ("A100-80GB", 0.21),
        ("L40S", 0.22),
        ("RTX-4090", 0.10),
        ("RTX-A6000", 0.12),
    ],
)
def test_1000_steps_cost_what_spec_says_to_the_cent(gpu, usd):
    estimate = cost_estimate(gpu=gpu, steps=1000)
    assert estimate.cost_to_completion_usd == usd
    assert estimate.step_seconds_source == "reference"


def test_the_h100_runs_at_spec_s_reference_step_time_and_rate():
    h100 = lookup_gpu("H100-SXM-80GB")
    assert (h100.step_seconds, h100.usd_per_hour) == (0.45, 2.60)


def test_the_fastest_gpu_is_not_the_cheapest_per_step():
    h100 = cost_estimate(gpu="H100-SXM-80GB", steps=1000)
    rtx4090 = cost_estimate(gpu="RTX-4090", steps=1000)
    assert round(rtx4090.step_seconds / h100.step_seconds, 1) == 2.7
    assert round(h100.usd_per_step / rtx4090.usd_per_step, 1) == 3.4


def test_an_explicit_rate_and_step_time_override_the_reference():
    estimate = cost_estimate(gpu="H100-SXM-80GB", steps=3600, usd_per_hour=2.0, step_seconds=2.0)
    assert (estimate.step_seconds, estimate.step_seconds_source) == (2.0, "override")
    assert estimate.usd_per_hour == 2.0
    assert estimate.cost_to_completion_usd == 4.0  # two hours at $2/h


def test_a_measured_step_time_replaces_the_reference():
    estimate = cost_estimate(gpu="RTX-4090", steps=1000, measured_step_seconds=2.4)
    assert (estimate.step_seconds, estimate.step_seconds_source) == (2.4, "measured")
    assert estimate.cost_to_completion_usd == 0.19  # twice the reference $0.0967


def test_an_explicit_step_time_wins_over_a_measured_one():
    estimate = cost_estimate(gpu="L40S", steps=10, step_seconds=3.0, measured_step_seconds=2.0)
    assert estimate.step_seconds_source == "override"


def test_the_first_hold_covers_the_steps_before_the_first_checkpoint_rounded_up():
    # 25 steps x 0.45 s x $2.60/h = $0.008125: a hold never rounds down to nothing.
    assert cost_estimate(gpu="H100-SXM-80GB", steps=1000, save_steps=25).first_hold_usd == 0.01
    hourly = cost_estimate(gpu="H100-SXM-80GB", steps=10_000, save_steps=8000, step_seconds=0.45)
    assert hourly.first_hold_usd == 2.60  # 8,000 x 0.45 s = one hour


def test_the_first_hold_never_exceeds_the_budget_or_the_whole_run():
    capped = cost_estimate(gpu="H100-SXM-80GB", steps=100_000, save_steps=8000, max_cost_usd=1.0)
    assert capped.first_hold_usd == 1.0
    short = cost_estimate(gpu="H100-SXM-80GB", steps=8000, save_steps=100_000)
    assert short.first_hold_usd == short.cost_to_completion_usd == 2.60


def test_cost_to_dict_uses_the_status_estimate_keys():
    assert cost_estimate(gpu="RTX-4090", steps=1000).to_dict() == {
        "gpu": "RTX-4090",
        "steps": 1000,
        "stepSeconds": 1.2,
        "stepSecondsSource": "reference",
        "usdPerHour": 0.29,
        "costToCompletionUSD": 0.10,
        "firstHoldUSD": 0.01,
    }


def test_an_unknown_gpu_is_refused_naming_the_allowed_ones():
    with pytest.raises(ValueError, match="H100-SXM-80GB, A100-80GB, L40S, RTX-4090, RTX-A6000"):
        cost_estimate(gpu="H100", steps=10)


@pytest.mark.parametrize(
    "bad",
    [{"steps": -1}, {"step_seconds": 0.0}, {"measured_step_seconds": -1.0}, {"usd_per_hour": -1.0}],
)
def test_nonsense_inputs_are_refused(bad):
    with pytest.raises(ValueError, match="must be"):
        cost_estimate(gpu="L40S", **{"steps": 10, **bad})


def test_estimates_are_immutable():
    estimate = cost_estimate(gpu="L40S", steps=10)
    assert isinstance(estimate, CostEstimate)
    with pytest.raises(AttributeError):
        estimate.steps = 20  # type: ignore[misc]
