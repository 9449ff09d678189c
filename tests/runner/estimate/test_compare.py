"""`grpo-run apply -f JOB --dry-run --compare` (issue 52 item 4): the cards that fit the job,
ranked by cost to completion on the shapes each cloud rents, the expected preemptions counted at
the spot price, with SPEC §3's point in view (the fastest card is not the cheapest per step)."""

from __future__ import annotations

import json

import pytest
import yaml

from grpo_run.runner.cli.commands import EXIT_OK, EXIT_USAGE, main
from grpo_run.runner.estimate.compare import compare, compare_lines, parse_clouds
from grpo_run.runner.estimate.preemption import preemptions
from grpo_run.runner.spec.job import parse_job
from tests.runner.estimate.test_estimate_jobs import QWEN3_0_6B, QWEN3_8B, doc, dry_run, model_folder

REFERENCE = {"numGenerations": 4, "maxCompletionLength": 64, "maxSteps": 1000}


def _rows(data, gpu):
    return {r["cloud"]: r for r in data["ranked"] if r["gpu"] == gpu}


@pytest.fixture
def reference(tmp_path):
    """SPEC §2's reference job (Qwen3-0.6B, graph-coloring, G=4, 64 tokens), 1,000 steps."""
    model_folder(tmp_path, "qwen3-0.6b", QWEN3_0_6B)
    return lambda **spec: parse_job(doc(tmp_path / "qwen3-0.6b", gpu="H100", parameters=REFERENCE, **spec))


def test_the_ranking_is_by_cost_to_completion_and_keeps_spec_s_step_times(reference):
    data = compare(reference(), clouds=("aws", "gcp"))
    costs = [r["costUSD"] for r in data["ranked"]]
    assert costs == sorted(costs) and [r["rank"] for r in data["ranked"]] == list(range(1, len(costs) + 1))
    # SPEC §3's reference step times, through the same estimate as the dry run's
    assert {g: _rows(data, g)["aws"]["stepSeconds"] for g in ("H100", "A100-80GB", "L40S")} == \
        {"H100": 0.45, "A100-80GB": 0.7, "L40S": 1.0}
    for row in data["ranked"]:
        assert row["costUSD"] == min(row[k] for k in ("onDemandUSD", "spotUSD") if k in row)
        assert row["usdPer1000Steps"] == round(row["stepSeconds"] * 1000 * row["usdPerHour"] / 3600, 2)


def test_the_fastest_card_is_not_the_cheapest_per_step(reference):
    point = compare(reference(), clouds=("aws",))["fastestVsCheapest"]
    assert not point["sameCard"]
    assert point["fastest"]["stepSeconds"] < point["cheapestPerStep"]["stepSeconds"]
    assert point["fastest"]["usdPer1000Steps"] > point["cheapestPerStep"]["usdPer1000Steps"]


def test_a_single_h100_on_aws_is_priced_on_demand_since_its_shape_has_no_spot_offer(reference):
    h100 = _rows(compare(reference(), clouds=("aws", "gcp")), "H100")
    aws = h100["aws"]
    assert (aws["instance"], aws["pricedAt"], aws["onDemandUSD"]) == ("p5.4xlarge", "on-demand", 0.86)
    assert "spotUSD" not in aws and "SpotPrice for p5.4xlarge is empty" in aws["noSpot"]
    assert h100["gcp"]["instance"] == "a3-highgpu-1g" and h100["gcp"]["pricedAt"] == "spot"


def test_a_card_sold_in_eights_pays_for_eight(reference):
    a100 = _rows(compare(reference(), clouds=("aws",)), "A100")["aws"]
    assert (a100["instance"], a100["idleGPUs"]) == ("p4d.24xlarge", 7)
    seconds = a100["completionSeconds"]
    assert a100["onDemandUSD"] == round(seconds * 21.957642 / 3600, 2)      # the whole instance, not / 8


def test_the_spot_cost_counts_the_preemptions_the_job_states(reference):
    calm = _rows(compare(reference(), clouds=("aws",)), "L4")["aws"]
    rough = _rows(compare(reference(pricing={"preemptionsPerHour": 2}), clouds=("aws",)), "L4")["aws"]
    expected = preemptions(per_hour=2, restart_s=rough["preemption"]["restartSeconds"],
                           run_seconds=rough["completionSeconds"], usd_per_hour=0.3988)
    assert rough["preemption"] == expected.to_dict() and expected.restarts > 0
    assert rough["spotUSD"] == round(rough["completionSeconds"] * 0.3988 / 3600 + expected.usd, 2) > calm["spotUSD"]
    assert rough["onDemandUSD"] == calm["onDemandUSD"]                     # an on-demand node is not preempted


def test_only_cards_that_fit_are_ranked_and_the_rest_are_said(tmp_path):
    model_folder(tmp_path, "qwen3-8b", QWEN3_8B)
    job = parse_job(doc(tmp_path / "qwen3-8b", gpu="H100", parameters={**REFERENCE, "method": "Full"}))
    data = compare(job, clouds=("aws",))
    unfit = {u["gpu"] for u in data["doNotFit"]}
    assert {"T4", "L4", "A10G", "L40S", "H100"} <= unfit and not unfit & {r["gpu"] for r in data["ranked"]}
    assert {r["gpu"] for r in data["ranked"]} <= {"H200", "B200"}
    assert "do not fit  " in compare_lines("est", data)


