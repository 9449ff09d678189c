"""Prices for shapes a user can rent (issue 52 item 4): the smallest instance of each card on each
cloud with its own on-demand and spot price and their source; a single-GPU job is not priced at an
8-GPU instance's spot price divided by 8; where the shape it rents has no spot offer, the dry run
says so."""

from __future__ import annotations

from fractions import Fraction

import pytest

from grpo_run.runner.estimate.estimate import estimate
from grpo_run.runner.estimate.shapes import CLOUDS, SHAPES, no_shape, rental, shapes_of
from grpo_run.runner.estimate.summary import summary
from grpo_run.runner.spec.gpus import GPUS
from grpo_run.runner.spec.job import parse_job
from tests.runner.estimate.test_estimate_jobs import QWEN3_0_6B, doc, model_folder

REFERENCE = {"numGenerations": 4, "maxCompletionLength": 64, "maxSteps": 1000}


def test_every_shape_names_its_catalog_commit_region_and_the_day_it_was_read():
    for shape in SHAPES:
        assert shape.card in GPUS and shape.cloud in CLOUDS and shape.gpus >= 1
        assert "SkyPilot catalog v" in shape.source and "commit " in shape.source and "read 2026-12-" in shape.source
        assert shape.region in shape.source
        assert (shape.spot is None) == bool(shape.no_spot)


def test_the_table_s_per_gpu_prices_are_its_instances_divided_by_their_gpus():
    # runner/spec/gpus.py charges per GPU; the shapes it names are the same catalog rows, whole
    for card in GPUS.values():
        for shape in shapes_of(card.name, "aws"):
            if shape.spot is not None:            # the instance the table's rate comes from
                assert card.usd_per_hour == round(shape.on_demand / shape.gpus, 4)
                assert card.spot_usd_per_hour == round(shape.spot / shape.gpus, 4)
                assert shape.instance in card.rate_source


def test_a_single_h100_rents_a_p5_4xlarge_which_has_no_spot_offer_and_eight_rent_a_p5_48xlarge():
    one = rental("H100", "aws", 1)
    assert (one.shape.instance, one.shape.gpus, one.instances, one.on_demand, one.spot) == ("p5.4xlarge", 1, 1, 6.88, None)
    assert "SpotPrice for p5.4xlarge is empty in every us-east-1 zone" in one.shape.no_spot
    eight = rental("H100", "aws", 8)
    assert (eight.shape.instance, eight.instances, eight.spot, eight.fills) == ("p5.48xlarge", 1, 17.6289, True)
    sixteen = rental("H100", "aws", 16)             # more GPUs than the largest instance: as many as needed
    assert (sixteen.shape.instance, sixteen.instances, sixteen.on_demand) == ("p5.48xlarge", 2, 110.08)
    a100 = rental("A100", "aws", 1)                 # AWS sells A100s in eights only: seven idle
    assert (a100.shape.instance, a100.idle, a100.fills) == ("p4d.24xlarge", 7, False)


def test_gcp_instances_are_their_host_and_gpu_rows_added():
    h100 = rental("H100", "gcp", 1).shape
    assert h100.instance == "a3-highgpu-1g" and h100.region == "us-central1"
    assert Fraction(str(h100.on_demand)) == Fraction("1.18251") + Fraction("4.20076")
    assert Fraction(str(h100.spot)) == Fraction("0.36117") + Fraction("2.9926")
    l4 = rental("L4", "gcp", 1).shape
    assert (l4.instance, Fraction(str(l4.on_demand))) == ("g2-standard-4", Fraction("0.14679") + Fraction("0.56004"))


def test_azure_s_unusable_h100_rows_are_left_out_and_said():
    assert rental("H100", "azure", 1) is None and rental("RTX4090", "aws", 1) is None
    assert "12 GPUs" in no_shape("H100", "azure") and no_shape("H100", "azure").endswith(
        "spec.pricing.usdPerHour prices what you rent")
    assert rental("A100-80GB", "azure", 1).shape.instance == "Standard_NC24ads_A100_v4"


