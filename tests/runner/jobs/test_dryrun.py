"""`status.estimate` for `grpo-run apply --dry-run`: SPEC §3's numbers from a config.json alone,
the user's overrides and measured step times, and the refusal of a job that cannot fit."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml

from grpo_run.runner.cli.commands import EXIT_OK, EXIT_USAGE, main
from grpo_run.runner.estimate.config import model_config
from grpo_run.runner.estimate.estimate import (MEASURED_WINDOW, check_fits, estimate, measured_step_seconds, measured_steps_path, record_measured_step_seconds)
from grpo_run.runner.spec.job import JobError, Pricing, TrainingJob, parse_job
from grpo_run.runner.estimate.memory import format_count

REPO = Path(__file__).resolve().parents[3]

# Qwen/Qwen3-8B's config.json, the keys that matter plus some the estimate must ignore.
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "vocab_size": 151936, "tie_word_embeddings": False, "max_position_embeddings": 40960,
            "model_type": "qwen3", "rms_norm_eps": 1e-06, "torch_dtype": "bfloat16"}

# SPEC §3's group (8 completions x 1,024 tokens) and its 1,000 steps on an H100.
SPEC_RUN = {"numGenerations": 8, "maxCompletionLength": 1024, "maxSteps": 1000}
NOW = datetime(2025, 6, 1, 12, 30, 15, 999, tzinfo=timezone.utc)


# Qwen/Qwen3-0.6B's config.json: the model of SPEC's reference job (SPEC §2, §3).
QWEN3_0_6B = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024, "intermediate_size": 3072,
              "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
              "vocab_size": 151936, "tie_word_embeddings": True, "model_type": "qwen3"}
# SPEC §2's example job: the reference job of SPEC §3's step times (runner/estimate/steptime.py).
REFERENCE = {"numGenerations": 4, "beta": 0.0, "maxCompletionLength": 64, "lora": {"r": 8}, "method": "LoRA",
             "saveSteps": 25, "maxSteps": 1000}


@pytest.fixture
def qwen3_0_6b(tmp_path) -> Path:
    """A folder holding only Qwen3-0.6B's config.json."""
    folder = tmp_path / "qwen3-0.6b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN3_0_6B))
    return folder


# The rates SPEC §3's costs of 1,000 steps imply: SPEC's worked examples are priced at them (the
# table charges AWS's prices for these cards: tests/runner/estimate/test_estimate.py).
SPEC_RATES = {"H100-SXM-80GB": 2.60, "H100": 2.60, "A100-80GB": 1.08, "L40S": 0.79}


def reference_job(model: Path, gpu: str = "H100-SXM-80GB", **kw) -> TrainingJob:
    """SPEC's reference job on `gpu`, at SPEC's rate for it unless spec.pricing says otherwise."""
    if gpu in SPEC_RATES:
        kw["pricing"] = {"usdPerHour": SPEC_RATES[gpu], **kw.get("pricing", {})}
    params = {**REFERENCE, **kw.pop("parameters", {})}
    return parse_job(manifest(model, gpu=gpu, parameters=params, environment={"name": "graph-coloring"}, **kw))


@pytest.fixture
def qwen3_8b(tmp_path) -> Path:
    """A folder holding only Qwen3-8B's config.json: no weights, no tokenizer."""
    folder = tmp_path / "qwen3-8b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN3_8B))
    return folder


def manifest(model, *, gpu="H100-SXM-80GB", name="qwen3-8b-grpo", **spec) -> dict:
    params = spec.pop("parameters", {})
    body = {"model": str(model), "environment": spec.pop("environment", {"name": "arithmetic"}),
            "parameters": params, **spec}
    if gpu is not None:
        body["gpu"] = gpu
    return {"apiVersion": "grpo-run/v1", "kind": "TrainingJob", "metadata": {"name": name}, "spec": body}


