"""What spot notices add to the estimate (issue 38 item 2, issue 52 item 3): a restart's parts
(boot, grpo-run's measured start, the model's load and the engine's start beside the checkpoint's
fetch, the step in flight), each with its source, at the rate of notices
spec.pricing.preemptionsPerHour states, in the cost to completion, the time, the spot line and
where maxCostUSD stops the run."""

from __future__ import annotations

import pytest

from grpo_run.runner.cli.commands import EXIT_BUDGET, EXIT_OK, EXIT_USAGE
from grpo_run.runner.estimate.estimate import estimate
from grpo_run.runner.estimate.preemption import (BOOT_SECONDS, GRPO_RUN_START_SECONDS, LOAD_BYTES_PER_SECOND,
                                                 preemptions, restart_parts, restart_seconds)
from grpo_run.runner.spec.job import JobError, parse_job
from tests.runner.estimate.test_estimate_jobs import GSM8K_LIKE, QWEN3_8B, doc, dry_run, model_folder


def test_a_restart_is_boot_start_the_weights_beside_the_checkpoint_fetch_and_half_a_step():
    assert (BOOT_SECONDS, LOAD_BYTES_PER_SECOND) == (120.0, 200e6)       # the stated allowances
    parts = {p.part: p for p in restart_parts(parameters=8_200_000_000, trainable_state_gb=0.35, step_seconds=101)}
    assert list(parts) == ["boot", "start", "model load", "checkpoint fetch", "lost step"]
    # 2 B x 8.2e9 / 200e6 B/s = 82 s; the state 0.35e9 B / 200e6 B/s = 1.75 s, beside the load; 101 s / 2
    assert [p.seconds for p in parts.values()] == [120.0, GRPO_RUN_START_SECONDS, 82.0, 1.8, 50.5]
    assert parts["checkpoint fetch"].overlapped and not parts["model load"].overlapped
    assert parts["boot"].source.startswith("allowance") and "spec.pricing.bootSeconds" in parts["boot"].source
    assert parts["start"].source.startswith("measured: bench/fresh_node.py")
    assert parts["model load"].source.startswith("2 B x 8,200,000,000 parameters at 200 MB/s: allowance")
    assert restart_seconds(parameters=8_200_000_000, trainable_state_gb=0.35, step_seconds=101) == \
        round(120 + GRPO_RUN_START_SECONDS + 82 + 50.5, 1)


def test_a_checkpoint_fetch_longer_than_the_load_counts_instead_of_it_and_the_engine_start_adds_to_the_load():
    # a full fine-tune: 1e9 parameters load in 10 s, its 16 GB of trainable state take 80 s to fetch
    full = restart_seconds(parameters=1_000_000_000, trainable_state_gb=16, step_seconds=2)
    assert full == round(120 + GRPO_RUN_START_SECONDS + 80 + 1, 1)
    # vLLM's start runs after the model's load in the trainer, both beside the fetch
    lora = dict(parameters=8_200_000_000, trainable_state_gb=0.35, step_seconds=101)
    assert restart_seconds(**lora, engine_start_s=60, engine_source="published") == \
        round(restart_seconds(**lora) + 60, 1)
    assert restart_seconds(**{**lora, "trainable_state_gb": 30}, engine_start_s=60, engine_source="published") == \
        round(120 + GRPO_RUN_START_SECONDS + 150 + 50.5, 1)     # 30 GB: 150 s, longer than 82 + 60


def test_the_job_s_own_boot_and_load_rate_replace_the_allowances_and_say_so(tmp_path):
    model = model_folder(tmp_path, "qwen3-8b", QWEN3_8B)
    own = estimate(parse_job(doc(model, parameters=GSM8K_LIKE,
                                 pricing={"preemptionsPerHour": 0.5, "bootSeconds": 30, "loadBytesPerSecond": 1e9})))
    parts = {p["part"]: p for p in own["preemption"]["parts"]}
    assert parts["boot"] == {"part": "boot", "seconds": 30.0, "source": "spec.pricing.bootSeconds"}
    assert parts["model load"]["source"].endswith("at 1000 MB/s: spec.pricing.loadBytesPerSecond")
    assert parts["checkpoint fetch"]["overlapped"] is True
    assert parts["start"]["seconds"] == GRPO_RUN_START_SECONDS
    default = estimate(parse_job(doc(model, parameters=GSM8K_LIKE, pricing={"preemptionsPerHour": 0.5})))
    assert own["preemption"]["restartSeconds"] < default["preemption"]["restartSeconds"]
    assert "boot 30 s + start" in own["note"]


@pytest.mark.parametrize("field", ["bootSeconds", "loadBytesPerSecond"])
def test_a_bad_boot_or_load_rate_is_refused_naming_the_field(tmp_path, field):
    model = model_folder(tmp_path, "qwen3-8b", QWEN3_8B)
    with pytest.raises(JobError) as refused:
        parse_job(doc(model, pricing={field: -3}))
    assert f"spec.pricing.{field}: must be a number > 0" in str(refused.value)


