"""vLLM as the sampler, colocated with the trainer (TRL's default mode): one engine in this very
process, over the same base weights the trainer loaded.

- The policy reaches the engine before every sampling without merging the base: a LoRA adapter is
  written as PEFT files into a folder of the work folder and loaded in place (LoRARequest with
  load_inplace); a full fine-tune's weights are loaded into the engine's model (load_weights).
  load_policy returns the sync's seconds, a step metric.
- Seeds: every request carries its own, derived from its block's seed (a prompt's group, or an
  evaluation batch) and its place in it, so a resumed step draws the same tokens as the first try
  on the same hardware, whatever else is in the batch.
- A stop request (a notice) is honoured between two engine steps: every request is aborted, not
  waited for, and GenerationInterrupted raised.
- Log-probabilities: the engine's of each sampled token after temperature ("processed_logprobs"),
  for the trainer's truncated importance sampling (trainer.grpo.truncated_is_weights).
- On a GPU the engine's memory is bounded by gpuMemoryUtilization and its KV cache released while
  the trainer updates (sleep mode, level 1); on a CPU gpuMemoryUtilization is the share of the
  machine's memory its KV cache takes, and there is no sleep mode.

vLLM runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0): no engine process to outlive the trainer,
the abort is immediate, and the weights are loaded without crossing a process boundary.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import torch
from torch import Tensor

from grpo_run.trainer.sampling.sampler import Completions, GenerationInterrupted
from grpo_run.trainer.sampling.engines import EngineRefused, SampleSettings
from grpo_run.trainer.seeds import member_seed

log = logging.getLogger(__name__)


class Drawn(NamedTuple):
    """One completion as the engine drew it."""
    token_ids: list[int]
    logprobs: list[float]           # the engine's, of each drawn token (empty when greedy gives none)
    truncated: bool                 # cut at max_tokens


def completions(outs: Sequence[Drawn], pad_id: int, device: torch.device) -> Completions:
    """The trainer's Completions from the engine's draws: right-padded ids, mask, truncated,
    entropy (estimated) and the engine's log-probabilities."""
    width = max(1, max(len(o.token_ids) for o in outs))
    n = len(outs)
    tokens = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.long)
    logps = torch.zeros(n, width, dtype=torch.float32)
    truncated = torch.zeros(n, dtype=torch.bool)
    for i, o in enumerate(outs):
        k = len(o.token_ids)
        tokens[i, :k] = torch.tensor(o.token_ids, dtype=torch.long)
        mask[i, :k] = 1
        if o.logprobs:
            logps[i, :k] = torch.tensor(o.logprobs, dtype=torch.float32)
        truncated[i] = o.truncated
    # -sum log p(sampled token) is an unbiased estimate of the summed entropy the native decoder
    # computes exactly; 0 when greedy (no log-probabilities to estimate with)
    entropy = -(logps * mask).sum(1)
    return Completions(tokens.to(device), mask.to(device), truncated.to(device), entropy.to(device), logps.to(device))


