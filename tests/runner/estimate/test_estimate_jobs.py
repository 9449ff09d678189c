"""The estimate of whole jobs (issue 25): the step time follows the model, the group and the
completion length; evaluations are paid for; every common spot GPU, and any card spec.pricing
describes, gets an estimate; the dry run answers in a few lines first."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from grpo_run.runner.cli.commands import EXIT_BUDGET, EXIT_OK, EXIT_USAGE, main
from grpo_run.runner.estimate.estimate import estimate
from grpo_run.runner.estimate.workload import evaluations, workload
from grpo_run.runner.spec.job import JobError, parse_job

# Published config.json values (huggingface.co/Qwen/Qwen3-8B, huggingface.co/Qwen/Qwen2.5-0.5B).
QWEN3_8B = {"model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936,
            "tie_word_embeddings": False}
QWEN2_5_0_5B = {"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
                "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936,
                "tie_word_embeddings": True}
# ... and a reward model of Qwen2.5-0.5B's shape: a sequence classifier with one logit
QWEN2_5_0_5B_RM = {**QWEN2_5_0_5B, "architectures": ["Qwen2ForSequenceClassification"], "id2label": {"0": "LABEL_0"}}
QWEN3_0_6B = {"model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936,
              "tie_word_embeddings": True}
QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May?\n"
            "Please reason step by step, and put your final answer within \\boxed{}.")
SPEC_RATES = {"H100": 2.60, "A100-80GB": 1.08, "L40S": 0.79}     # SPEC §3's costs imply them; the table charges AWS's
GSM8K_LIKE = {"numGenerations": 8, "promptsPerStep": 8, "maxCompletionLength": 512, "maxSteps": 500}


def model_folder(tmp_path: Path, name: str, config: dict) -> Path:
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def doc(model: Path | str, *, gpu: str | None = "L40S", parameters: dict | None = None, environment=None, **spec) -> dict:
    body = {"model": str(model), "environment": environment or {"name": "graph-coloring"},
            "parameters": parameters or {}, **spec}
    if gpu is not None:
        body["gpu"] = gpu
    return {"apiVersion": "grpo-run/v1", "kind": "TrainingJob", "metadata": {"name": "est"}, "spec": body}


@pytest.fixture
def gsm8k_like(tmp_path):
    """Your own environment of GSM8K-shaped tasks: 64 to train on, 100 held out."""
    (tmp_path / "rewards.py").write_text("def score(completion, task):\n    return 0.0\n")
    for name, count in (("train.jsonl", 64), ("eval.jsonl", 100)):
        (tmp_path / name).write_text("".join(json.dumps({"prompt": QUESTION, "answer": "72"}) + "\n"
                                             for _ in range(count)))
    env = {"name": "words", "reward": str(tmp_path / "rewards.py") + ":score",
           "tasks": str(tmp_path / "train.jsonl"), "evalTasks": str(tmp_path / "eval.jsonl")}

    def job(model: Path, gpu: str = "L40S", spec: dict | None = None, **params):
        return parse_job(doc(model, gpu=gpu, parameters={**GSM8K_LIKE, **params}, environment=env, **(spec or {})))

    return job


# --- the step time follows the job ----------------------------------------------------------------


@pytest.mark.parametrize(("gpu", "seconds", "usd"), [("H100", 0.45, 0.33), ("A100-80GB", 0.7, 0.21),
                                                      ("L40S", 1.0, 0.22), ("RTX4090", 1.2, 0.10), ("A6000", 1.3, 0.12)])
def test_the_reference_job_takes_spec_s_step_times_and_costs_spec_s_table_to_the_cent(tmp_path, gpu, seconds, usd):
    # SPEC §2's example job (Qwen3-0.6B, graph-coloring, G=4, 64-token completions, LoRA r=8, beta 0) for 1,000
    # steps, through the whole estimate: its config, its tasks' prompts, the model of a step
    job = parse_job(doc(model_folder(tmp_path, "qwen3-0.6b", QWEN3_0_6B), gpu=gpu, parameters={
        "numGenerations": 4, "maxCompletionLength": 64, "lora": {"r": 8}, "method": "LoRA", "beta": 0.0,
        "maxSteps": 1000}, **({"pricing": {"usdPerHour": SPEC_RATES[gpu]}} if gpu in SPEC_RATES else {})))
    est = estimate(job)
    assert (est["stepSeconds"], est["stepSecondsSource"], est["trainingUSD"]) == (seconds, "model", usd)
    assert est["tokens"]["prompt"] == 6.1                    # the prompts the calibration assumed


@pytest.mark.parametrize("gpu", ["L40S", "L4", "H100", "A10G", "RTX4090"])
def test_qwen3_8b_steps_at_least_5x_longer_than_qwen2_5_0_5b_on_the_same_card(tmp_path, gsm8k_like, gpu):
    big = estimate(gsm8k_like(model_folder(tmp_path, "qwen3-8b", QWEN3_8B), gpu))
    small = estimate(gsm8k_like(model_folder(tmp_path, "qwen2.5-0.5b", QWEN2_5_0_5B), gpu))
    assert big["stepSecondsSource"] == small["stepSecondsSource"] == "model"
    assert big["stepSeconds"] >= 5 * small["stepSeconds"], (big["stepSeconds"], small["stepSeconds"])


@pytest.mark.parametrize("gpu", ["L40S", "H100", "T4"])
def test_1024_token_completions_cost_at_least_3x_128_token_ones(tmp_path, gsm8k_like, gpu):
    model = model_folder(tmp_path, "qwen2.5-0.5b", QWEN2_5_0_5B)
    long = estimate(gsm8k_like(model, gpu, maxCompletionLength=1024))
    short = estimate(gsm8k_like(model, gpu, maxCompletionLength=128))
    assert long["costToCompletionUSD"] >= 3 * short["costToCompletionUSD"] > 0


def test_the_group_and_the_prompts_per_step_scale_the_step(tmp_path, gsm8k_like):
    model = model_folder(tmp_path, "qwen3-8b", QWEN3_8B)
    base = estimate(gsm8k_like(model, "H100"))["stepSeconds"]
    assert estimate(gsm8k_like(model, "H100", numGenerations=16))["stepSeconds"] > base
    assert estimate(gsm8k_like(model, "H100", promptsPerStep=2))["stepSeconds"] < base


def test_the_prompt_length_is_the_tasks_mean_and_the_completion_length_the_maximum(tmp_path, gsm8k_like):
    est = estimate(gsm8k_like(model_folder(tmp_path, "qwen3-8b", QWEN3_8B)))
    assert est["tokens"]["prompt"] == round(len(QUESTION) / 4, 1)
    assert est["tokens"]["promptIs"].startswith("expected") and est["tokens"]["completionIs"].startswith("maximum")
    reference = parse_job(doc(model_folder(tmp_path, "qwen3-0.6b", QWEN3_0_6B)))
    assert workload(reference).prompt_tokens == 6.1        # the reference job's, as steptime.py calibrates with


# --- evaluations ------------------------------------------------------------------------------------


def test_a_job_with_eval_steps_costs_more_than_the_same_job_without(tmp_path, gsm8k_like):
    model = model_folder(tmp_path, "qwen2.5-0.5b", QWEN2_5_0_5B)
    plain, often = estimate(gsm8k_like(model)), estimate(gsm8k_like(model, evalSteps=50))
    assert (plain["evaluations"], often["evaluations"]) == (2, 11)     # baseline, after 50, 100, ... 450, final
    assert plain["evalTasks"] == often["evalTasks"] == 100
    assert often["evalSeconds"] == pytest.approx(11 / 2 * plain["evalSeconds"], rel=0.01)
    assert often["costToCompletionUSD"] > plain["costToCompletionUSD"]
    assert often["trainingUSD"] == plain["trainingUSD"]


def test_evaluations_are_counted_as_the_recipe_runs_them():
    assert evaluations(200, None) == 2
    assert evaluations(200, 50) == 5          # after steps 50, 100, 150 (not 200: the final one is then)
    assert evaluations(201, 50) == 6


def test_a_data_set_on_the_hub_leaves_its_prompts_uncounted_and_says_so(tmp_path):
    job = parse_job(doc(model_folder(tmp_path, "qwen3-8b", QWEN3_8B), environment={"name": "gsm8k"}))
    est = estimate(job)                                      # nothing is downloaded for an estimate
    assert est["evalTasks"] == 1319 and est["tokens"]["prompt"] is None
    assert "prompts not counted" in est["note"]


# --- every common spot GPU, and any other card -------------------------------------------------------


@pytest.mark.parametrize("gpu", ["L4", "H200", "A10G", "T4", "B200", "A100"])
def test_the_cheap_spot_favourites_and_the_new_cards_get_an_estimate(tmp_path, gpu):
    est = estimate(parse_job(doc(model_folder(tmp_path, "qwen3-0.6b", QWEN3_0_6B), gpu=gpu)))
    assert est["gpu"] == gpu and est["stepSecondsSource"] == "model"
    assert est["costToCompletionUSD"] > 0 and est["stepSeconds"] > 0 and est["memory"]["fits"] is True
    assert est["rate"]["kind"] == "on-demand" and "SkyPilot catalog" in est["rate"]["source"]


def test_a_card_outside_the_table_gets_an_estimate_from_spec_pricing(tmp_path):
    model = model_folder(tmp_path, "qwen3-0.6b", QWEN3_0_6B)
    bare = estimate(parse_job(doc(model, gpu="RTX5090", pricing={"usdPerHour": 0.9, "memoryGB": 32})))
    assert (bare["gpu"], bare["usdPerHour"], bare["gpuMemoryGB"], bare["memory"]["fits"]) == ("RTX5090", 0.9, 32, True)
    assert bare["costToCompletionUSD"] > 0 and bare["stepModel"]["cardFigures"].startswith("stand-in")
    assert "the slowest figures of the listed cards with bf16 tensor cores stand in (121 TFLOP/s, 0.3 TB/s" in bare["note"]
    described = estimate(parse_job(doc(model, gpu="RTX5090", pricing={
        "usdPerHour": 0.9, "memoryGB": 32, "bf16TFLOPS": 209.5, "memoryBandwidthGBps": 1792})))
    assert described["stepSeconds"] < bare["stepSeconds"] and described["stepModel"]["cardFigures"] == "spec.pricing"


def test_a_card_outside_the_table_without_its_rate_and_memory_is_refused_saying_how(tmp_path):
    with pytest.raises(JobError) as e:
        parse_job(doc("tiny:char", gpu="RTX5090", pricing={"usdPerHour": 0.9}))
    assert e.value.problems == [
        "spec.gpu: unknown GPU (got 'RTX5090'): did you mean RTX4090? Use one of H100, H200, B200, A100-80GB, A100, "
        "L40S, L4, A10G, T4, RTX4090, A6000 (SkyPilot's names), or describe your card with spec.pricing: "
        "{usdPerHour: 1.2, memoryGB: 32}"]


@pytest.mark.parametrize(("written", "meant"), [("h100", "H100"), ("rtx-4090", "RTX4090"), ("a10g", "A10G")])
def test_a_gpu_name_in_the_wrong_case_is_refused_with_did_you_mean(written, meant):
    with pytest.raises(JobError) as e:
        parse_job(doc("tiny:char", gpu=written, pricing={"usdPerHour": 1.0, "memoryGB": 80}))   # even described
    assert f"spec.gpu: unknown GPU (got '{written}'): did you mean {meant}?" in e.value.problems[0]


def test_the_earlier_names_are_still_accepted_and_shown_as_written(tmp_path):
    job = parse_job(doc(model_folder(tmp_path, "qwen3-0.6b", QWEN3_0_6B), gpu="H100-SXM-80GB"))
    assert job.gpu == "H100-SXM-80GB" and job.to_dict()["spec"]["gpu"] == "H100-SXM-80GB"
    assert estimate(job)["gpu"] == "H100"                    # estimates use SkyPilot's names (SPEC §6)


def test_several_processes_each_take_a_share_of_the_prompts(tmp_path, gsm8k_like):
    model = model_folder(tmp_path, "qwen3-8b", QWEN3_8B)
    one = estimate(gsm8k_like(model, "H100"))
    four = estimate(gsm8k_like(model, "H100", spec={"resources": {"processes": 4}}))
    eight = estimate(gsm8k_like(model, "H100", spec={"resources": {"processes": 8}}))
    assert eight["gpus"] == 8 and eight["usdPerHour"] == pytest.approx(8 * one["usdPerHour"])     # fills p5.48xlarge
    assert four["usdPerHour"] == eight["usdPerHour"]          # ... which four rent too (AWS's H100s: 1 or 8 a node)
    assert eight["stepSeconds"] < four["stepSeconds"] < one["stepSeconds"]


def test_a_full_fine_tune_on_several_gpus_is_sized_sharded_and_an_adapter_replicated(tmp_path, gsm8k_like):
    model = model_folder(tmp_path, "qwen3-8b", QWEN3_8B)
    one = estimate(gsm8k_like(model, "H100", method="Full"))
    eight = estimate(gsm8k_like(model, "H100", spec={"resources": {"processes": 8}}, method="Full"))
    billions = one["memory"]["trainableStateGB"] / 16          # 16 bytes a parameter on one GPU
    # sharded with FSDP: the whole weights and gradients (4 bytes) and 1/8 of the other 12, per GPU
    assert eight["memory"]["trainableStateGB"] == pytest.approx(billions * (4 + 12 / 8), abs=0.01)
    assert eight["memory"]["fsdpShards"] == 8 and "fsdpShards" not in one["memory"]
    assert one["memory"]["fits"] is False and eight["memory"]["fits"] is True       # the newcomer's refusal
    lora = [estimate(gsm8k_like(model, "H100", spec={"resources": {"processes": n}})) for n in (1, 8)]
    assert lora[0]["memory"]["trainableStateGB"] == lora[1]["memory"]["trainableStateGB"]     # replicated


def test_a_job_the_estimate_says_does_not_fit_runs_with_skip_memory_check_and_a_warning(capsys, tmp_path):
    model_folder(tmp_path, "qwen3-8b", QWEN3_8B)
    document = doc("./qwen3-8b", gpu="H100", resources={"processes": 2},
                   parameters={"method": "Full", **GSM8K_LIKE})
    rc, out, err = dry_run(capsys, tmp_path, document)
    assert rc == EXIT_USAGE and "shard it over more GPUs of this kind, spec.resources.processes" in err
    assert "`grpo-run apply --skip-memory-check` runs it anyway" in err
    assert "memory      per GPU (Full sharded over 2 with FSDP): does NOT fit" in out
    rc, out, err = dry_run(capsys, tmp_path, document, "--skip-memory-check")
    assert rc == EXIT_OK, err
    assert err.startswith("warning: --skip-memory-check: the memory estimate says this job does not fit, and it "
                          "would run anyway (expect CUDA out of memory if the estimate is right): H100 cannot hold")


# --- the dry run's answer first ----------------------------------------------------------------------


def dry_run(capsys, tmp_path: Path, document: dict, *extra: str) -> tuple[int, str, str]:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(document))
    capsys.readouterr()
    rc = main(["apply", "-f", str(path), "--dry-run", *extra])
    out, err = capsys.readouterr()
    return rc, out, err


def test_the_dry_run_says_cost_time_fit_and_where_the_step_time_came_from_in_a_few_lines(capsys, tmp_path):
    model_folder(tmp_path, "qwen3-0.6b", QWEN3_0_6B)
    document = doc("./qwen3-0.6b", gpu="H100-SXM-80GB", maxCostUSD=5,
                   parameters={"numGenerations": 4, "maxCompletionLength": 64, "maxSteps": 1000})

    rc, out, err = dry_run(capsys, tmp_path, document)

    assert rc == EXIT_OK, err
    lines = out.splitlines()
    assert len(lines) <= 10
    # which price: the cloud, the region, the source and its date; and the spot price beside it
    assert lines[0] == ("est on H100: $0.86 to completion, about 8 min (at $6.88/h, AWS us-east-1 on-demand, SkyPilot "
                        "catalog v8 (commit 00148f2a), read 2026-12-02, p5.48xlarge / 8)")
    # a 1-GPU job rents a p5.4xlarge, which has no spot offer: not the p5.48xlarge's spot price / 8 (issue 52 item 4)
    assert lines[1].startswith("  spot        none: p5.4xlarge (1 x H100, the smallest AWS shape for this job) has no "
                               "spot offer: the catalog's SpotPrice for p5.4xlarge is empty in every us-east-1 zone")
    assert "p5.48xlarge (8 x H100) asks $17.6289/h spot, $2.204 a GPU only if your job fills it" in lines[1]
    assert "1,000 steps x 0.45 s = 8 min, $0.86" in out
    assert "2 x 100 held-out tasks (baseline, final)" in out
    assert "fits: needs about 3.6 GB of 72.0 GB usable (90% of 80 GB), 68.4 GB to spare" in out
    assert "  step time   modelled from the model's config and H100's datasheet figures (82% of it sampling; 64 " \
           "completion tokens at most, prompts ~6.1 tokens)" in out
    assert "maxCostUSD $5: covers it" in out
    assert ("  preemption  none counted: each notice would cost about 2 min (boot 120 s + start 5.2 s + model load 6 s "
            "+ lost step 0.2 s; checkpoint fetch 0.4 s beside the load), $0.25; set spec.pricing.preemptionsPerHour to "
            "count them") in lines
    assert "apiVersion" not in out                            # the document needs -o


def test_a_dry_run_whose_budget_ends_training_early_names_the_step_and_exits_4(capsys, tmp_path):
    model_folder(tmp_path, "qwen3-0.6b", QWEN3_0_6B)
    document = doc("./qwen3-0.6b", gpu="H100-SXM-80GB", maxCostUSD=0.1, pricing={"usdPerHour": 2.60},
                   parameters={"numGenerations": 4, "maxCompletionLength": 64, "maxSteps": 1000})

    rc, out, err = dry_run(capsys, tmp_path, document)

    # $0.33 to completion at $0.000325 a step: $0.10 less the baseline's share lasts about 300 steps
    assert rc == EXIT_BUDGET, err
    stop = re.search(r"budget      maxCostUSD \$0.1: STOPS the run after about step (\d+) of 1,000, before the final "
                     r"evaluation", out)
    assert stop and 290 <= int(stop[1]) < 308, out
    assert (f"warning: est: maxCostUSD $0.1 stops the run after about step {stop[1]} of 1,000 (BudgetExceeded): you "
            f"pay $0.1 and get no final held-out evaluation; raise spec.maxCostUSD to $0.33 (the cost to completion) "
            f"or lower spec.parameters.maxSteps") in err.splitlines()
    rc, _, err = dry_run(capsys, tmp_path, document, "-o", "yaml")      # the document too
    assert rc == EXIT_BUDGET and "warning: est: maxCostUSD $0.1 stops the run" in err


def test_the_dry_run_of_a_job_that_does_not_fit_says_by_how_much_and_what_would(capsys, tmp_path):
    model_folder(tmp_path, "qwen3-8b", QWEN3_8B)
    rc, out, err = dry_run(capsys, tmp_path, doc("./qwen3-8b", gpu="L4", parameters={"method": "Full"}))
    assert rc == EXIT_USAGE
    assert "does NOT fit: needs about 134.2 GB, 21.6 GB usable (90% of 24 GB): 112.6 GB short" in out
    assert "L4 cannot hold this run" in err and "B200 fits as is" in err


def test_a_card_whose_datasheet_figures_are_a_stand_in_says_so_in_the_estimate_and_the_dry_run(capsys, tmp_path):
    model = model_folder(tmp_path, "qwen3-0.6b", QWEN3_0_6B)
    a10g = estimate(parse_job(doc(model, gpu="A10G")))
    assert "A10G: NVIDIA publishes no figures for the A10G: the A10's are used" in a10g["note"]
    assert "FP32 rate (8.1 TFLOP/s)" in estimate(parse_job(doc(model, gpu="T4")))["stepModel"]["cardNote"]
    assert "cardNote" not in estimate(parse_job(doc(model, gpu="L4")))["stepModel"]
    rc, out, err = dry_run(capsys, tmp_path, doc("./qwen3-0.6b", gpu="A10G"))
    assert rc == EXIT_OK, err
    assert "\n  card        NVIDIA publishes no figures for the A10G" in out
    rc, out, err = dry_run(capsys, tmp_path, doc("./qwen3-0.6b", gpu="RTX5090", pricing={"usdPerHour": 0.9,
                                                                                           "memoryGB": 32}))
    assert rc == EXIT_OK, err
    assert ("\n  card        RTX5090 is not in the table: the slowest listed figures with bf16 tensor cores stand in "
            "(121 TFLOP/s, 0.3 TB/s), an upper bound; give yours as spec.pricing.bf16TFLOPS") in out


def test_with_o_the_dry_run_prints_the_whole_document_with_the_spec_s_estimate_fields(capsys, tmp_path):
    model_folder(tmp_path, "qwen3-0.6b", QWEN3_0_6B)
    rc, out, err = dry_run(capsys, tmp_path, doc("./qwen3-0.6b", gpu="L4"), "-o", "json")
    assert rc == EXIT_OK, err
    est = json.loads(out)["status"]["estimate"]
    assert {"costToCompletionUSD", "firstHoldUSD", "startTime", "stepSeconds", "gpu", "memory",
            "stepSecondsSource", "evalSeconds", "evaluations", "trainingUSD", "evalUSD"} <= est.keys()
    assert {"parameters", "trainableParameters", "weightsGB", "trainableStateGB", "referenceGB", "totalGB",
            "kvCacheBytesPerToken", "kvCacheGB", "fits"} <= est["memory"].keys()


def test_a_finished_gpu_run_teaches_the_estimate_of_its_model_and_length(tmp_path, gsm8k_like):
    from grpo_run.runner.jobs.run import remember_step_time as _remember_step_time

    job = gsm8k_like(model_folder(tmp_path, "qwen2.5-0.5b", QWEN2_5_0_5B), "L4")
    _remember_step_time(job, {"device": "cpu", "medianStepSeconds": 99.0})        # a CPU run teaches nothing
    assert estimate(job)["stepSecondsSource"] == "model"
    _remember_step_time(job, {"device": "cuda:0", "medianStepSeconds": 3.25})
    est = estimate(job)
    assert (est["stepSeconds"], est["stepSecondsSource"]) == (3.25, "measured")


def _record_of(job, device: str, step_seconds: list[float]) -> None:
    """The job's record in its work folder, as a node's supervisor leaves it: the manifest, the
    trainer's device and a time per step taken."""
    from grpo_run.runner.home import work_dir
    from grpo_run.state import values
    from grpo_run.state.record import RECORD_FILE, Record

    work_dir(job.name).mkdir(parents=True)
    with Record(work_dir(job.name) / RECORD_FILE) as record:
        record.init_job(job.name, job.to_dict())
        values.DEVICE.set(record, device)
        for step, seconds in enumerate(step_seconds, 1):
            record.log_step(step, {"stepSeconds": seconds, "loss": 0.0})


