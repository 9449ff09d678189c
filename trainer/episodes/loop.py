"""The episode loop: a batch of episodes, turn by turn, as token ids with a loss mask beside them.

Each turn samples one reply for every running episode (its whole sequence so far as the prompt),
appends the sampled ids (loss mask 1), tells the environment the reply's text, and appends the
ids of its observation (loss mask 0, `tokens.TurnRenderer`). Nothing is ever decoded and encoded
again: the ids trained are the ids sampled, boundaries included.

Limits: `max_turns` replies; `context` tokens in all (first prompt included: the model's context
length). An episode that reaches one ends with what it has and says which (`truncated`:
"maxTurns" or "context"); a reply cut by the context is not shown to the environment.

Determinism: episode i draws from its own generators, one per turn, seeded from its seed
(`turn_seed`), so its tokens depend on neither the other episodes nor how many are running, and
a replayed step draws the same tokens.

Engines: any sampler (the native decoder, vLLM) takes the sequences as token ids; an engine that
reports its log-probabilities (vLLM) has them kept beside the sampled tokens, for the update's
importance-sampling correction.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import Tensor

from grpo_run.trainer.episodes.limits import Truncation
from grpo_run.trainer.episodes.tokens import TurnRenderer
from grpo_run.trainer.seeds import turn_seed

if TYPE_CHECKING:
    from grpo_run.trainer.episodes.host import EnvironmentHost


@dataclass(frozen=True)
class Episodes:
    """A batch of N episodes: the first prompts, left-padded, and everything after them in one
    right-padded block, as a step's prompts and completions are."""
    prompt_ids: Tensor          # [N, P] the first prompts (left-padded)
    prompt_mask: Tensor         # [N, P]
    ids: Tensor                 # [N, T] the replies and observations, in order (right-padded with pad)
    mask: Tensor                # [N, T] 1 on every token of the episode (attention)
    loss_mask: Tensor           # [N, T] 1 on the sampled tokens only; 0 on observations and padding
    entropy: Tensor             # [N] the sampled tokens' entropy, summed (sampler.Completions')
    rewards: list[float]        # the sum of each episode's step rewards
    turns: list[int]            # replies each episode made
    truncated: list[Truncation | None]   # the limit that ended it, None when its environment said done
    prompts: list[Any]          # what reset returned (text or messages), for people to read
    replies: list[list[str]]    # each reply's text, as the environment (or its tools) read it
    # [N, T] the engine's log-probability of each sampled token (vLLM's; 0 on observations and
    # padding), None from the native decoder, whose are the trainer's own
    engine_logprobs: Tensor | None = None
    tool_calls: list[int] | None = None      # with tools: the calls each episode made
    tool_errors: list[int] | None = None     # ... and how many of them were answered with an error

    def exchanges(self, decode: Callable[[list[int]], str], first: int | None = None) -> list[list[str]]:
        """Each episode turn by turn (the `first` ones only, when given), as text: its replies and
        the environment's answers (the ids its turns added: an observation, tool results),
        alternating, reply first."""
        out = []
        for i in range(min(self.ids.size(0), self.ids.size(0) if first is None else first)):
            used = self.mask[i].bool()
            ids, learnt = self.ids[i][used].tolist(), self.loss_mask[i][used].tolist()
            parts: list[str] = []
            start = 0
            for k in range(1, len(ids) + 1):
                if k == len(ids) or learnt[k] != learnt[start]:
                    if learnt[start] == (len(parts) % 2 == 1):     # an answer before any reply: none here
                        parts.append("")
                    parts.append(decode(ids[start:k]).strip())
                    start = k
            out.append(parts)
        return out


Sample = Callable[[Tensor, Tensor, Sequence[int]], Any]     # (ids, mask, seeds) -> sampler.Completions


