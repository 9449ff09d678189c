"""The GRPO training loop: one object that owns the policy, its optimizer and the grader.

Read `train_step` top to bottom: it is SPEC §1 — sample a group, score, advantages, update.
Inside this object a stop request (preemption) is honoured between tokens while sampling, in
training and in evaluation, and between evaluation batches: either raises
`GenerationInterrupted`, and the half-done step or batch is abandoned. Between steps it is the
caller's (trainer.run.train). The last *completed* step is what a checkpoint holds.

Determinism: everything random in step s is seeded from (seed, s) — the prompts it sees, the
sampling generator, torch's global RNG (LoRA dropout) — so a run resumed at step s replays
exactly what an uninterrupted run would have done.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from trainer import grpo
from trainer.config import GRPOParams
from trainer.envs import Environment, Task
from trainer.grader import Grader
from trainer.policy import load_policy, load_reference, load_tokenizer, pick_device, trainable_parameters

log = logging.getLogger(__name__)


def step_seed(seed: int, step: int) -> int:
    """A distinct, reproducible seed for step `step` of a run seeded `seed`."""
    return (seed * 1_000_003 + step * 7919 + 17) % (2**63 - 1)


def batch_indices(seed: int, step: int, per_step: int, n_tasks: int) -> list[int]:
    """Which train tasks step `step` (0-based) sees: consecutive slices of per-epoch permutations.

    Derived from (seed, step) alone, so the data position needs no state of its own.
    """
    out = []
    for i in range(step * per_step, (step + 1) * per_step):
        epoch, pos = divmod(i, n_tasks)
        perm = np.random.default_rng([seed, epoch]).permutation(n_tasks)
        out.append(int(perm[pos]))
    return out


@dataclass(frozen=True)
class EvalResult:
    meanReward: float
    tasks: int
    solved: int                 # tasks with reward 1.0
    rewards: tuple[float, ...]
    batches: int = 1            # evaluation batches in all
    reusedBatches: int = 0      # of them, finished by an earlier attempt and not computed again

    @property
    def no_signal(self) -> bool:
        """All held-out rewards equal: at 0% or 100% GRPO's groups would all be identical."""
        return len(set(self.rewards)) <= 1

    def to_dict(self) -> dict[str, Any]:
        return {"meanReward": round(self.meanReward, 6), "tasks": self.tasks, "solved": self.solved,
                "batches": self.batches, "reusedBatches": self.reusedBatches}