def make_job(model, *, method="LoRA", beta=0.0, **kw) -> TrainingJob:
    """A parsed job with `method` and `beta` set afterwards, so a QLoRA estimate needs no
    bitsandbytes kernel on this machine (parse_job checks one; the estimate does not)."""
    job = parse_job(manifest(model, **kw))
    return job.model_copy(update={"parameters": job.parameters.model_copy(update={"method": method, "beta": beta})})


# --- the CLI ---------------------------------------------------------------------------------------


def apply(capsys, job_file: Path, fmt: str = "json") -> tuple[int, str, str]:
    """`grpo-run apply -f JOB --dry-run -o FMT` in this process: (exit status, stdout, stderr)."""
    argv = ["apply", "-f", str(job_file), "--dry-run", "-o", fmt]
    capsys.readouterr()
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def write_job(folder: Path, doc: dict) -> Path:
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize(
    ("method", "beta", "total_gb"),
    [("LoRA", 0.0, 16.8), ("QLoRA", 0.0, 4.5), ("Full", 0.0, 131.2), ("Full", 0.04, 147.6)],
)
def test_dry_run_json_reproduces_spec_memory_from_a_folder_holding_only_config_json(
        capsys, tmp_path, qwen3_8b, method, beta, total_gb):
    # No spec.gpu: memory alone (fits: null), so a full fine-tune that no single card holds is
    # still printed rather than refused.
    params = {**SPEC_RUN, "method": method, "beta": beta}
    job_file = write_job(tmp_path, manifest("./qwen3-8b", gpu=None, parameters=params))

    rc, out, err = apply(capsys, job_file, "json")

    assert rc == EXIT_OK, err
    doc = json.loads(out)
    assert doc["status"]["phase"] == "Pending"
    memory = doc["status"]["estimate"]["memory"]
    assert memory["totalGB"] == total_gb
    assert memory["kvCacheBytesPerToken"] == 147_456
    assert memory["parameters"] == 8_190_735_360
    assert memory["fits"] is None


def test_dry_run_prints_spec_s_lora_estimate_and_an_8b_step_time_from_the_model(capsys, tmp_path, qwen3_8b):
    # Before the model of a step, this printed SPEC's reference 0.45 s -- the time of a 0.6B model's
    # 4 x 64 tokens -- for an 8B model's 8 x 8 x 1,024 (issue 25).
    job_file = write_job(tmp_path, manifest("./qwen3-8b", parameters=SPEC_RUN))

    rc, out, err = apply(capsys, job_file, "json")

    assert rc == EXIT_OK, err
    est = json.loads(out)["status"]["estimate"]
    assert (est["gpu"], est["steps"], est["usdPerHour"], est["stepSecondsSource"]) == ("H100", 1000, 6.88, "model")
    # the rate says what it is; the 1-GPU shape the job rents (p5.4xlarge) has no spot offer, and the
    # estimate says so rather than offer the 8-GPU p5.48xlarge's spot price / 8 (issue 52 item 4)
    assert est["rate"]["kind"] == "on-demand" and est["rate"]["source"] == (
        "AWS us-east-1 on-demand, SkyPilot catalog v8 (commit 00148f2a), read 2026-12-02, p5.48xlarge / 8")
    assert "spot" not in est["rate"] and est["rate"]["noSpot"].startswith("p5.4xlarge (1 x H100")
    assert (est["shape"]["instance"], est["shape"]["onDemandUSDPerHour"]) == ("p5.4xlarge", 6.88)
    assert est["stepSeconds"] > 20 * 0.45
    assert est["costToCompletionUSD"] == pytest.approx(est["trainingUSD"] + est["evalUSD"], abs=0.011)
    assert est["tokens"] == {"prompt": 1.0, "promptIs": "expected (mean of the tasks)", "completion": 1024,
                             "completionIs": "maximum (maxCompletionLength)"}   # "3+5=": 4 characters
    assert format_count(est["memory"]["trainableParameters"]) == "21.8M"
    assert est["memory"] == {"parameters": 8_190_735_360, "trainableParameters": 21_823_488,
                             "weightsGB": 16.4, "trainableStateGB": 0.35, "referenceGB": 0.0,
                             "totalGB": 16.8, "kvCacheBytesPerToken": 147_456, "kvCacheGB": 1.2,
                             # 8 prompts x 8 completions; micro-batches of 32 keep their logits
                             # within a quarter of the H100's 80 GB
                             "microBatchSize": 32, "samplingGB": 9.7, "updateGB": 35.4, "neededGB": 52.2,
                             "fits": True}
    start = datetime.fromisoformat(est["startTime"].replace("Z", "+00:00"))
    assert start.tzinfo is not None and abs((datetime.now(timezone.utc) - start).total_seconds()) < 60


