"""The GPU table and the cost arithmetic: SPEC §3's worked examples, SkyPilot's names, rates
with their sources."""

from __future__ import annotations

import pytest

from grpo_run.runner.deploy.skypilot import SKYPILOT_GPUS
from grpo_run.runner.spec.gpus import GPUS, CostEstimate, cost_estimate, custom_gpu, lookup_gpu, suggestion


# --- cost --------------------------------------------------------------------------------------

# The rates SPEC §3's costs of 1,000 steps imply (cost x 3600 / (1000 x step seconds)); the table
# charges AWS's for these cards, so SPEC's worked examples give them explicitly.
SPEC_RATES = {"H100": 2.60, "A100-80GB": 1.08, "L40S": 0.79}


def test_one_price_list_ranks_the_cards_as_their_hardware_does():
    """The newcomer saw A100-80GB at $1.08/h and A100 (40 GB) at $2.74/h: two sources. One
    catalog now prices every card AWS sells, on demand and spot, so the bigger card costs more."""
    for kind in ("usd_per_hour", "spot_usd_per_hour"):
        price = {g.name: getattr(g, kind) for g in GPUS.values()}
        assert price["A100-80GB"] > price["A100"] and price["H100"] > price["A100-80GB"]
        assert price["L40S"] > price["L4"] and price["A10G"] > price["T4"]


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
    # at the rates SPEC's costs imply (the table charges AWS's prices for the cards AWS sells)
    estimate = cost_estimate(gpu=gpu, steps=1000, usd_per_hour=SPEC_RATES.get(lookup_gpu(gpu).name))
    assert estimate.cost_to_completion_usd == usd
    assert estimate.step_seconds_source == "reference"


def test_the_h100_runs_at_spec_s_reference_step_time_and_aws_s_prices():
    h100 = lookup_gpu("H100-SXM-80GB")
    assert (h100.name, h100.reference_step_seconds, h100.usd_per_hour, h100.spot_usd_per_hour) == \
        ("H100", 0.45, 6.88, 2.2036)            # p5.48xlarge / 8: $55.04 on demand, $17.6289 spot in use1-az6


def test_the_fastest_gpu_is_not_the_cheapest_per_step():
    h100 = cost_estimate(gpu="H100-SXM-80GB", steps=1000, usd_per_hour=SPEC_RATES["H100"])
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
    assert cost_estimate(gpu="H100-SXM-80GB", steps=1000, save_steps=25, usd_per_hour=2.60).first_hold_usd == 0.01
    hourly = cost_estimate(gpu="H100-SXM-80GB", steps=10_000, save_steps=8000, step_seconds=0.45, usd_per_hour=2.60)
    assert hourly.first_hold_usd == 2.60  # 8,000 x 0.45 s = one hour


def test_the_first_hold_never_exceeds_the_budget_or_the_whole_run():
    capped = cost_estimate(gpu="H100-SXM-80GB", steps=100_000, save_steps=8000, max_cost_usd=1.0)
    assert capped.first_hold_usd == 1.0
    short = cost_estimate(gpu="H100-SXM-80GB", steps=8000, save_steps=100_000, usd_per_hour=2.60)
    assert short.first_hold_usd == short.cost_to_completion_usd == 2.60


def test_cost_to_dict_uses_the_status_estimate_keys_and_skypilot_s_name():
    assert cost_estimate(gpu="RTX-4090", steps=1000).to_dict() == {
        "gpu": "RTX4090",
        "steps": 1000,
        "stepSeconds": 1.2,
        "stepSecondsSource": "reference",
        "usdPerHour": 0.29,
        "costToCompletionUSD": 0.10,
        "firstHoldUSD": 0.01,
        "evalSeconds": 0.0,
        "trainingUSD": 0.10,
        "evalUSD": 0.0,
    }


def test_an_unknown_gpu_is_refused_with_a_did_you_mean_and_the_allowed_names():
    with pytest.raises(ValueError, match="unknown GPU 'H100-PCIe': did you mean H100\\? Use one of H100, H200, B200, "
                                         "A100-80GB, A100, L40S, L4, A10G, T4, RTX4090, A6000"):
        cost_estimate(gpu="H100-PCIe", steps=10)


# --- the table ----------------------------------------------------------------------------------


def test_the_table_has_skypilot_s_names_and_the_earlier_ones_as_aliases():
    assert {"H100", "H200", "B200", "A100-80GB", "A100", "L40S", "L4", "A10G", "T4", "RTX4090", "A6000"} <= set(GPUS)
    for old, new in (("H100-SXM-80GB", "H100"), ("RTX-4090", "RTX4090"), ("RTX-A6000", "A6000"),
                     ("A100-80GB", "A100-80GB"), ("L40S", "L40S")):
        assert lookup_gpu(old) is GPUS[new]


@pytest.mark.parametrize(("written", "meant"), [("h100", "H100"), ("rtx 4090", "RTX4090"), ("a10g", "A10G"),
                                                ("H10", "H100"), ("A100-80G", "A100-80GB"), ("rtx-a6000", "A6000")])
