"""`--live` (issue 38 item 2): today's prices from the cloud's own price API, tested on recorded
answers (tests/runner/data/liveprices/): AWS's through botocore's Stubber, which checks them against
EC2's service model; Azure's and Google's served by a real HTTP server on 127.0.0.1. Where an API
cannot be asked, the dated table's prices, with the reason."""

from __future__ import annotations

import json
import threading
import urllib.parse
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import boto3
import pytest
import yaml
from botocore.stub import ANY, Stubber

from grpo_run.runner.cli.commands import EXIT_OK, EXIT_USAGE, main
from grpo_run.runner.estimate.estimate import estimate
from grpo_run.runner.estimate.liveprices import AWS_INSTANCES, LivePrices
from grpo_run.runner.estimate.summary import summary
from grpo_run.runner.spec.gpus import GPUS, lookup_gpu
from grpo_run.runner.spec.job import parse_job
from tests.runner.estimate.test_estimate_jobs import QWEN3_0_6B, doc, model_folder

DATA = Path(__file__).parent / "data" / "liveprices"


def recorded(name: str) -> dict:
    return json.loads((DATA / name).read_text())


@pytest.fixture
def ec2():
    """An EC2 client that answers describe_spot_price_history with the recorded answer, and checks
    what it was asked."""
    client = boto3.client("ec2", region_name="us-east-1", aws_access_key_id="testing", aws_secret_access_key="testing")
    answer = recorded("aws-describe-spot-price-history.json")
    for row in answer["SpotPriceHistory"]:
        row["Timestamp"] = datetime.fromisoformat(row["Timestamp"])
    with Stubber(client) as stub:
        stub.add_response("describe_spot_price_history", answer,
                          {"InstanceTypes": ["p5.48xlarge"], "ProductDescriptions": ["Linux/UNIX"], "StartTime": ANY,
                           "MaxResults": 100})
        yield client
        stub.assert_no_pending_responses()