def test_the_reference_job_costs_33_cents_per_1000_h100_steps_with_its_first_hold_a_cent(capsys, tmp_path, qwen3_0_6b):
    job_file = write_job(tmp_path, manifest("./qwen3-0.6b", parameters=REFERENCE, environment={"name": "graph-coloring"},
                                            pricing={"usdPerHour": SPEC_RATES["H100"]}))

    rc, out, err = apply(capsys, job_file, "json")

    assert rc == EXIT_OK, err
    est = json.loads(out)["status"]["estimate"]
    assert (est["stepSeconds"], est["stepSecondsSource"], est["trainingUSD"]) == (0.45, "model", 0.33)
    assert est["firstHoldUSD"] == 0.01  # the baseline (100 tasks) and 25 steps: $0.009, held as a cent
    assert (est["evaluations"], est["evalTasks"]) == (2, 100)   # baseline and final, graph-coloring's 100


def test_a_full_8b_fine_tune_on_an_rtx_4090_is_refused_with_the_numbers(capsys, tmp_path, qwen3_8b):
    job_file = write_job(tmp_path, manifest("./qwen3-8b", gpu="RTX-4090", parameters={"method": "Full"}))

    rc, out, err = apply(capsys, job_file, "json")

    assert rc == EXIT_USAGE                       # what apply answers: refused, nothing started
    assert "RTX4090 cannot hold this run: it needs about 134.2 GB (131.2 GB of weights" in err
    assert "21.6 GB usable" in err
    assert "method: LoRA or QLoRA" in err and "choose a bigger GPU: B200 fits as is" in err
    assert "Nothing was started" in err
    # the dry run still prints the whole job with its estimate, so -o json gives a user the numbers
    doc = json.loads(out)
    assert doc["spec"]["parameters"]["method"] == "Full" and doc["status"]["phase"] == "Pending"
    est = doc["status"]["estimate"]
    assert est["memory"]["fits"] is False and est["memory"]["neededGB"] == 134.2
    assert est["refusal"] == err.strip()


def test_the_tiny_demo_model_is_estimated_offline_in_yaml(capsys, tmp_path):
    job_file = write_job(tmp_path, manifest("tiny:char", gpu="RTX-4090", name="tiny-arithmetic"))

    rc, out, err = apply(capsys, job_file, "yaml")

    assert rc == EXIT_OK, err
    est = yaml.safe_load(out)["status"]["estimate"]
    assert est["memory"]["fits"] is True and est["memory"]["parameters"] > 0
    assert est["memory"]["kvCacheBytesPerToken"] == 2 * 2 * 2 * 16 * 2  # K,V x 2 layers x 2 heads x 16 x 2 B
    assert est["stepSecondsSource"] == "model" and est["stepSeconds"] < 0.1   # 2 layers x 64 hidden
    assert est["costToCompletionUSD"] <= 0.01


