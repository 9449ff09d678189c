"""`grpo-run get tj NAME -w`: a bar per phase with steps/s, ETA, reward, spend and projection."""

from datetime import datetime, timedelta, timezone

from grpo_run.runner.views.live import view
from grpo_run.state import values
from grpo_run.state.phases import Phase
from grpo_run.state.record import Record

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)


def manifest(max_steps=100):
    return {"apiVersion": "grpo-run/v1", "kind": "TrainingJob", "metadata": {"name": "live"},
            "spec": {"parameters": {"maxSteps": max_steps}}}


def a_run_in_training(tmp_path, *, rate_usd=3.6):
    record = Record(tmp_path / "state.db")
    record.init_job("live", manifest())
    record.set_phase(Phase.BASELINE_EVAL)
    record.record_eval("baseline", {"meanReward": 0.25, "tasks": 30, "solved": 7}, computed=True, fingerprint="f")
    record.set_phase(Phase.TRAINING)
    attempt = record.start_attempt("node-b", from_step=0)
    record.db["attempts"].update(attempt, {"started": T0.isoformat()})
    for step in range(1, 11):               # two steps a second, the reward climbing
        record.db["steps"].insert({"step": step, "logged": (T0 + timedelta(seconds=step / 2)).isoformat(),
                                   "metrics": f'{{"rewardMean": {step / 20}, "costUSD": {step * 0.0005}}}'})
    record.set_value("ledger", {str(attempt): {"seconds": 0.0, "usd": 0.0, "usdPerHour": rate_usd}})
    values.EVAL_PLAN.set(record, {"tasks": 30, "batches": 2})
    return record


def test_a_bar_per_phase_with_rate_eta_reward_and_the_projected_cost(tmp_path):
    with a_run_in_training(tmp_path) as record:
        head, baseline, training, final, spend = view(record)
    assert head == "live  Training  attempt 1 on node-b"
    assert baseline.split()[:2] == ["BaselineEval", "[" + "#" * 30 + "]"]
    assert "done       held-out 0.250 (30 tasks)" in baseline
    assert training.split()[:5] == ["Training", "[###" + "." * 27 + "]", "10/100", "10%", "2.0"]
    # 90 steps left at 2 steps/s, then a final evaluation as long as the baseline took (here ~0 s)
    assert "ETA 45s" in training or "ETA 46s" in training
    assert training.endswith("reward 0.275")                   # the newest ten steps' mean
    assert final.split()[:3] == ["FinalEval", "[" + "." * 30 + "]", "0/2"]
    # spent $0.005 (the newest step's ledger); 45 s more at $3.60/h is $0.045
    assert spend in ("  spend $0.0050 so far; projected $0.0500 at completion ($3.6/h)",
                     "  spend $0.0050 so far; projected $0.0510 at completion ($3.6/h)")


def test_a_run_without_a_rate_says_how_to_give_one_and_a_stopped_one_has_no_eta(tmp_path):
    with a_run_in_training(tmp_path, rate_usd=None) as record:
        record.end_attempt(1, "Preempted", notice="gcp")
        record.set_phase(Phase.PREEMPTED)
        head, _, training, _, spend = view(record)
    assert head == "live  Preempted  attempt 1 on node-b"
    assert "steps/s" not in training and "ETA" not in training
    assert spend == "  spend: no rate (set spec.gpu or spec.pricing.usdPerHour)"


def test_the_spend_counts_the_judges_priced_calls_with_or_without_a_gpu_rate(tmp_path):
    with a_run_in_training(tmp_path) as record:
        values.JUDGE_USD.set(record, {"quality": 0.012})
        *_, spend = view(record)
    # the newest step's costUSD ($0.005) was logged before these calls: the record's $0.012 is newer
    assert spend.startswith("  spend $0.0120 so far, $0.0120 of it judge calls; projected $0.0570 at completion "
                            "(GPU time; judge calls to come not counted)") or \
        spend.startswith("  spend $0.0120 so far, $0.0120 of it judge calls; projected $0.0580")
    with a_run_in_training(tmp_path / "no-rate", rate_usd=None) as record:
        values.JUDGE_USD.set(record, {"quality": 0.012})
        *_, spend = view(record)
    assert spend == "  spend $0.0120 so far, $0.0120 of it judge calls; no GPU rate (set spec.gpu or " \
                    "spec.pricing.usdPerHour)"