def test_restarts_lengthen_the_run_they_happen_in_and_a_rate_that_outruns_them_never_finishes():
    # 0.1 notices an hour, 360 s each: 36 s of every hour restarting (1%); 10 h of work take
    # T' = 10 h / 0.99, so 0.1 x 10 / 0.99 = 1.0101 restarts, 363.6 s, at $2/h $0.20
    found = preemptions(per_hour=0.1, restart_s=360, run_seconds=36_000, usd_per_hour=2.0)
    assert (found.restarts, found.seconds, found.usd) == (1.01, 363.6, 0.2)
    assert preemptions(per_hour=0, restart_s=360, run_seconds=36_000, usd_per_hour=2.0).seconds == 0
    never = preemptions(per_hour=10, restart_s=360, run_seconds=36_000, usd_per_hour=2.0)   # one every 6 min, 6 min each
    assert never.restarts is None and never.usd == 0


def test_the_estimate_counts_the_notices_the_job_states_in_its_cost_time_and_spot_line(tmp_path):
    model = model_folder(tmp_path, "qwen3-8b", QWEN3_8B)
    calm = estimate(parse_job(doc(model, parameters=GSM8K_LIKE)))
    rough = estimate(parse_job(doc(model, parameters=GSM8K_LIKE, pricing={"preemptionsPerHour": 0.5})))
    pre = rough["preemption"]
    assert calm["preemption"]["restarts"] == 0 and pre["restartSecondsSource"] == "model"
    assert pre["restartSeconds"] == calm["preemption"]["restartSeconds"] > 120
    hours = calm["completionSeconds"] / 3600
    assert pre["restarts"] == round(0.5 * hours / (1 - 0.5 * pre["restartSeconds"] / 3600), 2)
    assert rough["completionSeconds"] == round(calm["completionSeconds"] + pre["seconds"], 1)
    assert rough["costToCompletionUSD"] == round(calm["costToCompletionUSD"] + pre["usd"], 2) > calm["costToCompletionUSD"]
    assert rough["rate"]["spot"]["costToCompletionUSD"] > calm["rate"]["spot"]["costToCompletionUSD"]
    assert "preemptions: " in rough["note"] and "spec.pricing.preemptionsPerHour" in rough["note"]
    # your own restart time replaces the model's
    own = estimate(parse_job(doc(model, parameters=GSM8K_LIKE, pricing={"preemptionsPerHour": 0.5,
                                                                         "restartSeconds": 900})))
    assert own["preemption"]["restartSeconds"] == 900
    assert own["preemption"]["restartSecondsSource"] == "spec.pricing.restartSeconds"
    assert own["preemption"]["seconds"] > pre["seconds"]


def test_the_dry_run_says_what_the_notices_add_and_where_they_end_a_budget(capsys, tmp_path):
    model_folder(tmp_path, "qwen3-8b", QWEN3_8B)
    plain = doc("./qwen3-8b", parameters=GSM8K_LIKE)
    rc, out, err = dry_run(capsys, tmp_path, plain)
    assert rc == EXIT_OK, err
    cost = float(out.split("$", 1)[1].split(" ", 1)[0])
    # a budget the run fits without notices, but not with one every two hours
    rc, out, err = dry_run(capsys, tmp_path, {**plain, "spec": {**plain["spec"], "maxCostUSD": cost + 0.05,
                                                                "pricing": {"preemptionsPerHour": 0.5}}})
    assert rc == EXIT_BUDGET, err
    (line,) = [ln for ln in out.splitlines() if ln.startswith("  preemption  ")]
    assert " restarts expected at 0.5 an hour x 4 min (boot 120 s + start " in line
    assert line.endswith("(in the total)")
    assert "STOPS the run after about step 4" in out and "warning: est: maxCostUSD" in err


@pytest.mark.parametrize("value, says", [(-1, "must be a number >= 0 (got -1)"), ("often", "must be a number >= 0 (got 'often')"),
                                         (True, "must be a number >= 0 (got true)")])
def test_a_bad_rate_of_notices_is_refused_naming_the_field_and_the_fix(tmp_path, capsys, value, says):
    model = model_folder(tmp_path, "qwen3-8b", QWEN3_8B)
    with pytest.raises(JobError) as refused:
        parse_job(doc(model, pricing={"preemptionsPerHour": value}))
    assert f"spec.pricing.preemptionsPerHour: {says}" in str(refused.value)
    assert "or 0 to count none" in str(refused.value)
    rc, _, err = dry_run(capsys, tmp_path, doc("./qwen3-8b", pricing={"preemptionsPerHour": value}))
    assert rc == EXIT_USAGE and "spec.pricing.preemptionsPerHour" in err and "Traceback" not in err


def test_notices_faster_than_a_restart_are_said_to_never_finish_and_left_out_of_the_cost(tmp_path):
    from grpo_run.runner.estimate.summary import summary

    model = model_folder(tmp_path, "qwen3-8b", QWEN3_8B)
    calm = estimate(parse_job(doc(model, parameters=GSM8K_LIKE)))
    est = estimate(parse_job(doc(model, parameters=GSM8K_LIKE, pricing={"preemptionsPerHour": 30})))   # every 2 min
    assert est["preemption"]["restarts"] is None and est["costToCompletionUSD"] == calm["costToCompletionUSD"]
    assert "so the run would never finish" in est["note"]
    assert ("  preemption  at 30 notices an hour, each restart (4 min) outlasts the time between them: the run would "
            "never finish (not in the total)") in summary("est", est).splitlines()
