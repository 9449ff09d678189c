"""A user environment's files travel with the job, so a fresh node can resume it from storage.

`apply` (and `apply --detach`) reads every file the environment names (a reward given as
`file.py:function`, an episodes environment as `file.py:Class`, the tasks / evalTasks / dataset files, the dataFiles), resolved against the
job file's folder, records each one's sha256 in the spec (`spec.environment.sha256`) and, once it
holds the job's lease, copies them to the job's folder in storage (`environment/`).

`resume` takes the spec from storage, which whoever can write the bucket can also write: its
absolute paths are the submitting machine's, and on the resuming node they could name anything
(`/proc/self/environ`, `~/.aws/credentials`). So a resume never opens those paths and never
uploads a file: it fetches the stored copies into the work folder, checks each against the
recorded sha256 (a copy that differs is refused: the run would train on another reward or other
tasks than the ones applied), and the job points there. The stored `environment.path` is never
used: a reward imports from its own stored folder (and the installation) only.

Not copied: a reward given as `package.module:function` (install it on the node; deploy does
that), a data set name (`datasets` fetches it again) and a `save_to_disk` folder (put it on the
node, or give its data as files).
"""

from __future__ import annotations

from pathlib import Path

from grpo_run.checkpoint.storage.store import ObjectStore
from grpo_run.runner.spec.environment import EnvironmentSpec
from grpo_run.runner.spec.job import TrainingJob
from grpo_run.runner.supervisor.uploads import sha256_of, upload_environment  # noqa: F401  (apply's copy)

PREFIX = "environment"
UNSAFE_NAMES = ("", ".", "..")      # a file or field name that would step out of its folder


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
    """{field: path} of the files an environment needs (field as in the job: tasks,
    dataFiles.train, rewards.1, ...)."""
    files = {k: getattr(env, k) for k in ("tasks", "evalTasks", "dataset") if _local_file(getattr(env, k))}
    files.update({f"dataFiles.{split}": path for split, path in (env.dataFiles or {}).items()})
    if _reward_file(env.reward):
        files["reward"] = _reward_file(env.reward)
    if _reward_file(env.episodes):
        files["episodes"] = _reward_file(env.episodes)
    files.update({f"rewards.{i}": _reward_file(r.function) for i, r in enumerate(env.rewards) if _reward_file(r.function)})
    files.update({f"tools.{i}": _reward_file(t) for i, t in enumerate(env.tools) if _reward_file(t)})
    return files


def local_files(env: EnvironmentSpec) -> dict[str, str]:
    """{field: path} of every file and save_to_disk folder of this machine the environment needs
    (a job file read here, its paths resolved): what a node handed only the job file lacks. `apply
    --detach` uploads the files (checked by hash); folders are never copied."""
    return {**_files(env), **_folders(env)}


def _key(field: str, path: str) -> str:
    """Where a file lives in the job's storage folder, and under the work folder on a node.
    Raises ValueError for a field or file name that would step outside its folder there (a
    dataFiles split named `../x`, a path ending in `..`): such a spec never came from a job file."""
    name = Path(path).name
    for part, what in ((field, "field"), (name, "file name")):
        if part in UNSAFE_NAMES or any(c in part for c in "/\\\0"):
            raise ValueError(f"spec.environment.{field}: the {what} {part!r} cannot be a file's name in storage: "
                             "name the file (and each dataFiles split) with plain letters, digits, '.', '-', '_'")
    return f"{PREFIX}/{field}/{name}"


def with_file_hashes(job: TrainingJob) -> TrainingJob:
    """At `apply`: the job with the sha256 of each of its environment files (as they are now, on
    this machine, where the job file named them) in spec.environment.sha256. Hashes the job file
    gives already (a `get tj -o yaml` applied again) must be the files' own. Raises ValueError
    naming the field when they are not, or when a file cannot be read."""
    files = _files(job.environment)
    given = dict(job.environment.sha256)
    unknown = sorted(set(given) - set(files))
    if unknown:
        raise ValueError(f"spec.environment.sha256.{unknown[0]}: names no file of the environment (it has "
                         f"{', '.join(files) or 'none'}): leave sha256 out, apply records it")
    hashes = {}
    for field, path in files.items():
        _key(field, path)
        try:
            hashes[field] = sha256_of(Path(path))
        except OSError as e:
            raise ValueError(f"spec.environment.{field}: cannot read {path}: {e.strerror or e}") from None
        if given.get(field, hashes[field]) != hashes[field]:
            raise ValueError(f"spec.environment.sha256.{field}: {path} has sha256 {hashes[field]}, not the "
                             f"{given[field]} the job file gives: the file changed since; leave sha256 out to "
                             "apply the file as it is now")
    if not hashes:
        return job
    return job.model_copy(update={"environment": job.environment.model_copy(update={"sha256": hashes})})