def run_episodes(sample: Sample, render: TurnRenderer, host: EnvironmentHost, tasks: Sequence[Mapping[str, Any]],
                 seeds: Sequence[int], *, max_turns: int, context: int, pad_id: int) -> Episodes:
    """Play one episode per task to its end. `sample(ids, mask, seeds)`: one reply per row
    (left-padded ids [n, L]), row i drawing from seeds[i]; `host`: the environment
    (episodes.host.EnvironmentHost). Raises what they raise (GenerationInterrupted on a stop
    request, EnvironmentFailed), and EnvironmentFailed for a prompt or an observation the
    tokenizer cannot render."""
    n = len(tasks)
    prompts = host.reset(tasks, seeds)
    with _rendering(host, "the first prompt"):
        first, conversation = zip(*(render.first(p) for p in prompts)) if n else ((), ())
    first, conversation = list(first), list(conversation)
    tails: list[list[int]] = [[] for _ in range(n)]
    learn: list[list[int]] = [[] for _ in range(n)]
    rewards, turns = [0.0] * n, [0] * n
    calls, errors = [0] * n, [0] * n
    truncated: list[Truncation | None] = [None] * n
    replies: list[list[str]] = [[] for _ in range(n)]
    entropy = torch.zeros(n)
    newest: dict[int, list[int]] = {}                          # each episode's newest reply's ids
    engine: list[list[float]] | None = None                    # the engine's log-probabilities, beside tails
    running = list(range(n))
    for turn in range(max_turns):
        for i in [i for i in running if len(first[i]) + len(tails[i]) >= context]:
            truncated[i] = Truncation.CONTEXT                           # no room left for a reply
        running = [i for i in running if truncated[i] is None]
        if not running:
            break

        # sample a reply for every running episode
        ids, mask = left_padded([first[i] + tails[i] for i in running], pad_id)
        out = sample(ids, mask, [turn_seed(seeds[i], turn) for i in running])
        if engine is None and getattr(out, "logprobs", None) is not None:
            engine = [[] for _ in range(n)]
        told, texts = [], []
        for row, i in enumerate(running):
            reply = out.ids[row][out.mask[row].bool()].tolist()
            room = context - len(first[i]) - len(tails[i])
            entropy[i] += float(out.entropy[row])
            newest[i] = reply[:room]
            tails[i] += newest[i]
            learn[i] += [1] * len(newest[i])
            if engine is not None:
                engine[i] += out.logprobs[row][:len(newest[i])].tolist()
            turns[i] += 1
            if len(reply) > room:
                truncated[i] = Truncation.CONTEXT                       # cut short: the environment never sees it
                continue
            told.append(i)
            texts.append(render.tokenizer.decode(reply, skip_special_tokens=True))

        # the environment answers
        answers = host.step(told, texts) if told else []
        for i, text, answer in zip(told, texts, answers):
            replies[i].append(text)
            rewards[i] += answer.reward
            calls[i] += answer.tool_calls
            errors[i] += answer.tool_errors
            if answer.truncated is not None:                   # a tool, or the step, past its time limit
                truncated[i] = answer.truncated
                continue
            if answer.done:
                running.remove(i)
                continue
            if turn == max_turns - 1:
                truncated[i] = Truncation.MAX_TURNS
                continue
            with _rendering(host, f"episode {i}'s observation after turn {turn + 1}"):
                added, conversation[i] = render.observation(conversation[i], newest[i], text, answer.observation)
            if len(first[i]) + len(tails[i]) + len(added) >= context:
                truncated[i] = Truncation.CONTEXT                       # no room for the observation and a reply
                continue
            tails[i] += added
            learn[i] += [0] * len(added)
            if engine is not None:
                engine[i] += [0.0] * len(added)
        running = [i for i in running if truncated[i] is None]

    ids, mask = right_padded(tails, pad_id)
    loss_mask, _ = right_padded(learn, 0)
    prompt_ids, prompt_mask = left_padded(first, pad_id)
    engine_logprobs = None
    if engine is not None:
        engine_logprobs = torch.zeros(ids.shape, dtype=torch.float32)
        for i, row in enumerate(engine):
            engine_logprobs[i, :len(row)] = torch.tensor(row, dtype=torch.float32)
    tooled = bool(getattr(host, "tool_schemas", None))
    return Episodes(prompt_ids, prompt_mask, ids, mask, loss_mask, entropy, rewards, turns, truncated,
                    list(prompts), replies, engine_logprobs, calls if tooled else None, errors if tooled else None)


@contextmanager
def _rendering(host, what: str) -> Iterator[None]:
    """A prompt or an observation the tokenizer cannot render (chat messages without a chat
    template, a template that is not prefix-stable) is the environment's failure with this model:
    EnvironmentFailed, which ends the job as the user's code's (a restart would render it again)."""
    try:
        yield
    except ValueError as e:
        from grpo_run.trainer.episodes.host import EnvironmentFailed

        ref = getattr(host, "reward_ref", None)
        raise EnvironmentFailed(f"environment {ref!r}: {what} cannot be rendered for this model: {e}", ref=ref,
                                kind="invalid") from None


def left_padded(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """ids and attention mask [N, max len], each row on the right (a sampler's prompts)."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for k, row in enumerate(rows):
        if row:
            ids[k, width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[k, width - len(row):] = 1
    return ids, mask


def right_padded(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """ids and mask [N, max len], each row from the left (completions)."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), max(width, 1)), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), max(width, 1)), dtype=torch.long)
    for k, row in enumerate(rows):
        if row:
            ids[k, :len(row)] = torch.tensor(row, dtype=torch.long)
            mask[k, :len(row)] = 1
    return ids, mask