def test_a_hub_id_that_is_not_in_the_cache_is_refused_offline_with_how_to_fill_the_cache(capsys, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)          # read at import: HF_HUB_OFFLINE=1
    job_file = write_job(tmp_path, manifest("grpo-run-tests/no-such-model"))

    rc, out, err = apply(capsys, job_file, "json")

    assert rc == EXIT_USAGE and out == ""
    assert "no config.json for 'grpo-run-tests/no-such-model' in the Hugging Face cache" in err
    assert "`hf download grpo-run-tests/no-such-model config.json`" in err
    assert "keep spec.model: grpo-run-tests/no-such-model" in err


# --- estimate(): memory -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "beta", "weights", "state", "reference", "total"),
    [
        ("LoRA", 0.0, 16.4, 0.35, 0.0, 16.8),
        ("QLoRA", 0.0, 4.1, 0.35, 0.0, 4.5),
        ("Full", 0.0, 0.0, 131.2, 0.0, 131.2),
        ("Full", 0.04, 0.0, 131.2, 16.4, 147.6),
        ("LoRA", 0.04, 16.4, 0.35, 0.0, 16.8),  # the reference is the base with the adapter off
    ],
)
def test_memory_matches_spec_for_every_method(qwen3_8b, method, beta, weights, state, reference, total):
    memory = estimate(make_job(qwen3_8b, method=method, beta=beta, parameters=SPEC_RUN))["memory"]
    assert (memory["weightsGB"], memory["trainableStateGB"], memory["referenceGB"], memory["totalGB"]) == \
        (weights, state, reference, total)


def test_all_linear_adapts_the_seven_projections_and_a_list_adapts_only_those(qwen3_8b):
    all_linear = estimate(make_job(qwen3_8b, parameters=SPEC_RUN))["memory"]
    assert all_linear["trainableParameters"] == 606_208 * 36  # 75,776 x r=8 per layer
    attention = make_job(qwen3_8b, parameters={**SPEC_RUN, "lora": {"r": 8, "targetModules": ["q_proj", "v_proj"]}})
    # q: 4096+4096, v: 4096+1024 per layer, x r=8 x 36 layers
    assert estimate(attention)["memory"]["trainableParameters"] == (8192 + 5120) * 8 * 36


def test_the_kv_cache_is_one_group_of_completions(qwen3_8b):
    memory = estimate(make_job(qwen3_8b, parameters={**SPEC_RUN, "maxCompletionLength": 2048}))["memory"]
    assert memory["kvCacheGB"] == 2.4  # 8 x 2,048 tokens x 147,456 B


def test_the_example_folder_is_qwen3_8b(tmp_path):
    memory = estimate(make_job(REPO / "examples" / "qwen3-8b-config", parameters=SPEC_RUN))["memory"]
    assert (memory["parameters"], memory["totalGB"], memory["kvCacheGB"]) == (8_190_735_360, 16.8, 1.2)
    assert sorted(p.name for p in (REPO / "examples" / "qwen3-8b-config").iterdir()) == ["config.json"]


# --- estimate(): cost ---------------------------------------------------------------------------


def test_the_estimate_has_the_status_estimate_fields_and_starts_now(qwen3_8b):
    est = estimate(make_job(qwen3_8b, parameters=SPEC_RUN), now=NOW)
    assert {"costToCompletionUSD", "firstHoldUSD", "startTime", "stepSeconds", "stepSecondsSource",
            "usdPerHour", "gpu", "steps", "memory"} <= est.keys()
    assert est["startTime"] == "2025-06-01T12:30:15Z"


@pytest.mark.parametrize(("gpu", "seconds", "usd"), [
    ("H100-SXM-80GB", 0.45, 0.33), ("A100-80GB", 0.7, 0.21), ("L40S", 1.0, 0.22), ("RTX-4090", 1.2, 0.10),
    ("RTX-A6000", 1.3, 0.12), ("H100", 0.45, 0.33), ("RTX4090", 1.2, 0.10), ("A6000", 1.3, 0.12)])
