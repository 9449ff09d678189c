"""`grpo-run apply --dry-run --live [aws|azure|gcp]`: today's prices from the cloud's own price API,
in place of the dated table's, where this machine has the credentials and the network; otherwise
the table's, with a note saying why.

- aws: EC2's spot price history (boto3 `describe_spot_price_history`, Linux/UNIX, the current price
  in each zone of the region; the cheapest zone's is used and named). Needs AWS credentials. It
  gives spot prices only: the estimate goes on charging the table's on-demand price, and its spot
  line shows the live one.
- azure: the Retail Prices API (https://prices.azure.com/api/retail/prices, an OData $filter on the
  VM size, region and Consumption prices): Linux pay-as-you-go and Spot. No credentials needed.
- gcp: the Cloud Billing Catalog API (services/6F81-5844-456A/skus, Compute Engine): the GPU's own
  SKU, on-demand and Spot Preemptible, in the region. Needs an API key with the Cloud Billing API
  enabled, GRPO_RUN_GCP_API_KEY. Google prices the GPU apart from the VM it is attached to, so
  this is the GPU alone (AWS's and Azure's are whole instances divided by their GPUs).

Instances are named only where the table already names them (AWS: the instance its rate comes
from, runner/spec/gpus.py) or where the cloud's own documentation makes the card unambiguous (Azure's
ND and NCas_T4 sizes, Compute Engine's GPU names); a card without one is left at the table's price,
said so. The endpoints can be pointed elsewhere (GRPO_RUN_AZURE_PRICES_URL, GRPO_RUN_GCP_BILLING_URL;
botocore's AWS_ENDPOINT_URL_EC2), as the tests do at a local server with recorded answers.
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any

from grpo_run.runner.spec.gpus import Gpu

__all__ = ["AWS_INSTANCES", "AZURE_SIZES", "CLOUDS", "GCP_GPUS", "LiveUnavailable", "LivePrices"]

CLOUDS = ("aws", "azure", "gcp")
DEFAULT_REGIONS = {"aws": "us-east-1", "azure": "eastus", "gcp": "us-central1"}
TIMEOUT_S = 15.0
MAX_PAGES = 40                   # GCP's Compute Engine catalog is a few thousand SKUs: pages of up to 5,000

# The instances runner/spec/gpus.py prices each card from (its rate_source names them): (type, GPUs).
AWS_INSTANCES = {
    "H100": ("p5.48xlarge", 8), "H200": ("p5en.48xlarge", 8), "B200": ("p6-b200.48xlarge", 8),
    "A100-80GB": ("p4de.24xlarge", 8), "A100": ("p4d.24xlarge", 8), "L40S": ("g6e.xlarge", 1),
    "L4": ("g6.xlarge", 1), "A10G": ("g5.xlarge", 1), "T4": ("g4dn.xlarge", 1),
}
# Azure's VM sizes whose GPUs are these cards (Azure's ND H100 v5, ND H200 v5, ND A100 v4 / NDm A100
# v4 and NCasT4_v3 size pages): 8 SXM cards each, or one T4. Azure sells no L40S, L4, A10G or B200 size
# of one card type alone here (its A10 sizes are the A10, often a fraction of one).
AZURE_SIZES = {
    "H100": ("Standard_ND96isr_H100_v5", 8), "H200": ("Standard_ND96isr_H200_v5", 8),
    "A100-80GB": ("Standard_ND96amsr_A100_v4", 8), "A100": ("Standard_ND96asr_v4", 8),
    "T4": ("Standard_NC4as_T4_v3", 1),
}
# Compute Engine's GPU SKUs are described "Nvidia <model> GPU running in <place>" (older ones "Nvidia
# Tesla <model>", some "NVIDIA"), the Spot ones "Spot Preemptible Nvidia <model> GPU running in <place>"
# (usageType Preemptible); variants have words of their own ("H100 80GB Mega") and do not match.
GCP_GPUS = {
    "H100": "H100 80GB", "H200": "H200 141GB", "A100-80GB": "A100 80GB", "A100": "A100", "L4": "L4", "T4": "T4",
}
GCP_COMPUTE_SERVICE = "6F81-5844-456A"
AZURE_URL_ENV, GCP_URL_ENV, GCP_KEY_ENV = "GRPO_RUN_AZURE_PRICES_URL", "GRPO_RUN_GCP_BILLING_URL", "GRPO_RUN_GCP_API_KEY"


class LiveUnavailable(RuntimeError):
    """No live price here; the message says why (no credentials, no network, no such instance)."""


@dataclass(frozen=True)
class Quote:
    """One card's live prices per GPU-hour, and where they came from."""

    on_demand: float | None
    spot: float | None
    on_demand_source: str
    spot_source: str


