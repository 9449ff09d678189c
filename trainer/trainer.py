"""The GRPO training loop: one object that owns the policy, its optimizer and the grader.

Read `train_step` top to bottom: it is SPEC §1 — sample a group, score, advantages, update. It
plays its tasks through the run's rollout (trainer.rollout: single turns or episodes, with
whichever engine samples), updates through trainer.update, and never asks which engine or which
kind of environment it has. Inside this object a stop request (preemption) is honoured between
tokens while sampling and between evaluation batches: either raises `GenerationInterrupted`, and
the half-done step or batch is abandoned. Between steps it is the caller's (trainer.recipe.train).
The last *completed* step is what a checkpoint holds.

Determinism: everything random in step s is seeded from (seed, s) (trainer.seeds) — the prompts it
sees, one sampling generator per prompt (from (seed, s, the prompt's place in the step)), torch's
global RNG (LoRA dropout) — so a run resumed at step s replays exactly what an uninterrupted run
would have done, and a prompt draws from the same stream on any number of processes.

Several processes (trainer.distributed): each samples, scores and computes the advantages of
its shard of the step's prompts; DDP averages the gradients; rank 0 reports. Under a stop
request a rank abandons sampling as one process does, and the ranks agree right after sampling
whether the step is abandoned, so they never disagree about which collective comes next.
"""

from __future__ import annotations

import contextlib
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
from grpo_run.trainer.config import GRPOParams
from grpo_run.trainer.distributed import World
from grpo_run.trainer.sharding import full_state, load_full_state, shard_fsdp
from grpo_run.trainer.envs.catalog import Environment
from grpo_run.trainer.envs.tasks import Task
from grpo_run.trainer.episodes import replay
from grpo_run.trainer.evaluation import EvalResult
from grpo_run.trainer.grader.scoring import Scorer
from grpo_run.trainer.metrics import step_metrics
from grpo_run.trainer.model.missing import loading
from grpo_run.trainer.model.policy import eos_token_ids, load_policy, load_reference, load_tokenizer, pick_device, trainable_parameters
from grpo_run.trainer.protocol import SampleGroup
from grpo_run.trainer.rollout import Rollouts, build_rollout
from grpo_run.trainer.sampling.engines import SampleSettings, Sampler
from grpo_run.trainer.sampling.sampler import GenerationInterrupted
from grpo_run.trainer.sampling.start import start_sampler
from grpo_run.trainer.seeds import prompt_seed, step_seed
from grpo_run.trainer.threads import CpuShare
from grpo_run.trainer.update import NonFiniteStep, Update, Updated

