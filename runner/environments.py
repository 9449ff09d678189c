"""The job's environment as the trainer runs it: its tasks read (catalog tasks made from the seed,
or the job's task files and data sets, through trainer/envs/sources.py) and its rewards named.

runner/spec/ describes and checks the job file and reads nothing else; this is where a job
becomes the trainer's Environment, for the supervisor's run, the estimate's workload and `score`.
"""

from __future__ import annotations

from grpo_run.runner.spec.environment import DEFAULT_MAX_TURNS, EnvironmentSpec
from grpo_run.trainer.config import GRPOParams
from grpo_run.trainer.envs.catalog import CATALOG, reward_name

__all__ = ["build_environment", "environment_of", "rewards_of"]


def build_environment(job):
    """The trainer's Environment for a TrainingJob (`environment_of` its environment and parameters)."""
    return environment_of(job.environment, job.parameters)


def environment_of(env: EnvironmentSpec, p: GRPOParams):
    """The trainer's Environment: catalog tasks made from the seed (or loaded, for a data set),
    or the user's rewards and tasks. Raises ValueError naming a bad task file, column or split."""
    from dataclasses import replace

    from grpo_run.trainer.envs.catalog import catalog_environment, user_environment
    from grpo_run.trainer.envs.sources import checked_tasks, own_tasks     # the tasks' files and data sets, read

    if env.is_catalog:
        own = checked_tasks(env, own_tasks(env, p.seed)) if env.reads_tasks else None
        built = catalog_environment(env.name, seed=p.seed, n_train=p.trainTasks, n_eval=p.evalTasks,
                                    data_files=None if own else env.dataFiles, tasks=own)
        return replace(built, rewards=rewards_of(env))      # the job's rewards, by the job's names
    from grpo_run.trainer.envs.catalog import ANSWER_AFTER_TOOLS, EpisodeSettings

    train, held = own_tasks(env, p.seed)
    episodes = EpisodeSettings(env.episodes or ANSWER_AFTER_TOOLS, env.maxTurns or DEFAULT_MAX_TURNS,
                               tools=env.tools, tool_timeout_s=env.toolTimeoutSeconds,
                               step_timeout_s=env.stepTimeoutSeconds) if env.plays_episodes else None
    return user_environment(name=env.name, rewards=rewards_of(env), tasks=train, eval_tasks=held, search_path=env.path,
                            episodes=episodes)


def rewards_of(env: EnvironmentSpec) -> tuple:
    """The trainer's Rewards for this environment, named as the job names them, without its
    tasks (nothing is read or downloaded)."""
    from grpo_run.trainer.envs.catalog import Reward, catalog_rewards

    if env.reward is not None:
        return (Reward(reward_name(env.reward), env.reward, 1.0),)
    if not env.rewards and env.episodes is not None:     # the episode's own rewards alone
        return ()
    if not env.rewards:                     # a catalog environment's default
        return catalog_rewards(env.name)
    offered = CATALOG[env.name].rewards if env.is_catalog else {}
    return tuple(Reward(r.label, r.judge.url, r.weight, judge=r.judge.settings()) if r.judge is not None
                 else Reward(r.label, r.model, r.weight, model=True) if r.model is not None
                 else Reward(r.label, offered.get(r.function, r.function), r.weight, group=r.group)
                 for r in env.rewards)


