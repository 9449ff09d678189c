"""`grpo-run apply -f JOB --dry-run --compare [CLOUDS]`: which card, on which cloud, finishes the
job for the least money.

Every card of the table whose memory the job fits (the estimate's own memory model, card by card)
is priced on the shapes a user can rent (shapes.py): as many whole instances as the job's GPUs
need, at the instance's on-demand price and, where the source has a spot offer for that shape, its
spot price. The spot cost counts the preemptions `spec.pricing.preemptionsPerHour` states, each
costing the estimate's restart time (preemption.py: a spot node is preempted, an on-demand one is
not). A card is ranked by the cheaper of the two; the step times are the estimate's (the user's
measured runs, else the model of a step), so the ranking shows what SPEC §3 says of the reference
job: the fastest card is not the cheapest per step.

    compare(job, clouds=("aws", "gcp"))       the ranking as data (what -o yaml|json prints)
    compare_lines(name, compare(job))        the ranked table a person reads
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from grpo_run.runner.estimate.estimate import estimate
from grpo_run.runner.estimate.memory import USABLE_MEMORY_FRACTION
from grpo_run.runner.estimate.preemption import preemptions
from grpo_run.runner.estimate.shapes import CLOUDS, REGIONS, SOURCES, Rental, no_shape, rental
from grpo_run.runner.estimate.summary import duration
from grpo_run.runner.spec.gpus import GPUS
from grpo_run.runner.spec.hardware import Pricing
from grpo_run.runner.spec.job import TrainingJob

__all__ = ["compare", "compare_lines", "parse_clouds"]


def parse_clouds(value: str) -> tuple[str, ...]:
    """--compare's value: `all` (every cloud) or clouds separated by commas. Raises ValueError
    naming the flag and the clouds allowed."""
    if value == "all":
        return CLOUDS
    asked = tuple(dict.fromkeys(c.strip().lower() for c in value.split(",")))
    wrong = [c for c in asked if c not in CLOUDS]
    if wrong or not asked or "" in asked:
        raise ValueError(f"--compare {value!r}: unknown cloud {', '.join(repr(w) for w in wrong) or repr('')}; give "
                         f"{', '.join(CLOUDS)} (several separated by commas, e.g. --compare aws,gcp) or no value for all")
    return asked


def _variant(job: TrainingJob, card: str) -> TrainingJob:
    """`job` on `card`: spec.pricing keeps only what is not about spec.gpu (the notices and the
    restart time), since its rate, step time and card figures describe the card the job names."""
    pricing = job.pricing
    kept = {k: v for k, v in (("preemptionsPerHour", pricing and pricing.preemptionsPerHour),
                              ("restartSeconds", pricing and pricing.restartSeconds)) if v is not None}
    return job.model_copy(update={"gpu": card, "pricing": Pricing(**kept) if kept else None})


def _usd(seconds: float, per_hour: float) -> float:
    return float(Fraction(str(seconds)) * Fraction(str(per_hour)) / 3600)


def _row(est: dict[str, Any], rented: Rental, per_hour: float, judges: float, nodes: int) -> dict[str, Any]:
    """One card on one cloud: the estimate's times at the rented shape's prices, on each of `nodes`."""
    pre = est["preemption"]
    run = round(est["completionSeconds"] - pre["seconds"], 1)      # the estimate's time without its notices
    row: dict[str, Any] = {"gpu": est["gpu"], **rented.to_dict(), "nodes": nodes, "gpus": est["gpus"],
                           "stepSeconds": est["stepSeconds"], "stepSecondsSource": est["stepSecondsSource"],
                           "completionSeconds": run}
    on_demand = rented.on_demand * nodes if rented.on_demand is not None else None
    spot = rented.spot * nodes if rented.spot is not None else None
    if on_demand is not None:
        row["onDemandUSD"] = round(_usd(run, on_demand) + judges, 2)
    if spot is not None:
        found = preemptions(per_hour=per_hour, restart_s=pre["restartSeconds"], run_seconds=run, usd_per_hour=spot,
                            source=pre["restartSecondsSource"])
        row["preemption"] = found.to_dict()
        if found.restarts is not None:
            row["spotUSD"] = round(_usd(run, spot) + found.usd + judges, 2)
            row["spotSeconds"] = round(run + found.seconds, 1)
    priced = [(row[k], kind, rate) for k, kind, rate in (("spotUSD", "spot", spot), ("onDemandUSD", "on-demand", on_demand))
              if k in row]
    if priced:
        cost, kind, rate = min(priced, key=lambda p: p[0])
        row.update(costUSD=cost, pricedAt=kind, usdPerHour=rate,
                   usdPer1000Steps=round(_usd(est["stepSeconds"] * 1000, rate), 2))
    return row


def compare(job: TrainingJob, *, clouds: tuple[str, ...] = CLOUDS, sampler: str | None = None) -> dict[str, Any]:
    """The cards of the table that fit `job`, each on the smallest shape `clouds` rent of it,
    ranked by cost to completion (the module's docstring). Raises LookupError / ValueError as
    estimate() does (a model config it cannot find or read)."""
    from grpo_run.runner.spec.hardware import node_processes

    per_hour = (job.pricing.preemptionsPerHour or 0.0) if job.pricing else 0.0
    per_node = node_processes(job.resources)
    ranked, unfit, unpriced = [], [], []
    for name, card in GPUS.items():
        est = estimate(_variant(job, name), sampler=sampler)
        memory = est["memory"]
        if memory.get("fits") is False:
            unfit.append({"gpu": name, "neededGB": memory["neededGB"],
                          "usableGB": round(card.memory_gb * USABLE_MEMORY_FRACTION, 1)})
            continue
        judges = sum(j["usd"] for j in (est.get("judgeCalls") or {}).values() if j["usd"] is not None)
        for cloud in clouds:
            rented = rental(name, cloud, per_node)
            if rented is None:
                unpriced.append({"gpu": name, "cloud": cloud, "why": no_shape(name, cloud)})
                continue
            row = _row(est, rented, per_hour, judges, job.nodes or 1)
            (ranked if "costUSD" in row else unpriced).append(
                row if "costUSD" in row else {"gpu": name, "cloud": cloud,
                                              "why": "the shape has no price that finishes the run"})
    ranked.sort(key=lambda r: (r["costUSD"], r["completionSeconds"], r["gpu"], r["cloud"]))
    for i, row in enumerate(ranked, 1):
        row["rank"] = i
    out: dict[str, Any] = {"job": job.name, "clouds": list(clouds), "preemptionsPerHour": per_hour,
                           "gpusPerNode": per_node, "nodes": job.nodes or 1, "ranked": ranked,
                           "doNotFit": unfit, "notPriced": unpriced}
    point = _fastest_is_not_cheapest(ranked)
    if point:
        out["fastestVsCheapest"] = point
    return out


def _fastest_is_not_cheapest(ranked: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The fastest ranked card against the cheapest per step (SPEC §3's point), or None."""
    if not ranked:
        return None
    fastest = min(ranked, key=lambda r: (r["stepSeconds"], r["usdPer1000Steps"]))
    cheapest = min(ranked, key=lambda r: (r["usdPer1000Steps"], r["stepSeconds"]))
    same = fastest["gpu"] == cheapest["gpu"]
    return {"fastest": {k: fastest[k] for k in ("gpu", "cloud", "stepSeconds", "usdPer1000Steps")},
            "cheapestPerStep": {k: cheapest[k] for k in ("gpu", "cloud", "stepSeconds", "usdPer1000Steps")},
            "sameCard": same}


def _money(row: dict[str, Any], key: str) -> str:
    return f"${row[key]:.2f}" if key in row else "-"


def compare_lines(name: str, data: dict[str, Any]) -> str:
    """`data` (compare()) as the ranked table and a few lines under it."""
    rate = data["preemptionsPerHour"]
    lines = [f"{name}: the cards that fit, cheapest to completion first ({', '.join(data['clouds'])}; spot "
             + (f"with {rate:g} preemptions an hour (spec.pricing.preemptionsPerHour)" if rate else
                "with no preemptions counted: set spec.pricing.preemptionsPerHour") + ")"]
    head = ("rank", "gpu", "cloud", "instance", "rents", "s/step", "time", "on-demand", "spot", "$/1k steps")
    table = [head]
    for r in data["ranked"]:
        rents = f"{r['instances']}x{r['gpusPerInstance']}" + (f" ({r['idleGPUs']} idle)" if r["idleGPUs"] else "")
        spot = _money(r, "spotUSD") if "spotUSD" in r else ("no offer" if "spotUSDPerHour" not in r else "never ends")
        mark = lambda kind, text: text + ("*" if r["pricedAt"] == kind else "")    # noqa: E731
        table.append((str(r["rank"]), r["gpu"], r["cloud"], r["instance"], rents, f"{r['stepSeconds']:g}",
                      duration(r.get("spotSeconds", r["completionSeconds"]) if r["pricedAt"] == "spot"
                               else r["completionSeconds"]),
                      mark("on-demand", _money(r, "onDemandUSD")), mark("spot", spot), f"${r['usdPer1000Steps']:.2f}"))
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    lines.append("  * the price each card is ranked at; time includes the expected preemptions where spot is ranked")
    point = data.get("fastestVsCheapest")
    if point and not point["sameCard"]:
        f, c = point["fastest"], point["cheapestPerStep"]
        lines.append(f"  fastest     {f['gpu']} ({f['cloud']}, {f['stepSeconds']:g} s a step) is not the cheapest per step: "
                     f"${f['usdPer1000Steps']:.2f} per 1,000 steps against {c['gpu']}'s ${c['usdPer1000Steps']:.2f} "
                     f"({c['cloud']}, {c['stepSeconds']:g} s a step): {f['usdPer1000Steps'] / c['usdPer1000Steps']:.1f}x "
                     f"the cost per step, {c['stepSeconds'] / f['stepSeconds']:.1f}x faster")
    elif point:
        lines.append(f"  fastest     {point['fastest']['gpu']} is also the cheapest per step here")
    if data["doNotFit"]:
        lines.append("  do not fit  " + ", ".join(f"{u['gpu']} (needs {u['neededGB']:.1f} of {u['usableGB']:.1f} GB)"
                                                  for u in data["doNotFit"]))
    missing = _grouped(data["notPriced"])
    if missing:
        lines.append("  not priced  " + missing)
    used = [c for c in data["clouds"] if any(r["cloud"] == c for r in data["ranked"])]
    if used:                                     # the prices compared come from catalogs of different dates
        lines.append("  sources     " + "; ".join(f"{c}: {SOURCES[c]}, {REGIONS[c]}" for c in used)
                     + " (each row's: -o yaml)")
    return "\n".join(lines)


def _grouped(unpriced: list[dict[str, Any]]) -> str:
    """The cards with no price, by cloud: `aws: RTX4090, A6000; gcp: ...` (-o yaml says why each)."""
    by_cloud: dict[str, list[str]] = {}
    for u in sorted(unpriced, key=lambda u: CLOUDS.index(u["cloud"])):
        by_cloud.setdefault(u["cloud"], []).append(u["gpu"])
    return "; ".join(f"{cloud}: {', '.join(cards)}" for cloud, cards in by_cloud.items()) + \
        (" (why, each: -o yaml's notPriced)" if by_cloud else "")
