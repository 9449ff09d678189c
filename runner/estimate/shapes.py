"""The shapes a user can rent: for each card and cloud, the instance types that carry it, how many
GPUs each has, and the instance's own on-demand and spot price, with where each figure was read.

runner/spec/gpus.py charges a rate per GPU (AWS's p5.48xlarge divided by 8 for an H100). A job
rents whole instances, though: a single-GPU job on a card AWS sells only in 8-GPU instances pays
for eight, and the 8-GPU instance's spot price divided by 8 is not an offer it can take when the
1-GPU instance has none. This table says what is rentable, so that the estimate and
`apply --dry-run --compare` price the instances a job would actually run on (runner/estimate/compare.py).

Sources. Every figure below is a row of SkyPilot's catalog (github.com/skypilot-org/skypilot-catalog),
read through a stored copy of the repository at the commit named:
- AWS: catalogs/v8/aws/vms.csv at commit 00148f2a, region us-east-1, spot in zone use1-az6
  (the zone the table's other spot prices come from). Price is the on-demand price, SpotPrice the
  zone's spot price; an empty SpotPrice is no spot offer. p5.4xlarge (1 x H100) has an empty
  SpotPrice in every us-east-1 zone of that file (use1-az1 to use1-az6) and in us-east-2 and
  us-west-2: no spot offer. p5en.48xlarge, p6-b200.48xlarge, p4de.24xlarge and p4d.24xlarge are
  the only instance types of their cards in that file (8 GPUs each).
- GCP: catalogs/v8/gcp/vms.csv at commit 006059e0, region us-central1 (zone us-central1-a; the
  H200's and B200's only zone there, us-central1-b). Google prices a VM's host (its vCPUs and
  memory: the row of the machine type, no accelerator) apart from its GPUs (a row with no machine
  type and the accelerator and count): an instance's price is the two added, as SkyPilot adds them.
  g2-standard-4 = host $0.14679 (spot $0.05874) + 1 x L4 $0.56004 ($0.2231); a2-highgpu-1g =
  host $0.73948 ($0.36975) + 1 x A100 $2.93391 ($1.4341); a2-ultragpu-1g = host $1.09962
  ($0.54978) + 1 x A100-80GB $1.8462 ($1.964: that file asks more for the spot GPU than the
  on-demand one there); a3-highgpu-1g = host $1.18251 ($0.36117) + 1 x H100 $4.20076 ($2.9926;
  the same file asks $9.79655 for it in us-east4: dated prices for one card differ 2-3x between
  sources and regions); a3-ultragpu-8g = host $12.266 ($3.74713) + 8 x H200 $74.49392
  ($37.2472); a4-highgpu-8g = host $0.0 ($0.0, as the file gives it) + 8 x B200 $90.216
  ($32.6064). GCP attaches T4s to an N1 machine the user chooses: no one shape, not priced here.
- Azure: catalogs/v6/azure/vms.csv at commit 098741e7, region eastus: the only Azure catalog the
  stored copy has (v6, an older schema than the v8 files above; its date is that commit's, not
  read here). Standard_NC4as_T4_v3 (1 x T4) $0.526, spot $0.062699; Standard_NC24ads_A100_v4
  (1 x A100 80 GB, the PCIe card, which SkyPilot names A100-80GB) $3.673, spot $0.444433;
  Standard_ND96asr_v4 (8 x A100) $27.197, spot $2.99167. Its H100 rows are not used: it lists
  Standard_ND96isr_H100_v5 with 12 GPUs (Azure's ND H100 v5 has 8) and spot equal to on-demand,
  and Standard_NC40ads_H100_v5 carries the H100 NVL (94 GB), another card. The L40S, L4, A10G,
  H200 and B200 have no row there (Azure's A10 sizes are the A10).
A card or cloud without a row here has no price: the estimate and --compare say so, and
spec.pricing.usdPerHour prices what you rent.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

__all__ = ["CLOUDS", "REGIONS", "SHAPES", "SOURCES", "Rental", "Shape", "no_shape", "rental", "shapes_of",
           "whole_on_demand"]

CLOUDS = ("aws", "gcp", "azure")
REGIONS = {"aws": "us-east-1", "gcp": "us-central1", "azure": "eastus"}

_AWS = "SkyPilot catalog v8 aws/vms.csv (commit 00148f2a)"
_GCP = "SkyPilot catalog v8 gcp/vms.csv (commit 006059e0)"
_AZURE = "SkyPilot catalog v6 azure/vms.csv (commit 098741e7)"
SOURCES = {"aws": _AWS, "gcp": _GCP, "azure": _AZURE}   # each cloud's catalog file


@dataclass(frozen=True)
class Shape:
    """One instance type carrying `gpus` of `card`, priced per instance-hour in `region`."""

    card: str
    cloud: str
    region: str
    instance: str
    gpus: int                         # GPUs per instance
    on_demand: float | None           # USD per instance-hour; None: no sourced price
    spot: float | None                # USD per instance-hour; None: no spot offer in the source
    source: str                       # the catalog file, commit, zone and the day it was read
    no_spot: str = ""                 # why spot is None, as the source says it

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"cloud": self.cloud, "region": self.region, "instance": self.instance,
                               "gpusPerInstance": self.gpus}
        if self.on_demand is not None:
            out["onDemandUSDPerHour"] = self.on_demand
        if self.spot is not None:
            out["spotUSDPerHour"] = self.spot
        out["source"] = self.source
        if self.spot is None:
            out["noSpot"] = self.no_spot
        return out


def _gcp(host: str, gpu: str) -> float:
    """A GCP instance's price: its host's and its GPU's, added exactly (the module's docstring)."""
    return float(Fraction(host) + Fraction(gpu))


_AWS_READ = f"{_AWS}, us-east-1"
_AWS_SPOT = "spot in use1-az6"
_NO_SPOT_P5 = ("no spot offer: the catalog's SpotPrice for p5.4xlarge is empty in every us-east-1 zone "
               f"({_AWS}, read 2026-12-07)")

SHAPES: tuple[Shape, ...] = (
    # AWS, us-east-1: the on-demand prices read 2026-12-02, the spot prices 2026-12-04 (runner/spec/gpus.py)
    Shape("H100", "aws", "us-east-1", "p5.4xlarge", 1, 6.88, None, f"{_AWS_READ}, read 2026-12-07", _NO_SPOT_P5),
    Shape("H100", "aws", "us-east-1", "p5.48xlarge", 8, 55.04, 17.6289,
          f"{_AWS_READ}, {_AWS_SPOT}, read 2026-12-04"),
    Shape("H200", "aws", "us-east-1", "p5en.48xlarge", 8, 63.296, 16.5551, f"{_AWS_READ}, {_AWS_SPOT}, read 2026-12-04"),
    Shape("B200", "aws", "us-east-1", "p6-b200.48xlarge", 8, 113.9328, 21.0148,
          f"{_AWS_READ}, {_AWS_SPOT}, read 2026-12-04"),
    Shape("A100-80GB", "aws", "us-east-1", "p4de.24xlarge", 8, 27.44705, 8.6505,
          f"{_AWS_READ}, {_AWS_SPOT}, read 2026-12-04"),
    Shape("A100", "aws", "us-east-1", "p4d.24xlarge", 8, 21.957642, 7.8799, f"{_AWS_READ}, {_AWS_SPOT}, read 2026-12-04"),
    Shape("L40S", "aws", "us-east-1", "g6e.xlarge", 1, 1.861, 1.0492, f"{_AWS_READ}, {_AWS_SPOT}, read 2026-12-04"),
    Shape("L4", "aws", "us-east-1", "g6.xlarge", 1, 0.8048, 0.3988, f"{_AWS_READ}, {_AWS_SPOT}, read 2026-12-04"),
    Shape("A10G", "aws", "us-east-1", "g5.xlarge", 1, 1.006, 0.4364, f"{_AWS_READ}, {_AWS_SPOT}, read 2026-12-04"),
    Shape("T4", "aws", "us-east-1", "g4dn.xlarge", 1, 0.526, 0.2043, f"{_AWS_READ}, {_AWS_SPOT}, read 2026-12-04"),
    # GCP, us-central1-a, read 2026-12-07: host + GPU (the module's docstring)
    Shape("A100", "gcp", "us-central1", "a2-highgpu-1g", 1, _gcp("0.73948", "2.93391"), _gcp("0.36975", "1.4341"),
          f"{_GCP}, us-central1-a, host + GPU rows, read 2026-12-07"),
    Shape("A100-80GB", "gcp", "us-central1", "a2-ultragpu-1g", 1, _gcp("1.09962", "1.8462"), _gcp("0.54978", "1.964"),
          f"{_GCP}, us-central1-a, host + GPU rows, read 2026-12-07"),
    Shape("H100", "gcp", "us-central1", "a3-highgpu-1g", 1, _gcp("1.18251", "4.20076"), _gcp("0.36117", "2.9926"),
          f"{_GCP}, us-central1-a, host + GPU rows, read 2026-12-07"),
    Shape("L4", "gcp", "us-central1", "g2-standard-4", 1, _gcp("0.14679", "0.56004"), _gcp("0.05874", "0.2231"),
          f"{_GCP}, us-central1-a, host + GPU rows, read 2026-12-07"),
    Shape("H200", "gcp", "us-central1", "a3-ultragpu-8g", 8, _gcp("12.266", "74.49392"), _gcp("3.74713", "37.2472"),
          f"{_GCP}, us-central1-b, host + GPU rows, read 2026-12-07"),
    Shape("B200", "gcp", "us-central1", "a4-highgpu-8g", 8, _gcp("0.0", "90.216"), _gcp("0.0", "32.6064"),
          f"{_GCP}, us-central1-b, host + GPU rows (the host's row is $0.0), read 2026-12-07"),
    # Azure, eastus, read 2026-12-07 (the module's docstring: v6, the only Azure catalog there)
    Shape("T4", "azure", "eastus", "Standard_NC4as_T4_v3", 1, 0.526, 0.062699, f"{_AZURE}, eastus, read 2026-12-07"),
    Shape("A100-80GB", "azure", "eastus", "Standard_NC24ads_A100_v4", 1, 3.673, 0.444433,
          f"{_AZURE}, eastus, the A100 80 GB PCIe, read 2026-12-07"),
    Shape("A100", "azure", "eastus", "Standard_ND96asr_v4", 8, 27.197, 2.99167, f"{_AZURE}, eastus, read 2026-12-07"),
)

# Why a card has no shape on a cloud, where the source says more than "no row".
_WHY_NOT = {
    ("H100", "azure"): (f"{_AZURE} lists Standard_ND96isr_H100_v5 with 12 GPUs (Azure's ND H100 v5 has 8) and spot "
                        "equal to on-demand, and Standard_NC40ads_H100_v5 carries the H100 NVL (94 GB), another card: "
                        "no Azure H100 price here; `--live azure` asks Azure's Retail Prices API"),
    ("T4", "gcp"): "GCP attaches T4s to an N1 machine you choose: no one shape, no price here",
}


def shapes_of(card: str, cloud: str) -> list[Shape]:
    """The table's shapes of `card` on `cloud`, fewest GPUs first."""
    return sorted((s for s in SHAPES if s.card == card and s.cloud == cloud), key=lambda s: s.gpus)