def test_this_node_s_job_records_running_ones_too_teach_the_estimate_one_vote_per_job(tmp_path, gsm8k_like):
    from grpo_run.runner.estimate.estimate import record_measured_step_seconds

    model = model_folder(tmp_path, "qwen2.5-0.5b", QWEN2_5_0_5B)
    job = gsm8k_like(model, "L4")
    _record_of(gsm8k_like(model, "L4").model_copy(update={"name": "warming-up"}), "cuda:NVIDIA L4", [9.0, 5.0])
    _record_of(gsm8k_like(model, "L4").model_copy(update={"name": "on-a-cpu"}), "cpu", [90.0] * 5)
    _record_of(gsm8k_like(model, "L4", maxCompletionLength=1024).model_copy(update={"name": "longer"}),
               "cuda:NVIDIA L4", [50.0] * 5)
    _record_of(gsm8k_like(model, "L40S").model_copy(update={"name": "another-card"}), "cuda:NVIDIA L40S", [2.0] * 5)
    assert estimate(job)["stepSecondsSource"] == "model"          # none of these is this job's (GPU, model, length)

    _record_of(gsm8k_like(model, "L4").model_copy(update={"name": "running"}), "cuda:NVIDIA L4", [9.0, 4.0, 4.2, 4.4])
    est = estimate(job)
    assert (est["stepSeconds"], est["stepSecondsSource"], est["measuredRuns"]) == (4.4, "measured", 1)

    record_measured_step_seconds("L4", 6.0, "running", model=job.model, completion_length=512)   # the same run
    record_measured_step_seconds("L4", 3.0, "finished-elsewhere", model=job.model, completion_length=512)
    est = estimate(job)
    assert (est["stepSeconds"], est["measuredRuns"]) == (pytest.approx(3.7), 2)    # median of 3.0 and 4.4
    assert "the median of 2 of your runs of this model on L4" in est["note"]