__all__ = ["GRPOTrainer", "NonFiniteStep", "batch_indices"]


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
    """Owns the policy, optimizer, scheduler, the rollout (its engine) and the graders for one run."""

    def __init__(self, model_path: str, env: Environment, params: GRPOParams, *,
                 stop: threading.Event | None = None, device: torch.device | None = None,
                 model_name: str | None = None, world: World | None = None, sandbox_strict: bool = False,
                 judge_calls: dict[str, int] | None = None, judge_usd: dict[str, float] | None = None,
                 work: Path | None = None) -> None:
        self.params = params
        self.env = env
        self.model_path = model_path       # an asynchronous run's producer process loads it too (trainer.producer)
        self.stop = stop or threading.Event()
        self.world = world or World()
        self.cpu = CpuShare.from_environment()     # this node's threads, shared with its other trainers
        self.device = device or (self.world.device() if self.world.distributed else pick_device())
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
        self._threads = torch.get_num_threads()      # the trainer's, both threads' with staleness (cpu_threads)
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
        self.update = Update(self.model, self.trainable, self.optimizer, self.scheduler, self.reference, params,
                             self.world, self.device, fsdp=self.fsdp, tokens_at_most=self.sampled_tokens_at_most)
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
            from grpo_run.trainer.episodes.tokens import tool_format_of

            self.environment = EnvironmentHost(env.episodes.ref, search_path=env.search_path,
                                               timeout_s=params.rewardTimeoutSeconds, memory_mb=params.rewardMemoryMB,
                                               retries=0, strict=sandbox_strict, tools=env.episodes.tools,
                                               tool_timeout_s=env.episodes.tool_timeout_s,
                                               step_timeout_s=env.episodes.step_timeout_s,
                                               tool_format=tool_format_of(self.tokenizer) if env.episodes.tools
                                               else "hermes")
        # the engine, with the run's generation settings (a trainer built without a work folder, for
        # benchmarks and the API's tests, hands vLLM its adapters in a scratch folder)
        self._scratch = None
        if work is None:
            work = self._scratch = Path(tempfile.mkdtemp(prefix="grpo-run-vllm-"))
        eos_ids = eos_token_ids(self.tokenizer.name_or_path, self.tokenizer)
        self.sampler: Sampler = start_sampler(self.model, model_path, self.tokenizer,
                                              SampleSettings.of(params, eos_ids), params, self.device, self.world,
                                              work, sharded=self.fsdp)
        context = int(getattr(self.model.config, "max_position_embeddings", None) or 2**31 - 1)
        self.rollout = build_rollout(self.sampler, self.tokenizer, eos_ids, system_prompt=params.systemPrompt,
                                     template_kwargs=params.chatTemplateKwargs, host=self.environment,
                                     max_turns=env.episodes.max_turns if env.episodes is not None else 1,
                                     context=context, device=self.device, stop=self.stop)
        self.ahead = self._producer(eos_ids) if params.staleness > 0 else None

    def _producer(self, eos_ids: Sequence[int]):
        """spec.parameters.staleness > 0: the producer (trainer.ahead), made before anything samples:
        on a CPU a process of its own (trainer.producer), the threads split between it and the
        update; on a GPU a thread with a draft of the policy."""
        import copy

        from grpo_run.trainer.ahead import Ahead, draft_of, either, split_threads
        from grpo_run.trainer.producer import ProducerProcess
        from grpo_run.trainer.sampling.engines import NativeSampler
        from grpo_run.trainer.sampling.start import stop_strings_check
        from peft import get_peft_model_state_dict

        if not isinstance(self.sampler, NativeSampler) or self.world.distributed or self.environment is not None:
            raise ValueError("spec.parameters.staleness > 0 samples with the native decoder, on one process, "
                             "single-turn environments only (docs/sampling.md); set staleness: 0")
        threads = self._threads
        group = lambda step: self._step_group(step)[2:]          # noqa: E731
        if self.device.type == "cpu":
            mine, threads = split_threads(self._threads)
            torch.set_num_threads(mine)
            # a process of its own: a thread would share the interpreter lock with the update (trainer.producer)
            s = self.sampler
            process = ProducerProcess(model_path=self.model_path, params=self.params, settings=s.settings,
                                      pad_id=s.pad_id, eos_ids=eos_ids, compiled=s.compiled, threads=threads,
                                      stop=lambda: self.stop.is_set())
            return Ahead(self.params.staleness, self.params.maxSteps, live=self.adapter_state, draft=None,
                         rollout=None, group=group, temperature=self.params.temperature, threads=threads,
                         closing=threading.Event(), process=process)
        draft = draft_of(self.model)
        # its own tokenizer: a fast (Rust) tokenizer used from two threads at once can fail
        # ("Already borrowed"), and held-out evaluations encode while the producer does
        tokenizer, s = copy.deepcopy(self.tokenizer), self.sampler
        sampler = NativeSampler(draft, s.settings, pad_id=s.pad_id, device=self.device,
                                finished=stop_strings_check(tokenizer, self.params.stopStrings), compiled=s.compiled,
                                keep_decoder=True, logprobs=True)
        closing = threading.Event()
        rollout = build_rollout(sampler, tokenizer, eos_ids, system_prompt=self.params.systemPrompt,
                                template_kwargs=self.params.chatTemplateKwargs, host=None, max_turns=1,
                                context=2**31 - 1, device=self.device,
                                stop=either(lambda: self.stop.is_set(), closing.is_set))
        return Ahead(self.params.staleness, self.params.maxSteps, live=self.adapter_state,
                     draft=get_peft_model_state_dict(draft, save_embedding_layers=False), rollout=rollout,
                     group=group, temperature=self.params.temperature,
                     threads=threads, closing=closing)

    def sampler_status(self) -> dict[str, str | float]:
        """The engine as `get tj` shows it (status.sampler), with the run's staleness when it has one."""
        return {**self.sampler.status(), **({"staleness": self.params.staleness} if self.ahead is not None else {})}

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead.close()
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
        """The threads torch computes with on this process (the node's share, or the user's setting;
        with staleness, the update's and the producer's together: a resume splits them alike)."""
        return self._threads

    def _share_cpu(self) -> None:
        if self.cpu is not None and self.device.type == "cpu":
            self.cpu.take()                     # decided once, before the first forward

    @property
    def micro_batch_size(self) -> int:
        """Completions per forward/backward (trainer.update.Update.micro_batch_size)."""
        return self.update.micro_batch_size

    @property
    def sampled_tokens_at_most(self) -> int:
        """The most tokens a completion samples: maxCompletionLength, times maxTurns for an
        episode (its observations come besides: they are not counted here). Dr. GRPO's constant
        divisor, and the length the default micro-batch is sized for."""
        turns = self.env.episodes.max_turns if self.env.episodes is not None else 1
        return self.params.maxCompletionLength * turns

    # --- evaluation (trainer.evaluation) ---------------------------------------------------

    def evaluate(self, tasks: Sequence[Task], *, done: Mapping[int, Mapping[str, Sequence[float]]] | None = None,
                 on_batch: Callable[[int, dict[str, list[float]]], None] | None = None,
                 on_samples: Callable[[list[SampleGroup]], None] | None = None) -> EvalResult:
        """Mean reward on held-out tasks: trainer.evaluation.evaluate with this trainer."""
        return evaluation.evaluate(self, tasks, done=done, on_batch=on_batch, on_samples=on_samples)

    @contextlib.contextmanager
    def sampling_weights(self) -> Iterator[float]:
        """The policy's weights as they are, in the engine, for the block (FSDP: every rank
        gathers its whole weights, whatever it computes); yields the sync's seconds."""
        with self.update.whole_weights():
            yield self.sampler.load_policy(self.model)

    # --- one GRPO step -------------------------------------------------------------------

    def train_step(self, step: int) -> dict[str, float]:
        """Step `step` (0-based). Returns its metrics. Raises GenerationInterrupted on a stop
        request during sampling (nothing of this step has been applied; several processes: on
        any of them), RewardFunctionError when the reward function fails on every try,
        NonFiniteStep when its rewards, loss or gradient norm is not finite (before the optimizer
        steps: the weights stay as they were)."""
        p, t0, world = self.params, time.perf_counter(), self.world
        self._seed_step(step)
        mine, tasks, group, seeds = self._step_group(step)

        # sample a group (a group is G completions, or G episodes, of one task; each prompt's
        # group draws from its own seed); staleness N: drawn by the policy of step-N meanwhile
        batch, sync, drawn_by = None, 0.0, None
        try:
            if self.ahead is not None:
                batch, drawn_by = self.ahead.take(step)
            else:
                with self.sampling_weights() as sync:   # vLLM: the adapter (or weights) of the step before
                    batch = self.rollout.play(group, seeds, p.temperature)
        except GenerationInterrupted:
            if not world.distributed:
                raise
        loss_mask = None if batch is None else self._loss_mask(batch)                   # [b*G, T]
        # agree on a stop: abandoned on every rank if on any; the whole step's token count
        stopping, tokens = world.total(float(batch is None), 0.0 if loss_mask is None else float(loss_mask.sum()))
        if stopping:
            raise GenerationInterrupted()
        digests = None
        if batch.episodes is not None:                 # a replayed step's episodes must be those recorded
            digests = replay.checked_digests(step, batch.episodes, mine, p.numGenerations, self.replays, world,
                                             self.env.episodes.ref)
        t_sampled = time.perf_counter()

        # score (in the graders' processes; a failure raises, never becomes a 0)
        by_reward = self.scorer.score(batch.texts, group, [p.numGenerations] * len(tasks),
                                      episode=batch.episode_rewards() if self.scorer.episodes else None)
        rewards = torch.tensor(self.scorer.total(by_reward), dtype=torch.float32)      # [b*G], weighted sum

        # advantages (per group: a group never spans processes)
        adv = grpo.group_advantages(rewards, p.numGenerations, unbiased=p.advantageStd == "sample",
                                    scale=p.lossType != "dr_grpo").to(self.device)     # [b*G]

        # update (trainer.update: micro-batches, the KL term, the engine's correction, DDP/FSDP)
        self.sampler.release()                         # a GPU engine's KV cache is released for the update
        done = self.update.run(step, batch, loss_mask, adv, rewards, tokens=int(tokens),
                               lag=None if drawn_by is None else step - drawn_by)

        # metrics (and the step's first groups, for people to read)
        return self._metrics(step, batch, by_reward, rewards, adv, done, digests, tokens=int(tokens),
                             seconds=(t_sampled - t0, time.perf_counter() - t0), sync=sync)

    def _step_group(self, step: int) -> tuple[list[int], list[Task], list[Task], list[int]]:
        """Step `step`'s prompts on this process: their places among the step's, the tasks, each
        prompt's G copies (b*G), and one seed per prompt."""
        p = self.params
        step_tasks = batch_indices(p.seed, step, p.promptsPerStep, len(self.env.train_tasks))
        mine = self.world.shard(len(step_tasks))            # this process's prompts (all of them, alone)
        tasks = [self.env.train_tasks[step_tasks[j]] for j in mine]
        group = [t for t in tasks for _ in range(p.numGenerations)]          # b*G, each prompt G times
        return mine, tasks, group, [prompt_seed(p.seed, step, j) for j in mine]

    def _seed_step(self, step: int) -> None:
        """torch's global generator (LoRA dropout: its own stream on each rank), and Python's and
        numpy's: what runs in this process (a judge client's retry jitter) draws the same after a
        resume, and a checkpoint's RNG states are the same bytes in two runs of one job."""
        seed = step_seed(self.params.seed, step) + self.world.rank
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)

    def _loss_mask(self, batch: Rollouts) -> torch.Tensor:
        """The tokens the update learns from [N, T]: the sampled ones (an episode's observations are
        never trained). maskTruncatedCompletions (DAPO's overlong filtering): a completion cut at
        maxCompletionLength (an episode ended by a limit) gets no loss, since its end was never
        seen; it was scored and counts in the metrics. As in TRL, it still counts among the n
        completions that grpo and dr_grpo divide by."""
        if not self.params.maskTruncatedCompletions:
            return batch.loss_mask
        return batch.loss_mask * (~batch.ended).long().unsqueeze(1)

    def _metrics(self, step: int, batch: Rollouts, by_reward: Mapping[str, list[float]], rewards: torch.Tensor,
                 adv: torch.Tensor, done: Updated, digests: Mapping[int, str] | None, *, tokens: int,
                 seconds: tuple[float, float], sync: float) -> dict[str, Any]:
        """The step's metrics over every process (rank 0 reports them), its kept samples and, with
        episodes, every episode's digests in the step's order."""
        p, world = self.params, self.world
        local = {"rewards": rewards.tolist(), "byReward": {k: list(v) for k, v in by_reward.items()},
                 "entropy": float(batch.entropy.sum()), "lengths": batch.written(),
                 "truncated": batch.ended.tolist(), "loss": done.loss, "clipped": done.clipped,
                 "kl": done.kl or 0.0, "microBatches": done.micro_batches, "learning": done.learning}
        keep = p.sampleGroups if world.main else 0
        episodes = batch.episode_view(self.rollout.decode_ids, keep * p.numGenerations)
        if batch.episodes is not None:
            local.update(turns=episodes["turns"], truncatedBy=episodes["truncated_by"],
                         digests=sorted(digests.items()))     # JSON between ranks: pairs, not int keys
            if episodes["tools"] is not None:
                local.update(toolCalls=episodes["tools"][0], toolErrors=episodes["tools"][1])
        self.samples = kept_samples.step_groups(batch.prompts[::p.numGenerations], batch.texts, by_reward,
                                                local["rewards"], adv.tolist(), local["lengths"], local["truncated"],
                                                p.numGenerations, keep, self.scorer.primary, **episodes)
        shares = world.gather(local) if world.distributed else [local]
        metrics = step_metrics(shares, p.numGenerations, tokens, primary=self.scorer.primary,
                               iterations=p.numIterations)
        if batch.episodes is not None and world.main:   # every episode's digests, in the step's order
            self.episode_digests = [d for _, d in sorted(kv for share in shares for kv in share["digests"])]
        metrics.update(gradNorm=done.grad_norm, learningRate=self.scheduler.get_last_lr()[0],
                       sampleSeconds=seconds[0], stepSeconds=seconds[1])
        if done.mismatch is not None:
            metrics.update(syncSeconds=sync, logprobMismatch=done.mismatch)
        if done.offpolicy is not None:                 # staleness: the lag and the correction's ratios
            metrics.update(done.offpolicy)
        if done.kl is None:
            metrics.pop("kl")
        return metrics

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
        state = {"weights": weights, "optimizer": {"param_groups": param_groups, "state": moments},
                 "scheduler": self.scheduler.state_dict()}
        if self.ahead is not None:     # the policy versions drawing the steps in flight (trainer.ahead)
            state["inflight"] = self.ahead.inflight(self.scheduler.last_epoch)   # it steps once a step
        return state

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
        if self.ahead is not None:
            self.ahead.restore(state.get("inflight") or {})

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The adapter's tensors by their names in PEFT files (LoRA, QLoRA). Resolved once:
        walking the whole model's state dict at every checkpoint cost more than copying the
        adapter. The values share storage with the parameters, which the optimizer and
        `load_state_dict` update in place."""
        if self._adapter is None:
            from peft import get_peft_model_state_dict

            self._adapter = get_peft_model_state_dict(self.model, save_embedding_layers=False)
        return self._adapter
