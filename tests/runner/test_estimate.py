"""The cost estimate reproduces SPEC §3's worked examples."""

from __future__ import annotations

import pytest

from grpo_run.runner.gpus import CostEstimate, cost_estimate, lookup_gpu


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