# --- reward models ----------------------------------------------------------------------------------


def reward_model_job(tmp_path: Path, reward_model: str, gpu: str = "L40S"):
    (tmp_path / "rewards.py").write_text("def score(completion, task):\n    return 0.0\n")
    for name, count in (("train.jsonl", 16), ("eval.jsonl", 20)):
        (tmp_path / name).write_text("".join(json.dumps({"prompt": QUESTION}) + "\n" for _ in range(count)))
    env = {"name": "words", "rewards": [{"function": str(tmp_path / "rewards.py") + ":score"},
                                        {"model": reward_model, "weight": 0.5, "name": "rm"}],
           "tasks": str(tmp_path / "train.jsonl"), "evalTasks": str(tmp_path / "eval.jsonl")}
    return doc(model_folder(tmp_path, "qwen3-0.6b", QWEN3_0_6B), gpu=gpu, environment=env,
               parameters={"numGenerations": 8, "maxCompletionLength": 512, "maxSteps": 100})


def test_a_reward_model_s_weights_and_forward_are_in_the_memory_and_the_step_time(tmp_path):
    with_rm = reward_model_job(tmp_path, str(model_folder(tmp_path, "rm", QWEN2_5_0_5B_RM)))
    plain = json.loads(json.dumps(with_rm))
    plain["spec"]["environment"]["rewards"] = plain["spec"]["environment"]["rewards"][:1]
    rm, no_rm = estimate(parse_job(with_rm)), estimate(parse_job(plain))
    # Qwen2.5-0.5B's 494,032,768 parameters (its head tied to the embeddings) with a 896 x 1 score
    # head instead, in bf16: 0.99 GB, resident the whole run
    assert rm["memory"]["rewardModelsGB"] == 0.99 and "rewardModelsGB" not in no_rm["memory"]
    # its forward over the step's 64 completions is smaller than sampling or the update here
    assert 0 < rm["memory"]["scoringGB"] < max(rm["memory"]["samplingGB"], rm["memory"]["updateGB"])
    assert rm["memory"]["neededGB"] == pytest.approx(no_rm["memory"]["neededGB"] + 0.99)
    # one more forward pass per step (counted with the update) and per evaluation batch
    assert rm["stepModel"]["sampleSeconds"] == no_rm["stepModel"]["sampleSeconds"]
    assert rm["stepModel"]["updateSeconds"] > no_rm["stepModel"]["updateSeconds"]
    assert rm["evalSeconds"] > no_rm["evalSeconds"] and rm["costToCompletionUSD"] > no_rm["costToCompletionUSD"]


