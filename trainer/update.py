"""The update of a GRPO step (SPEC §1, step 4): PPO's clipped objective per token over a step's
rollouts, micro-batch by micro-batch, with the optional KL term and the engine's importance-sampling
correction, on one process or several (DDP for adapters, FSDP for a full fine-tune).

Gradients accumulate over the step's B*G completions, so the update equals one over all of them
(up to float rounding); with several processes DDP averages the ranks' gradients, each rank's
loss normalised by the whole step's n or tokens and scaled by the world size: the average is the
whole step's. Nothing is applied when the step's rewards, loss or gradient norm is not finite
(NonFiniteStep, decided by every rank together)."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from dataclasses import dataclass
import torch
from torch import Tensor

from grpo_run.trainer import grpo
from grpo_run.trainer.config import GRPOParams, default_micro_batch
from grpo_run.trainer.distributed import World
from grpo_run.trainer.sharding import unsharded, wrap_ddp
from grpo_run.trainer.model import llama
from grpo_run.trainer.model.policy import compute_dtype
from grpo_run.trainer.rollout import Rollouts
from grpo_run.trainer.sampling.engines import AGREEMENT, EngineDisagrees

log = logging.getLogger(__name__)


class NonFiniteStep(ArithmeticError):
    """A training step's numbers are not finite (NaN or infinite): its rewards, its loss or its
    gradient norm. Raised before the optimizer steps, so nothing of the step is applied, and a
    checkpoint is never sealed after it. Restarting cannot help: a resumed run replays the same
    step with the same numbers. `step`: the step as the record counts them (1 is the first)."""

    def __init__(self, step: int, what: str, value: float) -> None:
        self.step, self.what, self.value = step, what, value
        super().__init__(
            f"step {step}: the {what} is {value} (not a finite number); the step was not applied and no "
            f"checkpoint holds it. Usual causes: a learningRate too high for this model, or a reward "
            f"(times its weight) too large; change the job and submit it again")


@dataclass(frozen=True)
class Updated:
    """What one update did, for the step's metrics (this process's share)."""
    loss: float                   # the last iteration's, summed over micro-batches
    clipped: float                # tokens whose ratio was clipped
    kl: float | None              # the KL term summed over tokens (None: beta is 0)
    grad_norm: float
    micro_batches: int
    learning: int                 # completions with a non-zero advantage (or all, with a KL term)
    mismatch: float | None        # mean |trainer - engine| log-probability over drawn tokens (None: native)
    offpolicy: dict[str, float] | None = None   # staleness: the lag and the ratios' statistics (`lag`)


class Ratios:
    """An asynchronous step's importance ratios p_trained / p_drawing over its loss tokens (the
    first iteration's: the policy as the step starts), and the share the cap truncated."""

    def __init__(self, cap: float) -> None:
        self.cap, self.total, self.tokens, self.truncated = cap, 0.0, 0, 0
        self.low, self.high = math.inf, -math.inf

    def add(self, trained: Tensor, drawing: Tensor, mask: Tensor) -> None:
        keep = mask.bool()
        r = torch.exp(trained.detach() - drawing)[keep]
        if r.numel():
            self.total += float(r.sum())
            self.tokens += r.numel()
            self.truncated += int((r > self.cap).sum())
            self.low, self.high = min(self.low, float(r.min())), max(self.high, float(r.max()))

    def summary(self) -> dict[str, float]:
        if not self.tokens:
            return {"isRatioMean": 1.0, "isRatioMin": 1.0, "isRatioMax": 1.0, "isTruncated": 0.0}
        return {"isRatioMean": self.total / self.tokens, "isRatioMin": self.low, "isRatioMax": self.high,
                "isTruncated": self.truncated / self.tokens}