def test_the_job_s_own_rate_and_card_figures_do_not_price_the_other_cards(reference):
    mine = compare(reference(pricing={"usdPerHour": 0.01, "stepSeconds": 9.0}), clouds=("aws",))
    plain = compare(reference(), clouds=("aws",))
    assert mine["ranked"] == plain["ranked"]


def test_cards_a_cloud_has_no_usable_price_for_are_said_not_ranked(reference):
    data = compare(reference(), clouds=("azure",))
    assert {r["gpu"] for r in data["ranked"]} == {"T4", "A100-80GB", "A100"}
    why = {u["gpu"]: u["why"] for u in data["notPriced"]}
    assert "Standard_ND96isr_H100_v5 with 12 GPUs" in why["H100"] and "H100 NVL" in why["H100"]
    assert why["L4"].startswith("SkyPilot catalog v6 azure/vms.csv (commit 098741e7) has no L4 row in eastus")
    assert "  not priced  azure: H100, H200, B200, L40S, L4, A10G, RTX4090, A6000" in compare_lines("est", data)


def test_unknown_clouds_are_refused_naming_the_flag():
    assert parse_clouds("all") == ("aws", "gcp", "azure") and parse_clouds("GCP, aws") == ("gcp", "aws")
    for bad in ("ibm", "aws,", ""):
        with pytest.raises(ValueError, match=r"^--compare .*: unknown cloud .*give aws, gcp, azure"):
            parse_clouds(bad)


# --- the command ---------------------------------------------------------------------------------

def _document(tmp_path):
    model_folder(tmp_path, "qwen3-0.6b", QWEN3_0_6B)
    return doc("./qwen3-0.6b", gpu="H100", parameters=REFERENCE)


def test_the_dry_run_prints_the_ranked_table_and_the_fastest_card_s_cost_per_step(capsys, tmp_path):
    rc, out, err = dry_run(capsys, tmp_path, _document(tmp_path), "--compare", "aws,gcp")
    assert rc == EXIT_OK, err
    lines = out.splitlines()
    assert lines[0].startswith("est: the cards that fit, cheapest to completion first (aws, gcp; spot with no "
                               "preemptions counted")
    assert lines[1].split() == ["rank", "gpu", "cloud", "instance", "rents", "s/step", "time", "on-demand", "spot",
                                "$/1k", "steps"]
    assert lines[2].split()[0] == "1"
    h100 = next(line for line in lines if " H100 " in line and " aws " in line)
    assert "p5.4xlarge" in h100 and "no offer" in h100 and "$0.86*" in h100
    assert any(line.startswith("  fastest     ") and "is not the cheapest per step" in line for line in lines)


def test_the_ranking_as_data_with_o_json_and_o_yaml(capsys, tmp_path):
    document = _document(tmp_path)
    rc, out, _ = dry_run(capsys, tmp_path, document, "--compare", "-o", "json")
    data = json.loads(out)["compare"]
    assert rc == EXIT_OK and data["clouds"] == ["aws", "gcp", "azure"] and data["ranked"][0]["rank"] == 1
    assert {"instance", "gpusPerInstance", "cloud", "region", "source", "costUSD"} <= set(data["ranked"][0])
    rc, out, _ = dry_run(capsys, tmp_path, document, "--compare", "gcp", "-o", "yaml")
    assert rc == EXIT_OK and {r["cloud"] for r in yaml.safe_load(out)["compare"]["ranked"]} == {"gcp"}


def test_bad_compare_flags_are_refused_naming_the_flag(capsys, tmp_path):
    document = _document(tmp_path)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(document))
    capsys.readouterr()
    assert main(["apply", "-f", str(path), "--compare"]) == EXIT_USAGE
    assert capsys.readouterr().err.startswith("error: --compare is for --dry-run")
    rc, _, err = dry_run(capsys, tmp_path, document, "--compare", "ibm")
    assert rc == EXIT_USAGE and err.startswith("error: --compare 'ibm': unknown cloud 'ibm'")
    rc, _, err = dry_run(capsys, tmp_path, document, "--compare", "--live")
    assert rc == EXIT_USAGE and "--compare ranks on the dated table's shapes" in err
    assert "Traceback" not in err


def test_a_job_on_several_nodes_rents_its_shape_on_each(tmp_path):
    model_folder(tmp_path, "qwen3-0.6b", QWEN3_0_6B)
    job = parse_job(doc(tmp_path / "qwen3-0.6b", gpu="H100", parameters={**REFERENCE, "promptsPerStep": 16},
                        nodes=2, resources={"processes": 8}))
    data = compare(job, clouds=("aws",))
    h100 = _rows(data, "H100")["aws"]
    assert (h100["instance"], h100["instances"], h100["nodes"], h100["gpus"]) == ("p5.48xlarge", 1, 2, 16)
    assert h100["onDemandUSD"] == round(h100["completionSeconds"] * 2 * 55.04 / 3600, 2)
    assert h100["spotUSD"] == round(h100["completionSeconds"] * 2 * 17.6289 / 3600, 2)


def test_a_spot_node_that_never_finishes_is_ranked_on_demand(reference):
    # a notice every 36 s against restarts of minutes: on spot the run never ends (preemption.py)
    l4 = _rows(compare(reference(pricing={"preemptionsPerHour": 100}), clouds=("aws",)), "L4")["aws"]
    assert l4["preemption"]["restarts"] is None and "spotUSD" not in l4
    assert (l4["pricedAt"], l4["costUSD"]) == ("on-demand", l4["onDemandUSD"])