def _now() -> str:
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


@dataclass
class LivePrices:
    """The --live choice: `cloud` (one of CLOUDS) and its `region` (DEFAULT_REGIONS' when None).
    `ec2` is the boto3 EC2 client to ask (made from the environment's credentials when None)."""

    cloud: str
    region: str | None = None
    ec2: Any = None

    def __post_init__(self) -> None:
        if self.cloud not in CLOUDS:
            raise ValueError(f"--live {self.cloud!r}: expected one of {', '.join(CLOUDS)}")
        if self.region is not None and not re.fullmatch(r"[a-z]{2,}(-[a-z0-9]+)*[0-9]?", self.region):
            raise ValueError(f"--live-region {self.region!r}: expected the cloud's own region name, e.g. "
                             f"{DEFAULT_REGIONS[self.cloud]} (lower-case letters, digits and dashes)")
        if self.region is None:
            env = (os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")) if self.cloud == "aws" else None
            self.region = env or DEFAULT_REGIONS[self.cloud]

    def instance_of(self, card: str) -> tuple[str, int] | None:
        """The instance this cloud's live price of `card` is a share of, and its GPUs: AWS's and
        Azure's are whole instances divided by their GPUs; GCP's GPU SKU is priced per GPU (None)."""
        return {"aws": AWS_INSTANCES, "azure": AZURE_SIZES}.get(self.cloud, {}).get(card)

    def __call__(self, card: Gpu) -> tuple[Gpu, str]:
        """`card` with today's prices where the API gives them, and the note that says which were
        used; the card as it is, and why, where it does not."""
        try:
            quote = {"aws": self._aws, "azure": self._azure, "gcp": self._gcp}[self.cloud](card)
        except LiveUnavailable as e:
            return card, f"--live {self.cloud}: {e}; the dated table's prices are used"
        priced = card
        used = []
        if quote.on_demand is not None:
            priced = replace(priced, usd_per_hour=quote.on_demand, rate_kind="on-demand",
                             rate_source=quote.on_demand_source)
            used.append(f"on-demand ${quote.on_demand:g}/h")
        if quote.spot is not None:
            priced = replace(priced, spot_usd_per_hour=quote.spot, spot_source=quote.spot_source)
            used.append(f"spot ${quote.spot:g}/h")
        elif quote.on_demand is not None:         # no spot price of this cloud: not the table's other cloud's beside it
            priced = replace(priced, spot_usd_per_hour=None, spot_source="")
            used.append("no spot price")
        kept = "" if quote.on_demand is not None else f"; the charged on-demand rate stays the table's ({card.rate_source})"
        return priced, f"--live {self.cloud}: {card.name} priced live in {self.region}, " + " and ".join(used) + kept

    # --- AWS ---------------------------------------------------------------------------------------

    def _aws(self, card: Gpu) -> Quote:
        if card.name not in AWS_INSTANCES or not card.listed:
            raise LiveUnavailable(f"the table names no AWS instance for {card.name}")
        instance, gpus = AWS_INSTANCES[card.name]
        client = self.ec2 if self.ec2 is not None else self._ec2_client()
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            answer = client.describe_spot_price_history(
                InstanceTypes=[instance], ProductDescriptions=["Linux/UNIX"],
                StartTime=datetime.now(timezone.utc), MaxResults=100)
        except ClientError as e:
            raise LiveUnavailable(f"EC2 refused describe_spot_price_history in {self.region} "
                                  f"({e.response.get('Error', {}).get('Code', 'error')})") from None
        except BotoCoreError as e:
            raise LiveUnavailable(f"EC2 in {self.region} could not be asked ({e})") from None
        newest: dict[str, dict] = {}
        for row in answer.get("SpotPriceHistory", []):
            zone = row.get("AvailabilityZoneId") or row["AvailabilityZone"]
            if row.get("InstanceType") == instance and (zone not in newest or row["Timestamp"] > newest[zone]["Timestamp"]):
                newest[zone] = row
        if not newest:
            raise LiveUnavailable(f"EC2 has no spot price for {instance} in {self.region}")
        zone, row = min(newest.items(), key=lambda z: float(z[1]["SpotPrice"]))
        prices = sorted(float(r["SpotPrice"]) for r in newest.values())
        per_gpu = round(float(row["SpotPrice"]) / gpus, 4)
        spread = f"; {len(prices)} zones ask ${prices[0]:g}-{prices[-1]:g}" if len(prices) > 1 else ""
        stamp = row["Timestamp"].astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        return Quote(None, per_gpu, "", f"AWS {self.region} spot in {zone}, EC2 spot price history (live, price of "
                                        f"{stamp}, read {_now()}), {instance}" + (f" / {gpus}" if gpus > 1 else "") + spread)

    def _ec2_client(self):
        import boto3
        from botocore.config import Config

        session = boto3.Session()
        if session.get_credentials() is None:
            raise LiveUnavailable("no AWS credentials here (EC2's spot price history needs them)")
        return session.client("ec2", region_name=self.region,
                              config=Config(connect_timeout=5, read_timeout=TIMEOUT_S, retries={"max_attempts": 2}))

    # --- Azure -------------------------------------------------------------------------------------

    def _azure(self, card: Gpu) -> Quote:
        if card.name not in AZURE_SIZES or not card.listed:
            raise LiveUnavailable(f"Azure sells no VM size of {card.name}s alone that this table maps")
        size, gpus = AZURE_SIZES[card.name]
        query = (f"serviceName eq 'Virtual Machines' and armRegionName eq '{self.region}' and "
                 f"armSkuName eq '{size}' and priceType eq 'Consumption'")
        url = os.environ.get(AZURE_URL_ENV, "https://prices.azure.com/api/retail/prices")
        url += "?" + urllib.parse.urlencode({"$filter": query})
        items: list[dict] = []
        for _ in range(MAX_PAGES):
            page = _get_json(url, "Azure's Retail Prices API")
            items += page.get("Items") or []
            url = page.get("NextPageLink")
            if not url:
                break
        linux = [i for i in items if i.get("armSkuName") == size and i.get("currencyCode", "USD") == "USD"
                 and "Windows" not in i.get("productName", "") and i.get("unitOfMeasure") == "1 Hour"
                 and "Low Priority" not in i.get("skuName", "")]
        spot = [i for i in linux if i.get("skuName", "").endswith(" Spot")]
        regular = [i for i in linux if not i.get("skuName", "").endswith(" Spot")]
        if not spot and not regular:
            raise LiveUnavailable(f"Azure's Retail Prices API lists no Linux price for {size} in {self.region}")

        def source(item: dict, kind: str) -> str:
            return (f"Azure {self.region} {kind}, Retail Prices API (live, effective "
                    f"{str(item.get('effectiveStartDate', '?'))[:10]}, read {_now()}), {size}"
                    + (f" / {gpus}" if gpus > 1 else ""))

        od = min(regular, key=lambda i: i["retailPrice"]) if regular else None
        sp = min(spot, key=lambda i: i["retailPrice"]) if spot else None
        return Quote(round(od["retailPrice"] / gpus, 4) if od else None, round(sp["retailPrice"] / gpus, 4) if sp else None,
                     source(od, "on-demand") if od else "", source(sp, "spot") if sp else "")

    # --- GCP ---------------------------------------------------------------------------------------

    def _gcp(self, card: Gpu) -> Quote:
        if card.name not in GCP_GPUS or not card.listed:
            raise LiveUnavailable(f"Compute Engine sells no {card.name}")
        key = os.environ.get(GCP_KEY_ENV)
        if not key:
            raise LiveUnavailable(f"no API key here: set {GCP_KEY_ENV} to a key with the Cloud Billing API enabled")
        model = GCP_GPUS[card.name]
        pattern = re.compile(rf"(Spot Preemptible )?Nvidia (?:Tesla )?{re.escape(model)} GPU running in .+", re.IGNORECASE)
        base = os.environ.get(GCP_URL_ENV, "https://cloudbilling.googleapis.com").rstrip("/")
        found: dict[str, tuple[float, str]] = {}
        token = ""
        for _ in range(MAX_PAGES):
            params = {"key": key, "currencyCode": "USD", "pageSize": 5000, **({"pageToken": token} if token else {})}
            page = _get_json(f"{base}/v1/services/{GCP_COMPUTE_SERVICE}/skus?{urllib.parse.urlencode(params)}",
                             "Google's Cloud Billing Catalog API")
            for sku in page.get("skus") or []:
                category = sku.get("category") or {}
                match = pattern.fullmatch(sku.get("description", ""))
                if not match or category.get("resourceGroup") != "GPU" or self.region not in sku.get("serviceRegions", []):
                    continue
                usage = category.get("usageType")
                kind = "spot" if usage == "Preemptible" and match.group(1) else "on-demand" if usage == "OnDemand" else None
                price = _gcp_hourly(sku)
                if kind and price is not None:
                    found[kind] = (price, sku.get("pricingInfo", [{}])[-1].get("effectiveTime", "?"))
            token = page.get("nextPageToken") or ""
            if not token:
                break
        if not found:
            raise LiveUnavailable(f"the Cloud Billing catalog lists no Nvidia {model} GPU in {self.region}")

        def source(kind: str) -> str:
            return (f"GCP {self.region} {kind}, Cloud Billing Catalog API (live, effective {found[kind][1][:10]}, read "
                    f"{_now()}), Nvidia {model} GPU alone (its VM's vCPUs and memory not included)")

        od, sp = found.get("on-demand"), found.get("spot")
        return Quote(od[0] if od else None, sp[0] if sp else None, source("on-demand") if od else "",
                     source("spot") if sp else "")


def _gcp_hourly(sku: dict) -> float | None:
    """A Cloud Billing SKU's price per hour (its newest pricingInfo's first tier: units + nanos)."""
    try:
        expression = sku["pricingInfo"][-1]["pricingExpression"]
        rate = expression["tieredRates"][0]["unitPrice"]
        price = int(rate.get("units") or 0) + int(rate.get("nanos") or 0) / 1e9
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    unit = expression.get("usageUnit")
    return round(price, 4) if unit == "h" else None


def _get_json(url: str, what: str) -> dict:
    """GET `url` as JSON; LiveUnavailable saying which API and why for any failure."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers={"Accept": "application/json"}),
                                    timeout=TIMEOUT_S) as answer:
            doc = json.loads(answer.read().decode("utf-8"))
    except urllib.error.HTTPError as e:
        raise LiveUnavailable(f"{what} answered HTTP {e.code}") from None
    except (urllib.error.URLError, OSError) as e:
        raise LiveUnavailable(f"{what} could not be reached ({getattr(e, 'reason', e)})") from None
    except (ValueError, UnicodeDecodeError):
        raise LiveUnavailable(f"{what} answered something that is not JSON") from None
    if not isinstance(doc, dict):
        raise LiveUnavailable(f"{what} answered JSON that is not an object")
    return doc