class PriceServer:
    """The recorded Azure and Google answers, served over HTTP on 127.0.0.1; `asked` keeps each
    request's path and query."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, dict[str, list[str]]]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:            # noqa: N802 (http.server's name)
                url = urllib.parse.urlsplit(self.path)
                query = urllib.parse.parse_qs(url.query)
                owner.asked.append((url.path, query))
                if url.path == "/api/retail/prices":
                    name = "azure-retail-prices-page2.json" if "$skip" in query else "azure-retail-prices-page1.json"
                elif url.path == "/v1/services/6F81-5844-456A/skus":
                    name = "gcp-skus-page2.json" if query.get("pageToken") == ["page-2"] else "gcp-skus-page1.json"
                else:
                    self.send_error(404)
                    return
                body = (DATA / name).read_text().replace("{base}", f"{owner.base}/api/retail/prices").encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def prices(monkeypatch):
    server = PriceServer()
    monkeypatch.setenv("GRPO_RUN_AZURE_PRICES_URL", f"{server.base}/api/retail/prices")
    monkeypatch.setenv("GRPO_RUN_GCP_BILLING_URL", server.base)
    yield server
    server.close()


def h100_job(tmp_path, **spec):
    return parse_job(doc(model_folder(tmp_path, "qwen3-0.6b", QWEN3_0_6B), gpu="H100",
                         parameters={"maxCompletionLength": 64, "maxSteps": 1000}, **spec))


def test_the_aws_instances_are_the_ones_the_table_prices_each_card_from():
    for name, (instance, gpus) in AWS_INSTANCES.items():
        assert GPUS[name].rate_source.endswith(f", {instance}" + (f" / {gpus}" if gpus > 1 else "")), name


def test_aws_spot_is_the_cheapest_zones_newest_price_per_gpu_and_the_on_demand_charge_stays(tmp_path, ec2):
    card, note = LivePrices("aws", "us-east-1", ec2=ec2)(lookup_gpu("H100"))
    # newest per zone: use1-az6 17.6289 (not its older 12.00), use1-az1 19.2531, use1-az4 55.04; / 8 GPUs
    assert card.spot_usd_per_hour == 2.2036 and card.usd_per_hour == 6.88 and card.rate_kind == "on-demand"
    assert card.spot_source.startswith("AWS us-east-1 spot in use1-az6, EC2 spot price history (live, price of "
                                       "2026-12-05T06:12:41Z, read ")
    assert card.spot_source.endswith("p5.48xlarge / 8; 3 zones ask $17.6289-55.04")
    assert note.startswith("--live aws: H100 priced live in us-east-1, spot $2.2036/h; the charged on-demand rate "
                           "stays the table's (AWS us-east-1 on-demand, SkyPilot catalog v8")


def test_the_estimate_and_the_dry_run_say_the_live_spot_price_they_used(tmp_path, ec2):
    # 8 processes fill the p5.48xlarge whose live spot price is quoted per GPU: they get it per GPU
    est = estimate(h100_job(tmp_path, resources={"processes": 8}), live=LivePrices("aws", "us-east-1", ec2=ec2))
    spot = est["rate"]["spot"]
    assert spot["usdPerHour"] == round(8 * 2.2036, 4) and "EC2 spot price history (live" in spot["source"]
    assert est["rate"]["kind"] == "on-demand" and est["livePrices"].startswith("--live aws: H100 priced live")
    lines = summary("est", est).splitlines()
    assert lines[1].startswith("  live        --live aws: H100 priced live in us-east-1, spot $2.2036/h")
    assert lines[2].startswith("  spot        $") and ("at $17.63/h (AWS us-east-1 spot in use1-az6, EC2 spot price "
                                                          "history (live, price of 2026-12-05T06:12:41Z") in lines[2]
    assert lines[2].endswith("spot prices move, on-demand is their ceiling): to budget at it, spec.pricing.usdPerHour: "
                             "2.2036")


def test_a_one_gpu_job_is_shown_the_whole_live_instance_s_spot_price_not_an_eighth(tmp_path, ec2):
    # issue 52 item 4: the live p5.48xlarge's spot / 8 is not an offer a 1-GPU job can take
    est = estimate(h100_job(tmp_path), live=LivePrices("aws", "us-east-1", ec2=ec2))
    spot = est["rate"]["spot"]
    assert spot["usdPerHour"] == 17.6288                      # 2.2036 x 8: the live quote's whole instance
    assert "the whole p5.48xlarge (8 x H100, $17.6288/h) for this job's 1" in spot["source"]
    assert "the smallest shape, p5.4xlarge (1 x H100), has no spot offer" in spot["source"]
    assert "more than the charged rate, which is this job's share of the instance" in summary("est", est)


def test_aws_without_credentials_or_refused_falls_back_to_the_table_saying_why(tmp_path, monkeypatch):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    h100 = lookup_gpu("H100")
    card, note = LivePrices("aws", "us-east-1")(h100)
    assert card == h100
    assert note == ("--live aws: no AWS credentials here (EC2's spot price history needs them); the dated table's "
                    "prices are used")
    client = boto3.client("ec2", region_name="us-east-1", aws_access_key_id="testing", aws_secret_access_key="testing")
    with Stubber(client) as stub:
        stub.add_client_error("describe_spot_price_history", "UnauthorizedOperation", http_status_code=403)
        card, note = LivePrices("aws", "us-east-1", ec2=client)(h100)
    assert card == h100 and "EC2 refused describe_spot_price_history in us-east-1 (UnauthorizedOperation)" in note
    card, note = LivePrices("aws", "us-east-1", ec2=client)(lookup_gpu("RTX4090"))     # AWS sells none
    assert "the table names no AWS instance for RTX4090" in note


def test_azure_prices_both_kinds_from_the_retail_api_across_its_pages(prices):
    card, note = LivePrices("azure", "eastus")(lookup_gpu("H100"))
    (first, filtered), (second, paged) = prices.asked
    assert first == second == "/api/retail/prices" and "$skip" in paged
    assert filtered["$filter"] == ["serviceName eq 'Virtual Machines' and armRegionName eq 'eastus' and armSkuName eq "
                                   "'Standard_ND96isr_H100_v5' and priceType eq 'Consumption'"]
    # Linux pay-as-you-go 98.32 / 8 (not Windows' 112.64), Spot 29.496 / 8 (not Low Priority's)
    assert (card.usd_per_hour, card.spot_usd_per_hour, card.rate_kind) == (12.29, 3.687, "on-demand")
    assert card.rate_source.startswith("Azure eastus on-demand, Retail Prices API (live, effective 2026-10-01, read ")
    assert card.spot_source.startswith("Azure eastus spot, Retail Prices API (live, effective 2026-12-03, read ")
    assert card.rate_source.endswith("Standard_ND96isr_H100_v5 / 8")
    assert note == "--live azure: H100 priced live in eastus, on-demand $12.29/h and spot $3.687/h"


def test_gcp_prices_the_gpu_sku_itself_and_needs_an_api_key(prices, monkeypatch):
    h100 = lookup_gpu("H100")
    monkeypatch.delenv("GRPO_RUN_GCP_API_KEY", raising=False)
    card, note = LivePrices("gcp")(h100)
    assert card == h100 and "no API key here: set GRPO_RUN_GCP_API_KEY" in note and not prices.asked
    monkeypatch.setenv("GRPO_RUN_GCP_API_KEY", "recorded-key")
    card, note = LivePrices("gcp", "us-central1")(h100)
    assert [q["key"] for _, q in prices.asked] == [["recorded-key"]] * 2        # both pages
    # "Nvidia H100 80GB GPU" 9.79608 and its Spot Preemptible 2.253; not the Mega GPU nor the commitment
    assert (card.usd_per_hour, card.spot_usd_per_hour) == (9.7961, 2.253)
    assert card.rate_source.startswith("GCP us-central1 on-demand, Cloud Billing Catalog API (live, effective "
                                       "2026-12-04, read ")
    assert card.rate_source.endswith("Nvidia H100 80GB GPU alone (its VM's vCPUs and memory not included)")
    assert "GCP us-central1 spot" in card.spot_source
    # an older "Nvidia Tesla" name, and no Spot SKU: no spot price beside it, not the table's AWS one
    card, note = LivePrices("gcp", "us-central1")(lookup_gpu("T4"))
    assert (card.usd_per_hour, card.spot_usd_per_hour, card.spot_source) == (0.35, None, "")
    assert note == "--live gcp: T4 priced live in us-central1, on-demand $0.35/h and no spot price"
    card, note = LivePrices("gcp", "europe-west4")(h100)          # no SKU of it there
    assert card == h100 and "lists no Nvidia H100 80GB GPU in europe-west4" in note


def test_the_dry_run_with_live_azure_names_the_price_it_charged(tmp_path, capsys, prices):
    model_folder(tmp_path, "qwen3-0.6b", QWEN3_0_6B)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc("./qwen3-0.6b", gpu="H100", parameters={"maxCompletionLength": 64,
                                                                               "maxSteps": 1000})))
    capsys.readouterr()
    assert main(["apply", "-f", str(path), "--dry-run", "--live", "azure"]) == EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("est on H100: $1.54 to completion, about 8 min (at $12.29/h, Azure eastus on-demand, "
                               "Retail Prices API (live, effective 2026-10-01, read ")
    assert lines[1] == "  live        --live azure: H100 priced live in eastus, on-demand $12.29/h and spot $3.687/h"
    # one GPU of Standard_ND96isr_H100_v5 is not for rent: the whole instance's spot price (3.687 x 8)
    assert lines[2].startswith("  spot        $3.70 at $29.50/h (Azure eastus spot, Retail Prices API (live")
    assert "the whole Standard_ND96isr_H100_v5 (8 x H100, $29.496/h) for this job's 1" in lines[2]
    assert main(["apply", "-f", str(path), "--dry-run", "--live", "azure", "-o", "yaml"]) == EXIT_OK
    rate = yaml.safe_load(capsys.readouterr().out)["status"]["estimate"]["rate"]
    assert rate["kind"] == "on-demand" and rate["source"].startswith("Azure eastus on-demand, Retail Prices API (live")


def test_live_is_refused_outside_a_dry_run_and_an_unknown_cloud_is_named(tmp_path, capsys):
    model_folder(tmp_path, "qwen3-0.6b", QWEN3_0_6B)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc("./qwen3-0.6b", gpu="H100")))
    capsys.readouterr()
    assert main(["apply", "-f", str(path), "--live", "azure"]) == EXIT_USAGE
    assert "--live is for --dry-run" in capsys.readouterr().err
    assert main(["apply", "-f", str(path), "--dry-run", "--live", "oracle"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "'oracle' is not one of 'aws', 'azure', 'gcp'" in err and "Traceback" not in err
    assert main(["apply", "-f", str(path), "--dry-run", "--live", "azure", "--live-region", "east us' or 1"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--live-region \"east us' or 1\": expected the cloud's own region name, e.g. eastus" in err