def no_shape(card: str, cloud: str) -> str:
    """Why `card` has no price on `cloud` here, in words for the dry run."""
    why = _WHY_NOT.get((card, cloud)) or f"{SOURCES[cloud]} has no {card} row in {REGIONS[cloud]}"
    return f"{why}; spec.pricing.usdPerHour prices what you rent"


@dataclass(frozen=True)
class Rental:
    """What a job of `gpus` GPUs on one node rents: `instances` of `shape`."""

    shape: Shape
    gpus: int                         # the job's GPUs on the node
    instances: int

    @property
    def idle(self) -> int:
        """GPUs rented and not used."""
        return self.instances * self.shape.gpus - self.gpus

    @property
    def on_demand(self) -> float | None:
        return None if self.shape.on_demand is None else float(Fraction(str(self.shape.on_demand)) * self.instances)

    @property
    def spot(self) -> float | None:
        return None if self.shape.spot is None else float(Fraction(str(self.shape.spot)) * self.instances)

    @property
    def fills(self) -> bool:
        """Whether the job uses every GPU it rents (then the per-GPU price is what it pays)."""
        return self.idle == 0

    def to_dict(self) -> dict[str, Any]:
        return {**self.shape.to_dict(), "instances": self.instances, "idleGPUs": self.idle}


