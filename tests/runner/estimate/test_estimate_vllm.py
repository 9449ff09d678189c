"""The estimate knows the engine that samples (issue 32): vLLM colocated takes its share of the card
and starts once; as a server it is on another GPU; its sampling has its own step model and its own
measured runs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from grpo_run.runner.estimate.estimate import VLLM_START_SECONDS, check_fits, estimate, record_measured_step_seconds
from grpo_run.runner.estimate.memory import memory_estimate
from grpo_run.runner.estimate.steptime import REFERENCE_WORK, VLLM_ANCHOR, step_time
from grpo_run.runner.spec.gpus import GPUS
from grpo_run.runner.spec.job import parse_job
from tests.runner.estimate.test_estimate_jobs import QWEN3_0_6B, QWEN3_8B, doc, model_folder

REFERENCE = dict(method="LoRA", lora_r=8, beta=0.0, num_generations=4, max_completion_length=64,
                 prompt_tokens=6, prompts_per_step=8)


def test_colocated_vllm_holds_its_share_of_the_card_while_sampling_and_sleeps_through_the_update():
    native = memory_estimate(QWEN3_8B, gpu="H100", **REFERENCE)
    colocated = memory_estimate(QWEN3_8B, gpu="H100", sampler="colocate", engine_share=0.3, **REFERENCE)
    engine = colocated.to_dict()["engine"]
    assert engine["engineGB"] == 24.0                                  # 0.3 x 80 GB
    assert engine["engineWeightsGB"] == pytest.approx(16.4 + 0.04)     # 8.2B at 16 bits + the 21.8M-parameter adapter at 16 bits
    assert engine["engineKvCacheGB"] == pytest.approx(24.0 - 16.44)
    # the trainer's own weights and state beside the larger of the engine's share and the update
    assert colocated.needed_gb == pytest.approx(native.total_gb + max(24.0, native.update_gb))
    assert colocated.fits and "engine" not in native.to_dict()


def test_a_share_too_small_for_the_engine_s_weights_does_not_fit_and_says_what_share_would(tmp_path):
    model = model_folder(tmp_path, "qwen3-8b", QWEN3_8B)
    job = parse_job(doc(model, gpu="H100",
                        parameters={"sampler": "vllm", "vllm": {"gpuMemoryUtilization": 0.15}}))
    est = estimate(job, sampler="vllm")
    assert est["memory"]["fits"] is False
    refusal = check_fits(est)
    assert refusal.startswith("spec.parameters.vllm.gpuMemoryUtilization: vLLM's share of H100 is 12.0 GB")
    assert "raise gpuMemoryUtilization above 0.21" in refusal and "sampler: native" in refusal
    # the same job with the default share fits
    ok = estimate(parse_job(doc(model, gpu="H100", parameters={"sampler": "vllm"})), sampler="vllm")
    assert ok["memory"]["fits"] is True and check_fits(ok) is None


def test_a_vllm_server_is_on_another_gpu_so_the_trainer_holds_neither_its_share_nor_a_kv_cache():
    server = memory_estimate(QWEN3_8B, gpu="H100", sampler="server", **REFERENCE)
    native = memory_estimate(QWEN3_8B, gpu="H100", **REFERENCE)
    assert server.to_dict()["engine"] == {"sampler": "vllm", "mode": "server", "onThisGPU": False}
    assert server.needed_gb == pytest.approx(native.total_gb + native.update_gb)
    assert server.needed_gb < native.total_gb + native.sampling_gb or native.sampling_gb <= native.update_gb


def test_vllm_samples_the_reference_job_at_its_published_rate_and_the_native_decoder_slower():
    h100 = GPUS["H100"]
    vllm = step_time(replace(REFERENCE_WORK, engine="vllm"), h100)
    native = step_time(REFERENCE_WORK, h100)
    tokens = REFERENCE_WORK.sequences * REFERENCE_WORK.completion_tokens
    assert tokens / (vllm.sample_seconds * vllm.calibration) == pytest.approx(VLLM_ANCHOR["tokensPerSecond"])
    assert native.seconds == pytest.approx(0.45)                        # SPEC's reference step, unchanged
    assert vllm.update_seconds == native.update_seconds and vllm.seconds < native.seconds


def test_the_engine_s_start_up_is_paid_once_and_the_user_s_own_measured_start_ups_replace_the_published_one(tmp_path):
    model = model_folder(tmp_path, "qwen3-0.6b", QWEN3_0_6B)
    job = parse_job(doc(model, gpu="H100", parameters={"sampler": "vllm", "maxSteps": 100}))
    native = estimate(job, sampler="native")
    vllm = estimate(job, sampler="vllm")
    assert vllm["sampler"] == "vllm" and native["sampler"] == "native"
    assert "engineStartSeconds" not in native
    assert vllm["engineStartSeconds"] == VLLM_START_SECONDS
    assert vllm["completionSeconds"] == pytest.approx(vllm["stepSeconds"] * 100 + vllm["evalSeconds"] + 60, abs=0.1)
    start_usd = round(60 * vllm["usdPerHour"] / 3600, 2)
    assert vllm["engineStartUSD"] == start_usd
    assert vllm["firstHoldUSD"] > native["firstHoldUSD"]
    assert "published start-up, vllm-project/vllm#20264" in vllm["note"]

    # a finished native run teaches the native estimate only; a vLLM run teaches the vLLM one, its start-up too
    record_measured_step_seconds("H100", 0.9, "native-run", model=job.model, completion_length=64)
    assert estimate(job, sampler="vllm")["stepSecondsSource"] == "model"
    record_measured_step_seconds("H100", 0.3, "vllm-run", model=job.model, completion_length=64,
                                 sampler="vllm", engine_start_seconds=42.0)
    measured = estimate(job, sampler="vllm")
    assert (measured["stepSeconds"], measured["stepSecondsSource"]) == (0.3, "measured")
    assert measured["engineStartSeconds"] == 42.0 and "the median of your vLLM runs" in measured["note"]
    assert estimate(job, sampler="native")["stepSeconds"] == 0.9


def test_a_server_starts_nothing_on_the_trainer_s_node(tmp_path):
    model = model_folder(tmp_path, "qwen3-0.6b", QWEN3_0_6B)
    job = parse_job(doc(model, gpu="H100", parameters={
        "sampler": "vllm", "vllm": {"mode": "server", "server": "http://127.0.0.1:9"}}))
    est = estimate(job, sampler="vllm")
    assert "engineStartSeconds" not in est and est["memory"]["engine"]["mode"] == "server"



def test_the_dry_run_s_summary_names_the_engine_its_share_and_its_start_up(tmp_path):
    from grpo_run.runner.estimate.summary import summary

    model = model_folder(tmp_path, "qwen3-0.6b", QWEN3_0_6B)
    job = parse_job(doc(model, gpu="H100", parameters={"sampler": "vllm", "maxSteps": 100}))
    text = summary("est", estimate(job, sampler="vllm"))
    assert "  vLLM start  60 s once, $0.11" in text, text
    assert "of it sampling by vLLM" in text
    assert "vLLM's share (gpuMemoryUtilization) is 24.0 GB of it while sampling" in text
    assert "vLLM" not in summary("est", estimate(job, sampler="native"))


def test_a_restart_after_a_notice_starts_the_engine_again(tmp_path):
    model = model_folder(tmp_path, "qwen3-0.6b", QWEN3_0_6B)
    job = parse_job(doc(model, gpu="H100", parameters={"sampler": "vllm", "maxSteps": 1000},
                        pricing={"preemptionsPerHour": 1}))
    native, vllm = estimate(job, sampler="native"), estimate(job, sampler="vllm")
    assert vllm["preemption"]["restartSeconds"] == pytest.approx(
        native["preemption"]["restartSeconds"] + VLLM_START_SECONDS - (native["stepSeconds"] - vllm["stepSeconds"]) / 2,
        abs=0.1)
