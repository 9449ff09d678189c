"""A user environment's files travel with the job, so a fresh node can resume it from storage.

At `apply`, every file the environment names (a reward given as `file.py:function`, the tasks /
evalTasks / dataset files, the dataFiles) is copied to the job's folder in object storage
(`environment/`). At `resume` on a node where those paths do not exist, they are fetched into the
work folder and the job points there. Not copied: a reward given as `package.module:function`
(install it on the node; deploy does that), a data set name (`datasets` fetches it again) and a
`save_to_disk` folder (put it on the node, or give its data as files).
"""

from __future__ import annotations

from pathlib import Path

from grpo_run.checkpoint.storage.store import Store
from grpo_run.runner.spec.environment import EnvironmentSpec
from grpo_run.runner.spec.job import TrainingJob

PREFIX = "environment"


def _reward_file(ref: str | None) -> str | None:
    module = (ref or "").rpartition(":")[0]
    return module if module.endswith(".py") else None


def _local_file(path: str | None) -> bool:
    """A data file the job names by path (resolved absolute when the job was read), not a data set
    name and not a folder (a folder has no suffix)."""
    return bool(path) and Path(path).is_absolute() and bool(Path(path).suffix)


def _folders(env: EnvironmentSpec) -> dict[str, str]:
    """{field: folder} of save_to_disk folders the environment reads: not copied to storage."""
    return {k: getattr(env, k) for k in ("tasks", "evalTasks", "dataset")
            if getattr(env, k) and Path(getattr(env, k)).is_absolute() and not _local_file(getattr(env, k))}


def _files(env: EnvironmentSpec) -> dict[str, str]:
    """{field: local path} of the files an environment needs (field as in the job: tasks,
    dataFiles.train, rewards.1, ...)."""
    files = {k: getattr(env, k) for k in ("tasks", "evalTasks", "dataset") if _local_file(getattr(env, k))}
    files.update({f"dataFiles.{split}": path for split, path in (env.dataFiles or {}).items()})
    if _reward_file(env.reward):
        files["reward"] = _reward_file(env.reward)
    files.update({f"rewards.{i}": _reward_file(r.function) for i, r in enumerate(env.rewards) if _reward_file(r.function)})
    return files


def upload_environment(job: TrainingJob, store: Store) -> None:
    for field, path in _files(job.environment).items():
        store.put_file(Path(path), f"{PREFIX}/{field}/{Path(path).name}")


def localize_environment(job: TrainingJob, store: Store, work: Path) -> TrainingJob:
    """The job with its environment files on this node: as they are when they exist here,
    else fetched from storage into `work/environment`. Raises LookupError when neither."""
    env = job.environment
    for field, folder in _folders(env).items():
        if not Path(folder).is_dir():
            raise LookupError(f"spec.environment.{field}: the folder {folder} is not on this node, and folders are "
                              "not copied to storage: put it on the node, or give its data as files")
    files = _files(env)
    if all(Path(p).exists() for p in files.values()):
        return job
    fetched: dict[str, str] = {}
    for field, path in files.items():
        local = work / PREFIX / field / Path(path).name
        try:
            store.get_file(f"{PREFIX}/{field}/{Path(path).name}", local)
        except FileNotFoundError:
            raise LookupError(f"spec.environment.{field}: {path} is not on this node and not in storage") from None
        fetched[field] = str(local)

    def moved(ref: str, field: str) -> str:
        return f"{fetched[field]}:{ref.rpartition(':')[2]}" if field in fetched else ref

    update: dict = {k: fetched[k] for k in ("tasks", "evalTasks", "dataset") if k in fetched}
    if env.dataFiles:
        update["dataFiles"] = {s: fetched.get(f"dataFiles.{s}", p) for s, p in env.dataFiles.items()}
    if env.reward:
        update["reward"] = moved(env.reward, "reward")
    if env.rewards:
        update["rewards"] = tuple(r.model_copy(update={"function": moved(r.function, f"rewards.{i}")})
                                  for i, r in enumerate(env.rewards))
    folders = tuple(str(Path(fetched[k]).parent) for k in fetched if k == "reward" or k.startswith("rewards."))
    update["path"] = tuple(env.path) + folders
    return job.model_copy(update={"environment": env.model_copy(update=update)})