def test_an_unknown_cloud_is_refused_naming_the_field_and_the_clouds():
    with pytest.raises(ValueError, match=r"cloud: unknown cloud 'ibm'; use one of aws, gcp, azure"):
        rental("H100", "ibm", 1)


def _job(tmp_path, gpu: str, **spec):
    return parse_job(doc(model_folder(tmp_path, "qwen3-0.6b", QWEN3_0_6B), gpu=gpu, parameters=REFERENCE, **spec))


def test_a_one_gpu_h100_job_is_not_offered_the_8_gpu_instance_s_spot_price_and_the_estimate_says_why(tmp_path):
    est = estimate(_job(tmp_path, "H100"))
    assert "spot" not in est["rate"]                                     # was p5.48xlarge's $17.6289 / 8
    assert est["rate"]["noSpot"].startswith("p5.4xlarge (1 x H100, the smallest AWS shape for this job) has no spot offer")
    assert "p5.48xlarge (8 x H100) asks $17.6289/h spot" in est["rate"]["noSpot"]
    shape = est["shape"]
    assert (shape["instance"], shape["gpusPerInstance"], shape["cloud"], shape["region"], shape["onDemandUSDPerHour"],
            shape["instances"], shape["idleGPUs"]) == ("p5.4xlarge", 1, "aws", "us-east-1", 6.88, 1, 0)
    assert "spotUSDPerHour" not in shape and "commit 00148f2a" in shape["source"] and shape["noSpot"]
    text = summary("est", est)
    assert "\n  spot        none: p5.4xlarge (1 x H100" in text and "at $2.20/h" not in text


def test_eight_h100_processes_fill_the_p5_48xlarge_and_get_its_spot_price(tmp_path):
    est = estimate(_job(tmp_path, "H100", resources={"processes": 8}))
    assert est["shape"]["instance"] == "p5.48xlarge" and est["shape"]["idleGPUs"] == 0
    assert est["rate"]["spot"]["usdPerHour"] == round(8 * 2.2036, 4) and "p5.48xlarge / 8" in est["rate"]["spot"]["source"]
    assert "noSpot" not in est["rate"]


def test_a_one_gpu_a100_job_is_offered_the_whole_instance_s_spot_price_and_told_it_rents_eight(tmp_path):
    est = estimate(_job(tmp_path, "A100"))
    spot = est["rate"]["spot"]
    assert spot["usdPerHour"] == 7.8799                                  # the whole p4d.24xlarge, not / 8
    assert "the whole p4d.24xlarge (8 x A100, $7.8799/h) for this job's 1" in spot["source"]
    assert est["shape"]["idleGPUs"] == 7
    assert "  rents       1 x p4d.24xlarge (8 x A100 each, 7 idle: AWS rents no smaller A100 shape)" \
        in summary("est", est)


def test_a_user_s_own_rate_is_theirs_to_say_and_no_spot_note_is_added(tmp_path):
    est = estimate(_job(tmp_path, "H100", pricing={"usdPerHour": 2.2036}))
    assert est["usdPerHour"] == 2.2036 and "noSpot" not in est["rate"] and "spot" not in est["rate"]
    assert est["shape"]["instance"] == "p5.4xlarge"                      # still said: what the job rents


def test_a_card_one_instance_holds_keeps_the_table_s_spot_line(tmp_path):
    est = estimate(_job(tmp_path, "L40S"))
    assert est["rate"]["spot"]["usdPerHour"] == 1.0492 and est["shape"]["instance"] == "g6e.xlarge"


def test_each_node_of_a_job_rents_its_own_instance(tmp_path):
    est = estimate(_job(tmp_path, "A100", nodes=2))             # one process on each of 2 nodes
    assert (est["shape"]["instance"], est["shape"]["nodes"], est["gpus"]) == ("p4d.24xlarge", 2, 2)
    assert est["rate"]["spot"]["usdPerHour"] == round(2 * 7.8799, 4)          # two whole instances