def test_one_reward_model_forward_is_a_one_logit_pass_computed_by_hand():
    from grpo_run.runner.estimate.memory import model_shape
    from grpo_run.runner.estimate.steptime import COMPUTE_EFFICIENCY, LAUNCH_SECONDS, MEMORY_EFFICIENCY, score_seconds
    from grpo_run.runner.spec.gpus import lookup_gpu

    config = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 1000}
    card = lookup_gpu("L40S")
    # per layer: q 64x64, k 64x32, v 64x32, o 64x64, gate/up/down 64x128 x3 = 36,864; 2 layers; head 64 x 1
    matmul = 2 * 36_864 + 64
    tokens, sequences = 100, 8
    flops = sequences * tokens * (2 * matmul + 4 * 2 * 4 * 16 * tokens / 2)
    read = 2 * matmul
    by_hand = LAUNCH_SECONDS * 2 + max(read / (card.memory_bandwidth * MEMORY_EFFICIENCY),
                                       flops / (card.bf16_flops * COMPUTE_EFFICIENCY))
    assert score_seconds(model_shape(config), sequences, tokens, card) == pytest.approx(by_hand, rel=1e-12)


def test_the_dry_run_counts_a_reward_model_and_names_one_it_cannot_find(capsys, tmp_path, monkeypatch):
    rc, out, err = dry_run(capsys, tmp_path, reward_model_job(tmp_path, str(model_folder(tmp_path, "rm", QWEN2_5_0_5B_RM))))
    assert rc == EXIT_OK, err
    assert "the reward models' weights are 0.99 GB of it" in out
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    rc, out, err = dry_run(capsys, tmp_path, reward_model_job(tmp_path, "grpo-run-tests/no-such-reward-model"))
    assert rc == EXIT_USAGE
    assert "spec.environment.rewards[1].model: " in err and "grpo-run-tests/no-such-reward-model" in err
    assert "Traceback" not in err
    # a causal LM's config (no one-logit head) is refused before a GPU is paid for
    rc, out, err = dry_run(capsys, tmp_path, reward_model_job(tmp_path, str(model_folder(tmp_path, "lm", QWEN2_5_0_5B))))
    assert rc == EXIT_USAGE and "Traceback" not in err
    assert "spec.environment.rewards[1].model: " in err and "has 2 outputs (num_labels); a reward model is a " \
        "sequence classifier with one logit" in err