def environment_uploads(job: TrainingJob) -> tuple[tuple[str, str, str], ...]:
    """(local file, key in the job's storage, sha256) of each file `apply` sends: the job must have
    been through with_file_hashes."""
    env = job.environment
    return tuple((path, _key(field, path), env.sha256[field]) for field, path in _files(env).items())


def localize_environment(job: TrainingJob, store: ObjectStore, work: Path) -> TrainingJob:
    """On `resume`: the job with its environment files fetched from storage into
    `work/environment`, each checked against the sha256 the spec records; the paths the stored
    spec names are never opened on this node. Raises LookupError when a file is not in storage
    or a folder not on this node, ValueError when a stored copy is not the file `apply` recorded."""
    env = job.environment
    for field, folder in _folders(env).items():
        if not Path(folder).is_dir():
            raise LookupError(f"spec.environment.{field}: the folder {folder} is not on this node, and folders are "
                              "not copied to storage: put it on the node, or give its data as files")
    files = _files(env)
    if not files:       # the stored `path` names folders of the machine that applied it: never this node's
        return job.model_copy(update={"environment": env.model_copy(update={"path": ()})}) if env.path else job
    keys = {field: _key(field, path) for field, path in files.items()}    # all checked before any fetch
    fetched: dict[str, str] = {}
    for field, path in files.items():
        key = keys[field]
        want = env.sha256.get(field)
        if want is None:
            raise ValueError(f"spec.environment.{field}: the stored job records no sha256 for {Path(path).name} "
                             "(submitted by an older grpo-run, or edited in storage), so its stored copy cannot be "
                             "checked: apply the job file again (grpo-run apply -f FILE [--detach])")
        local = work / key
        try:
            store.get_file(key, local)
        except FileNotFoundError:
            raise LookupError(f"spec.environment.{field}: {Path(path).name} is not in storage ({key}): apply the "
                              "job file again (grpo-run apply -f FILE [--detach])") from None
        got = sha256_of(local)
        if got != want:
            local.unlink()
            raise ValueError(f"spec.environment.{field}: the copy in storage ({key}) has sha256 {got}, not the "
                             f"{want} recorded when the job was applied: it was replaced since, so this node "
                             "refuses to train on it; apply the job file again (grpo-run apply -f FILE [--detach])")
        fetched[field] = str(local)

    def moved(ref: str, field: str) -> str:
        return f"{fetched[field]}:{ref.rpartition(':')[2]}" if field in fetched else ref

    update: dict = {k: fetched[k] for k in ("tasks", "evalTasks", "dataset") if k in fetched}
    if env.dataFiles:
        update["dataFiles"] = {s: fetched.get(f"dataFiles.{s}", p) for s, p in env.dataFiles.items()}
    if env.reward:
        update["reward"] = moved(env.reward, "reward")
    if env.episodes:
        update["episodes"] = moved(env.episodes, "episodes")
    if env.rewards:
        update["rewards"] = tuple(r.model_copy(update={"function": moved(r.function, f"rewards.{i}")})
                                  for i, r in enumerate(env.rewards))
    if env.tools:
        update["tools"] = tuple(moved(t, f"tools.{i}") for i, t in enumerate(env.tools))
    # The reward imports from its own stored folder only: the stored `path` is whatever the bucket
    # says (`~/.aws`, GRPO_RUN_HOME/runs), and named the applying machine's folders anyway.
    update["path"] = tuple(dict.fromkeys(str(Path(fetched[k]).parent) for k in fetched
                                         if k in ("reward", "episodes") or k.startswith(("rewards.", "tools."))))
    return job.model_copy(update={"environment": env.model_copy(update=update)})
