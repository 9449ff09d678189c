"""The dry run's answer first: a few lines a person reads before deciding to spend money.

`grpo-run apply -f JOB --dry-run` prints this; `-o yaml|json` print the whole job with
`status.estimate` instead (SPEC §3, §6). Every figure here is a field of that estimate.
"""

from __future__ import annotations

from typing import Any

from grpo_run.runner.estimate.memory import USABLE_MEMORY_FRACTION
from grpo_run.runner.spec.gpus import STAND_IN

__all__ = ["budget_stop", "budget_warning", "duration", "summary"]

def duration(seconds: float) -> str:
    """`seconds` as a person says it: 40 s, 12 min, 3.2 h, 2.5 days."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def summary(name: str, est: dict[str, Any], *, job_file: str = "JOB.yaml", max_cost_usd: float | None = None) -> str:
    """The estimate `est` of job `name` in a few lines: cost to completion with evaluations,
    time, whether it fits and by how much, and where the step time came from."""
    memory = est["memory"]
    lines: list[str] = []
    if est.get("gpu") is None:
        lines.append(f"{name}: no spec.gpu, so no cost yet (set spec.gpu to a name such as H100, L4, A10G, or "
                     "describe your card with spec.pricing: {usdPerHour: ..., memoryGB: ...})")
        lines += [f"  live        {est['livePrices']}"] if est.get("livePrices") else []
        lines += _judge_lines(est)
        lines.append(f"  memory      needs about {memory['neededGB']:.1f} GB on the GPU")
    else:
        lines += _cost_lines(name, est, max_cost_usd)
        lines.append("  memory      " + _fit_line(est))
    lines.append(f"  everything: grpo-run apply -f {job_file} --dry-run -o yaml")
    return "\n".join(lines)


def _cost_lines(name: str, est: dict[str, Any], max_cost_usd: float | None) -> list[str]:
    gpu, gpus, steps = est["gpu"], est.get("gpus", 1), est["steps"]
    rate = est.get("rate") or {}
    on = f"{gpus} x {gpu}" if gpus > 1 else gpu
    if gpus > 1:
        on += " (one process each, a share of the prompts each)"
    lines = [f"{name} on {on}: ${est['costToCompletionUSD']:.2f} to completion, about "
             f"{duration(est['completionSeconds'])} (at ${est['usdPerHour']:.2f}/h, "
             + ("" if rate.get("kind") in ("on-demand", "spot") else "rate from ")    # the source names the kind
             + f"{rate.get('source') or 'the table'})"]
    if est.get("livePrices"):                   # which prices --live read, or why it fell back to the table
        lines.append(f"  live        {est['livePrices']}")
    spot = rate.get("spot")
    if rate.get("noSpot"):                      # the shape this job rents has no spot offer: said, not priced
        lines.append(f"  spot        none: {rate['noSpot']}")
    shape = est.get("shape") or {}
    if shape.get("idleGPUs"):                   # the per-GPU rate assumes a full instance; this job leaves some idle
        lines.append(f"  rents       {shape['instances']} x {shape['instance']} ({shape['gpusPerInstance']} x {gpu} each, "
                     f"{shape['idleGPUs']} idle: {shape['cloud'].upper()} rents no smaller {gpu} shape), "
                     + (f"${shape['onDemandUSDPerHour'] * shape['instances']:.2f}/h on demand, "
                        if "onDemandUSDPerHour" in shape else "")
                     + f"{shape['cloud'].upper()} {shape['region']}: "
                     + ("the charge above is all of it (`--dry-run --compare` ranks the clouds' shapes; "
                        "spec.pricing.usdPerHour charges what you pay a GPU where you rent one alone)"
                        if rate.get("wholeInstances") else f"the charge above is {gpus} GPU's share"))
    if spot:
        # a whole instance's spot price can exceed the charged rate, a per-GPU share of it: said so
        why = ("spot prices move, on-demand is their ceiling" if spot["usdPerHour"] <= est["usdPerHour"] else
               "more than the charged rate, which is this job's share of the instance: you rent all of it")
        lines.append(f"  spot        ${spot['costToCompletionUSD']:.2f} at ${spot['usdPerHour']:.2f}/h ({spot['source']}; "
                     f"{why}): to budget at it, spec.pricing.usdPerHour: {spot['usdPerHour'] / gpus:g}")
    lines.append(f"  training    {steps:,} steps x {est['stepSeconds']:g} s = {duration(est['stepSeconds'] * steps)}, "
                 f"${est['trainingUSD']:.2f}")
    evals, tasks = est.get("evaluations"), est.get("evalTasks")
    if tasks:
        lines.append(f"  evaluating  {evals} x {tasks:,} held-out tasks (baseline, "
                     + ("every evalSteps, " if evals > 2 else "") + f"final) = {duration(est['evalSeconds'])}, "
                     f"${est['evalUSD']:.2f}")
    else:
        lines.append(f"  evaluating  {evals} evaluations, not counted (held-out tasks unknown here)")
    lines += _preemption_lines(est)
    tokens, model = est.get("tokens") or {}, est.get("stepModel") or {}
    prompt = tokens.get("prompt")
    turns = tokens.get("turns")
    n = tokens.get("completion")
    replies = (f"{turns} replies x {n} token{'' if n == 1 else 's'} at most (the environment's answers not "
               f"counted)" if turns else f"{n} completion token{'' if n == 1 else 's'} at most")
    shape = f"{replies}, prompts ~{prompt:g} tokens" if prompt is not None else f"{replies}, prompts not counted"
    lines.append(f"  step time   {_source(est, gpu, model)} ({_modelled(est, model)}{shape})")
    if model and model.get("cardFigures", "").startswith("stand-in"):
        lines.append(f"  card        {gpu} is not in the table: the slowest listed figures with bf16 tensor cores stand "
                     f"in ({STAND_IN[0] / 1e12:g} TFLOP/s, {STAND_IN[1] / 1e12:g} TB/s), an upper bound; give yours as "
                     "spec.pricing.bf16TFLOPS and memoryBandwidthGBps")
    if est.get("engineStartSeconds"):
        lines.append(f"  vLLM start  {duration(est['engineStartSeconds'])} once, ${est['engineStartUSD']:.2f}")
    if model and model.get("cardNote"):
        lines.append(f"  card        {model['cardNote']}")
    lines += _judge_lines(est)
    if max_cost_usd is not None:
        stop = budget_stop(est, max_cost_usd)
        lines.append(f"  budget      maxCostUSD ${max_cost_usd:g}: " + ("covers it" if stop is None else
                     f"STOPS the run after about step {stop:,} of {steps:,}, before the final evaluation"))
    return lines


def _preemption_lines(est: dict[str, Any]) -> list[str]:
    """What spot notices add (status.estimate.preemption), or what one would cost when none are counted."""
    pre = est.get("preemption")
    if not pre:
        return []
    each = duration(pre["restartSeconds"])
    if pre["restartSecondsSource"] != "model":
        how = "spec.pricing.restartSeconds"
    else:
        from grpo_run.runner.estimate.preemption import parts_text

        how = parts_text(pre.get("parts") or [])
    if pre["restarts"] is None:
        return [f"  preemption  at {pre['perHour']:g} notices an hour, each restart ({each}) outlasts the time between "
                "them: the run would never finish (not in the total)"]
    if not pre["perHour"]:
        return [f"  preemption  none counted: each notice would cost about {each} ({how}), "
                f"${pre['restartSeconds'] * est['usdPerHour'] / 3600:.2f}; set spec.pricing.preemptionsPerHour to count them"]
    return [f"  preemption  {pre['restarts']:g} restarts expected at {pre['perHour']:g} an hour x {each} ({how}) = "
            f"{duration(pre['seconds'])}, ${pre['usd']:.2f} (in the total)"]


def budget_stop(est: dict[str, Any], max_cost_usd: float | None) -> int | None:
    """The step after which maxCostUSD stops the run, before its final evaluation; None when the
    budget covers the run (or there is no budget or no cost)."""
    if max_cost_usd is None or est.get("costToCompletionUSD") is None or est["costToCompletionUSD"] <= max_cost_usd:
        return None
    return est.get("budgetStopsAfterStep", est["steps"])


def budget_warning(name: str, est: dict[str, Any], max_cost_usd: float | None) -> str | None:
    """The line a dry run (and apply) cannot miss when maxCostUSD ends training early, or None."""
    stop = budget_stop(est, max_cost_usd)
    if stop is None:
        return None
    return (f"warning: {name}: maxCostUSD ${max_cost_usd:g} stops the run after about step {stop:,} of "
            f"{est['steps']:,} (BudgetExceeded): you pay ${max_cost_usd:g} and get no final held-out evaluation; "
            f"raise spec.maxCostUSD to ${est['costToCompletionUSD']:.2f} (the cost to completion) or lower "
            f"spec.parameters.maxSteps")


def _judge_lines(est: dict[str, Any]) -> list[str]:
    """One line per LLM judge: its calls to completion and, priced per call, their cost."""
    lines = []
    for name, judge in (est.get("judgeCalls") or {}).items():
        calls = f"{judge['calls']:,} calls" if judge["calls"] is not None else "calls not counted (held-out tasks unknown)"
        cost = (f", ${judge['usd']:.2f} (in the total)" if judge["usd"] is not None else
                ", not priced per call (see the note in -o yaml)")
        lines.append(f"  judge       {name}: {calls}{cost}")
    return lines


def _source(est: dict[str, Any], gpu: str, model: dict[str, Any]) -> str:
    """Where the step time came from, in words."""
    source = est["stepSecondsSource"]
    if source == "measured":
        runs = est.get("measuredRuns") or 0
        return (f"your one run of this model on {gpu}" if runs == 1 else
                f"the median of {runs} of your runs of this model on {gpu}")
    if source == "override":
        return "spec.pricing.stepSeconds"
    if source == "model":
        figures = model.get("cardFigures", "")
        card = (f"{gpu}'s datasheet figures" if figures.startswith("datasheet") else
                f"{gpu}'s figures in spec.pricing" if figures == "spec.pricing" else "stand-in figures")
        return f"modelled from the model's config and {card}"
    return f"{gpu}'s reference step time"


def _modelled(est: dict[str, Any], model: dict[str, Any]) -> str:
    """The model of a step's own figure, where it is not the step time shown."""
    if not model:
        return ""
    by = " by vLLM" if est.get("sampler") == "vllm" else ""
    if est["stepSecondsSource"] == "model":
        return f"{model['samplingShare']:.0%} of it sampling{by}; "
    return f"modelled: {model['seconds']:g} s, {model['samplingShare']:.0%} of it sampling{by}; "