def test_the_reference_job_takes_spec_s_step_time_and_1000_steps_cost_spec_s_figure(qwen3_0_6b, gpu, seconds, usd):
    est = estimate(reference_job(qwen3_0_6b, gpu))
    assert (est["stepSeconds"], est["stepSecondsSource"], est["trainingUSD"]) == (seconds, "model", usd)
    # and the evaluations (100 tasks, twice) come on top, in the cost to completion
    assert est["evalSeconds"] > 0 and est["costToCompletionUSD"] >= usd


def test_the_users_rate_and_step_time_override_the_table(qwen3_8b):
    job = make_job(qwen3_8b, parameters={"maxSteps": 3600}, pricing={"usdPerHour": 2.0, "stepSeconds": 2.0})
    est = estimate(job)
    assert (est["usdPerHour"], est["stepSeconds"], est["stepSecondsSource"]) == (2.0, 2.0, "override")
    assert est["costToCompletionUSD"] == 4.0  # 3,600 steps x 2 s = 2 hours at $2/h
    assert "spec.pricing.stepSeconds" in est["note"]


def test_a_rate_alone_keeps_the_modelled_step_time(qwen3_0_6b):
    est = estimate(reference_job(qwen3_0_6b, pricing={"usdPerHour": 5.2}))
    assert (est["stepSeconds"], est["stepSecondsSource"], est["trainingUSD"]) == (0.45, "model", 0.65)
    assert est["rate"] == {"kind": "unstated", "source": "spec.pricing.usdPerHour"}


def test_measured_step_times_replace_the_model_for_that_gpu_model_and_length(qwen3_0_6b):
    job = reference_job(qwen3_0_6b, "RTX-4090")
    assert estimate(job)["stepSecondsSource"] == "model"

    record_measured_step_seconds("RTX-4090", 2.4, "earlier-run", model=job.model, completion_length=64)

    est = estimate(job)
    assert (est["stepSeconds"], est["stepSecondsSource"]) == (2.4, "measured")
    assert est["trainingUSD"] == 0.19  # twice the modelled 1.2 s
    assert "your one run of this model on RTX4090 with completions of up to 64 tokens" in est["note"]
    assert estimate(reference_job(qwen3_0_6b, "RTX4090"))["stepSecondsSource"] == "measured"   # the alias's card
    assert estimate(reference_job(qwen3_0_6b, "L40S"))["stepSecondsSource"] == "model"         # per GPU
    longer = reference_job(qwen3_0_6b, "RTX-4090", parameters={"maxCompletionLength": 512})
    assert estimate(longer)["stepSecondsSource"] == "model"                                    # per length bucket
    assert estimate(make_job(qwen3_0_6b, gpu="RTX-4090"))["stepSecondsSource"] == "measured"   # 64: the same bucket


def test_a_measured_step_time_is_kept_per_model(qwen3_0_6b, qwen3_8b):
    record_measured_step_seconds("L40S", 9.0, "run-8b", model=str(qwen3_8b), completion_length=64)
    assert estimate(reference_job(qwen3_0_6b, "L40S"))["stepSecondsSource"] == "model"
    assert measured_step_seconds("L40S", str(qwen3_8b), 50) == 9.0        # 50 tokens: the bucket of 64


def test_an_explicit_step_time_wins_over_a_measured_one(qwen3_0_6b):
    record_measured_step_seconds("L40S", 3.0, "earlier-run", model=str(qwen3_0_6b), completion_length=64)
    est = estimate(reference_job(qwen3_0_6b, "L40S", pricing={"stepSeconds": 0.5}))
    assert (est["stepSeconds"], est["stepSecondsSource"]) == (0.5, "override")


