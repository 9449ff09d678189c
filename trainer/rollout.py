"""The rollout seam: what the policy wrote for a batch of tasks, as one typed batch.

A `Rollout` plays tasks with the run's engine and returns `Rollouts`: the first prompts and
everything after them as token ids with a loss mask beside them, whatever played them. A single
turn is the one-turn case (its loss mask is its mask); an episode appends the environment's ids
with loss mask 0 (trainer.episodes.loop). The training step, the evaluations and every engine go
through this one call, so neither the step nor an evaluation asks which engine or which kind of
environment it has.

Seeds: `play(tasks, seeds, temperature)` takes one seed per equal consecutive block of tasks (a
prompt's group, or one for an evaluation batch), as the engines do; an episode's own seed is its
block's member (trainer.seeds.member_seed), so its environment's reset and its turns' draws depend
on nothing else in the batch. A stop request between two tokens raises GenerationInterrupted.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch
from torch import Tensor

from grpo_run.trainer.envs.tasks import Task
from grpo_run.trainer.episodes.limits import Truncation
from grpo_run.trainer.episodes.loop import Episodes, run_episodes
from grpo_run.trainer.episodes.tokens import TurnRenderer, readable
from grpo_run.trainer.model.prompts import Prompt, PromptEncoder
from grpo_run.trainer.sampling.engines import Sampler
from grpo_run.trainer.seeds import member_seed


@dataclass(frozen=True)
class Rollouts:
    """A batch of N completions (or episodes), on the trainer's device."""
    prompts: list[Prompt]           # what each row was asked first (text or messages), for people to read
    prompt_ids: Tensor              # [N, P] the first prompts, left-padded
    prompt_mask: Tensor             # [N, P]
    ids: Tensor                     # [N, T] what came after them (an episode: replies and observations), right-padded
    mask: Tensor                    # [N, T] 1 on every token of it (attention)
    loss_mask: Tensor               # [N, T] 1 on the sampled tokens only (a single turn: its mask)
    entropy: Tensor                 # [N] the sampled tokens' entropy, summed (sampler.Completions')
    truncated: list[Truncation | None]   # the limit that ended each row, None when it ended by itself
    texts: list[str]                # each row's text (an episode: its replies and observations, in order)
    engine_logprobs: Tensor | None = None   # [N, T] the engine's log-probability of each sampled token (vLLM)
    episodes: Episodes | None = None        # multi-turn: rewards, turns, tool calls, replies

    @property
    def ended(self) -> Tensor:
        """[N] bool: a limit ended the row (maskTruncatedCompletions' rows)."""
        return torch.tensor([t is not None for t in self.truncated], dtype=torch.bool, device=self.ids.device)

    def written(self) -> list[int]:
        """Tokens each row's model wrote (an episode's observations are not its)."""
        return self.loss_mask.sum(1).tolist()

    def episode_rewards(self) -> list[float] | None:
        """Episodes: the sum of each one's step rewards (None for single turns)."""
        return None if self.episodes is None else self.episodes.rewards

    def episode_view(self, decode_ids: Callable[[list[int]], str], first: int | None = None) -> dict[str, Any]:
        """What a person reads of each episode beside its text (kept_samples' keywords): its turns,
        the limit that ended it, its tool calls and errors, and (the `first` ones) its exchanges;
        nothing for single turns."""
        played = self.episodes
        if played is None:
            return {}
        return {"turns": played.turns, "truncated_by": [None if t is None else str(t) for t in played.truncated],
                "tools": None if played.tool_calls is None else (played.tool_calls, played.tool_errors or []),
                "exchanges": played.exchanges(decode_ids, first)}


class Rollout(Protocol):
    """Plays tasks with the run's engine."""
    sampler: Sampler

    def play(self, tasks: Sequence[Task], seeds: Sequence[int] | None, temperature: float) -> Rollouts:
        """One completion (or episode) per task; `seeds` one per equal consecutive block of tasks."""

    def decode_ids(self, ids: list[int]) -> str:
        """Token ids as text (special tokens skipped)."""


