"""The memory estimate reproduces SPEC §3's worked examples, from a config.json alone."""

from __future__ import annotations

import pytest

from grpo_run.runner.spec.gpus import GPUS
from grpo_run.runner.estimate.memory import fits, format_count, memory_estimate

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
        "microBatchSize": 8,
        "samplingGB": 1.2,
        "updateGB": 9.4,
        "neededGB": 13.9,
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


def test_the_update_holds_one_micro_batch_of_logits_and_activations():
    # Qwen3-8B QLoRA, SPEC's group (8 x 1,024 tokens), on an RTX 4090: the trainer's default
    # micro-batch keeps logits + their gradient within a quarter of 24 GB:
    # 6e9 // (2 x 1,025 x 151,936 x 2 B) = 9 -> all 8 completions in one micro-batch.
    estimate = qwen3_8b("QLoRA", gpu="RTX-4090")
    assert estimate.micro_batch_size == 8
    logits = 2 * 8 * 1025 * 151_936 * 2                      # 16-bit logits and their gradient
    chunk = 3 * 2**26 * 4                                     # the fp32 log-softmax chunk, recomputed
    kept = 36 * 8 * 1024 * 4096 * 2                           # each layer's input (checkpointing)
    layer = 8 * 1024 * (6 * 4096 + 2 * 1024 + 4 * 12288) * 2  # one layer's activations, recomputed
    assert logits + chunk + kept + layer == 9_446_240_256
    assert estimate.update_gb == 9.4 and estimate.sampling_gb == 1.2
    assert estimate.needed_gb == 13.9 and estimate.fits


@pytest.mark.parametrize("gpu", ["RTX-4090", "L40S", "RTX-A6000", "A100-80GB", "H100-SXM-80GB"])
def test_an_8b_qlora_run_fits_every_card_in_the_table_with_gradient_checkpointing(gpu):
    assert qwen3_8b("QLoRA", gpu=gpu).fits


def test_without_gradient_checkpointing_every_layer_keeps_its_activations():
    estimate = qwen3_8b("QLoRA", gpu="RTX-4090", gradient_checkpointing=False)
    assert estimate.update_gb == 50.5 and not estimate.fits
    assert qwen3_8b("QLoRA", gpu="A100-80GB", gradient_checkpointing=False).fits


def test_an_8b_full_fine_tune_fits_only_the_b200():
    # 134.2 GB needed: only the B200's 180 GB (162 usable) holds it; the H200's 141 GB does not
    assert [name for name in GPUS if qwen3_8b("Full", gpu=name).fits] == ["B200"]


def test_a_0_6b_lora_run_fits_a_24_gb_card():
    estimate = memory_estimate(QWEN3_0_6B, method="LoRA", lora_r=8, beta=0.0, gpu="RTX-4090", **GROUP)
    assert estimate.fits and fits(estimate.needed_gb, "RTX-4090")


def test_the_kv_cache_of_a_whole_step_can_stop_a_run_from_fitting():
    # 8 prompts x 8 completions x 4,096 tokens sampled at once: 262,144 tokens x 147,456 B = 38.7 GB.
    estimate = qwen3_8b("QLoRA", gpu="RTX-4090", prompts_per_step=8, max_completion_length=4096)
    assert estimate.sampling_gb == 38.7 and not estimate.fits
    assert qwen3_8b("QLoRA", gpu="A100-80GB", prompts_per_step=8, max_completion_length=4096).fits


def test_a_smaller_micro_batch_lowers_the_update():
    assert qwen3_8b("QLoRA", gpu="L40S", micro_batch_size=2).update_gb < qwen3_8b("QLoRA", gpu="L40S").update_gb
