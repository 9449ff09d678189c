"""`status.estimate` for `grpo-run apply --dry-run` (SPEC §3, §6): what a job will cost, how
long it will take and whether it fits its GPU, before anything is spent.

The numbers come from `memory.py` (memory from the model's config.json alone), `steptime.py`
(a step's and an evaluation's time from the job and the card), `workload.py` (prompt lengths
and held-out tasks), `measured.py` (the user's own step times), `preemption.py` (what notices
add), `liveprices.py` (`--live`) and `runner.spec.gpus` (the cards, the cost arithmetic), the model's
config.json found by `config.py`. This module shapes the answer:

    estimate(job)                            the status.estimate dict
    check_fits(estimate(job))                None, or the refusal to print before anything starts
    record_measured_step_seconds(gpu, s, job, model=, completion_length=)
                                             after a finished run: keep its step time (this
                                             node's job records are read as they are)
    summary.summary(job, estimate(job))      the dry run's answer in a few lines
"""

from __future__ import annotations

import logging
import statistics
from fractions import Fraction
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

from grpo_run.runner.estimate.config import model_config, reward_model_configs
from grpo_run.runner.estimate.measured import (MEASURED_WINDOW, MIN_STEPS, completion_bucket, measured_runs,
                                               measured_start_seconds, measured_step_seconds, measured_steps_path,
                                               record_measured_step_seconds)
from grpo_run.runner.estimate.memory import USABLE_MEMORY_FRACTION, memory_estimate, model_shape
from grpo_run.runner.estimate.preemption import count_preemptions
from grpo_run.runner.estimate.shapes import Rental, rental, shapes_of, whole_on_demand
from grpo_run.runner.estimate.steptime import StepWork, eval_seconds, step_time
from grpo_run.runner.estimate.workload import workload
from grpo_run.runner.spec.gpus import GPUS, STAND_IN, Gpu, canonical_name, cost_estimate, custom_gpu, lookup_gpu
from grpo_run.runner.spec.environment import DEFAULT_MAX_TURNS
from grpo_run.runner.spec.job import TrainingJob

log = logging.getLogger(__name__)

__all__ = [
    "MEASURED_WINDOW",
    "card_of",
    "check_fits",
    "estimate",
    "measured_step_seconds",
    "measured_steps_path",
    "record_measured_step_seconds",
]


# --- the estimate -------------------------------------------------------------------------------


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