class GRPOTrainer:
    """Owns the policy, optimizer, scheduler and grader for one run."""

    def __init__(self, model_path: str, env: Environment, params: GRPOParams, *,
                 stop: threading.Event | None = None, device: torch.device | None = None,
                 model_name: str | None = None) -> None:
        self.params = params
        self.env = env
        self.stop = stop or threading.Event()
        self.device = device or pick_device()
        self.tokenizer = load_tokenizer(model_path)
        self.model = load_policy(model_path, params, self.device)
        if model_name and hasattr(self.model, "peft_config"):
            # Saved adapters name the base as the user did (a hub id, tiny:char), not as a path
            # on this node: exports from any node are then byte-identical.
            self.model.peft_config["default"].base_model_name_or_path = model_name
        self.reference = load_reference(model_path, self.device) if params.beta > 0 and params.method == "Full" else None
        self.optimizer = torch.optim.AdamW(trainable_parameters(self.model), lr=params.learningRate,
                                           weight_decay=params.weightDecay)
        from transformers import get_scheduler

        self.scheduler = get_scheduler(params.lrScheduler, self.optimizer, num_warmup_steps=params.warmupSteps,
                                       num_training_steps=params.maxSteps)
        self._adapter: dict[str, torch.Tensor] | None = None   # snapshot's view of the adapter (LoRA, QLoRA)
        self.grader = Grader(env.reward_ref, search_path=env.search_path, timeout_s=params.rewardTimeoutSeconds,
                             memory_mb=params.rewardMemoryMB, retries=params.rewardRetries)

    def close(self) -> None:
        self.grader.close()

    # --- helpers -------------------------------------------------------------------------

    def _encode(self, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        enc = self.tokenizer(list(prompts), return_tensors="pt", padding=True)
        return enc.input_ids.to(self.device), enc.attention_mask.to(self.device)

    def _decode(self, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
        return [self.tokenizer.decode(row[m.bool()].tolist(), skip_special_tokens=True) for row, m in zip(ids, mask)]

    def _generate(self, prompt_ids, prompt_mask, temperature: float, generator):
        """Sample completions; a stop request between two tokens abandons them
        (GenerationInterrupted)."""
        self.model.eval()
        return grpo.sample(self.model, prompt_ids, prompt_mask, max_new_tokens=self.params.maxCompletionLength,
                           temperature=temperature, eos_id=self.tokenizer.eos_token_id,
                           pad_id=self.tokenizer.pad_token_id, generator=generator,
                           should_stop=lambda: self.stop.is_set())

    # --- evaluation ----------------------------------------------------------------------

    def evaluate(self, tasks: Sequence[Task], *, done: Mapping[int, Sequence[float]] | None = None,
                 on_batch: Callable[[int, list[float]], None] | None = None) -> EvalResult:
        """Mean reward on held-out tasks (greedy by default), scored by the grader, in batches
        of evalBatchSize. Batch i's rewards in `done` (from an attempt that was stopped part-way)
        are taken as they are; every batch computed here goes to `on_batch(i, rewards)`. Each
        batch draws from its own generator, seeded from (seed, i), so a batch computes the same
        whichever batches came before it. Raises GenerationInterrupted on a stop request between
        batches or between two tokens; the batches finished before it were reported."""
        p, done = self.params, done or {}
        rewards: list[float] = []
        starts = range(0, len(tasks), p.evalBatchSize)
        for i, start in enumerate(starts):
            if i in done:
                rewards += list(done[i])
                continue
            if self.stop.is_set():               # preemption honoured between evaluation batches
                raise grpo.GenerationInterrupted()
            chunk = list(tasks[start:start + p.evalBatchSize])
            gen = torch.Generator(device=self.device).manual_seed(step_seed(p.seed, -1 - i))
            ids, mask = self._encode([t["prompt"] for t in chunk])
            comp, cmask = self._generate(ids, mask, p.evalTemperature, gen)
            batch = self.grader.score(self._decode(comp, cmask), chunk)
            if on_batch is not None:
                on_batch(i, batch)
            rewards += batch
        return EvalResult(meanReward=float(np.mean(rewards)), tasks=len(tasks),
                          solved=sum(1 for r in rewards if r == 1.0), rewards=tuple(rewards),
                          batches=len(starts), reusedBatches=sum(1 for i in range(len(starts)) if i in done))

    # --- one GRPO step -------------------------------------------------------------------

    def train_step(self, step: int) -> dict[str, float]:
        """Step `step` (0-based). Returns its metrics. Raises GenerationInterrupted on a stop
        request during sampling (nothing of this step has been applied), RewardFunctionError
        when the reward function fails on every try."""
        p, t0 = self.params, time.perf_counter()
        seed = step_seed(p.seed, step)
        torch.manual_seed(seed)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        tasks = [self.env.train_tasks[i] for i in batch_indices(p.seed, step, p.promptsPerStep, len(self.env.train_tasks))]
        group = [t for t in tasks for _ in range(p.numGenerations)]          # B*G, each prompt G times

        # sample a group
        prompt_ids, prompt_mask = self._encode([t["prompt"] for t in group])  # [B*G, P]
        comp_ids, comp_mask = self._generate(prompt_ids, prompt_mask, p.temperature, gen)
        texts = self._decode(comp_ids, comp_mask)
        t_sampled = time.perf_counter()

        # score (in the grader's process; a failure raises, never becomes a 0)
        rewards = torch.tensor(self.grader.score(texts, group), dtype=torch.float32)   # [B*G]

        # advantages
        adv = grpo.group_advantages(rewards, p.numGenerations, unbiased=p.advantageStd == "sample",
                                    scale=p.lossType != "dr_grpo").to(self.device)     # [B*G]

        # update
        self.model.train()
        ref_logps = self._reference_logprobs(prompt_ids, prompt_mask, comp_ids, comp_mask) if p.beta > 0 else None
        old_logps = None
        for _ in range(p.numIterations):
            logps = grpo.completion_logprobs(self.model, prompt_ids, prompt_mask, comp_ids, comp_mask,
                                             p.temperature)                             # [B*G, T]
            if old_logps is None:
                old_logps = logps.detach()      # the sampling policy: ratio is exactly 1 on iteration 1
            per_token, clipped = grpo.clipped_token_loss(logps, old_logps, adv, p.epsilon)
            if ref_logps is not None:
                kl = grpo.k3_kl(logps, ref_logps)
                per_token = per_token + p.beta * kl
            loss = grpo.reduce_loss(per_token, comp_mask, p.lossType, p.maxCompletionLength)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(trainable_parameters(self.model), p.maxGradNorm)
            self.optimizer.step()
        self.scheduler.step()

        mask = comp_mask.float()
        metrics = {
            "rewardMean": rewards.mean().item(),
            "rewardStd": rewards.std(unbiased=False).item(),
            "identicalGroups": grpo.identical_group_fraction(rewards, p.numGenerations),
            "completionLength": mask.sum(1).mean().item(),
            "loss": loss.item(),
            "clipRatio": ((clipped.float() * mask).sum() / mask.sum().clamp_min(1)).item(),
            "gradNorm": float(grad_norm),
            "learningRate": self.scheduler.get_last_lr()[0],
            "sampleSeconds": t_sampled - t0,
            "stepSeconds": time.perf_counter() - t0,
        }
        if ref_logps is not None:
            metrics["kl"] = ((kl.detach() * mask).sum() / mask.sum().clamp_min(1)).item()
        return metrics

    @torch.no_grad()
    def _reference_logprobs(self, prompt_ids, prompt_mask, comp_ids, comp_mask) -> torch.Tensor:
        if self.reference is not None:
            return grpo.completion_logprobs(self.reference, prompt_ids, prompt_mask, comp_ids, comp_mask,
                                            self.params.temperature)
        with self.model.disable_adapter():   # LoRA/QLoRA: the base itself is the reference, no extra weights
            return grpo.completion_logprobs(self.model, prompt_ids, prompt_mask, comp_ids, comp_mask,
                                            self.params.temperature)

    # --- state for checkpoints (trainer.snapshot reads it) ----------------------------

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The adapter's tensors by their names in PEFT files (LoRA, QLoRA). Resolved once:
        walking the whole model's state dict at every checkpoint cost more than copying the
        adapter. The values share storage with the parameters, which the optimizer and
        `load_state` update in place."""
        if self._adapter is None:
            from peft import get_peft_model_state_dict

            self._adapter = get_peft_model_state_dict(self.model, save_embedding_layers=False)
        return self._adapter
