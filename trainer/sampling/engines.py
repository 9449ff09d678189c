"""The sampler the recipe asks for completions, and which engine a job samples with.

One protocol, two engines: the native decoder (trainer.sampling.sampler, over transformers) and
vLLM (trainer.sampling.vllm_engine). The trainer asks `sample(prompt_ids, prompt_mask, seeds, ...)`
and never knows which engine answered; `load_policy(model)` brings the policy's newest weights to
the engine before it samples (nothing to do for the native decoder, which samples with the model
itself).

Which engine a run samples with is decided once, for the run: trainer.sampling.choice.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Protocol, Sequence

import torch
from torch import Tensor

from grpo_run.trainer.sampling import sampler
from grpo_run.trainer.sampling.sampler import Completions


class EngineUnavailable(RuntimeError):
    """The vLLM server did not answer, failed, or took too long: an infrastructure failure."""


class EngineDisagrees(EngineUnavailable):
    """The engine drew tokens from another policy than the trainer's: its log-probabilities of the
    tokens it drew differ from the trainer's beyond the bound (AGREEMENT). An infrastructure
    failure: the attempt ends before the step is trained on, and the next one syncs afresh."""


# The mean |trainer - engine| log-probability over a step's drawn tokens an engine may show (nats),
# by compute dtype: float32 on a CPU measured below 1e-3 (tests/trainer/sampling/test_vllm_engine.py), so
# 0.05 leaves fifty times the room; 16-bit kernels round far more (bfloat16 keeps 8 bits of
# mantissa), so 0.3, not yet measured on a GPU (bench/gpu_check.py reports the step's mismatch). A
# missing adapter or another base is far beyond either (test_vllm_engine's forced disagreement).
AGREEMENT = {torch.float32: 0.05, torch.bfloat16: 0.3, torch.float16: 0.3}


class EngineRefused(RuntimeError):
    """The engine cannot sample this job as it was started or configured (a server's method or
    adapter rank, a memory share too small): restarting the trainer cannot help; the message
    says how to fix it."""


@dataclass(frozen=True)
class SampleSettings:
    """How a run's completions are drawn, built once from the job (`of`) and handed to every engine
    (vLLM's SamplingParams less the seed; the native decoder's arguments). `temperature` is the
    training's; an evaluation samples `at(evalTemperature)`. A vLLM server gets these fields as
    JSON with every /sample."""
    temperature: float
    max_tokens: int
    top_k: int = 0                  # 0: off
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] | list[int] = ()     # every id that ends a completion (EOS)
    stop: tuple[str, ...] | list[str] = ()               # spec.parameters.stopStrings

    @classmethod
    def of(cls, params, eos_ids: Sequence[int]) -> SampleSettings:
        """The job's settings (`params`: trainer.config.GRPOParams) with the model's end ids."""
        return cls(temperature=params.temperature, max_tokens=params.maxCompletionLength, top_k=params.topK,
                   top_p=params.topP, repetition_penalty=params.repetitionPenalty, stop_token_ids=tuple(eos_ids),
                   stop=tuple(params.stopStrings))

    def at(self, temperature: float) -> SampleSettings:
        return self if temperature == self.temperature else replace(self, temperature=temperature)


class Sampler(Protocol):
    """What the trainer asks of an engine; built with the run's SampleSettings."""
    engine: str
    version: str

    def load_policy(self, model: torch.nn.Module) -> float:
        """The policy's weights as they are now, for the samples that follow. Returns the sync's
        seconds (0 where nothing moves: the native decoder samples with the model itself)."""

    def sample(self, prompt_ids: Tensor, prompt_mask: Tensor, seeds: Sequence[int] | None, *, temperature: float,
               should_stop: Callable[[], bool]) -> Completions:
        """Completions for prompt_ids, prompt_mask [N, P] (left-padded). `seeds`: one per equal
        consecutive block of rows (a prompt's group), or one for all rows; a row's draws depend on
        its block's seed and its place in the block only (None: unseeded, the native decoder's
        greedy tests). Raises GenerationInterrupted when `should_stop()` turns true."""

    def release(self) -> None:
        """Give back what the engine holds that the update needs (a GPU engine's KV cache); the
        next load_policy takes it again."""

    def status(self) -> dict[str, str | float]:
        """The engine as `get tj` shows it (status.sampler): engine, and for vLLM its version,
        mode, start-up seconds (and the server's address)."""

    def close(self) -> None:
        ...


class NativeSampler:
    """The native decoder: sampler.sample over the policy itself, one torch.Generator per seed."""
    engine, version = "native", ""

    def __init__(self, model: torch.nn.Module, settings: SampleSettings, *, pad_id: int, device: torch.device,
                 finished: Callable[[Tensor, Tensor], Tensor] | None = None, compiled: bool = False,
                 keep_decoder: bool = True, logprobs: bool = False) -> None:
        """`finished`: the stop-strings check (start.stop_strings_check); `compiled`: the compiled
        decode step (compileDecode); `keep_decoder`: the fast decoder kept with the model (not
        for a sharded one, whose gathered weights are new tensors at every gathering); `logprobs`:
        record each drawn token's log-probability (an asynchronous run's producer, trainer.ahead)."""
        self.model, self.settings, self.pad_id, self.device = model, settings, pad_id, device
        self.finished, self.compiled, self.keep_decoder, self.logprobs = finished, compiled, keep_decoder, logprobs

    def load_policy(self, model: torch.nn.Module) -> float:
        return 0.0                # it samples with the policy itself

    def sample(self, prompt_ids: Tensor, prompt_mask: Tensor, seeds: Sequence[int] | None, *, temperature: float,
               should_stop: Callable[[], bool]) -> Completions:
        s = self.settings
        gens = [torch.Generator(device=self.device).manual_seed(seed) for seed in seeds or ()]
        return sampler.sample(self.model, prompt_ids=prompt_ids, prompt_mask=prompt_mask, temperature=temperature,
                              generator=(gens[0] if len(gens) == 1 else gens) if gens else None,
                              should_stop=should_stop, max_new_tokens=s.max_tokens, eos_ids=s.stop_token_ids,
                              pad_id=self.pad_id, top_k=s.top_k, top_p=s.top_p,
                              repetition_penalty=s.repetition_penalty, finished=self.finished,
                              compiled=self.compiled, keep_decoder=self.keep_decoder, logprobs=self.logprobs)

    def release(self) -> None:
        pass                      # sampler.sample releases a kept decoder's cache after each call

    def status(self) -> dict[str, str | float]:
        return {"engine": "native"}

    def close(self) -> None:
        pass