class Text:
    """Ids to text and back for one tokenizer: prompts through its chat template, completions decoded."""

    def __init__(self, tokenizer: Any, encoder: PromptEncoder) -> None:
        self.tokenizer, self.encoder = tokenizer, encoder

    def decode_ids(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def decode(self, ids: Tensor, mask: Tensor) -> list[str]:
        """Each row's masked tokens as text. The rows as lists in one call each, not a tensor slice
        per row (a step's 64 slices were most of what decoding short completions cost); a
        completion repeated in the batch is decoded once."""
        rows = [tuple(t for t, m in zip(row, keep) if m) for row, keep in zip(ids.tolist(), mask.tolist())]
        texts = {row: self.decode_ids(list(row)) for row in dict.fromkeys(rows)}
        return [texts[row] for row in rows]


class SingleTurn:
    """A completion per task, to its prompt (through the tokenizer's chat template)."""

    def __init__(self, sampler: Sampler, text: Text, device: torch.device, stop: threading.Event) -> None:
        self.sampler, self.text, self.device, self.stop = sampler, text, device, stop

    def decode_ids(self, ids: list[int]) -> str:
        return self.text.decode_ids(ids)

    def play(self, tasks: Sequence[Task], seeds: Sequence[int] | None, temperature: float) -> Rollouts:
        """Raises ValueError for a prompt the tokenizer cannot render (messages without a chat
        template), GenerationInterrupted on a stop request."""
        prompts = [t["prompt"] for t in tasks]
        ids, mask = self.text.encoder.encode(prompts)                                    # [N, P]
        ids, mask = ids.to(self.device), mask.to(self.device)
        out = self.sampler.sample(ids, mask, seeds, temperature=temperature, should_stop=self.stop.is_set)
        truncated = [Truncation.LENGTH if cut else None for cut in out.truncated.tolist()]
        return Rollouts(prompts=prompts, prompt_ids=ids, prompt_mask=mask, ids=out.ids, mask=out.mask,
                        loss_mask=out.mask, entropy=out.entropy, truncated=truncated,
                        texts=self.text.decode(out.ids, out.mask), engine_logprobs=out.logprobs)


class MultiTurn:
    """An episode per task, to its end (trainer.episodes.loop), with the environment in its
    sandboxed worker (`host`: trainer.episodes.host.EnvironmentHost). The token budget is the
    model's context."""

    def __init__(self, sampler: Sampler, text: Text, host: Any, eos_ids: Sequence[int], *, max_turns: int,
                 context: int, pad_id: int, device: torch.device, stop: threading.Event) -> None:
        self.sampler, self.text, self.host, self.device, self.stop = sampler, text, host, device, stop
        self.render = TurnRenderer(text.encoder, eos_ids)
        self.max_turns, self.context, self.pad_id = max_turns, context, pad_id

    def decode_ids(self, ids: list[int]) -> str:
        return readable(self.text.tokenizer, ids)      # for people (episode_view): an <unk> shown, not dropped

    def play(self, tasks: Sequence[Task], seeds: Sequence[int] | None, temperature: float) -> Rollouts:
        """Raises what the episode loop raises (GenerationInterrupted, EnvironmentFailed)."""
        seeds = list(seeds or [0])
        block = len(tasks) // len(seeds)
        episode_seeds = [member_seed(seeds[i // block], i % block) for i in range(len(tasks))]

        def sample(ids: Tensor, mask: Tensor, row_seeds: Sequence[int]):
            return self.sampler.sample(ids.to(self.device), mask.to(self.device), row_seeds,
                                       temperature=temperature, should_stop=self.stop.is_set)

        played = run_episodes(sample, self.render, self.host, tasks, episode_seeds, max_turns=self.max_turns,
                              context=self.context, pad_id=self.pad_id)
        ids, mask = played.ids.to(self.device), played.mask.to(self.device)
        return Rollouts(prompts=list(played.prompts), prompt_ids=played.prompt_ids.to(self.device),
                        prompt_mask=played.prompt_mask.to(self.device), ids=ids, mask=mask,
                        loss_mask=played.loss_mask.to(self.device), entropy=played.entropy.to(self.device),
                        truncated=list(played.truncated), texts=self.text.decode(ids, mask),
                        engine_logprobs=None if played.engine_logprobs is None else
                        played.engine_logprobs.to(self.device), episodes=played)


def build_rollout(sampler: Sampler, tokenizer: Any, eos_ids: Sequence[int], *, system_prompt: str | None,
                  template_kwargs: Mapping[str, Any], host: Any | None, max_turns: int, context: int,
                  device: torch.device, stop: threading.Event) -> Rollout:
    """The run's rollout: single turns, or episodes when the environment talks back (`host`);
    its tools' schemas reach the chat template."""
    tools = host.tool_schemas if host is not None else []
    encoder = PromptEncoder(tokenizer, system_prompt=system_prompt,
                            template_kwargs={**template_kwargs, **({"tools": tools} if tools else {})})
    text = Text(tokenizer, encoder)
    if host is None:
        return SingleTurn(sampler, text, device, stop)
    return MultiTurn(sampler, text, host, eos_ids, max_turns=max_turns, context=context,
                     pad_id=tokenizer.pad_token_id, device=device, stop=stop)