def test_a_version_1_measurements_file_is_read_and_kept_but_never_used_for_a_model(qwen3_0_6b):
    measured_steps_path().parent.mkdir(parents=True, exist_ok=True)
    measured_steps_path().write_text(json.dumps({"version": 1, "gpus": {"H100-SXM-80GB": [
        {"job": "old", "stepSeconds": 0.6, "finishedAt": "2025-01-01T00:00:00Z"}]}}))
    assert measured_step_seconds("H100") == 0.6                    # under today's name, with no model
    assert estimate(reference_job(qwen3_0_6b))["stepSecondsSource"] == "model"
    record_measured_step_seconds("H100", 0.5, "new", model=str(qwen3_0_6b), completion_length=64)
    stored = json.loads(measured_steps_path().read_text())
    assert stored["version"] == 2 and [r["job"] for r in stored["gpus"]["H100"]] == ["old", "new"]
    assert estimate(reference_job(qwen3_0_6b))["stepSeconds"] == 0.5


def test_the_measured_step_time_is_the_median_of_the_last_20_runs():
    for i in range(MEASURED_WINDOW):
        record_measured_step_seconds("A100-80GB", 100.0, f"old-{i}")
    for i, seconds in enumerate([1.0, 2.0, 9.0]):
        record_measured_step_seconds("A100-80GB", seconds, f"new-{i}")
    # the window holds 17 runs at 100 s and the three new ones
    assert measured_step_seconds("A100-80GB") == 100.0
    for i in range(10):
        record_measured_step_seconds("A100-80GB", 0.8, f"newer-{i}")
    # now 7 x 100 s, 1, 2, 9 and 10 x 0.8 s: the 10th and 11th of 20 are 0.8 and 1.0
    assert measured_step_seconds("A100-80GB") == pytest.approx(0.9)
    stored = json.loads(measured_steps_path().read_text())
    assert len(stored["gpus"]["A100-80GB"]) == MEASURED_WINDOW
    assert stored["gpus"]["A100-80GB"][-1]["job"] == "newer-9"


def test_nonsense_measurements_are_refused():
    with pytest.raises(ValueError, match="must be a GPU's name"):
        record_measured_step_seconds("", 1.0, "j")
    for bad in (0.0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="must be a number > 0"):
            record_measured_step_seconds("L40S", bad, "j")
    assert not measured_steps_path().exists()


def test_a_damaged_measurements_file_falls_back_to_the_model_and_is_rewritten(qwen3_8b):
    measured_steps_path().parent.mkdir(parents=True, exist_ok=True)
    measured_steps_path().write_text("{not json")
    assert estimate(make_job(qwen3_8b))["stepSecondsSource"] == "model"
    record_measured_step_seconds("H100-SXM-80GB", 0.6, "next-run")
    assert measured_step_seconds("H100-SXM-80GB") == 0.6
    assert [p.name for p in measured_steps_path().parent.iterdir() if p.name.endswith(".tmp")] == []


def test_without_a_gpu_memory_is_estimated_and_cost_is_left_open_with_a_note(qwen3_8b):
    est = estimate(make_job(qwen3_8b, gpu=None, parameters=SPEC_RUN))
    assert est["memory"]["totalGB"] == 16.8 and est["memory"]["fits"] is None
    assert est["costToCompletionUSD"] is None and est["firstHoldUSD"] is None and est["gpu"] is None
    assert "cost needs spec.gpu" in est["note"]
    assert check_fits(est) is None


def test_a_budget_below_the_cost_caps_the_first_hold_and_says_where_the_run_stops(qwen3_0_6b):
    job = reference_job(qwen3_0_6b, parameters={"maxSteps": 100_000, "saveSteps": 8000}, maxCostUSD=1.0)
    est = estimate(job)
    assert est["trainingUSD"] == 32.5 and est["firstHoldUSD"] == 1.0
    # $1 less the baseline evaluation's share, at $0.000325 a step (3,076 steps without the baseline)
    assert "maxCostUSD 1 is reached after about 3075 of 100000 steps (the baseline evaluation, the GPU's time): " \
           "the run stops there (BudgetExceeded), before the final evaluation" in est["note"]
    assert est["budgetStopsAfterStep"] == 3075


# --- check_fits ---------------------------------------------------------------------------------