def rental(card: str, cloud: str, gpus: int = 1) -> Rental | None:
    """The smallest rentable shape of `card` on `cloud` for `gpus` GPUs on one node: the instance
    with the fewest GPUs that holds them all, else as many of the largest as they need; None when
    the table has no shape of it there."""
    if cloud not in CLOUDS:
        raise ValueError(f"cloud: unknown cloud {cloud!r}; use one of {', '.join(CLOUDS)}")
    found = shapes_of(card, cloud)
    if not found:
        return None
    fitting = [s for s in found if s.gpus >= gpus]
    if fitting:
        return Rental(fitting[0], gpus, 1)
    largest = found[-1]
    return Rental(largest, gpus, -(-gpus // largest.gpus))


def whole_on_demand(card: str, gpus: int, nodes: int = 1) -> tuple[float, str] | None:
    """What a job of `gpus` GPUs on each of `nodes` nodes pays an hour on demand where AWS's
    smallest shape for it leaves GPUs idle (a 1-GPU A100 job rents a whole p4d.24xlarge): the
    whole instances' price, and where it was read. None when the job fills what it rents (the
    table's per-GPU rate, runner/spec/gpus.py, is then what it pays) or no AWS shape is listed.
    The estimate charges it and the cost ledger counts it, so that maxCostUSD guards the bill."""
    rented = rental(card, "aws", gpus)
    if rented is None or rented.fills or rented.on_demand is None:
        return None
    shape = rented.shape
    usd = float(Fraction(str(shape.on_demand)) * rented.instances * nodes)
    return usd, (f"{shape.source}, the whole {shape.instance} ({shape.gpus} x {card}, ${shape.on_demand:g}/h) for "
                 f"this job's {gpus}{' a node' if nodes > 1 else ''}: AWS rents no smaller {card} shape")
