"""What the model writes, kept for a person to read: the first `sampleGroups` groups of every
training step (prompt, each completion with its rewards by name, advantage, length, truncated)
and, at every evaluation, the completions for the first `sampleEvalTasks` held-out tasks (the
same tasks each time, so the baseline's and the final answer to one task sit side by side).

They reach the supervisor as the `Samples` event (trainer.protocol) and the run's record through
its books. Text is capped at MAX_CHARS characters per prompt and per completion; the books bound
how many steps are kept (runner.books.sample_books)."""

from __future__ import annotations

from typing import Mapping, Sequence

from grpo_run.trainer.model.prompts import Prompt
from grpo_run.trainer.protocol import SAMPLE_CHARS, SampleCompletion, SampleGroup

MAX_CHARS = SAMPLE_CHARS      # per prompt and per completion, in the record


def capped(text: str, limit: int = MAX_CHARS) -> str:
    """`text`, or its first `limit` characters and how many more there were."""
    return text if len(text) <= limit else f"{text[:limit]}... [{len(text) - limit} more characters]"


def prompt_text(prompt: Prompt) -> str:
    """A task's prompt as text: itself, or its chat messages as `role: content` lines."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m.get('role')}: {m.get('content')}" for m in prompt)


def step_groups(prompts: Sequence[Prompt], texts: Sequence[str], by_reward: Mapping[str, Sequence[float]],
                totals: Sequence[float], advantages: Sequence[float], lengths: Sequence[int],
                truncated: Sequence[bool], group_size: int, keep: int, primary: str,
                turns: Sequence[int] | None = None, truncated_by: Sequence[str | None] | None = None,
                tools: tuple[Sequence[int], Sequence[int]] | None = None,
                exchanges: Sequence[Sequence[str]] | None = None) -> list[SampleGroup]:
    """The first `keep` groups of a step: `prompts` is one per group, the other sequences one per
    completion ([groups x group_size], a group's completions consecutive). `primary`: the first
    reward's name (a completion that scores 1 on it solved the task). Episodes: each one's
    `turns` and the limit that ended it (`truncated_by`), its `exchanges` (replies and answers,
    alternating); with tools, its (calls, errors)."""
    out = []
    for g in range(min(keep, len(prompts))):
        rows = range(g * group_size, (g + 1) * group_size)
        out.append(SampleGroup(item=g, prompt=capped(prompt_text(prompts[g])), completions=[
            SampleCompletion(text=capped(texts[i]), rewards={k: float(v[i]) for k, v in by_reward.items()},
                             reward=float(totals[i]), advantage=float(advantages[i]), length=int(lengths[i]),
                             truncated=bool(truncated[i]), turns=None if turns is None else int(turns[i]),
                             truncatedBy=None if truncated_by is None else truncated_by[i],
                             **_tool_counts(tools, i), **_exchange(exchanges, i)) for i in rows],
            solved=all(by_reward[primary][i] == 1.0 for i in rows)))
    return out


def eval_items(first: int, prompts: Sequence[Prompt], texts: Sequence[str], by_reward: Mapping[str, Sequence[float]],
               totals: Sequence[float], lengths: Sequence[int], truncated: Sequence[bool],
               keep: int, primary: str, turns: Sequence[int] | None = None,
               truncated_by: Sequence[str | None] | None = None,
               tools: tuple[Sequence[int], Sequence[int]] | None = None,
               exchanges: Sequence[Sequence[str]] | None = None) -> list[SampleGroup]:
    """The held-out tasks of one evaluation batch that are among the first `keep` of all held-out
    tasks; `first` is the batch's first task's place among them. One completion per task (an
    episode: with its `turns` and the limit that ended it)."""
    out = []
    for j in range(min(len(prompts), max(0, keep - first))):
        out.append(SampleGroup(item=first + j, prompt=capped(prompt_text(prompts[j])), completions=[
            SampleCompletion(text=capped(texts[j]), rewards={k: float(v[j]) for k, v in by_reward.items()},
                             reward=float(totals[j]), length=int(lengths[j]), truncated=bool(truncated[j]),
                             turns=None if turns is None else int(turns[j]),
                             truncatedBy=None if truncated_by is None else truncated_by[j],
                             **_tool_counts(tools, j), **_exchange(exchanges, j))],
            solved=by_reward[primary][j] == 1.0))
    return out


def _tool_counts(tools: tuple[Sequence[int], Sequence[int]] | None, i: int) -> dict[str, int]:
    return {} if tools is None else {"toolCalls": int(tools[0][i]), "toolErrors": int(tools[1][i])}


EXCHANGE_CHARS = 400      # each reply or answer of a kept episode, turn by turn


def _exchange(exchanges: Sequence[Sequence[str]] | None, i: int) -> dict[str, list[str]]:
    return {} if exchanges is None else {"exchange": [capped(t, EXCHANGE_CHARS) for t in exchanges[i][:64]]}
