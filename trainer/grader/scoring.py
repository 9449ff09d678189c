"""The environment's rewards, scored together: each function in its own sandboxed grader
process, the step's reward the weighted sum, every function's scores kept for the record.

    with Scorer(env.rewards, ...) as scorer:
        by_name = scorer.score(completions, tasks, [G] * B)   # {name: [B*G] floats}
        rewards = scorer.total(by_name)                   # [B*G] weighted sums
        scorer.sandbox_mode                               # {"network": "netns", ...}: for the events
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import Any, Mapping, Sequence

from grpo_run.trainer.envs.catalog import Reward
from grpo_run.trainer.grader.grader import Grader
from grpo_run.trainer.startup import clock


# An episode's summed step rewards, among the step's rewards by name (trainer.episodes)
EPISODE = "episode"


class Scorer:
    """Owns one Grader per reward function. Raises what Grader raises (RewardFunctionError
    when a function fails on every try: never a score)."""

    def __init__(self, rewards: Sequence[Reward], *, search_path: Sequence[str] = (), device: Any = "cpu",
                 judge_calls: Mapping[str, int] | None = None, judge_usd: Mapping[str, float] | None = None,
                 episodes: bool = False, **grader_settings: Any) -> None:
        """A reward model (Reward.model) is loaded here, on `device` (rewardmodel.RewardModel); a
        judge (Reward.judge) counts on from `judge_calls` and `judge_usd` (its name: the run's calls
        and their price so far). `episodes`: the completions are episodes, whose summed step
        rewards `score` is given as the reward named EPISODE (weight 1, the primary one); the
        reward functions, if any, score each whole episode besides."""
        names = [r.name for r in rewards] + ([EPISODE] if episodes else [])
        if not names or len(set(names)) != len(names):
            raise ValueError(f"rewards need distinct names (got {', '.join(names) or 'none'}"
                             f"{'; ' + EPISODE + ' is the episode reward' if episodes else ''})")
        self.rewards = tuple(rewards)
        self.episodes = episodes
        self._graders: list[Any] = []       # a Grader per function, a RewardModel per model, a Judge per judge
        started = time.time()
        try:
            for r in self.rewards:
                if r.judge is not None:
                    from grpo_run.trainer.grader.judge import Judge

                    self._graders.append(Judge(r.name, r.judge, calls=(judge_calls or {}).get(r.name, 0),
                                               usd=(judge_usd or {}).get(r.name, 0.0)))
                elif r.model:
                    from grpo_run.trainer.grader.rewardmodel import RewardModel

                    self._graders.append(RewardModel(r.ref, device))
                else:
                    self._graders.append(Grader(r.ref, search_path=search_path, group=r.group, **grader_settings))
        except BaseException:
            self.close()
            raise
        clock().add("grader start", started)   # the node's path to its first step (trainer.startup)

    @property
    def sandbox_mode(self) -> dict[str, str]:
        """The sandbox layers in force for the environment's rewards (Grader.sandbox_mode), for the
        trainer's events and the run's record. Every grader runs on the same node with the same
        settings; a layer on which they differ anyway reads as their values joined by "|"."""
        modes = [g.sandbox_mode for g in self._graders if isinstance(g, Grader)]    # a reward model runs outside it
        return {layer: "|".join(sorted({m[layer] for m in modes})) for layer in modes[0]} if modes else {}

    @property
    def primary(self) -> str:
        """The first reward's name (EPISODE for episodes): an evaluation's `solved` counts the
        tasks it scores 1.0."""
        return EPISODE if self.episodes else self.rewards[0].name

    @property
    def names(self) -> tuple[str, ...]:
        """Every reward's name, in the order `score` and `total` take them."""
        return ((EPISODE,) if self.episodes else ()) + tuple(r.name for r in self.rewards)

    def score(self, completions: Sequence[str], tasks: Sequence[Mapping[str, Any]],
              groups: Sequence[int] | None = None, episode: Sequence[float] | None = None) -> dict[str, list[float]]:
        """{reward name: one score per completion}, in the environment's order. `groups`: the sizes
        of the consecutive groups (a prompt's G completions) that group rewards see together
        (None: each completion alone). `episode`: each episode's summed step rewards (episodes
        only, required then)."""
        if self.episodes != (episode is not None):
            raise ValueError("episode rewards go with episodes (Scorer(episodes=True)), and only there")
        out = {EPISODE: [float(r) for r in episode]} if episode is not None else {}
        out.update({r.name: g.score(completions, tasks) if r.model or r.judge else g.score(completions, tasks, groups)
                    for r, g in zip(self.rewards, self._graders)})
        return out

    @property
    def judge_calls(self) -> dict[str, int]:
        """{judge reward's name: the run's answered calls so far}; {} without judges."""
        return {r.name: g.calls for r, g in zip(self.rewards, self._graders) if r.judge is not None}

    @property
    def judge_usd(self) -> dict[str, float]:
        """{priced judge reward's name: the run's spend on its calls so far}; {} without one."""
        return {r.name: g.usd for r, g in zip(self.rewards, self._graders) if r.judge is not None and g.priced}

    def total(self, by_name: Mapping[str, Sequence[float]]) -> list[float]:
        """The weighted sum per completion, summed in the environment's order (so it is the same
        float on every run)."""
        columns = [(1.0, by_name[EPISODE])] if self.episodes else []
        columns += [(r.weight, by_name[r.name]) for r in self.rewards]
        return [sum(w * scores[i] for w, scores in columns) for i in range(len(columns[0][1]))]

    def close(self) -> None:
        for g in self._graders:
            g.close()

    def __enter__(self) -> Scorer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