def _iso(t: datetime) -> str:
    return t.astimezone(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _figures(x: float) -> float:
    """`x` to three significant figures: as precise as the model is, and what the cost is
    computed from, so the printed step time times the steps is the printed cost."""
    return float(f"{x:.3g}")


def card_of(job: TrainingJob) -> Gpu | None:
    """The job's GPU: the table's entry for spec.gpu with any figures spec.pricing gives over
    it, or the card spec.pricing describes when the table does not list it (the job's
    validation makes sure one of them exists); None without spec.gpu."""
    if job.gpu is None:
        return None
    pricing = job.pricing
    if canonical_name(job.gpu) is None:
        if pricing is None or pricing.usdPerHour is None or pricing.memoryGB is None:
            lookup_gpu(job.gpu)                     # raises, naming what is allowed
        return custom_gpu(job.gpu, usd_per_hour=pricing.usdPerHour, memory_gb=pricing.memoryGB,
                          bf16_tflops=pricing.bf16TFLOPS, memory_bandwidth_gbps=pricing.memoryBandwidthGBps)
    card = lookup_gpu(job.gpu)
    if pricing is None:
        return card
    return replace(card, memory_gb=pricing.memoryGB or card.memory_gb,
                   bf16_flops=pricing.bf16TFLOPS * 1e12 if pricing.bf16TFLOPS else card.bf16_flops,
                   memory_bandwidth=(pricing.memoryBandwidthGBps * 1e9 if pricing.memoryBandwidthGBps
                                     else card.memory_bandwidth))


# vLLM's start-up before its first sample, until the user's own runs measured it (measured.py):
# 34 s to initialise the engine and 59 s to its first answer, for a 3.4 GiB model with a warm
# compile cache (vllm-project/vllm#20264); a cold compile cache takes longer.
VLLM_START_SECONDS = 60.0


def estimate(job: TrainingJob, *, now: datetime | None = None, sampler: str | None = None,
             live=None) -> dict[str, Any]:
    """`status.estimate` for `job` (SPEC §6 names, and more), from the model's config alone.

    Cost needs `spec.gpu`; without it the cost fields are None and `note` says so, and
    `memory.fits` is None. Step time: `spec.pricing.stepSeconds` ("override"), else the median of
    the user's measured runs of this model on this GPU with completions of this length bucket,
    running ones on this node included ("measured", `measuredRuns` of them; measured.py), else the model of a step ("model", steptime.py). Evaluations (baseline, every
    evalSteps, final) are counted in `evalSeconds`, `evalUSD` and the cost to completion. The
    rate is `spec.pricing.usdPerHour` or the table's; `live` (liveprices.LivePrices, `--live`) puts
    today's prices from the cloud's own API in place of the table's, its note saying which.

    `sampler`: the engine that samples (native | vllm; runner.jobs.preflight.sampler_choice), None for
    what the job names (auto counts as native). vLLM colocated shares the card (memory.engine) and
    starts once (VLLM_START_SECONDS, or the user's measured start-ups); its sampling has its own
    step model (steptime.VLLM_PASS_SECONDS) and its own measured runs.

    Raises LookupError when the model's config cannot be found (see `model_config`); ValueError
    for a config the estimate cannot read (missing keys, mixture-of-experts) or a LoRA target
    module it does not know.
    """
    from grpo_run.runner.spec.hardware import node_processes

    p = job.parameters
    engine = sampler or ("vllm" if p.sampler == "vllm" else "native")
    nodes = job.nodes or 1
    gpus = node_processes(job.resources) * nodes  # one process per GPU: an adapter replicated (DDP), Full sharded (FSDP)
    prompts = -(-p.promptsPerStep // gpus)         # per GPU: each samples its share of the prompts
    card = card_of(job)
    live_note = None
    if live is not None and card is not None:
        card, live_note = live(card)
    elif live is not None:
        live_note = f"--live {live.cloud}: the job names no spec.gpu, so there is no card to price"
    config = model_config(job.model)
    scorer_configs = reward_model_configs(job)
    targets = p.lora.targetModules
    env = job.environment
    episodes = env.plays_episodes
    turns = (env.maxTurns or DEFAULT_MAX_TURNS) if episodes else 1
    memory = memory_estimate(
        config,
        method=p.method,
        lora_r=p.lora.r,
        lora_targets=(targets,) if isinstance(targets, str) else targets,  # "all-linear": all 7
        beta=p.beta,
        # kvCacheGB is one group: numGenerations x maxCompletionLength tokens; prompt tokens are
        # left out of memory, as SPEC §3 counts it.
        num_generations=p.numGenerations,
        # an episode's replies are one sequence: up to maxTurns x maxCompletionLength sampled
        # tokens (the environment's observations not counted: their length is the environment's)
        max_completion_length=p.maxCompletionLength * turns,
        prompts_per_step=prompts,
        micro_batch_size=p.microBatchSize,
        gradient_checkpointing=p.gradientCheckpointing,
        gpu=card,
        reward_models=scorer_configs,
        shards=gpus,                               # Full: sharded with FSDP, the rest replicated
        sampler="native" if engine == "native" else p.vllm.mode,
        engine_share=p.vllm.gpuMemoryUtilization,
        staleness=p.staleness,
    )
    work = workload(job)
    shape = model_shape(config)
    step = StepWork(shape=shape, method=p.method, prompts=prompts, generations=p.numGenerations,
                    prompt_tokens=work.prompt_tokens or 0.0, completion_tokens=p.maxCompletionLength,
                    num_iterations=p.numIterations, beta=p.beta, gradient_checkpointing=p.gradientCheckpointing,
                    scorers=tuple(model_shape(c) for c in scorer_configs), engine=engine, turns=turns,
                    staleness=p.staleness, adapter_parameters=memory.trainable_parameters)
    out: dict[str, Any] = {
        "costToCompletionUSD": None,
        "firstHoldUSD": None,
        # `apply` runs the job in the foreground as soon as the estimate is accepted: it starts now.
        "startTime": _iso(now or _utcnow()),
        "stepSeconds": None,
        "stepSecondsSource": None,
        "usdPerHour": None,
        "gpu": card.name if card else None,
        "gpus": gpus,
        "steps": p.maxSteps,
        "method": p.method,
        "evaluations": work.evaluations,
        "evalTasks": work.eval_tasks,
        "evalSeconds": None,
        "completionSeconds": None,
        "trainingUSD": None,
        "evalUSD": None,
        "tokens": {"prompt": work.prompt_tokens, "promptIs": "expected (mean of the tasks)",
                   "completion": p.maxCompletionLength, "completionIs": "maximum (maxCompletionLength)",
                   **({"turns": turns, "turnsIs": "maximum (spec.environment.maxTurns): replies per episode, "
                       "the environment's observations not counted"} if episodes else {})},
        "memory": memory.to_dict(),
        "sampler": engine,
        **({"livePrices": live_note} if live_note else {}),
    }
    notes: list[str] = [live_note] if live_note else []
    if card is None:
        notes.append("cost needs spec.gpu (one of " + ", ".join(GPUS) + ", or any card with spec.pricing "
                     "usdPerHour and memoryGB): set it to get costToCompletionUSD and firstHoldUSD, and whether "
                     "memory fits")
    judge_notes: list[str] = []
    judges = _judges(job, work, judge_notes)
    priced = [j["usd"] for j in judges.values() if j["usd"] is not None]
    if card is not None:
        out.update(_cost(job, card, step, work, gpus, notes, judges_usd=sum(priced),
                         live_instance=live.instance_of(card.name) if live is not None else None))
    notes += judge_notes
    if judges:
        out["judgeCalls"] = judges
        if priced and out["costToCompletionUSD"] is not None:
            out["costToCompletionUSD"] = round(out["costToCompletionUSD"] + sum(priced), 2)
    if card is not None:                          # what spot notices add (preemption.py)
        count_preemptions(job, out, notes)
    if work.unknown:
        notes.append(work.unknown)
    out["note"] = "; ".join(notes)
    return out


def _cost(job: TrainingJob, card: Gpu, step: StepWork, work, gpus: int, notes: list[str], *,
          judges_usd: float, live_instance: tuple[str, int] | None = None) -> dict[str, Any]:
    """The cost and time fields of the estimate for `card`, and their notes; `judges_usd`: the
    judges' calls priced per call, to completion (_judges), which count in whether and when
    maxCostUSD stops the run."""
    p, pricing = job.parameters, job.pricing
    timed = step_time(step, card)
    runs = measured_runs(card.name, job.model, p.maxCompletionLength * step.turns, step.engine)
    start, start_source = 0.0, None
    if step.engine == "vllm" and p.vllm.mode == "colocate":
        measured_start = measured_start_seconds(card.name, job.model)
        start, start_source = ((measured_start, "measured") if measured_start is not None
                               else (VLLM_START_SECONDS, "published"))
    one_eval = 0.0
    if work.eval_tasks:
        eval_prompt = work.eval_prompt_tokens if work.eval_prompt_tokens is not None else step.prompt_tokens
        one_eval = eval_seconds(step.shape, p.method, tasks=work.eval_tasks, batch_size=p.evalBatchSize,
                                prompt_tokens=eval_prompt, completion_tokens=p.maxCompletionLength, gpu=card,
                                scorers=step.scorers, engine=step.engine, turns=step.turns)
    evals = round(one_eval * work.evaluations, 1)
    priced = dict(gpu=card, steps=p.maxSteps, step_seconds=pricing.stepSeconds if pricing else None,
                  measured_step_seconds=statistics.median(runs) if runs else None,
                  model_step_seconds=_figures(timed.seconds), eval_seconds=evals, baseline_seconds=round(one_eval, 1),
                  save_steps=p.saveSteps, max_cost_usd=job.maxCostUSD, gpus=gpus, start_seconds=start)
    stated = pricing.usdPerHour if pricing else None
    table = GPUS.get(card.name)
    # the table's own rate (not --live's, not the user's): where AWS rents the card only in bigger
    # instances, the job pays for the whole ones (the ledger charges the same: runspec.usd_per_hour)
    nodes = job.nodes or 1
    whole = whole_on_demand(card.name, gpus // nodes, nodes) if stated is None and card.listed and table is not None \
        and (card.usd_per_hour, card.rate_source) == (table.usd_per_hour, table.rate_source) else None
    cost = cost_estimate(usd_per_hour=stated if whole is None else float(Fraction(str(whole[0])) / gpus), **priced)
    c = cost.to_dict()
    fields = {k: c[k] for k in ("costToCompletionUSD", "firstHoldUSD", "stepSeconds", "stepSecondsSource",
                                "usdPerHour", "evalSeconds", "trainingUSD", "evalUSD")}
    fields["completionSeconds"] = round(cost.step_seconds * p.maxSteps + evals + start, 1)
    if start:
        fields.update(engineStartSeconds=c["engineStartSeconds"], engineStartUSD=c["engineStartUSD"])
        notes.append(f"vLLM's start-up, {start:g} s before the first step, is counted once"
                     + (f" (the median of your vLLM runs of this model on {card.name})" if start_source == "measured"
                        else " (a published start-up, vllm-project/vllm#20264; your own runs replace it)"))
    fields["gpuMemoryGB"] = card.memory_gb
    fields["measuredRuns"] = len(runs)
    fields["rate"] = {"kind": card.rate_kind if not (pricing and pricing.usdPerHour) else "unstated",
                      "source": "spec.pricing.usdPerHour" if pricing and pricing.usdPerHour else
                      whole[1] if whole is not None else card.rate_source}
    if whole is not None:
        fields["rate"]["wholeInstances"] = True
    rented = rental(card.name, "aws", gpus // nodes) if card.listed else None
    if rented is not None:                       # what the job rents: whole instances (shapes.py)
        fields["shape"] = {**rented.to_dict(), "nodes": nodes}
    spot_rate, spot_source = _spot_rate(card, rented, gpus, live_instance)
    if rented is not None and spot_rate is None and not (pricing and pricing.usdPerHour):
        fields["rate"]["noSpot"] = _no_spot(card, rented)
        notes.append(f"spot: {fields['rate']['noSpot']}")
    if spot_rate is not None and not (pricing and pricing.usdPerHour):
        # the spot price of the shape the job rents, offered beside the on-demand one the estimate charges
        spot = cost_estimate(usd_per_hour=spot_rate, **priced)
        fields["rate"]["spot"] = {"usdPerHour": spot.usd_per_hour, "source": spot_source,
                                  "costToCompletionUSD": round(spot.cost_to_completion_usd + judges_usd, 2)}
    fields["stepModel"] = {"seconds": _figures(timed.seconds), "sampleSeconds": _figures(timed.sample_seconds),
                           "updateSeconds": _figures(timed.update_seconds),
                           "samplingShare": round(timed.sampling_share, 2), "calibration": round(timed.calibration, 3),
                           **({"syncSeconds": _figures(timed.sync_seconds), "overlapped": True}
                              if timed.sync_seconds is not None else {}),
                           "cardFigures": _figures_from(card, pricing)}
    if card.figures_note:
        fields["stepModel"]["cardNote"] = card.figures_note
        notes.append(f"{card.name}: {card.figures_note}")
    bucket = completion_bucket(p.maxCompletionLength)
    notes.append({
        "override": "step time from spec.pricing.stepSeconds",
        "measured": f"step time: {_runs(len(runs))} of this model on {card.name} with completions "
                    f"of up to {bucket} tokens (the last {MEASURED_WINDOW} at most: this node's job records, running "
                    f"ones too, and the finished runs kept in {measured_steps_path()})",
        "model": f"step time: modelled from the model's config and {card.name}'s figures (stepModel; how: docs/job.md), "
                 "calibrated on a reference job's measured step times (Qwen3-0.6B LoRA, G=4, "
                 "64-token completions)"
                 + ("" if card.name in _REFERENCE_CARDS else
                    f"; that job was not measured on {card.name}, so the calibration is the five cards' fit alone")
                 + f"; your own runs of this model on {card.name} replace it once they have taken {MIN_STEPS} steps",
    }[cost.step_seconds_source])
    if not card.listed and not (pricing and pricing.bf16TFLOPS and pricing.memoryBandwidthGBps):
        notes.append(f"{card.name} is not in the table and spec.pricing gives no bf16TFLOPS and memoryBandwidthGBps: "
                     f"the slowest figures of the listed cards with bf16 tensor cores stand in ({STAND_IN[0] / 1e12:g} "
                     f"TFLOP/s, {STAND_IN[1] / 1e12:g} TB/s: an upper bound on the step time of such a card; a card "
                     "without them, like a V100, is slower)")
    if gpus > 1:
        across = f" on {job.nodes} nodes" if (job.nodes or 1) > 1 else ""
        rate_said = f"the whole instances they rent, ${whole[0]:g}/h" if whole is not None else \
            f"{gpus} x {card.name}'s rate"
        notes.append(f"{gpus} processes{across}, one per GPU: usdPerHour is {rate_said}; the step time is one "
                     "GPU's share of the prompts (communication not counted), memory is per GPU"
                     + (f" (Full: sharded with FSDP, so each GPU holds the whole weights and gradients while it samples "
                        f"or updates and 1/{gpus} of the optimizer's state)" if job.parameters.method == "Full" else
                        " (a replica of the model and adapter on each)"))
    per_call = sum(_per_call(r.judge) or 0.0 for r in job.environment.rewards or () if r.judge is not None)
    if job.maxCostUSD is not None and cost.cost_to_completion_usd + judges_usd > job.maxCostUSD:
        # spent by step k: the baseline evaluation, then per step its GPU time, its judge calls and
        # its share of the evaluations every evalSteps; the final evaluation comes after the last step
        per_second = cost.usd_per_hour / 3600
        between = max(work.evaluations - 2, 0) * one_eval * per_second / p.maxSteps if p.maxSteps else 0.0
        per_step = float(cost.usd_per_step) + per_call * p.promptsPerStep * p.numGenerations + between
        left = job.maxCostUSD - (one_eval + start) * per_second
        stop = max(0, min(int(left / per_step), p.maxSteps)) if per_step else p.maxSteps
        fields["budgetStopsAfterStep"] = stop
        notes.append(f"maxCostUSD {job.maxCostUSD:g} is reached after about {stop} of {p.maxSteps} steps ("
                     + ("the baseline evaluation, " if one_eval else "") + "the GPU's time"
                     + (" and the judges' calls" if per_call else "")
                     + "): the run stops there (BudgetExceeded), before the final evaluation")
    return fields


def _spot_rate(card: Gpu, rented: Rental | None, gpus: int, live_instance: tuple[str, int] | None = None,
               ) -> tuple[float | None, str]:
    """The spot price per GPU-hour the job can take, and its source. A price per GPU of an
    instance of several (the table's, or --live's `live_instance`) is an offer only to a job that
    fills that instance; a job that does not rents it whole, so it is shown the whole instances'
    price shared over its GPUs. A job whose smallest shape has no spot offer gets None (the table's
    rows only: --live asks about one instance). spec.pricing.usdPerHour is how a user says otherwise."""
    table = GPUS.get(card.name)
    live = table is not None and (card.spot_usd_per_hour, card.spot_source) != (table.spot_usd_per_hour,
                                                                                 table.spot_source)
    per_node = rented.gpus if rented is not None else gpus
    if live or rented is None:
        if card.spot_usd_per_hour is None or live_instance is None or per_node % live_instance[1] == 0:
            return card.spot_usd_per_hour, card.spot_source
        instance, n = live_instance              # a price per GPU of `n`: the whole instances, shared
        instances = -(-per_node // n)
        whole = Fraction(str(card.spot_usd_per_hour)) * n
        smaller = (f"; the smallest shape, {rented.shape.instance} ({rented.shape.gpus} x {card.name}), has "
                   f"{rented.shape.no_spot}" if rented is not None and rented.spot is None else "")
        return (float(whole * instances / per_node),
                f"{card.spot_source}; the whole {instance} ({n} x {card.name}, ${float(whole):g}/h) for this job's "
                f"{per_node}{smaller}")
    if rented.spot is None:
        return None, ""
    shape = rented.shape
    if rented.fills:
        return card.spot_usd_per_hour, card.spot_source
    return (float(Fraction(str(shape.spot)) * rented.instances / per_node),
            f"{shape.source}, the whole {shape.instance} ({shape.gpus} x {card.name}, ${shape.spot:g}/h) for "
            f"this job's {per_node}: {shape.cloud.upper()} rents no smaller {card.name} shape")


def _no_spot(card: Gpu, rented: Rental) -> str:
    """Why the job has no spot price: the shape it rents has no spot offer; what a bigger one asks."""
    shape = rented.shape
    bigger = [s for s in shapes_of(card.name, shape.cloud) if s.gpus > shape.gpus and s.spot is not None]
    said = f"{shape.instance} ({shape.gpus} x {card.name}, the smallest {shape.cloud.upper()} shape for this job) has " \
           f"{shape.no_spot}"
    if bigger:
        b = bigger[0]
        said += (f"; {b.instance} ({b.gpus} x {card.name}) asks ${b.spot:g}/h spot, ${b.spot / b.gpus:.4g} a GPU only "
                 f"if your job fills it (spec.resources.processes: {b.gpus}); to budget at a price you rent, set "
                 "spec.pricing.usdPerHour")
    return said


def _judges(job: TrainingJob, work, notes: list[str]) -> dict[str, dict[str, Any]]:
    """{judge reward: its calls to completion (one per completion sampled, one per held-out task
    an evaluation scores) and their price when priced per call}, with a note each."""
    p, found = job.parameters, {}
    for r in getattr(job.environment, "rewards", None) or ():
        if r.judge is None:
            continue
        trained = p.maxSteps * p.promptsPerStep * p.numGenerations
        calls = None if work.eval_tasks is None else trained + work.evaluations * work.eval_tasks
        per_token, per_call = r.judge.usdPerMillionTokens is not None, _per_call(r.judge)
        usd = None if calls is None or per_call is None else round(calls * per_call, 2)
        found[r.label] = {"calls": calls, "usd": usd}
        what = (f"judge {r.label!r}: {calls} calls to completion" if calls is not None else
                f"judge {r.label!r}: {trained} calls in training, and one per held-out task an evaluation scores")
        if per_token:
            what += " (priced per token: their cost depends on the replies and is not in costToCompletionUSD)"
        elif per_call is not None:
            what += f" at ${per_call:g} a call" + (f": ${usd:.2f}, in costToCompletionUSD" if usd is not None else "")
        else:
            what += " (unpriced: not in the cost)"
        notes.append(what)
    return found


def _per_call(judge) -> float | None:
    """A judge's price per call when it is priced per call (not per token: that depends on the replies)."""
    return judge.usdPerCall if judge.usdPerMillionTokens is None else None


def _runs(count: int) -> str:
    return "your one run" if count == 1 else f"the median of {count} of your runs"


def _figures_from(card: Gpu, pricing) -> str:
    """Where the card's FLOP/s and bandwidth come from."""
    given = bool(pricing and (pricing.bf16TFLOPS or pricing.memoryBandwidthGBps))
    if card.listed:
        return "datasheet, with spec.pricing's" if given else "datasheet"
    if pricing and pricing.bf16TFLOPS and pricing.memoryBandwidthGBps:
        return "spec.pricing"
    return ("stand-in: the slowest listed card with bf16 tensor cores (spec.pricing has no bf16TFLOPS and "
            "memoryBandwidthGBps)")


_REFERENCE_CARDS = frozenset(g.name for g in GPUS.values() if g.reference_step_seconds is not None)


def check_fits(estimate: dict[str, Any]) -> str | None:
    """None when the run fits its GPU (or no GPU is named); otherwise why not, with the numbers
    and what would fit, as one paragraph to print before anything starts."""
    memory, gpu = estimate["memory"], estimate.get("gpu")
    if gpu is None or memory.get("fits") is not False:
        return None
    card_gb = estimate.get("gpuMemoryGB") or lookup_gpu(gpu).memory_gb
    total, need = memory["totalGB"], memory["neededGB"]
    sampling, update = memory["samplingGB"], memory["updateGB"]
    usable = card_gb * USABLE_MEMORY_FRACTION
    engine = memory.get("engine") or {}
    if engine.get("mode") == "server":
        sampling = 0.0                  # the engine and its KV cache are on the server's GPU
    if engine.get("engineKvCacheGB") is not None and engine["engineKvCacheGB"] < engine["minKvCacheGB"]:
        least = (engine["engineWeightsGB"] + engine["minKvCacheGB"]) / card_gb
        return (f"spec.parameters.vllm.gpuMemoryUtilization: vLLM's share of {gpu} is {engine['engineGB']:.1f} GB "
                f"({engine['engineGB'] / card_gb:.0%} of {card_gb:.0f} GB), less than its own "
                f"{engine['engineWeightsGB']:.2f} GB of weights and the {engine['minKvCacheGB']:.2f} GB of KV cache of "
                "one sequence, so the engine could not start. Nothing was started. To fit: raise "
                f"gpuMemoryUtilization above {least:.2f} (the trainer and the engine must fit together: "
                f"{usable:.1f} GB usable), or sample with sampler: native. If you know better than this estimate, "
                "`grpo-run apply --skip-memory-check` runs it anyway.")
    method = estimate.get("method")
    bigger = [g.name for g in GPUS.values() if need <= g.memory_gb * USABLE_MEMORY_FRACTION]
    largest = max(g.memory_gb for g in GPUS.values()) * USABLE_MEMORY_FRACTION
    options = []
    if method == "Full":
        options.append("train an adapter instead, method: LoRA or QLoRA (a full fine-tune's "
                       f"{memory['trainableStateGB']:.1f} GB of Adam state is most of it)")
        if _sharding_helps(memory, usable):
            options.append("shard it over more GPUs of this kind, spec.resources.processes (FSDP: each holds the "
                           "whole weights and gradients while it samples or updates, and 1/N of the optimizer's "
                           "state)")
    elif method == "LoRA":
        options.append("use method: QLoRA (a 4-bit base, about a quarter of the "
                       f"{memory['weightsGB']:.1f} GB of weights)")
    if engine.get("engineGB") and engine["engineGB"] >= update:
        sampling = engine["engineGB"]
        options.append("lower spec.parameters.vllm.gpuMemoryUtilization (vLLM holds that share of the card while "
                        "it samples)")
    elif sampling >= update and sampling > 0 and not engine:
        options.append("lower promptsPerStep, numGenerations or maxCompletionLength (sampling holds the KV "
                       "cache of every completion of the step at once)")
    elif update > 0:
        options.append(f"lower microBatchSize (now {memory['microBatchSize']}) or maxCompletionLength (the "
                       "update holds one micro-batch's logits and activations)")
    if bigger:
        options.append("choose a bigger GPU: " + _or(bigger) + (" fits" if len(bigger) == 1 else " fit")
                       + " as is")
    else:
        options.append(f"no single GPU in the table fits it as is (the largest has {largest:.1f} GB "
                       "usable)")
    return (
        f"{gpu} cannot hold this run: it needs about {need:.1f} GB ({total:.1f} GB of weights, "
        f"trainable state and reference + the larger of {sampling:.1f} GB "
        + ("of vLLM's share of the card" if engine.get("engineGB") else "of KV cache") + " while sampling "
        f"and {update:.1f} GB for the update of a micro-batch of {memory['microBatchSize']}), and {gpu} has "
        f"{usable:.1f} GB usable ({USABLE_MEMORY_FRACTION:.0%} of {card_gb:.0f} GB). "
        "Nothing was started. To fit: " + "; ".join(options) + ". If you know better than this estimate, "
        "`grpo-run apply --skip-memory-check` runs it anyway."
    )


def _sharding_helps(memory: dict[str, Any], usable: float) -> bool:
    """Whether a full fine-tune could fit this card sharded over more GPUs: even sharded without
    end, each GPU holds the whole weights and gradients (4 bytes a parameter) beside the rest."""
    from grpo_run.runner.estimate.memory import quoted_count

    whole = 4 * quoted_count(memory["parameters"]) / 1e9
    return memory["neededGB"] - memory["trainableStateGB"] + whole < usable


def _or(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