def _fit_line(est: dict[str, Any]) -> str:
    scorers = est["memory"].get("rewardModelsGB") or 0.0
    line = _fit(est)
    shards = est["memory"].get("fsdpShards")
    engine = est["memory"].get("engine") or {}
    return ((f"per GPU (Full sharded over {shards} with FSDP): " if shards else "") + line
            + (f"; the reward models' weights are {scorers:.2f} GB of it" if scorers else "")
            + (f"; vLLM's share (gpuMemoryUtilization) is {engine['engineGB']:.1f} GB of it while sampling"
               if engine.get("engineGB") else "; vLLM samples on its server's GPU" if engine else ""))


def _fit(est: dict[str, Any]) -> str:
    memory = est["memory"]
    card_gb = est.get("gpuMemoryGB")
    need = memory["neededGB"]
    if card_gb is None or memory.get("fits") is None:
        return f"needs about {need:.1f} GB"
    usable = card_gb * USABLE_MEMORY_FRACTION
    if memory["fits"]:
        return (f"fits: needs about {need:.1f} GB of {usable:.1f} GB usable ({USABLE_MEMORY_FRACTION:.0%} of "
                f"{card_gb:g} GB), {usable - need:.1f} GB to spare")
    return (f"does NOT fit: needs about {need:.1f} GB, {usable:.1f} GB usable ({USABLE_MEMORY_FRACTION:.0%} of "
            f"{card_gb:g} GB): {need - usable:.1f} GB short (what would fit is below)")
