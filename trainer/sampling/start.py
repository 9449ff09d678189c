"""Starting the engine a trainer samples with: which one (spec.parameters.sampler as the supervisor
resolved it, `auto` resolved here when a trainer runs on its own), built with the run's one
SampleSettings, and the native decoder's stop-string check."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from grpo_run.trainer.config import GRPOParams
from grpo_run.trainer.distributed import World
from grpo_run.trainer.model.policy import compute_dtype
from grpo_run.trainer.sampling.choice import decide
from grpo_run.trainer.sampling.engines import NativeSampler, SampleSettings, Sampler
from grpo_run.trainer.startup import clock


def resolved_engine(params: GRPOParams, config: Callable[[], dict], device: torch.device, world: World) -> str:
    """spec.parameters.sampler as the supervisor resolved it, or `auto` resolved here (a trainer
    run on its own): "native" or "vllm"."""
    if params.sampler != "auto":
        return params.sampler
    return decide(params, config, gpu=device.type == "cuda", processes=world.size).engine


def start_sampler(model: torch.nn.Module, model_path: str, tokenizer: Any, settings: SampleSettings,
                  params: GRPOParams, device: torch.device, world: World, work: Path, *,
                  sharded: bool = False) -> Sampler:
    """The run's engine: the native decoder over `model` itself, or vLLM colocated (loading
    `model_path`) or a server (spec.parameters.vllm.mode); `work`: the folder adapters and weights
    are handed over in; `sharded`: the model's weights are FSDP shards (no fast decoder is kept)."""
    with clock().part("engine start"):      # the node's path to its first step (trainer.startup)
        return _start_sampler(model, model_path, tokenizer, settings, params, device, world, work, sharded=sharded)


def _start_sampler(model: torch.nn.Module, model_path: str, tokenizer: Any, settings: SampleSettings,
                   params: GRPOParams, device: torch.device, world: World, work: Path, *, sharded: bool) -> Sampler:
    p, pad_id = params, tokenizer.pad_token_id
    if resolved_engine(p, model.config.to_dict, device, world) == "native":
        return NativeSampler(model, settings, pad_id=pad_id, device=device,
                             finished=stop_strings_check(tokenizer, p.stopStrings), compiled=p.compileDecode,
                             keep_decoder=not sharded)
    if p.vllm.mode == "server":
        from grpo_run.trainer.sampling.vllm_client import VllmServerSampler

        return VllmServerSampler(p.vllm.server, settings, model=model_path, method=p.method, lora_rank=p.lora.r,
                                 timeout_s=p.vllm.serverTimeoutSeconds, pad_id=pad_id, work=work)
    from grpo_run.trainer.sampling.vllm_engine import VllmSampler   # heavy: only where it samples

    return VllmSampler(model_path, method=p.method, lora_rank=p.lora.r, dtype=compute_dtype(device),
                       device=device, gpu_memory_utilization=p.vllm.gpuMemoryUtilization, settings=settings,
                       pad_id=pad_id, seed=p.seed, work=work)


def stop_strings_check(tokenizer: Any, stops: tuple[str, ...] | list[str]
                       ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """The native decoder's `finished` for stopStrings (None without any): a running row is
    finished once one of them appears in the text of its newest tokens. Only that tail is decoded:
    as many tokens as the longest stop string has UTF-8 bytes, plus one, because every token
    (special tokens aside, which decoding skips) decodes to at least one byte, so a stop string
    completed by the newest token lies inside it. Only the completion counts, not the prompt."""
    if not stops:
        return None
    window = max(len(s.encode("utf-8")) for s in stops) + 1

    def finished(tokens: torch.Tensor, running: torch.Tensor) -> torch.Tensor:   # [N, t], [N] -> [N]
        tails = tokenizer.batch_decode(tokens[running][:, -window:].tolist(), skip_special_tokens=True)
        out = torch.zeros_like(running)
        out[running] = torch.tensor([any(s in text for s in stops) for text in tails], device=running.device)
        return out
    return finished
