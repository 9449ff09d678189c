"""The GRPO training loop: one object that owns the policy, its optimizer and the grader.

Read `train_step` top to bottom: it is SPEC §1 — sample a group, score, advantages, update.
Inside this object a stop request (preemption) is honoured between tokens while sampling, in
training and in evaluation, and between evaluation batches: either raises
`GenerationInterrupted`, and the half-done step or batch is abandoned. Between steps it is the
caller's (trainer.recipe.train). The last *completed* step is what a checkpoint holds.

Determinism: everything random in step s is seeded from (seed, s) — the prompts it sees, one
sampling generator per prompt (from (seed, s, the prompt's place in the step)), torch's global
RNG (LoRA dropout) — so a run resumed at step s replays exactly what an uninterrupted run would
have done, and a prompt draws from the same stream on any number of processes.

Several processes (trainer.distributed): each samples, scores and computes the advantages of
its shard of the step's prompts; DDP averages the gradients; rank 0 reports. Under a stop
request a rank abandons sampling as one process does, and the ranks agree right after sampling
whether the step is abandoned, so they never disagree about which collective comes next.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from grpo_run.trainer import evaluation, grpo, kept_samples
from grpo_run.trainer.evaluation import Answers, EvalResult
from grpo_run.trainer.metrics import step_metrics
from grpo_run.trainer.sampling import decode, sampler
from grpo_run.trainer.sampling.engines import NativeSampler, Sampler
from grpo_run.trainer.sampling.start import resolved_engine, start_vllm, stop_strings_check
from grpo_run.trainer.config import GRPOParams, default_micro_batch
from grpo_run.trainer.distributed import World, full_state, load_full_state, shard_fsdp, unsharded, wrap_ddp
from grpo_run.trainer.envs.catalog import Environment
from grpo_run.trainer.envs.tasks import Task
from grpo_run.trainer.episodes import replay
from grpo_run.trainer.episodes.loop import Episodes, episode_seed, run_episodes
from grpo_run.trainer.episodes.tokens import TurnRenderer
from grpo_run.trainer.grader.scoring import Scorer
from grpo_run.trainer.model.missing import loading
from grpo_run.trainer.model.policy import (compute_dtype, eos_token_ids, load_policy, load_reference, load_tokenizer, pick_device, trainable_parameters)
from grpo_run.trainer.model.prompts import Prompt, PromptEncoder
from grpo_run.trainer.protocol import SampleGroup
from grpo_run.trainer.threads import CpuShare

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


def step_seed(seed: int, step: int) -> int:
    """A distinct, reproducible seed for step `step` of a run seeded `seed`."""
    return (seed * 1_000_003 + step * 7919 + 17) % (2**63 - 1)


def prompt_seed(seed: int, step: int, position: int) -> int:
    """The seed of the sampling generator of the prompt at `position` (0-based) among step `step`'s."""
    return (step_seed(seed, step) * 1_000_033 + position * 104_729 + 1) % (2**63 - 1)


def batch_indices(seed: int, step: int, per_step: int, n_tasks: int) -> list[int]:
    """Which train tasks step `step` (0-based) sees: consecutive slices of per-epoch permutations.

    Derived from (seed, step) alone, so the data position needs no state of its own.
    """
    out, perms = [], {}
    for i in range(step * per_step, (step + 1) * per_step):
        epoch, pos = divmod(i, n_tasks)
        if epoch not in perms:             # one permutation for each epoch the step's slice reaches
            perms[epoch] = np.random.default_rng([seed, epoch]).permutation(n_tasks)
        out.append(int(perms[epoch][pos]))
    return out