class Update:
    """The update's side of a trainer: its model (under DDP with several processes), optimizer and
    schedule; `tokens_at_most`: the most tokens a completion samples (Dr. GRPO's divisor)."""

    def __init__(self, model: torch.nn.Module, trainable: list[torch.nn.Parameter], optimizer, scheduler,
                 reference: torch.nn.Module | None, params: GRPOParams, world: World, device: torch.device, *,
                 fsdp: bool, tokens_at_most: int) -> None:
        self.model, self.trainable, self.optimizer, self.scheduler = model, trainable, optimizer, scheduler
        self.reference, self.params, self.world, self.device = reference, params, world, device
        self.fsdp, self.tokens_at_most = fsdp, tokens_at_most
        self._ddp: torch.nn.Module | None = None   # the model under DDP, for the update (several processes)

    def run(self, step: int, batch: Rollouts, loss_mask: Tensor, adv: Tensor, rewards: Tensor, *,
            tokens: int, lag: int | None = None) -> Updated:
        """Step `step` (0-based) of `batch`, its advantages `adv` [N] and loss mask [N, T] (the
        batch's, less maskTruncatedCompletions' rows); `tokens`: the whole step's loss tokens;
        `lag`: an asynchronous run's (trainer.ahead) steps between the policy that drew the batch
        and this one (None: synchronous). Raises NonFiniteStep before anything is applied."""
        p, world = self.params, self.world
        n = p.promptsPerStep * p.numGenerations                                      # the whole step's
        if not self.model.training:        # sampling leaves the mode as it was: set once, not every step
            self.model.train()
        learning = grpo.learning_rows(adv, p.beta)                                     # [M <= b*G]
        parts = [self.trimmed(batch.prompt_ids, batch.prompt_mask, batch.ids, batch.mask, rows)
                 for rows in grpo.micro_batches(learning, self.micro_batch_size)]
        refs = [self._reference_logprobs(*part[1:]) for part in parts] if p.beta > 0 else None
        olds: list[Tensor | None] = [None] * len(parts)
        # vLLM samples: each token's loss weighted by min(p_trainer / p_engine, cap) (truncated
        # importance sampling), the engine's and the trainer's log-probabilities differing a little
        # Asynchronous (`lag`): the same weighting against the drawing version's log-probabilities
        # (recorded as it sampled), min(p_trained / p_drawing, stalenessImportanceCap): truncated,
        # never masked, so no token is dropped; the ratios' statistics are the step's metrics
        engine = batch.engine_logprobs
        cap = (p.stalenessImportanceCap if lag is not None else p.vllm.importanceSamplingCap) if engine is not None else 0.0
        is_weights: list[Tensor | None] = [None] * len(parts)
        mismatch = [0.0, 0]                                        # sum |trainer - engine| over tokens, tokens
        ratios = Ratios(cap) if lag is not None else None
        model = self._update_model()
        for iteration in range(p.numIterations):
            # zeros, not None: with no completion to learn from, the optimizer still takes its step
            # (Adam's moments decay, weight decay applies) exactly as over an all-zero gradient
            self.optimizer.zero_grad(set_to_none=False)
            for param in self.trainable:
                if param.grad is None:                 # first step of this process
                    param.grad = torch.zeros_like(param)
            with self.whole_weights():     # FSDP: whole for the passes, sharded again for the step
                loss = clipped_tokens = kl_sum = 0.0
                for j, (sl, p_ids, p_mask, c_ids, c_mask) in enumerate(parts):
                    with self._sync_gradients(last=j == len(parts) - 1):
                        logps = grpo.completion_logprobs(model, p_ids, p_mask, c_ids, c_mask, p.temperature,
                                                         fast=self.fast_forward)                     # [m, T]
                        l_mask = loss_mask[sl, :c_mask.size(1)]                              # [m, T]
                        if olds[j] is None:
                            olds[j] = logps.detach()    # the sampling policy: ratio is exactly 1 on iteration 1
                            if engine is not None:
                                eng = engine[sl, :c_mask.size(1)]                                # [m, T]
                                drawn = batch.loss_mask[sl, :c_mask.size(1)]   # an episode's observations: not drawn
                                mismatch[0] += float(((olds[j] - eng).abs() * drawn).sum())
                                mismatch[1] += int(drawn.sum())
                                if cap > 0:
                                    is_weights[j] = grpo.truncated_is_weights(olds[j], eng, cap)
                                if ratios is not None:
                                    ratios.add(olds[j], eng, l_mask)
                        per_token, clipped = grpo.clipped_token_loss(logps, olds[j], adv[sl], p.epsilon)
                        if is_weights[j] is not None:
                            per_token = per_token * is_weights[j]
                        if refs is not None:
                            kl = grpo.k3_kl(logps, refs[j])
                            per_token = per_token + p.beta * kl
                            kl_sum += (kl.detach() * l_mask).sum().item()
                        part_loss = grpo.reduce_loss(per_token, l_mask, p.lossType, self.tokens_at_most,
                                                     completions=n, tokens=tokens)
                        (part_loss * world.size if world.distributed else part_loss).backward()
                    loss += part_loss.item()
                    clipped_tokens += (clipped.float() * l_mask).sum().item()
                if world.distributed and not parts:      # nothing to learn here: join the average with zeros
                    self._zero_backward(model, batch)
            if engine is not None and iteration == 0 and not lag:    # lag 0: the drawing policy is this one
                self._check_agreement(step, mismatch[0] / mismatch[1] if mismatch[1] else 0.0)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, p.maxGradNorm, foreach=True)
            if hasattr(grad_norm, "full_tensor"):      # FSDP: a DTensor, the whole gradient's norm
                grad_norm = grad_norm.full_tensor()
            self._check_finite(step, rewards, loss, float(grad_norm))   # before anything is applied
            self.optimizer.step()
        self.scheduler.step()
        return Updated(loss=loss, clipped=clipped_tokens, kl=kl_sum if refs is not None else None,
                       grad_norm=float(grad_norm), micro_batches=len(parts), learning=int(learning.numel()),
                       mismatch=None if engine is None or lag is not None else
                       (mismatch[0] / mismatch[1] if mismatch[1] else 0.0),
                       offpolicy=None if ratios is None else {"staleness": lag, **ratios.summary()})

    def _check_agreement(self, step: int, mismatch: float) -> None:
        """Raise EngineDisagrees when the engine's log-probabilities of what it drew are not the
        policy's (beyond spec.parameters.vllm.maxLogprobMismatch, or the dtype's AGREEMENT): checked
        after every sync, before anything of the step is applied."""
        dtype = compute_dtype(self.device)
        bound = self.params.vllm.maxLogprobMismatch or AGREEMENT.get(dtype, max(AGREEMENT.values()))
        if mismatch > bound:
            raise EngineDisagrees(
                f"step {step + 1}: the sampling engine's log-probabilities of the tokens it drew differ from the "
                f"trainer's by {mismatch:.3g} nats on average (the bound for {str(dtype).removeprefix('torch.')} is "
                f"{bound:g}): the engine is not sampling the policy being trained, and the step was not trained on. "
                f"Likely causes: the adapter or weights did not reach the engine (a failed reload), a vLLM server "
                f"serving another base model or another job's adapter, or the engine's dtype differs from the "
                f"trainer's; spec.parameters.vllm.maxLogprobMismatch sets the bound")

    def _check_finite(self, step: int, rewards: Tensor, loss: float, grad_norm: float) -> None:
        """Raise NonFiniteStep when the step's rewards, loss or gradient norm is not finite. Each
        reward is finite and within MAX_ABS_REWARD (the grader checks), but a weight can still
        carry the sum past float32's range. Several processes: decided together (one all-reduce),
        since each rank's rewards and loss are its own, so every rank raises at the same step and
        none waits in a collective."""
        bad_rewards, bad_loss, bad_norm = self.world.agree(not bool(torch.isfinite(rewards).all()),
                                                           not math.isfinite(loss), not math.isfinite(grad_norm))
        if bad_rewards:
            worst = rewards[~torch.isfinite(rewards)]
            raise NonFiniteStep(step + 1, "weighted sum of a completion's rewards (in float32)",
                                float(worst[0]) if worst.numel() else math.nan)
        if bad_loss:
            raise NonFiniteStep(step + 1, "loss", loss if not math.isfinite(loss) else math.nan)
        if bad_norm:
            raise NonFiniteStep(step + 1, "gradient norm", grad_norm if not math.isfinite(grad_norm) else math.nan)

    @functools.cached_property
    def fast_forward(self) -> llama.LlamaFamily | None:
        """The update's forward through the Llama family's arithmetic (llama.LlamaFamily.training_logits:
        the model's own, bit for bit, without the library's per-call machinery), for a model alone in
        its process that it stands for (llama.training_refusal); None: the model's own forward."""
        if self.world.distributed:        # DDP's forward starts the all-reduce; FSDP gathers in hooks
            return None
        reason = llama.training_refusal(self.model)
        if reason is not None:
            log.debug("the update runs through the model's own forward: %s", reason)
            return None
        return llama.LlamaFamily.of(self.model)

    @functools.cached_property
    def micro_batch_size(self) -> int:
        """Completions per forward/backward, one figure for the whole run:
        spec.parameters.microBatchSize, else trainer.config.default_micro_batch for this model on
        this device at full completion length. The supervisor records it at the first start and
        passes it back on a resume, so a run resumed on another kind of node keeps its arithmetic."""
        p = self.params
        completions = p.promptsPerStep * p.numGenerations
        if p.microBatchSize is not None:
            return min(p.microBatchSize, completions)
        vocab = self.model.get_output_embeddings().weight.size(0)
        device_bytes = (torch.cuda.get_device_properties(self.device).total_memory
                        if self.device.type == "cuda" else None)
        return default_micro_batch(completions, self.tokens_at_most + 1, vocab,
                                   compute_dtype(self.device).itemsize, device_bytes)

    def whole_weights(self) -> contextlib.AbstractContextManager:
        """Full fine-tunes on several processes (FSDP): every unit's whole weights for the block."""
        return unsharded(self.model) if self.fsdp else contextlib.nullcontext()

    def _update_model(self) -> torch.nn.Module:
        """The model the update runs through: itself (alone, or sharded by FSDP), or under DDP
        with several processes (made at the first step: a checkpoint has been loaded into the
        very same parameters by then)."""
        if not self.world.distributed or self.fsdp:
            return self.model
        if self._ddp is None:
            self._ddp = wrap_ddp(self.model, self.world)
        return self._ddp

    def _sync_gradients(self, *, last: bool):
        """DDP's all-reduce on the step's last micro-batch only; the others accumulate locally."""
        if self.fsdp:
            self.model.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
        if self._ddp is None or last:
            return contextlib.nullcontext()
        return self._ddp.no_sync()

    def _zero_backward(self, model, batch: Rollouts) -> None:
        """A rank whose completions all have advantage 0 still joins DDP's all-reduce: one row's
        forward, its loss times 0, so every trainable parameter gets a zero gradient."""
        sl, p_ids, p_mask, c_ids, c_mask = self.trimmed(batch.prompt_ids, batch.prompt_mask, batch.ids, batch.mask,
                                                        torch.zeros(1, dtype=torch.long, device=self.device))
        logps = grpo.completion_logprobs(model, p_ids, p_mask, c_ids, c_mask, self.params.temperature)
        (logps.sum() * 0.0).backward()

    @staticmethod
    def trimmed(prompt_ids, prompt_mask, comp_ids, comp_mask, sl: Tensor):
        """Micro-batch `sl` (row indices), without the prompt padding columns (left) and completion padding
        columns (right) that none of its rows use: positions come from the mask, so the
        log-probabilities are the same, for less memory when its completions are short."""
        p_mask, c_mask = prompt_mask[sl], comp_mask[sl]
        first = p_mask.size(1) - int(p_mask.sum(1).max())             # prompts are left-padded
        last = int(c_mask.sum(1).max())                               # completions are right-padded
        return sl, prompt_ids[sl, first:], p_mask[:, first:], comp_ids[sl, :last], c_mask[:, :last]

    @torch.no_grad()
    def _reference_logprobs(self, prompt_ids, prompt_mask, comp_ids, comp_mask) -> Tensor:
        if self.reference is not None:
            return grpo.completion_logprobs(self.reference, prompt_ids, prompt_mask, comp_ids, comp_mask,
                                            self.params.temperature)
        with self.model.disable_adapter():   # LoRA/QLoRA: the base itself is the reference, no extra weights
            return grpo.completion_logprobs(self.model, prompt_ids, prompt_mask, comp_ids, comp_mask,
                                            self.params.temperature)