def test_a_run_that_fits_is_not_refused(qwen3_8b):
    assert check_fits(estimate(make_job(qwen3_8b, method="QLoRA", gpu="L40S", parameters=SPEC_RUN))) is None


def test_a_step_whose_kv_cache_does_not_fit_is_refused_naming_cards_that_fit(qwen3_8b):
    # 8 prompts x 8 completions x 4,096 tokens, all sampled at once: 38.7 GB of KV cache.
    run = {**SPEC_RUN, "maxCompletionLength": 4096}
    refusal = check_fits(estimate(make_job(qwen3_8b, method="QLoRA", gpu="RTX-4090", parameters=run)))
    assert refusal.startswith("RTX4090 cannot hold this run: it needs about 43.2 GB (4.5 GB of weights")
    assert "the larger of 38.7 GB of KV cache while sampling and 9.4 GB for the update of a micro-batch of 2" in refusal
    assert "lower promptsPerStep, numGenerations or maxCompletionLength" in refusal
    assert "H100, H200, B200, A100-80GB, L40S or A6000 fit as is" in refusal   # 43.2 GB usable on 48 GB
    assert "method: QLoRA" not in refusal  # it already is


def test_an_8b_qlora_group_of_8x1024_fits_a_24_gb_card_in_micro_batches(qwen3_8b):
    est = estimate(make_job(qwen3_8b, method="QLoRA", gpu="RTX-4090", parameters=SPEC_RUN))
    assert check_fits(est) is None and est["memory"]["microBatchSize"] == 9 and est["memory"]["neededGB"] == 15.0


def test_a_lora_run_too_big_for_its_card_suggests_qlora(qwen3_8b):
    refusal = check_fits(estimate(make_job(qwen3_8b, gpu="RTX-4090", parameters=SPEC_RUN)))
    assert "needs about 27.3 GB" in refusal and "use method: QLoRA" in refusal


# --- the model's config -------------------------------------------------------------------------


def test_a_folder_needs_only_config_json(qwen3_8b):
    assert model_config(str(qwen3_8b)) == QWEN3_8B


def test_a_folder_without_config_json_says_what_to_point_at(tmp_path):
    with pytest.raises(LookupError, match="has no config.json"):
        model_config(str(tmp_path))


def test_a_hub_id_is_read_from_the_hugging_face_cache_without_the_network(tmp_path):
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen3-8B" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(QWEN3_8B))
    (tmp_path / "hub" / "models--Qwen--Qwen3-8B" / "refs").mkdir()
    (tmp_path / "hub" / "models--Qwen--Qwen3-8B" / "refs" / "main").write_text("abc123")
    assert model_config("Qwen/Qwen3-8B", cache_dir=tmp_path / "hub") == QWEN3_8B


