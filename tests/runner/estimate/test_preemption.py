"""What spot notices add to the estimate (issue 38 item 2): a restart's start-up, model load and
the step in flight, at the rate of notices spec.pricing.preemptionsPerHour states, in the cost to
completion, the time, the spot line and where maxCostUSD stops the run."""

from __future__ import annotations

import pytest

from grpo_run.runner.cli.commands import EXIT_BUDGET, EXIT_OK, EXIT_USAGE
from grpo_run.runner.estimate.estimate import estimate
from grpo_run.runner.estimate.preemption import preemptions, restart_seconds
from grpo_run.runner.spec.job import JobError, parse_job
from tests.runner.estimate.test_estimate_jobs import GSM8K_LIKE, QWEN3_8B, doc, dry_run, model_folder


def test_a_restart_is_start_up_the_weights_and_state_at_the_stated_rate_and_half_a_step():
    # 120 s + (2 B x 8.2e9 + 0.35e9 B) / 200e6 B/s = 120 + 83.75 s, + 101 s / 2 = 254.25 s
    assert restart_seconds(parameters=8_200_000_000, trainable_state_gb=0.35, step_seconds=101) == 254.2


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
    assert " restarts expected at 0.5 an hour x 4 min (start-up, model load, half a step) = " in line
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
