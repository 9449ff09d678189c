"""A user environment's files travel with the job, so a fresh node can resume it from storage.

At `apply`, a reward given as `file.py:function` and the tasks / evalTasks files are copied to
the job's folder in object storage (`environment/`). At `resume` on a node where those paths do
not exist, they are fetched into the work folder and the job points there. A reward given as
`package.module:function` must be installed on the node instead (deploy does that).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from checkpoint.store import Store
from runner.job import EnvironmentSpec, TrainingJob

PREFIX = "environment"


def _files(env: EnvironmentSpec) -> dict[str, str]:
    """{field: local path} of the files an environment needs."""
    files = {"tasks": env.tasks, "evalTasks": env.evalTasks}
    module, _, _ = env.reward.rpartition(":")
    if module.endswith(".py"):
        files["reward"] = module
    return files


def upload_environment(job: TrainingJob, store: Store) -> None:
    env = job.environment
    if env.is_catalog:
        return
    for field, path in _files(env).items():
        store.put_file(Path(path), f"{PREFIX}/{field}/{Path(path).name}")


def localize_environment(job: TrainingJob, store: Store, work: Path) -> TrainingJob:
    """The job with its environment files on this node: as they are when they exist here,
    else fetched from storage into `work/environment`. Raises LookupError when neither."""
    env = job.environment
    if env.is_catalog or all(Path(p).exists() for p in _files(env).values()):
        return job
    fetched: dict[str, str] = {}
    for field, path in _files(env).items():
        local = work / PREFIX / field / Path(path).name
        try:
            store.get_file(f"{PREFIX}/{field}/{Path(path).name}", local)
        except FileNotFoundError:
            raise LookupError(f"spec.environment.{field}: {path} is not on this node and not in storage") from None
        fetched[field] = str(local)
    reward = env.reward
    if "reward" in fetched:
        reward = f"{fetched.pop('reward')}:{env.reward.rpartition(':')[2]}"
    search = tuple(env.path) + tuple(str(Path(p).parent) for p in (reward.rpartition(":")[0],) if p.endswith(".py"))
    return replace(job, environment=replace(env, reward=reward, path=search, **fetched))
