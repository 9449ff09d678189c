"""`status.estimate` for `grpo-run apply --dry-run` (SPEC §3, §6): what a job will cost and
whether it fits its GPU, before anything is spent.

The numbers come from `runner.memory` (memory from the model's config.json alone) and
`runner.estimate` (cost from the GPU table). This module finds the inputs -- the model's config,
the user's overrides, the user's own measured step times -- and shapes the answer:

    model_config(job.model)                  config.json as a dict (no weights, no network)
    estimate(job)                            the status.estimate dict
    check_fits(estimate(job))                None, or the refusal to print before anything starts
    record_measured_step_seconds(gpu, s, job)  after a finished run: learn this GPU's step time
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import statistics
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from grpo_run.checkpoint.storage.fsio import atomic_write_text
from grpo_run.runner.gpus import GPUS, cost_estimate, lookup_gpu
from grpo_run.runner.spec.job import TrainingJob
from grpo_run.runner.estimate.memory import USABLE_MEMORY_FRACTION, memory_estimate
from grpo_run.runner.home import ensure_model, grpo_run_home, is_tiny

log = logging.getLogger(__name__)

__all__ = [
    "MEASURED_WINDOW",
    "check_fits",
    "estimate",
    "measured_step_seconds",
    "measured_steps_path",
    "model_config",
    "record_measured_step_seconds",
]

# The estimate uses the median of this many most recent finished runs on a GPU type: recent
# enough to follow a new driver or a new model, many enough that one odd run does not swing it.
MEASURED_WINDOW = 20


# --- the model's config -------------------------------------------------------------------------


def model_config(model: str, *, cache_dir: str | Path | None = None) -> dict[str, Any]:
    """The model's config.json as a dict, without weights and without the network.

    - `tiny:NAME`: the built-in demo model, built on first use under $GRPO_RUN_HOME/models/;
    - a local folder: its config.json (a folder holding only config.json is enough);
    - a hub id such as `Qwen/Qwen3-8B`: its config.json from the Hugging Face cache
      (`cache_dir`, default the usual HF_HUB_CACHE), only if it was downloaded before. The
      cache's raw file is read rather than `AutoConfig`'s object, so an architecture this
      transformers does not know is still estimated, and the three sources give the same dict.

    Raises LookupError when the config cannot be found here, saying how to provide it; ValueError
    when a config.json is not a JSON object.
    """
    if is_tiny(model):
        return _read_config(Path(ensure_model(model)) / "config.json")
    folder = Path(model).expanduser()
    if folder.is_dir():
        path = folder / "config.json"
        if not path.is_file():
            raise LookupError(f"{folder} has no config.json: point spec.model at the folder "
                              "`save_pretrained` wrote (only config.json is needed for the estimate)")
        return _read_config(path)
    if folder.exists() or model.startswith(("/", "./", "../", "~")):
        raise LookupError(f"spec.model: {model} is not a folder; give a folder holding the "
                          "model's config.json")
    path = _cached_hub_config(model, cache_dir)
    if path is None:
        raise LookupError(
            f"spec.model: no config.json for {model!r} in the Hugging Face cache, and the estimate "
            "never downloads (many nodes have no network). Pass a local folder holding the "
            f"model's config.json instead, e.g. `hf download {model} config.json --local-dir "
            f"./{model.rsplit('/', 1)[-1]}` on a machine with network, then "
            f"spec.model: ./{model.rsplit('/', 1)[-1]}")
    return _read_config(Path(path))


def _cached_hub_config(repo_id: str, cache_dir: str | Path | None) -> str | None:
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json",
                                       cache_dir=str(cache_dir) if cache_dir else None)
    except ValueError:  # not a valid repo id (e.g. "a/b/c"): it cannot be in the cache either
        return None
    return found if isinstance(found, str) else None  # None, or _CACHED_NO_EXIST


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: must be a JSON object like the one `save_pretrained` writes")
    return config


# --- the user's measured step times -------------------------------------------------------------
#
# $GRPO_RUN_HOME/measured-steps.json:
#   {"version": 1, "gpus": {"H100-SXM-80GB": [{"job": "...", "stepSeconds": 0.52,
#                                              "finishedAt": "2025-01-01T00:00:00Z"}, ...]}}
# oldest first, at most MEASURED_WINDOW runs per GPU. Written atomically (temporary file, fsync,
# rename) under a lock, so two jobs finishing at once both get recorded and a reader never sees
# half a file.


def measured_steps_path() -> Path:
    return grpo_run_home() / "measured-steps.json"


def measured_step_seconds(gpu: str) -> float | None:
    """The median step time of the user's last MEASURED_WINDOW finished runs on `gpu`, or None
    when there are none. An unreadable file counts as none (logged): a dry run never fails on it.
    """
    runs = _load_measured(measured_steps_path()).get(gpu, [])
    seconds = [r["stepSeconds"] for r in runs[-MEASURED_WINDOW:]]
    return statistics.median(seconds) if seconds else None


def record_measured_step_seconds(gpu: str, seconds: float, job: str) -> None:
    """Remember that `job` ran at `seconds` per training step on `gpu`; later estimates for `gpu`
    use the median of the last MEASURED_WINDOW such runs.

    Raises ValueError for a GPU not in the table or a step time that is not a number > 0.
    """
    lookup_gpu(gpu)
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
            or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"step seconds: must be a number > 0 (got {seconds!r})")
    path = measured_steps_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.with_name(path.name + ".lock")):
        gpus = _load_measured(path)
        runs = gpus.setdefault(gpu, [])
        runs.append({"job": job, "stepSeconds": float(seconds), "finishedAt": _iso(_utcnow())})
        del runs[:-MEASURED_WINDOW]
        atomic_write_text(path, json.dumps({"version": 1, "gpus": gpus}, indent=2) + "\n")


def _load_measured(path: Path) -> dict[str, list[dict[str, Any]]]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        gpus = doc["gpus"]
        return {name: [r for r in runs if _valid_run(r)] for name, runs in gpus.items()
                if name in GPUS and isinstance(runs, list)}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        # Written atomically, so this is a hand edit gone wrong; the next record starts afresh.
        log.warning("ignoring %s (%s: %s); estimates use reference step times", path,
                    type(e).__name__, e)
        return {}


def _valid_run(run: Any) -> bool:
    s = run.get("stepSeconds") if isinstance(run, dict) else None
    return isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) and s > 0


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    import fcntl

    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        yield


# --- the estimate -------------------------------------------------------------------------------


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


def _iso(t: datetime) -> str:
    return t.astimezone(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def estimate(job: TrainingJob, *, now: datetime | None = None) -> dict[str, Any]:
    """`status.estimate` for `job` (SPEC §6 names), from the model's config alone.

    Cost needs `spec.gpu`; without it the cost fields are None and `note` says so, and
    `memory.fits` is None. Step time: `spec.pricing.stepSeconds` ("override"), else the user's
    measured median on this GPU ("measured"), else the table's ("reference"); the rate is
    `spec.pricing.usdPerHour` or the table's.

    Raises LookupError when the model's config cannot be found (see `model_config`); ValueError
    for a config the estimate cannot read (missing keys, mixture-of-experts) or a LoRA target
    module it does not know.
    """
    from grpo_run.runner.spec.job import node_processes

    p = job.parameters
    gpus = node_processes(job.resources)          # one process per GPU, each a replica (DDP)
    targets = p.lora.targetModules
    memory = memory_estimate(
        model_config(job.model),
        method=p.method,
        lora_r=p.lora.r,
        lora_targets=(targets,) if isinstance(targets, str) else targets,  # "all-linear": all 7
        beta=p.beta,
        # kvCacheGB is one group: numGenerations x maxCompletionLength tokens. Prompt tokens are
        # not counted (their length is the environment's, unknown here); SPEC §3 counts the same.
        num_generations=p.numGenerations,
        max_completion_length=p.maxCompletionLength,
        prompts_per_step=-(-p.promptsPerStep // gpus),   # per GPU: each samples its share of the prompts
        micro_batch_size=p.microBatchSize,
        gradient_checkpointing=p.gradientCheckpointing,
        gpu=job.gpu,
    )
    out: dict[str, Any] = {
        "costToCompletionUSD": None,
        "firstHoldUSD": None,
        # `apply` runs the job in the foreground as soon as the estimate is accepted: it starts now.
        "startTime": _iso(now or _utcnow()),
        "stepSeconds": None,
        "stepSecondsSource": None,
        "usdPerHour": None,
        "gpu": job.gpu,
        "gpus": gpus,
        "steps": p.maxSteps,
        "method": p.method,
        "memory": memory.to_dict(),
    }
    notes: list[str] = []
    if job.gpu is None:
        notes.append("cost needs spec.gpu (one of " + ", ".join(GPUS) + "): set it to get "
                     "costToCompletionUSD and firstHoldUSD, and whether memory fits"
                     + ("; spec.pricing applies to that GPU" if job.pricing else ""))
    else:
        pricing = job.pricing
        cost = cost_estimate(
            gpu=job.gpu,
            steps=p.maxSteps,
            usd_per_hour=pricing.usdPerHour if pricing else None,
            step_seconds=pricing.stepSeconds if pricing else None,
            measured_step_seconds=measured_step_seconds(job.gpu),
            save_steps=p.saveSteps,
            max_cost_usd=job.maxCostUSD,
            gpus=gpus,
        )
        c = cost.to_dict()
        out.update({k: c[k] for k in ("costToCompletionUSD", "firstHoldUSD", "stepSeconds",
                                      "stepSecondsSource", "usdPerHour")})
        notes.append({
            "override": "step time from spec.pricing.stepSeconds",
            "measured": f"step time: the median of your last finished runs on {job.gpu} "
                        f"(up to {MEASURED_WINDOW}, from {measured_steps_path()})",
            "reference": f"step time: SPEC's reference for {job.gpu}; your own runs on it replace it "
                         "once they finish",
        }[cost.step_seconds_source])
        if gpus > 1:
            notes.append(f"{gpus} processes, one per GPU: usdPerHour is {gpus} x {job.gpu}'s rate; the step time "
                         "is one GPU's (no speed-up assumed), memory is per GPU")
        if job.maxCostUSD is not None and cost.cost_to_completion_usd > job.maxCostUSD:
            per_step = cost.usd_per_step
            notes.append(f"maxCostUSD {job.maxCostUSD:g} is reached after about "
                         f"{int(job.maxCostUSD / per_step) if per_step else p.maxSteps} of "
                         f"{p.maxSteps} steps: the run stops there (BudgetExceeded)")
    out["note"] = "; ".join(notes)
    return out


def check_fits(estimate: dict[str, Any]) -> str | None:
    """None when the run fits its GPU (or no GPU is named); otherwise why not, with the numbers
    and what would fit, as one paragraph to print before anything starts."""
    memory, gpu = estimate["memory"], estimate.get("gpu")
    if gpu is None or memory.get("fits") is not False:
        return None
    card = lookup_gpu(gpu)
    total, need = memory["totalGB"], memory["neededGB"]
    sampling, update = memory["samplingGB"], memory["updateGB"]
    usable = card.memory_gb * USABLE_MEMORY_FRACTION
    method = estimate.get("method")
    bigger = [g.name for g in GPUS.values() if need <= g.memory_gb * USABLE_MEMORY_FRACTION]
    largest = max(g.memory_gb for g in GPUS.values()) * USABLE_MEMORY_FRACTION
    options = []
    if method == "Full":
        options.append("train an adapter instead, method: LoRA or QLoRA (a full fine-tune's "
                       f"{memory['trainableStateGB']:.1f} GB of Adam state is most of it)")
    elif method == "LoRA":
        options.append("use method: QLoRA (a 4-bit base, about a quarter of the "
                       f"{memory['weightsGB']:.1f} GB of weights)")
    if sampling >= update and sampling > 0:
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
        f"trainable state and reference + the larger of {sampling:.1f} GB of KV cache while sampling "
        f"and {update:.1f} GB for the update of a micro-batch of {memory['microBatchSize']}), and {gpu} has "
        f"{usable:.1f} GB usable ({USABLE_MEMORY_FRACTION:.0%} of {card.memory_gb:.0f} GB). "
        "Nothing was started. To fit: " + "; ".join(options) + "."
    )


def _or(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