class VllmSampler:
    """A vLLM engine sampling for one trainer process."""
    engine = "vllm"

    def __init__(self, model_path: str, *, method: str, lora_rank: int, dtype: torch.dtype, device: torch.device,
                 gpu_memory_utilization: float, work: Path, seed: int = 0, settings: SampleSettings | None = None,
                 pad_id: int = 0) -> None:
        """The engine over `model_path`'s base weights, for `method` (LoRA: adapters up to rank
        `lora_rank`; Full: weights loaded into it). `settings`: the run's, for `sample` (a
        server's engine has none: its `generate` takes a request's own with each call)."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"      # before vllm is imported: the engine in-process
        # and no usage report to stats.vllm.ai (vLLM's default) from the trainer or a vllm-server
        os.environ["VLLM_NO_USAGE_STATS"] = os.environ["DO_NOT_TRACK"] = "1"
        # vLLM's own lines (its engine config, kernels it lacks, thread counts) go to the trainer's log through
        # the root logger (trainer.logs), not to the terminal, where the progress line is
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
        threads = torch.get_num_threads()
        t0 = time.perf_counter()
        import vllm
        from vllm import LLM

        self.version = vllm.__version__
        self.method, self.pad_id, self.settings = method, pad_id, settings
        self.gpu = device.type == "cuda"
        self.folder = Path(work) / "vllm-adapter"
        lora = method == "LoRA"
        try:
            self.llm = LLM(model=model_path, dtype=str(dtype).removeprefix("torch."), seed=seed,
                           gpu_memory_utilization=gpu_memory_utilization, enable_lora=lora,
                           max_lora_rank=max(8, lora_rank) if lora else 16, max_loras=1,
                           logprobs_mode="processed_logprobs", enable_sleep_mode=self.gpu,
                           enforce_eager=not self.gpu, enable_prefix_caching=True,
                           use_tqdm_on_load=False)      # no progress bar of its own beside the run's
        except ValueError as e:           # vLLM's own word on memory and on models it cannot serve
            if "memory" not in str(e).lower():
                raise EngineRefused(f"spec.parameters.sampler: vLLM cannot serve spec.model here ({e}); use "
                                    f"sampler: native") from None
            where = "the GPU's memory" if self.gpu else \
                "the machine's memory, and on a CPU it must hold this whole trainer process besides the KV cache"
            raise EngineRefused(f"spec.parameters.vllm.gpuMemoryUtilization: {gpu_memory_utilization}: vLLM could "
                                f"not start with it ({e}); it is the share of {where}: raise it, or use "
                                f"sampler: native") from None
        # vLLM's CPU worker lowers torch's threads for serving; the trainer's arithmetic keeps its count
        torch.set_num_threads(threads)
        self.start_seconds = time.perf_counter() - t0
        self._lora = None
        self._asleep = False
        self._requests = 0
        log.info("vLLM %s started in %.1f s (%s)", self.version, self.start_seconds, "GPU" if self.gpu else "CPU")

    # --- the policy's weights --------------------------------------------------------------------

    def load_policy(self, model: torch.nn.Module) -> float:
        t0 = time.perf_counter()
        self._wake()
        if self.method == "LoRA":
            self._load_adapter(model)
        else:
            self._load_weights(model)
        return time.perf_counter() - t0

    def _load_adapter(self, model) -> None:
        if self.folder.exists():
            shutil.rmtree(self.folder)
        # adapter_config.json and adapter_model.safetensors only (embeddings are never the adapter's: PEFT need not
        # look for the base's config, which a tiny: or hub name does not locate)
        model.save_pretrained(str(self.folder), save_embedding_layers=False)
        self.use_adapter_folder(self.folder)

    def use_adapter_folder(self, folder: Path) -> None:
        """Sample with the PEFT adapter in `folder` from now on (loaded again even under the same name)."""
        from vllm.lora.request import LoRARequest

        self._lora = LoRARequest("policy", 1, str(folder), load_inplace=True)

    def _load_weights(self, model) -> None:
        self.load_weights([(name, p.detach()) for name, p in model.state_dict().items()])

    def load_weights(self, weights: list[tuple[str, Tensor]]) -> None:
        """A full fine-tune's weights (Hugging Face names) into the engine's model: vLLM's in-place
        reload, which also redoes what its loader did after loading (the CPU's repacked linear
        weights, for one; a plain load_weights into the processed layers fails there)."""
        self._wake()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        self.llm.llm_engine.reset_prefix_cache()     # cached KV blocks were computed by the old weights

    def release(self) -> None:
        """Release the KV cache for the update (a GPU's, vLLM's sleep mode level 1; a CPU engine has
        no sleep mode)."""
        if self.gpu and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    # --- sampling --------------------------------------------------------------------------------

    def sample(self, prompt_ids: Tensor, prompt_mask: Tensor, seeds: Sequence[int], *, temperature: float,
               should_stop: Callable[[], bool]) -> Completions:
        prompts = [prompt_ids[row][prompt_mask[row].bool()].tolist() for row in range(prompt_ids.size(0))]
        outs = self.generate(prompts, seeds, self.settings.at(temperature), should_stop)
        return completions(outs, self.pad_id, prompt_ids.device)

    def generate(self, prompts: list[list[int]], seeds: Sequence[int], settings: "SampleSettings",
                 should_stop: Callable[[], bool]) -> list[Drawn]:
        """One completion per prompt (token ids); `seeds` one per equal consecutive block of
        prompts. Raises GenerationInterrupted, every request aborted, when `should_stop()` turns true."""
        from vllm import SamplingParams

        self._wake()
        n = len(prompts)
        block = n // len(seeds)
        engine = self.llm.llm_engine
        ids: dict[str, int] = {}
        for row, prompt in enumerate(prompts):
            params = SamplingParams(
                n=1, temperature=settings.temperature, top_k=settings.top_k if settings.top_k > 0 else -1,
                top_p=settings.top_p, repetition_penalty=settings.repetition_penalty, max_tokens=settings.max_tokens,
                seed=member_seed(seeds[row // block], row % block), logprobs=0,
                stop_token_ids=list(settings.stop_token_ids), stop=list(settings.stop) or None,
                include_stop_str_in_output=True, skip_special_tokens=True)
            request = f"r{self._requests}"
            self._requests += 1
            ids[request] = row
            engine.add_request(request, {"prompt_token_ids": prompt}, params, lora_request=self._lora)
        outputs: dict[int, Drawn] = {}
        while engine.has_unfinished_requests():
            if should_stop():                         # a notice: abort, never wait for the requests
                engine.abort_request(list(ids))
                raise GenerationInterrupted()
            for out in engine.step():
                if out.finished:
                    o = out.outputs[0]
                    logps = [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)] if o.logprobs else []
                    outputs[ids[out.request_id]] = Drawn(list(o.token_ids), logps, o.finish_reason == "length")
        return [outputs[row] for row in range(n)]

    def status(self) -> dict[str, str | float]:
        return {"engine": self.engine, "version": self.version, "mode": "colocate",
                "startSeconds": round(self.start_seconds, 2)}

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            del llm
        if self.folder.exists():
            shutil.rmtree(self.folder, ignore_errors=True)
