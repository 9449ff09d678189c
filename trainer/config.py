"""The trainer's parameters: a frozen dataclass that knows its YAML names, defaults and limits.

`spec.parameters` of a TrainingJob is parsed here. Every problem is collected and reported
together, each naming the field, what was given and what is allowed, e.g.
`spec.parameters.numGenerations: must be >= 2 (got 1): GRPO needs a group to compare`.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping

METHODS = ("LoRA", "QLoRA", "Full")
LOSS_TYPES = ("grpo", "dapo", "dr_grpo")
STD_CONVENTIONS = ("sample", "population")
SCHEDULERS = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LoraParams:
    r: int = 8
    alpha: float | None = None          # None: 2 x r
    dropout: float = 0.0
    targetModules: str | tuple[str, ...] = "all-linear"

    @property
    def scaling_alpha(self) -> float:
        return self.alpha if self.alpha is not None else 2.0 * self.r


@dataclass(frozen=True)
class GRPOParams:
    """`spec.parameters`. Names are the YAML names (camelCase), as users write them."""
    numGenerations: int = 4            # G, completions per prompt
    beta: float = 0.0                  # KL coefficient; 0 loads/computes no reference at all
    maxCompletionLength: int = 64      # tokens per completion
    lora: LoraParams = field(default_factory=LoraParams)
    method: str = "LoRA"               # LoRA | QLoRA | Full
    saveSteps: int = 25                # checkpoint every N steps
    maxSteps: int = 200                # training steps
    learningRate: float = 1e-5
    temperature: float = 1.0           # sampling temperature during training
    promptsPerStep: int = 8            # B, prompts per step (B x G completions)
    epsilon: float = 0.2               # PPO clip range
    numIterations: int = 1             # updates per generated batch (mu); >1 makes clipping bite
    lossType: str = "grpo"             # grpo | dapo | dr_grpo
    advantageStd: str = "sample"       # sample (n-1, as TRL) | population (n)
    seed: int = 0
    trainTasks: int | None = None      # catalog environments: train tasks (None: the environment's default)
    evalTasks: int | None = None       # catalog environments: held-out tasks (None: the environment's default)
    evalTemperature: float = 0.0       # 0 = greedy decoding for evaluation
    evalBatchSize: int = 64            # held-out tasks per evaluation batch (a stopped evaluation resumes by batch)
    gradientCheckpointing: bool = True
    maxGradNorm: float = 1.0
    weightDecay: float = 0.0
    warmupSteps: int = 0
    lrScheduler: str = "constant"      # constant | linear | cosine
    rewardTimeoutSeconds: float = 10.0  # per completion, in the grader
    rewardMemoryMB: int = 2048          # grader process memory limit
    rewardRetries: int = 2              # extra tries after a reward-function failure


Check = Callable[[Any], str | None]


def _at_least(lo: float) -> Check:
    return lambda v: None if v >= lo else f"must be >= {lo}"


def _above(lo: float) -> Check:
    return lambda v: None if v > lo else f"must be > {lo}"


def _within(lo: float, hi: float) -> Check:
    return lambda v: None if lo <= v <= hi else f"must be between {lo} and {hi}"


def _one_of(choices: tuple[str, ...]) -> Check:
    return lambda v: None if v in choices else "must be one of " + ", ".join(choices)


CHECKS: dict[str, Check] = {
    "numGenerations": _at_least(2),
    "beta": _at_least(0),
    "maxCompletionLength": _at_least(1),
    "method": _one_of(METHODS),
    "saveSteps": _at_least(1),
    "maxSteps": _at_least(1),
    "learningRate": _above(0),
    "temperature": _above(0),
    "promptsPerStep": _at_least(1),
    "epsilon": _within(0, 1),
    "numIterations": _at_least(1),
    "lossType": _one_of(LOSS_TYPES),
    "advantageStd": _one_of(STD_CONVENTIONS),
    "trainTasks": _at_least(1),
    "evalTasks": _at_least(1),
    "evalTemperature": _at_least(0),
    "evalBatchSize": _at_least(1),
    "maxGradNorm": _above(0),
    "weightDecay": _at_least(0),
    "warmupSteps": _at_least(0),
    "lrScheduler": _one_of(SCHEDULERS),
    "rewardTimeoutSeconds": _above(0),
    "rewardMemoryMB": _at_least(64),
    "rewardRetries": _at_least(0),
}
# Why a limit exists, where it is not obvious; appended after the value given.
WHY = {"numGenerations": "GRPO needs a group to compare"}
LORA_CHECKS: dict[str, Check] = {"r": _at_least(1), "dropout": _within(0, 0.99)}


def type_name(t: Any) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(t, str(t))


def coerce(value: Any, t: Any) -> tuple[Any, str | None]:
    """Value as type t, or an error. YAML's ints are accepted where numbers are wanted; bools never
    pass as numbers (`true` for a step count is a mistake, not 1)."""
    if t is bool:
        return (value, None) if isinstance(value, bool) else (None, "must be true or false")
    if isinstance(value, bool):
        return None, f"must be {type_name(t)}"
    if t is int:
        return (value, None) if isinstance(value, int) else (None, "must be an integer")
    if t is float:
        return (float(value), None) if isinstance(value, (int, float)) else (None, "must be a number")
    if t is str:
        return (value, None) if isinstance(value, str) else (None, "must be a string")
    raise TypeError(t)


def unknown_keys(raw: Mapping[str, Any], known: list[str], where: str) -> list[str]:
    problems = []
    for key in raw:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"; did you mean {close[0]}?" if close else "; allowed: " + ", ".join(known)
            problems.append(f"{where}.{key}: unknown field{hint}")
    return problems


def _fmt(v: Any) -> str:
    return repr(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else str(v)


def parse_lora(raw: Any, where: str, problems: list[str]) -> LoraParams:
    if raw is None:
        return LoraParams()
    if not isinstance(raw, Mapping):
        problems.append(f"{where}: must be a mapping like {{r: 8}} (got {_fmt(raw)})")
        return LoraParams()
    names = [f.name for f in fields(LoraParams)]
    problems += unknown_keys(raw, names, where)
    values: dict[str, Any] = {}
    for key, t in (("r", int), ("alpha", float), ("dropout", float)):
        if key in raw:
            v, err = coerce(raw[key], t)
            err = err or LORA_CHECKS.get(key, lambda _: None)(v)
            if err:
                problems.append(f"{where}.{key}: {err} (got {_fmt(raw[key])})")
            else:
                values[key] = v
    if "targetModules" in raw:
        tm = raw["targetModules"]
        if tm == "all-linear":
            values["targetModules"] = tm
        elif isinstance(tm, list) and tm and all(isinstance(x, str) for x in tm):
            values["targetModules"] = tuple(tm)
        else:
            problems.append(f"{where}.targetModules: must be \"all-linear\" or a list of module names like [q_proj, v_proj] (got {_fmt(tm)})")
    return LoraParams(**values)


def parse_parameters(raw: Any, where: str, problems: list[str]) -> GRPOParams:
    """`spec.parameters` -> GRPOParams; problems are appended, never raised."""
    if raw is None:
        return GRPOParams()
    if not isinstance(raw, Mapping):
        problems.append(f"{where}: must be a mapping of parameters (got {_fmt(raw)})")
        return GRPOParams()
    names = [f.name for f in fields(GRPOParams)]
    problems += unknown_keys(raw, names, where)
    values: dict[str, Any] = {}
    types = {f.name: f.type for f in fields(GRPOParams)}
    for key, value in raw.items():
        if key not in names:
            continue
        if key == "lora":
            values["lora"] = parse_lora(value, f"{where}.lora", problems)
            continue
        t = {"int": int, "int | None": int, "float": float, "str": str, "bool": bool}[types[key]]
        v, err = coerce(value, t)
        err = err or CHECKS.get(key, lambda _: None)(v)
        if err:
            why = f": {WHY[key]}" if key in WHY else ""
            problems.append(f"{where}.{key}: {err} (got {_fmt(value)}){why}")
        else:
            values[key] = v
    return GRPOParams(**values)


def to_yaml_dict(params: GRPOParams) -> dict[str, Any]:
    """The parameters as a user would write them (every default filled in)."""
    out: dict[str, Any] = {}
    for f in fields(params):
        v = getattr(params, f.name)
        if isinstance(v, LoraParams):
            v = {"r": v.r, "alpha": v.scaling_alpha, "dropout": v.dropout,
                 "targetModules": v.targetModules if isinstance(v.targetModules, str) else list(v.targetModules)}
        if v is not None:       # None: "the environment's default", written by leaving it out
            out[f.name] = v
    return out