def test_a_near_miss_gets_a_did_you_mean(written, meant):
    assert suggestion(written) == meant
    with pytest.raises(ValueError, match=f"did you mean {meant}\\?"):
        lookup_gpu(written)


def test_every_card_has_datasheet_figures_and_a_rate_with_its_source_and_kind():
    for gpu in GPUS.values():
        assert gpu.memory_gb >= 16 and gpu.bf16_flops > 1e12 and gpu.memory_bandwidth > 1e11
        assert gpu.usd_per_hour is not None and gpu.usd_per_hour > 0
        assert gpu.rate_kind in ("on-demand", "spot", "unstated") and gpu.rate_source
        # a card AWS sells: one catalog's on-demand price and, beside it, its spot price; the two it does not
        # sell keep SPEC's implied rate, which does not say on-demand or spot
        aws = "AWS us-east-1 on-demand, SkyPilot catalog v8 (commit 00148f2a), read 2026-12-02, "
        spot = "AWS us-east-1 spot in use1-az6, SkyPilot catalog v8 (commit 00148f2a), read 2026-12-04, "
        if gpu.name in ("RTX4090", "A6000"):
            assert (gpu.rate_source, gpu.rate_kind, gpu.spot_usd_per_hour) == (
                "grpo-run's reference table, not a quote", "unstated", None)
        else:
            assert gpu.rate_kind == "on-demand" and gpu.rate_source.startswith(aws)
            assert gpu.spot_source.startswith(spot) and gpu.spot_source[len(spot):] == gpu.rate_source[len(aws):]
            assert 0 < gpu.spot_usd_per_hour < gpu.usd_per_hour
    assert [g.name for g in GPUS.values() if g.reference_step_seconds] == ["H100", "A100-80GB", "L40S", "RTX4090", "A6000"]


def test_skypilot_accelerators_come_from_the_table_for_every_accepted_name():
    assert SKYPILOT_GPUS["H100-SXM-80GB"] == SKYPILOT_GPUS["H100"] == "H100:1"
    assert SKYPILOT_GPUS["RTX-A6000"] == "A6000:1" and SKYPILOT_GPUS["L4"] == "L4:1"
    assert {v.split(":")[0] for v in SKYPILOT_GPUS.values()} == set(GPUS)


def test_a_card_outside_the_table_is_what_spec_pricing_says_or_the_slowest_listed_card():
    card = custom_gpu("RTX5090", usd_per_hour=0.9, memory_gb=32, bf16_tflops=209.5, memory_bandwidth_gbps=1792)
    assert (card.name, card.memory_gb, card.bf16_flops, card.memory_bandwidth, card.listed) == \
        ("RTX5090", 32, 209.5e12, 1792e9, False)
    bare = custom_gpu("X1", usd_per_hour=1.0, memory_gb=24)
    # the slowest cards with bf16 tensor cores, not a T4's FP32 rate: the L4's figures, both
    assert (bare.bf16_flops, bare.memory_bandwidth) == (GPUS["L4"].bf16_flops, GPUS["L4"].memory_bandwidth)
    assert GPUS["T4"].bf16_flops < bare.bf16_flops and not GPUS["T4"].bf16_tensor_cores
    assert cost_estimate(gpu=card, steps=3600, model_step_seconds=1.0).cost_to_completion_usd == 0.9


# --- evaluations --------------------------------------------------------------------------------


def test_evaluations_are_paid_for_on_top_of_the_steps_and_the_baseline_is_in_the_first_hold():
    plain = cost_estimate(gpu="H100", steps=1000, model_step_seconds=0.45, usd_per_hour=2.60)
    evals = cost_estimate(gpu="H100", steps=1000, model_step_seconds=0.45, eval_seconds=3600, baseline_seconds=1800,
                          usd_per_hour=2.60)
    assert (plain.cost_to_completion_usd, evals.cost_to_completion_usd) == (0.33, 2.93)  # $0.325 + $2.60
    assert (evals.training_usd, evals.eval_usd) == (0.33, 2.60)
    assert evals.first_hold_usd == 1.31      # half an hour of baseline + 25 steps: $1.30 + $0.008, up


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


def test_docs_job_md_lists_every_card_with_the_table_s_figures():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[3] / "docs" / "job.md").read_text()
    rows = {cells[0].strip("` "): cells for line in text.splitlines() if line.startswith("| `")
            for cells in [[c.strip() for c in line.strip("|").split("|")]] if cells[0].strip("` ") in GPUS}
    assert set(rows) == set(GPUS)
    for name, gpu in GPUS.items():
        aliases, memory, flops, bandwidth, rate = rows[name][1:6]
        assert aliases.replace("`", "").split(", ") == (list(gpu.aliases) or [""])
        assert float(memory) == gpu.memory_gb and float(flops.split()[0]) * 1e12 == gpu.bf16_flops
        assert float(bandwidth) * 1e12 == pytest.approx(gpu.memory_bandwidth) and float(rate) == gpu.usd_per_hour
        assert ("on-demand" in rows[name][6]) == (gpu.rate_kind == "on-demand")