class GRPOTrainer:
    """Owns the policy, optimizer, scheduler and grader for one run."""

    def __init__(self, model_path: str, env: Environment, params: GRPOParams, *,
                 stop: threading.Event | None = None, device: torch.device | None = None,
                 model_name: str | None = None, world: World | None = None, sandbox_strict: bool = False,
                 judge_calls: dict[str, int] | None = None, judge_usd: dict[str, float] | None = None,
                 work: Path | None = None) -> None:
        self.params = params
        self.env = env
        self.stop = stop or threading.Event()
        self.world = world or World()
        self.cpu = CpuShare.from_environment()     # this node's threads, shared with its other trainers
        self.device = device or (self.world.device() if self.world.distributed else pick_device())
        self._ddp: torch.nn.Module | None = None   # the model under DDP, for the update (several processes)
        with loading("spec.model", model_path):        # not there: the job fails, no restarts
            self.tokenizer = load_tokenizer(model_path)
            self.model = load_policy(model_path, params, self.device)
        # several processes: LoRA/QLoRA adapters replicated under DDP, a full fine-tune sharded (FSDP)
        self.fsdp = self.world.distributed and params.method == "Full"
        if self.fsdp:
            if params.compileDecode:
                raise ValueError("compileDecode does not work with method Full on several processes (FSDP): "
                                 "its compiled step keeps weights that FSDP gathers afresh for every sampling")
            shard_fsdp(self.model, self.world)      # before the optimizer: its parameters become shards
        self._share_cpu()                      # after the load: a run started beside this one has registered
        if model_name and hasattr(self.model, "peft_config"):
            # Saved adapters name the base as the user did (a hub id, tiny:char), not as a path
            # on this node: exports from any node are then byte-identical.
            self.model.peft_config["default"].base_model_name_or_path = model_name
        self.reference = load_reference(model_path, self.device) if params.beta > 0 and params.method == "Full" else None
        self.trainable = trainable_parameters(self.model)
        # foreach: one kernel per operation over all tensors, not one per tensor (the default on
        # CPU); the same arithmetic, bit for bit, and a LoRA adapter is dozens of small tensors
        self.optimizer = torch.optim.AdamW(self.trainable, lr=params.learningRate, weight_decay=params.weightDecay,
                                           foreach=True)
        from transformers import get_scheduler

        self.scheduler = get_scheduler(params.lrScheduler, self.optimizer, num_warmup_steps=params.warmupSteps,
                                       num_training_steps=params.maxSteps)
        self._adapter: dict[str, torch.Tensor] | None = None   # snapshot's view of the adapter (LoRA, QLoRA)
        # episodes: the digests recorded for steps a resume replays ({step: [digest, ...]}: the plan's), and
        # the newest step's (rank 0; trainer.episodes.replay)
        self.replays: Mapping[int, Sequence[str]] = {}
        self.episode_digests: list[str] | None = None
        self.samples: list[SampleGroup] = []      # the newest step's first groups (trainer.kept_samples)
        # reward functions in sandboxed graders; a reward model (on this device, outside the optimizer) or judge here
        self.scorer = Scorer(env.rewards, search_path=env.search_path, device=self.device, judge_calls=judge_calls,
                             judge_usd=judge_usd, timeout_s=params.rewardTimeoutSeconds, memory_mb=params.rewardMemoryMB,
                             retries=params.rewardRetries, strict=sandbox_strict,
                             episodes=env.episodes is not None and env.episodes.rewards_itself)
        # multi-turn: the environment's objects in a sandboxed worker of their own, as a reward's
        self.environment = None
        if env.episodes is not None:
            from grpo_run.trainer.episodes.host import EnvironmentHost

            self.environment = EnvironmentHost(env.episodes.ref, search_path=env.search_path,
                                               timeout_s=params.rewardTimeoutSeconds, memory_mb=params.rewardMemoryMB,
                                               retries=0, strict=sandbox_strict, tools=env.episodes.tools,
                                               tool_timeout_s=env.episodes.tool_timeout_s,
                                               step_timeout_s=env.episodes.step_timeout_s)
        self._work, self._scratch = work, None
        self.sampler: Sampler = self._start_sampler(model_path)

    def close(self) -> None:
        self.sampler.close()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
        self.scorer.close()
        if self.environment is not None:
            self.environment.close()
        if self.cpu is not None:
            self.cpu.close()

    @property
    def sandbox_mode(self) -> dict[str, str]:
        """The reward sandbox's layers in force (Scorer.sandbox_mode), the episodes environment's
        worker's among them."""
        modes = dict(self.scorer.sandbox_mode)
        if self.environment is not None:
            for layer, value in self.environment.sandbox_mode.items():
                modes[layer] = "|".join(sorted({value, *modes.get(layer, value).split("|")}))
        return modes

    @property
    def cpu_threads(self) -> int:
        """The threads torch computes with on this process (the node's share, or the user's setting)."""
        return torch.get_num_threads()

    def _share_cpu(self) -> None:
        if self.cpu is not None and self.device.type == "cpu":
            self.cpu.take()                     # decided once, before the first forward

    # --- helpers -------------------------------------------------------------------------

    @functools.cached_property
    def prompts(self) -> PromptEncoder:
        """Task prompts (text or chat messages) to ids, through the tokenizer's chat template."""
        tools = self.environment.tool_schemas if self.environment is not None else []
        return PromptEncoder(self.tokenizer, system_prompt=self.params.systemPrompt,
                             template_kwargs={**self.params.chatTemplateKwargs, **({"tools": tools} if tools else {})})

    @functools.cached_property
    def eos_ids(self) -> tuple[int, ...]:
        """Every token id that ends a completion: the generation config's and the tokenizer's."""
        return eos_token_ids(self.tokenizer.name_or_path, self.tokenizer)

    def _encode(self, prompts: Sequence[Prompt]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded prompt ids and attention mask [N, P]; raises ValueError for a prompt the
        tokenizer cannot render (messages without a chat template)."""
        ids, mask = self.prompts.encode(prompts)
        return ids.to(self.device), mask.to(self.device)

    def _decode_ids(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _decode(self, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
        # the rows as lists in one call each, not a tensor slice per row (a step's 64 slices were
        # most of what decoding short completions cost); a completion repeated in the batch is
        # decoded once
        rows = [tuple(t for t, m in zip(row, keep) if m) for row, keep in zip(ids.tolist(), mask.tolist())]
        texts = {row: self._decode_ids(list(row)) for row in dict.fromkeys(rows)}
        return [texts[row] for row in rows]

    def _start_sampler(self, model_path: str) -> Sampler:
        """The engine that samples for this run (trainer.sampling.start): the native decoder reads
        the model and the generation settings as they are at each sampling; vLLM gets the work folder
        (a trainer built without one, for benchmarks and the API's tests: a scratch folder)."""
        p = self.params
        if resolved_engine(p, self.model.config.to_dict, self.device, self.world) == "native":
            return NativeSampler(self.device, lambda: dict(
                model=self.model, max_new_tokens=p.maxCompletionLength, eos_ids=self.eos_ids,
                pad_id=self.tokenizer.pad_token_id, top_k=p.topK, top_p=p.topP, repetition_penalty=p.repetitionPenalty,
                finished=stop_strings_check(self.tokenizer, p.stopStrings), compiled=p.compileDecode,
                keep_decoder=not self.fsdp))
        if self._work is None:
            self._work = self._scratch = Path(tempfile.mkdtemp(prefix="grpo-run-vllm-"))
        return start_vllm(model_path, self.tokenizer, self.eos_ids, p, self.device, self._work)

    @property
    def sampler_status(self) -> dict[str, str | float]:
        """The engine as `get tj` shows it (status.sampler): engine, version, mode, start-up seconds."""
        s = self.sampler
        if s.engine == "native":
            return {"engine": "native"}
        return {"engine": s.engine, "version": s.version, "mode": self.params.vllm.mode,
                "startSeconds": round(s.start_seconds, 2), **({"server": self.params.vllm.server}
                                                              if self.params.vllm.mode == "server" else {})}

    def _generate(self, prompt_ids, prompt_mask, temperature: float, seeds: Sequence[int] | None) -> sampler.Completions:
        """Sample completions (ids, mask, truncated, entropy, the engine's log-probabilities) with
        the run's engine; one seed per prompt's group, or one for all rows (None: unseeded, the
        native decoder's greedy tests). A stop request between
        two tokens (two engine steps) abandons them (GenerationInterrupted)."""
        return self.sampler.sample(prompt_ids, prompt_mask, seeds, temperature=temperature,
                                   should_stop=lambda: self.stop.is_set())

    def _play(self, tasks: Sequence[Task], seeds: Sequence[int], temperature: float) -> Episodes:
        """One episode per task to its end (trainer.episodes.loop), episode i seeded seeds[i]:
        the environment's reset gets it, and each turn draws from a generator made from it. The
        token budget is the model's context (max_position_embeddings)."""
        def sample(ids: torch.Tensor, mask: torch.Tensor, row_seeds: Sequence[int]) -> sampler.Completions:
            return self._generate(ids.to(self.device), mask.to(self.device), temperature, row_seeds)

        context = int(getattr(self.model.config, "max_position_embeddings", None) or 2**31 - 1)
        return run_episodes(sample, TurnRenderer(self.prompts, self.eos_ids), self.environment, tasks, seeds,
                            max_turns=self.env.episodes.max_turns, context=context, pad_id=self.tokenizer.pad_token_id)

    # --- evaluation (trainer.evaluation) ---------------------------------------------------

    def evaluate(self, tasks: Sequence[Task], *, done: Mapping[int, Mapping[str, Sequence[float]]] | None = None,
                 on_batch: Callable[[int, dict[str, list[float]]], None] | None = None,
                 on_samples: Callable[[list[SampleGroup]], None] | None = None) -> EvalResult:
        """Mean reward on held-out tasks: trainer.evaluation.evaluate with this trainer."""
        return evaluation.evaluate(self, tasks, done=done, on_batch=on_batch, on_samples=on_samples)

    @contextlib.contextmanager
    def sampling_weights(self) -> Iterator[None]:
        """The policy's weights as they are, in the engine, for the block (FSDP: every rank
        gathers its whole weights, whatever it computes)."""
        with self._whole_weights():
            self.sampler.load_policy(self.model)
            yield

    def answer_once(self, tasks: Sequence[Task], temperature: float, *, batch: int) -> Answers:
        """Each of `tasks` answered once (an episode played to its end), inside `sampling_weights`;
        evaluation batch `batch` draws from generators seeded from (seed, batch) alone."""
        seed = step_seed(self.params.seed, -1 - batch)
        if self.environment is not None:          # an episode per task, each seeded from the batch's seed
            played = self._play(tasks, [episode_seed(seed, j) for j in range(len(tasks))], temperature)
            return Answers(prompts=played.prompts, texts=self._decode(played.ids, played.mask),
                           lengths=played.mask.sum(1).tolist(), truncated=[t is not None for t in played.truncated],
                           episode_rewards=played.rewards, turns=played.turns, truncated_by=played.truncated,
                           tools=_tools_of(played), exchanges=played.exchanges(self._decode_ids))
        ids, mask = self._encode([t["prompt"] for t in tasks])
        comp, cmask, cut = self._generate(ids, mask, temperature, [seed])[:3]
        return Answers(prompts=[t["prompt"] for t in tasks], texts=self._decode(comp, cmask),
                       lengths=cmask.sum(1).tolist(), truncated=cut.tolist())

    # --- one GRPO step -------------------------------------------------------------------

    def train_step(self, step: int) -> dict[str, float]:
        """Step `step` (0-based). Returns its metrics. Raises GenerationInterrupted on a stop
        request during sampling (nothing of this step has been applied; several processes: on
        any of them), RewardFunctionError when the reward function fails on every try,
        NonFiniteStep when its rewards, loss or gradient norm is not finite (before the optimizer
        steps: the weights stay as they were)."""
        p, t0, world = self.params, time.perf_counter(), self.world
        seed = step_seed(p.seed, step)
        torch.manual_seed(seed + world.rank)           # LoRA dropout: its own stream on each rank
        # Python's and numpy's generators as well: what runs in this process (a judge client's retry
        # jitter) draws the same after a resume, and a checkpoint's RNG states are the same bytes
        # in two runs of one job (they came from the interpreter's start before)
        random.seed(seed + world.rank)
        np.random.seed((seed + world.rank) % 2**32)
        step_tasks = batch_indices(p.seed, step, p.promptsPerStep, len(self.env.train_tasks))
        mine = world.shard(len(step_tasks))            # this process's prompts (all of them, alone)
        tasks = [self.env.train_tasks[step_tasks[j]] for j in mine]
        seeds = [prompt_seed(p.seed, step, j) for j in mine]                 # one per prompt's group
        group = [t for t in tasks for _ in range(p.numGenerations)]          # b*G, each prompt G times

        # sample a group
        # (topK, topP and repetitionPenalty shape the draws only: the update's log-probabilities are
        # of the temperature-scaled distribution, as in TRL)
        # (episodes: a group is G episodes of the task, each its prompt's seed and its own place)
        played: Episodes | None = None
        if self.environment is None:
            prompt_ids, prompt_mask = self._encode([t["prompt"] for t in group])  # [b*G, P]
        interrupted = False
        engine_logps = None
        try:
            with self._whole_weights():
                self.sampler.load_policy(self.model)       # vLLM: the adapter (or weights) of the step before
                if self.environment is not None:
                    played = self._play(group, [episode_seed(s, k) for s in seeds for k in range(p.numGenerations)],
                                        p.temperature)
                    (prompt_ids, prompt_mask, comp_ids, comp_mask, entropy, truncated,
                     engine_logps) = played.tensors(self.device)
                else:
                    comp_ids, comp_mask, truncated, entropy, engine_logps = self._generate(
                        prompt_ids, prompt_mask, p.temperature, seeds)      # [b*G, T], [b*G, T], [b*G], [b*G], [b*G, T]
        except sampler.GenerationInterrupted:
            if not world.distributed:
                raise
            interrupted = True
        # maskTruncatedCompletions (DAPO's overlong filtering): a completion cut at maxCompletionLength
        # (an episode ended by a limit) gets no loss, since its end was never seen; it was scored and
        # counts in the metrics. As in TRL, it still counts among the n completions that grpo and
        # dr_grpo divide by. An episode's observations are never trained: its loss mask is its
        # sampled tokens' only.
        if interrupted:
            loss_mask = None
        else:
            loss_mask = played.loss_mask.to(self.device) if played is not None else comp_mask    # [b*G, T]
            if p.maskTruncatedCompletions:
                loss_mask = loss_mask * (~truncated).long().unsqueeze(1)
        # several processes: abandoned on every rank if on any, and the whole step's token count
        stopping, tokens = world.total(float(interrupted), 0.0 if loss_mask is None else float(loss_mask.sum()))
        if stopping:
            raise sampler.GenerationInterrupted()
        digests = None
        if played is not None:                 # a replayed step's episodes must be those recorded
            digests = replay.checked_digests(step, played, mine, p.numGenerations, self.replays, world,
                                             self.env.episodes.ref)
        n, tokens = p.promptsPerStep * p.numGenerations, int(tokens)               # the whole step's
        texts = self._decode(comp_ids, comp_mask)
        t_sampled = time.perf_counter()

        # score (in the graders' processes; a failure raises, never becomes a 0)
        by_reward = self.scorer.score(texts, group, [p.numGenerations] * len(tasks),
                                      episode=played.rewards if played is not None and self.scorer.episodes else None)
        rewards = torch.tensor(self.scorer.total(by_reward), dtype=torch.float32)      # [b*G], weighted sum
        # each reward is finite and within MAX_ABS_REWARD (the grader checks), but a weight can
        # still carry the sum past float32's range: checked with the loss, before the update
        rewards_finite = bool(torch.isfinite(rewards).all())

        # advantages (per group: a group never spans processes)
        adv = grpo.group_advantages(rewards, p.numGenerations, unbiased=p.advantageStd == "sample",
                                    scale=p.lossType != "dr_grpo").to(self.device)     # [b*G]

        # update, micro-batch by micro-batch: gradients accumulate over the step's B*G
        # completions, so the update equals one over all of them (up to float rounding); with
        # several processes DDP averages the ranks' gradients, each rank's loss normalised by the
        # whole step's n or tokens and scaled by the world size: the average is the whole step's
        if not self.model.training:        # sampling leaves the mode as it was: set once, not every step
            self.model.train()
        learning = grpo.learning_rows(adv, p.beta)                                     # [M <= b*G]
        parts = [self._trimmed(prompt_ids, prompt_mask, comp_ids, comp_mask, rows)
                 for rows in grpo.micro_batches(learning, self.micro_batch_size)]
        refs = [self._reference_logprobs(*part[1:]) for part in parts] if p.beta > 0 else None
        olds: list[torch.Tensor | None] = [None] * len(parts)
        # vLLM samples: each token's loss weighted by min(p_trainer / p_engine, cap) (truncated
        # importance sampling), the engine's and the trainer's log-probabilities differing a little
        cap = p.vllm.importanceSamplingCap if engine_logps is not None else 0.0
        is_weights: list[torch.Tensor | None] = [None] * len(parts)
        mismatch = [0.0, 0]                                        # sum |trainer - engine| over tokens, tokens
        if hasattr(self.sampler, "sleep"):
            self.sampler.sleep()                       # a GPU engine's KV cache is released for the update
        model = self._update_model()
        for _ in range(p.numIterations):
            # zeros, not None: with no completion to learn from, the optimizer still takes its step
            # (Adam's moments decay, weight decay applies) exactly as over an all-zero gradient
            self.optimizer.zero_grad(set_to_none=False)
            for param in self.trainable:
                if param.grad is None:                 # first step of this process
                    param.grad = torch.zeros_like(param)
            with self._whole_weights():     # FSDP: whole for the passes, sharded again for the step
                loss = clipped_tokens = kl_sum = 0.0
                for j, (sl, p_ids, p_mask, c_ids, c_mask) in enumerate(parts):
                    with self._sync_gradients(last=j == len(parts) - 1):
                        logps = grpo.completion_logprobs(model, p_ids, p_mask, c_ids, c_mask, p.temperature,
                                                         fast=self._fast_forward)                    # [m, T]
                        l_mask = loss_mask[sl, :c_mask.size(1)]                              # [m, T]
                        if olds[j] is None:
                            olds[j] = logps.detach()    # the sampling policy: ratio is exactly 1 on iteration 1
                            if engine_logps is not None:
                                eng = engine_logps[sl, :c_mask.size(1)]                          # [m, T]
                                sampled = c_mask if played is None else l_mask   # an episode's observations: not drawn
                                mismatch[0] += float(((olds[j] - eng).abs() * sampled).sum())
                                mismatch[1] += int(sampled.sum())
                                if cap > 0:
                                    is_weights[j] = grpo.truncated_is_weights(olds[j], eng, cap)
                        per_token, clipped = grpo.clipped_token_loss(logps, olds[j], adv[sl], p.epsilon)
                        if is_weights[j] is not None:
                            per_token = per_token * is_weights[j]
                        if refs is not None:
                            kl = grpo.k3_kl(logps, refs[j])
                            per_token = per_token + p.beta * kl
                            kl_sum += (kl.detach() * l_mask).sum().item()
                        part_loss = grpo.reduce_loss(per_token, l_mask, p.lossType, self.sampled_tokens_at_most,
                                                     completions=n, tokens=tokens)
                        (part_loss * world.size if world.distributed else part_loss).backward()
                    loss += part_loss.item()
                    clipped_tokens += (clipped.float() * l_mask).sum().item()
                if world.distributed and not parts:      # nothing to learn here: join the average with zeros
                    self._zero_backward(model, prompt_ids, prompt_mask, comp_ids, comp_mask)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, p.maxGradNorm, foreach=True)
            if hasattr(grad_norm, "full_tensor"):      # FSDP: a DTensor, the whole gradient's norm
                grad_norm = grad_norm.full_tensor()
            self._check_finite(step, rewards, rewards_finite, loss, float(grad_norm))   # before anything is applied
            self.optimizer.step()
        self.scheduler.step()

        local = {"rewards": rewards.tolist(), "byReward": {k: list(v) for k, v in by_reward.items()},
                 "entropy": float(entropy.sum()),
                 # tokens the model wrote (an episode's observations are not its)
                 "lengths": (comp_mask if played is None else played.loss_mask).sum(1).tolist(),
                 "truncated": truncated.tolist(), "loss": loss,
                 "clipped": clipped_tokens, "kl": kl_sum, "microBatches": len(parts),
                 "learning": int(learning.numel())}
        if played is not None:
            local.update(turns=played.turns, truncatedBy=played.truncated, digests=sorted(digests.items()))
            if played.tool_calls is not None:
                local.update(toolCalls=played.tool_calls, toolErrors=played.tool_errors)
        # what the model wrote: the step's first groups, for people to read (rank 0 reports them)
        firsts = [t["prompt"] for t in tasks] if played is None else played.prompts[::p.numGenerations]
        self.samples = kept_samples.step_groups(firsts, texts, by_reward, local["rewards"],
                                           adv.tolist(), local["lengths"], local["truncated"], p.numGenerations,
                                           p.sampleGroups if world.main else 0, self.scorer.primary,
                                           turns=None if played is None else played.turns,
                                           truncated_by=None if played is None else played.truncated,
                                           tools=_tools_of(played),
                                           exchanges=None if played is None else played.exchanges(
                                               self._decode_ids, p.sampleGroups * p.numGenerations if world.main else 0))
        shares = world.gather(local) if world.distributed else [local]
        metrics = step_metrics(shares, p.numGenerations, tokens, primary=self.scorer.primary,
                               iterations=p.numIterations)
        if played is not None and world.main:      # every episode's digests, in the step's order (rank 0 reports)
            self.episode_digests = [d for _, d in sorted(kv for share in shares for kv in share["digests"])]
        metrics.update(gradNorm=float(grad_norm), learningRate=self.scheduler.get_last_lr()[0],
                       sampleSeconds=t_sampled - t0, stepSeconds=time.perf_counter() - t0)
        if engine_logps is not None:
            metrics.update(syncSeconds=self.sampler.sync_seconds,
                           logprobMismatch=mismatch[0] / mismatch[1] if mismatch[1] else 0.0)
        if refs is None:
            metrics.pop("kl")
        return metrics

    def _check_finite(self, step: int, rewards: torch.Tensor, rewards_finite: bool, loss: float,
                      grad_norm: float) -> None:
        """Raise NonFiniteStep when the step's rewards, loss or gradient norm is not finite.
        Several processes: decided together (one all-reduce), since each rank's rewards and loss
        are its own, so every rank raises at the same step and none waits in a collective."""
        bad_rewards, bad_loss, bad_norm = self.world.agree(not rewards_finite, not math.isfinite(loss),
                                                           not math.isfinite(grad_norm))
        if bad_rewards:
            worst = rewards[~torch.isfinite(rewards)]
            raise NonFiniteStep(step + 1, "weighted sum of a completion's rewards (in float32)",
                                float(worst[0]) if worst.numel() else math.nan)
        if bad_loss:
            raise NonFiniteStep(step + 1, "loss", loss if not math.isfinite(loss) else math.nan)
        if bad_norm:
            raise NonFiniteStep(step + 1, "gradient norm", grad_norm if not math.isfinite(grad_norm) else math.nan)

    @functools.cached_property
    def _fast_forward(self) -> decode.LlamaFamilyDecoder | None:
        """The update's forward through the decoder's arithmetic (decode.LlamaFamilyDecoder.training_logits: the
        model's own, bit for bit, without the library's per-call machinery), for a model alone in
        its process that it stands for (decode.training_refusal); None: the model's own forward."""
        if self.world.distributed:        # DDP's forward starts the all-reduce; FSDP gathers in hooks
            return None
        reason = decode.training_refusal(self.model)
        if reason is not None:
            log.debug("the update runs through the model's own forward: %s", reason)
            return None
        return decode.LlamaFamilyDecoder.of(self.model)

    def _whole_weights(self):
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

    def _zero_backward(self, model, prompt_ids, prompt_mask, comp_ids, comp_mask) -> None:
        """A rank whose completions all have advantage 0 still joins DDP's all-reduce: one row's
        forward, its loss times 0, so every trainable parameter gets a zero gradient."""
        sl, p_ids, p_mask, c_ids, c_mask = self._trimmed(prompt_ids, prompt_mask, comp_ids, comp_mask,
                                                         torch.zeros(1, dtype=torch.long, device=self.device))
        logps = grpo.completion_logprobs(model, p_ids, p_mask, c_ids, c_mask, self.params.temperature)
        (logps.sum() * 0.0).backward()

    @property
    def sampled_tokens_at_most(self) -> int:
        """The most tokens a completion samples: maxCompletionLength, times maxTurns for an
        episode (its observations come besides: they are not counted here). Dr. GRPO's constant
        divisor, and the length the default micro-batch is sized for."""
        turns = self.env.episodes.max_turns if self.env.episodes is not None else 1
        return self.params.maxCompletionLength * turns

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
        return default_micro_batch(completions, self.sampled_tokens_at_most + 1, vocab,
                                   compute_dtype(self.device).itemsize, device_bytes)

    @staticmethod
    def _trimmed(prompt_ids, prompt_mask, comp_ids, comp_mask, sl: torch.Tensor):
        """Micro-batch `sl` (row indices), without the prompt padding columns (left) and completion padding
        columns (right) that none of its rows use: positions come from the mask, so the
        log-probabilities are the same, for less memory when its completions are short."""
        p_mask, c_mask = prompt_mask[sl], comp_mask[sl]
        first = p_mask.size(1) - int(p_mask.sum(1).max())             # prompts are left-padded
        last = int(c_mask.sum(1).max())                               # completions are right-padded
        return sl, prompt_ids[sl, first:], p_mask[:, first:], comp_ids[sl, :last], c_mask[:, :last]

    @torch.no_grad()
    def _reference_logprobs(self, prompt_ids, prompt_mask, comp_ids, comp_mask) -> torch.Tensor:
        if self.reference is not None:
            return grpo.completion_logprobs(self.reference, prompt_ids, prompt_mask, comp_ids, comp_mask,
                                            self.params.temperature)
        with self.model.disable_adapter():   # LoRA/QLoRA: the base itself is the reference, no extra weights
            return grpo.completion_logprobs(self.model, prompt_ids, prompt_mask, comp_ids, comp_mask,
                                            self.params.temperature)

    # --- its state, for checkpoints (trainer.checkpointing.snapshot writes and reads it) ------------

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of this trainer besides the RNGs (torchtitan's Stateful):
        "weights", the trainable weights (LoRA, QLoRA: the adapter's tensors as PEFT files name
        them; Full: the whole model's, each storage once, as safetensors stores tied weights);
        "optimizer", its "param_groups" and its "state" as one dict of moments per trainable
        parameter, in the optimizer's order; "scheduler", the learning-rate schedule's state.
        Live tensors: copy them before the next step changes them (snapshot.pack). A full
        fine-tune sharded by FSDP: a collective every rank calls, the whole state on rank 0's CPU
        and empty on the others."""
        param_groups = self.optimizer.state_dict()["param_groups"]
        if self.fsdp:
            weights, moments = full_state(self.model, self.optimizer)
        else:
            moments = [self.optimizer.state.get(p, {}) for p in self.trainable]
            weights = dict(self.adapter_state()) if self.params.method != "Full" else self.model.state_dict()
        if self.params.method == "Full":
            unique, seen = {}, set()
            for name, tensor in weights.items():
                if tensor.data_ptr() not in seen:     # tied weights: the first name of each storage
                    seen.add(tensor.data_ptr())
                    unique[name] = tensor
            weights = unique
        return {"weights": weights, "optimizer": {"param_groups": param_groups, "state": moments},
                "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The inverse of `state_dict` (every rank passes the same whole state; FSDP shards it).
        Raises ValueError when the weights or moments do not fit this trainer's trainable
        parameters (the job's lora settings or method changed since they were saved)."""
        weights, optimizer = state["weights"], state["optimizer"]
        if self.fsdp:
            load_full_state(self.model, self.optimizer, weights, optimizer["state"], optimizer["param_groups"])
        else:
            try:
                if self.params.method == "Full":
                    self.model.load_state_dict(weights, strict=False)
                else:
                    from peft import set_peft_model_state_dict

                    set_peft_model_state_dict(self.model, weights)
            except RuntimeError as exc:       # torch: "size mismatch for ...": say what it means here
                raise ValueError(f"weights do not fit this run's trainable parameters ({str(exc).strip()[:300]})") from None
            if len(optimizer["state"]) != len(self.trainable) or any(
                    m.shape != p.shape for p, s in zip(self.trainable, optimizer["state"]) for m in s.values() if m.dim()):
                raise ValueError("optimizer state does not fit this run's trainable parameters")
            self.optimizer.load_state_dict({"state": {i: s for i, s in enumerate(optimizer["state"]) if s},
                                            "param_groups": optimizer["param_groups"]})
        self.scheduler.load_state_dict(state["scheduler"])

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The adapter's tensors by their names in PEFT files (LoRA, QLoRA). Resolved once:
        walking the whole model's state dict at every checkpoint cost more than copying the
        adapter. The values share storage with the parameters, which the optimizer and
        `load_state_dict` update in place."""
        if self._adapter is None:
            from peft import get_peft_model_state_dict

            self._adapter = get_peft_model_state_dict(self.model, save_embedding_layers=False)
        return self._adapter


def _tools_of(played: Episodes | None) -> tuple[list[int], list[int]] | None:
    """Each episode's (tool calls, tool errors), with tools."""
    return None if played is None or played.tool_calls is None else (played.tool_calls, played.tool_errors or [])