def test_a_judge_s_calls_are_counted_and_priced_per_call_in_the_cost_to_completion(tmp_path):
    job = reward_model_job(tmp_path, str(model_folder(tmp_path, "rm", QWEN2_5_0_5B_RM)))
    judge = {"url": "http://127.0.0.1:8000/v1", "model": "m", "prompt": "Rate {completion}"}
    job["spec"]["environment"]["rewards"][1] = {"judge": {**judge, "usdPerCall": 0.001}, "name": "quality"}
    plain = json.loads(json.dumps(job))
    plain["spec"]["environment"]["rewards"] = plain["spec"]["environment"]["rewards"][:1]
    judged, no_judge = estimate(parse_job(job)), estimate(parse_job(plain))
    # 100 steps x 8 prompts x 8 completions, and 20 held-out tasks in each of the 2 evaluations
    calls = 100 * 8 * 8 + 2 * 20
    assert judged["evaluations"] == 2 and judged["judgeCalls"] == {"quality": {"calls": calls, "usd": 6.44}}
    assert judged["costToCompletionUSD"] == pytest.approx(no_judge["costToCompletionUSD"] + 6.44)
    assert f"judge 'quality': {calls} calls to completion at $0.001 a call: $6.44, in costToCompletionUSD" \
        in judged["note"]
    # a budget the GPU's time alone fits in, the calls not: the dry run says where the run stops, counting both
    budget = round(no_judge["costToCompletionUSD"] + 3.0, 2)
    capped = estimate(parse_job({**job, "spec": {**job["spec"], "maxCostUSD": budget}}))
    per_step = no_judge["stepSeconds"] * no_judge["usdPerHour"] / 3600 + 8 * 8 * 0.001
    baseline = no_judge["evalSeconds"] / 2 * no_judge["usdPerHour"] / 3600
    said = re.search(rf"maxCostUSD {budget:g} is reached after about (\d+) of 100 steps \(the baseline evaluation, "
                     r"the GPU's time and the judges' calls\): the run stops there", capped["note"])
    assert said and abs(int(said[1]) - (budget - baseline) / per_step) <= 1 and int(said[1]) < 100, capped["note"]
    job["spec"]["environment"]["rewards"][1]["judge"] = {**judge, "usdPerMillionTokens": {"input": 1, "output": 2}}
    per_token = estimate(parse_job(job))
    assert per_token["judgeCalls"] == {"quality": {"calls": calls, "usd": None}}
    assert per_token["costToCompletionUSD"] == no_judge["costToCompletionUSD"]
    assert "priced per token: their cost depends on the replies and is not in costToCompletionUSD" in per_token["note"]