def test_a_hub_id_not_in_the_cache_raises_lookup_error_naming_the_fix(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(LookupError) as e:
        model_config("Qwen/Qwen3-8B", cache_dir=tmp_path / "empty-cache")
    assert "HF_HUB_OFFLINE is set, so it is not fetched" in str(e.value)
    assert "`hf download Qwen/Qwen3-8B config.json`" in str(e.value) and "--local-dir" not in str(e.value)
    # the config this checkout ships is named, so the dry run works offline (the newcomer found it by chance)
    assert (f"for a dry run alone, offline, spec.model: {REPO / 'examples' / 'qwen3-8b-config'} (its config.json, "
            "shipped with this checkout) gives the same estimate") in str(e.value)
    with pytest.raises(LookupError) as other:
        model_config("Qwen/Qwen3-0.6B", cache_dir=tmp_path / "empty-cache")
    assert "shipped with this checkout" not in str(other.value)          # no config of it here: not offered


def test_a_config_that_is_not_a_json_object_is_named(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="must be a JSON object"):
        model_config(str(tmp_path))


# --- spec.pricing in the job file ---------------------------------------------------------------


def test_pricing_is_parsed_and_shown_only_when_set(qwen3_8b):
    job = parse_job(manifest(qwen3_8b, pricing={"usdPerHour": 2, "stepSeconds": 0.5}))
    assert job.pricing == Pricing(usdPerHour=2.0, stepSeconds=0.5)
    assert job.to_dict()["spec"]["pricing"] == {"usdPerHour": 2.0, "stepSeconds": 0.5}
    assert "pricing" not in parse_job(manifest(qwen3_8b)).to_dict()["spec"]
    assert parse_job(manifest(qwen3_8b, pricing={"stepSeconds": 1})).to_dict()["spec"]["pricing"] == {"stepSeconds": 1.0}


def test_pricing_problems_are_reported_with_the_others(qwen3_8b):
    doc = manifest(qwen3_8b, pricing={"usdPerHour": 0, "stepSeconds": "fast", "usdPerHr": 2},
                   parameters={"numGenerations": 1})
    with pytest.raises(JobError) as e:
        parse_job(doc)
    found = e.value.problems
    assert "spec.pricing.usdPerHour: must be a number > 0 (got 0)" in found
    assert "spec.pricing.stepSeconds: must be a number > 0 (got 'fast')" in found
    assert "spec.pricing.usdPerHr: unknown field; did you mean usdPerHour?" in found
    assert any(p.startswith("spec.parameters.numGenerations") for p in found)


def test_an_empty_pricing_block_is_a_problem(qwen3_8b):
    with pytest.raises(JobError, match="spec.pricing: must be a mapping with usdPerHour, stepSeconds, memoryGB"):
        parse_job(manifest(qwen3_8b, pricing={}))


def _tiny_job(tmp_path: Path, storage: str | None, **parameters) -> Path:
    spec = {"model": "tiny:char", "environment": {"name": "arithmetic"}, "parameters": parameters}
    if storage is not None:
        spec["storage"] = storage
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "grpo-run/v1", "kind": "TrainingJob",
                                    "metadata": {"name": "tiny-engine"}, "spec": spec}))
    return path


def test_a_dry_run_with_storage_says_how_the_job_samples_here_when_a_node_would_sample_otherwise(tmp_path, capsys):
    """A job with storage may be submitted to a GPU node (vLLM there, under auto) or run here with
    apply (native on this CPU): the dry run said only the first, and the run that followed it here
    sampled otherwise. It says both when they differ."""
    job = _tiny_job(tmp_path, str(tmp_path / "store"))
    capsys.readouterr()
    assert main(["apply", "-f", str(job), "--dry-run", "-o", "json"]) == EXIT_OK
    sampler = json.loads(capsys.readouterr().out)["status"]["sampler"]
    assert sampler["here"]["engine"] == "native" and sampler["here"]["why"].startswith("auto: no GPU on this node")
    assert main(["apply", "-f", str(job), "--dry-run"]) == EXIT_OK
    out = capsys.readouterr().out
    assert f"here (apply without --detach): native: auto: no GPU on this node" in out, out
    # no storage: the job runs here only, one line as before
    assert main(["apply", "-f", str(_tiny_job(tmp_path, None)), "--dry-run", "-o", "json"]) == EXIT_OK
    assert "here" not in json.loads(capsys.readouterr().out)["status"]["sampler"]


def test_a_dry_run_refuses_sampler_vllm_where_apply_does(tmp_path, capsys):
    """tiny:char's head_dim 16 has no kernel in vLLM's CPU attention: apply refuses sampler: vllm
    with exit 2; a dry run of a job that can only run here (no storage) said nothing and exited 0."""
    job = _tiny_job(tmp_path, None, sampler="vllm")
    capsys.readouterr()
    said = []
    for dry in (["--dry-run"], []):
        assert main(["apply", "-f", str(job), *dry]) == EXIT_USAGE
        said.append(capsys.readouterr().err)
    assert "spec.parameters.sampler: vllm cannot sample this job" in said[0]
    assert said[0] == said[1]
