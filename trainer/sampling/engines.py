"""The sampler the recipe asks for completions, and which engine a job samples with.

One protocol, two engines: the native decoder (trainer.sampling.sampler, over transformers) and
vLLM (trainer.sampling.vllm_engine). The trainer asks `sample(prompt_ids, prompt_mask, seeds, ...)`
and never knows which engine answered; `load_policy(model)` brings the policy's newest weights to
the engine before it samples (nothing to do for the native decoder, which samples with the model
itself).

Which engine a run samples with is decided once, for the run: trainer.sampling.choice.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch
from torch import Tensor

from grpo_run.trainer.sampling import sampler
from grpo_run.trainer.sampling.sampler import Completions

class EngineUnavailable(RuntimeError):
    """The vLLM server did not answer, failed, or took too long: an infrastructure failure."""


class EngineRefused(RuntimeError):
    """The engine cannot sample this job as it was started or configured (a server's method or
    adapter rank, a memory share too small): restarting the trainer cannot help; the message
    says how to fix it."""


class Sampler(Protocol):
    """What the trainer asks of an engine."""
    engine: str
    version: str

    def load_policy(self, model: torch.nn.Module) -> None:
        """The policy's weights as they are now, for the samples that follow."""

    def sample(self, prompt_ids: Tensor, prompt_mask: Tensor, seeds: Sequence[int], *, temperature: float,
               should_stop: Callable[[], bool]) -> Completions:
        """Completions for prompt_ids, prompt_mask [N, P] (left-padded). `seeds`: one per equal
        consecutive block of rows (a prompt's group), or one for all rows; a row's draws depend on
        its block's seed and its place in the block only. Raises GenerationInterrupted when
        `should_stop()` turns true."""

    def close(self) -> None:
        ...


class NativeSampler:
    """The native decoder: sampler.sample over the policy itself, one torch.Generator per seed."""
    engine, version = "native", ""

    def __init__(self, device: torch.device, options: Callable[[], dict]) -> None:
        """`options()`: the model and sampler.sample's settings besides the prompts, temperature,
        generators and stop (model, max_new_tokens, eos_ids, pad_id, top_k, top_p,
        repetition_penalty, finished, compiled), asked at each call: the policy as it is then."""
        self.device, self.options = device, options

    def load_policy(self, model: torch.nn.Module) -> None:
        pass                      # it samples with the policy itself

    def sample(self, prompt_ids: Tensor, prompt_mask: Tensor, seeds: Sequence[int] | None, *, temperature: float,
               should_stop: Callable[[], bool]) -> Completions:
        gens = [torch.Generator(device=self.device).manual_seed(s) for s in seeds or ()]
        return sampler.sample(prompt_ids=prompt_ids, prompt_mask=prompt_mask, temperature=temperature,
                              generator=(gens[0] if len(gens) == 1 else gens) if gens else None,
                              should_stop=should_stop, **self.options())

    def close(self) -> None:
        pass
