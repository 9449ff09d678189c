"""`spec.pricing` and `spec.resources`: what a job runs on, and what that costs.

Apart from job.py (the whole file's schema and its error format) because they are the parts the
estimate and the node's process count read on their own."""

from __future__ import annotations

import math
import os
import sys
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from grpo_run.runner.spec.yamlfile import int_text
from grpo_run.trainer.config import Strict, fmt, problem
from grpo_run.trainer.sampling.choice import node_has_gpu


def positive_number(v: Any, fix: str = "") -> float:
    """A finite number > 0 (YAML's booleans are not numbers), else the house error."""
    try:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise problem(f"must be a number > 0 (got {fmt(v)}){fix}")
        return float(v)
    except OverflowError:                        # an int past float's range: parse_job names it
        raise problem(f"must be a number > 0 that fits in a float (got {int_text(v)}){fix}") from None


class Pricing(Strict):
    """`spec.pricing`: the user's own numbers for `spec.gpu`, over the estimate's table; for a card the
    table does not list, its description (usdPerHour and memoryGB; bf16TFLOPS and memoryBandwidthGBps
    from its datasheet for the step model)."""
    usdPerHour: float | None = None   # what this node costs you per hour
    stepSeconds: float | None = None  # seconds per training step (wins over measured and modelled)
    memoryGB: float | None = None     # the card's memory, decimal GB
    bf16TFLOPS: float | None = None   # its peak dense bf16 tensor TFLOP/s
    memoryBandwidthGBps: float | None = None   # its memory bandwidth, GB/s
    preemptionsPerHour: float | None = None    # notices you expect per node-hour (0 or unset: none counted)
    restartSeconds: float | None = None        # what one preemption costs in time (default: modelled from its parts)
    bootSeconds: float | None = None           # ... of which a replacement node's boot and install (default: an allowance)
    loadBytesPerSecond: float | None = None    # ... and how fast it fetches and loads weights and checkpoints (an allowance)

    @model_validator(mode="before")
    @classmethod
    def _some(cls, raw: Any) -> Any:
        if not isinstance(raw, dict) or not raw:
            raise problem("must be a mapping with usdPerHour, stepSeconds, memoryGB, bf16TFLOPS, memoryBandwidthGBps, "
                          "preemptionsPerHour, restartSeconds, bootSeconds and/or loadBytesPerSecond, e.g. "
                          "{usdPerHour: 2.1, stepSeconds: 0.5} "
                          f"(got {fmt(raw)})")
        return raw

    @field_validator("preemptionsPerHour", mode="before")
    @classmethod
    def _rate(cls, v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise problem(f"must be a number >= 0 (got {fmt(v)}): the spot notices you expect per hour of the "
                          "run, e.g. 0.05 (about one a day is 0.042), or 0 to count none")
        return float(v)

    @field_validator("usdPerHour", "stepSeconds", "memoryGB", "bf16TFLOPS", "memoryBandwidthGBps", "restartSeconds",
                     "bootSeconds", "loadBytesPerSecond", mode="before")
    @classmethod
    def _positive(cls, v: Any) -> Any:
        return positive_number(v)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class Resources(Strict):
    """`spec.resources`: what of the node the job uses."""
    processes: int | Literal["auto"] = Field(1, json_schema_extra={"like": "{processes: 4}"})   # one per GPU

    @field_validator("processes", mode="before")
    @classmethod
    def _processes(cls, v: Any) -> Any:
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            return v
        raise problem(f"must be a whole number >= 1 or auto (the node's GPUs) (got {fmt(v)})")

    def to_dict(self) -> dict[str, Any]:
        return {"processes": self.processes}


def node_gpus() -> int:
    """This node's GPUs (CUDA devices); 0 on a node without any. On Linux a node without a GPU
    driver (NVIDIA's listing, or ROCm's /dev/kfd) has none, said without importing torch: the
    supervisor of a resume on a CPU node is spared that import (about a second, on its path to
    the first new step, beside the trainer's own)."""
    if sys.platform.startswith("linux") and "torch" not in sys.modules and not node_has_gpu() \
            and not os.path.exists("/dev/kfd"):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def node_processes(resources: Resources | None) -> int:
    """How many trainer processes (ranks) this node runs for the job: spec.resources.processes,
    `auto` as this node's GPUs (1 on a node without any)."""
    asked = resources.processes if resources is not None else 1
    return asked if asked != "auto" else max(1, node_gpus())