def test_the_dry_run_says_a_judge_s_calls_and_their_cost(capsys, tmp_path):
    job = reward_model_job(tmp_path, str(model_folder(tmp_path, "rm", QWEN2_5_0_5B_RM)))
    job["spec"]["environment"]["rewards"][1] = {"name": "quality", "judge": {
        "url": "http://127.0.0.1:8000/v1", "model": "m", "prompt": "Rate {completion}", "usdPerCall": 0.001}}
    rc, out, err = dry_run(capsys, tmp_path, job)
    assert rc == EXIT_OK, err
    assert "  judge       quality: 6,440 calls, $6.44 (in the total)" in out



# --- episodes (spec.environment.episodes) ---------------------------------------------------------

def test_an_episode_is_estimated_as_max_turns_replies_decoded_one_after_another(tmp_path):
    from grpo_run.runner.estimate.measured import sampled_length
    from grpo_run.runner.estimate.summary import summary

    model = model_folder(tmp_path, "qwen3-0.6b", QWEN3_0_6B)
    (tmp_path / "env.py").write_text("class Guess:\n    def reset(self, task, seed):\n        return 'guess'\n"
                                     "    def step(self, reply):\n        return None\n")
    for name, first in (("tasks.jsonl", 0), ("eval.jsonl", 10)):
        (tmp_path / name).write_text("".join(json.dumps({"prompt": f"a range: {i}-99"}) + "\n"
                                             for i in range(first, first + 8)))
    env = {"name": "guess", "episodes": str(tmp_path / "env.py") + ":Guess", "tasks": str(tmp_path / "tasks.jsonl"),
           "evalTasks": str(tmp_path / "eval.jsonl")}
    params = {"maxCompletionLength": 16}
    one = estimate(parse_job(doc(model, gpu="H100", parameters=params, environment={**env, "maxTurns": 1})))
    four = estimate(parse_job(doc(model, gpu="H100", parameters=params, environment={**env, "maxTurns": 4})))
    plain = {k: v for k, v in env.items() if k != "episodes"} | {"reward": str(tmp_path / "env.py") + ":Guess"}
    single = estimate(parse_job(doc(model, gpu="H100", parameters=params, environment=plain)))
    assert one["stepSeconds"] == pytest.approx(single["stepSeconds"])          # one turn: a completion
    # four turns: each prefills the episode so far and decodes 16 tokens; the update passes over 4 x 16
    assert 3.5 * one["stepSeconds"] < four["stepSeconds"] < 5 * one["stepSeconds"]
    assert four["evalSeconds"] > 3.5 * one["evalSeconds"]
    assert four["tokens"]["turns"] == 4 and "turns" not in single["tokens"]
    assert four["memory"]["samplingGB"] > one["memory"]["samplingGB"]            # an episode is one sequence
    assert "4 replies x 16 tokens at most (the environment's answers not counted)" in summary("est", four)
    defaults = parse_job(doc(model, gpu="H100", parameters=params, environment=env))   # maxTurns left out: 6
    assert estimate(defaults)["tokens"]["turns"] == 6
    assert sampled_length(defaults.to_dict()["spec"]) == 96                  # measured runs: by what they decode
    assert sampled_length({"parameters": params, "environment": plain}) == 16
