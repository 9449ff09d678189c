"""`spec.environment` of a TrainingJob: a catalog environment, or your own rewards and tasks
(files, a `save_to_disk` folder, a data set name), validated by pydantic, and the trainer's
Environment built from it.

Paths come out absolute, resolved against the job file's folder (the `base` in the validation
context); `check_files` False (a resume on a fresh node) leaves files that may be in storage only.
"""

from __future__ import annotations

import logging
import math
import os
import re
from pathlib import Path
from typing import Any

from pydantic import (
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from grpo_run.runner.spec.judge import JudgeSpec
from grpo_run.trainer.config import Strict, fmt, problem, problems_at
from grpo_run.trainer.envs.catalog import CATALOG, reward_name

log = logging.getLogger(__name__)


def base_folder(info: ValidationInfo) -> Path:
    return (info.context or {}).get("base") or Path.cwd()


def checks_files(info: ValidationInfo) -> bool:
    return (info.context or {}).get("check_files", True)


def resolve_path(path: str, base: Path) -> str:
    """A path from the job file, relative to the file's folder; `module:function` refs untouched."""
    p = Path(path).expanduser()
    return str(p if p.is_absolute() else (base / p).resolve())


def _ref(ref: str, info: ValidationInfo, what: str = "function") -> str:
    """`module:function` as is; `file.py:function` with the file resolved (and checked); `what`
    names the attribute in the message (an episodes environment's Class)."""
    module, sep, func = ref.rpartition(":")
    if not sep or not module or not func.isidentifier():
        raise problem(f"must be module:{what} or file.py:{what} (got {ref!r})")
    if not module.endswith(".py"):
        return ref
    path = Path(resolve_path(module, base_folder(info)))
    if checks_files(info) and not path.is_file():
        raise problem(f"no such file {path} (got {ref!r})")
    _no_link_out(module, path, info)
    return f"{path}:{func}"


def _no_link_out(value: str, resolved: Path, info: ValidationInfo, label: str = "") -> None:
    """Refuse a path that lies in the job's folder as written but leads out of it through a
    symbolic link: `apply` uploads what it names, and a bundle someone else wrote could link
    `extra.json` to the user's ~/.config/gcloud credentials. A path written outside the job's
    folder is what it says, and stays allowed."""
    if not checks_files(info):
        return
    base = os.path.realpath(base_folder(info))
    written = os.path.normpath(os.path.join(base, os.path.expanduser(value)))
    if _within(written, base) and not _within(os.path.realpath(resolved), base):
        raise problem(f"{label}{value} is a symbolic link to {os.path.realpath(resolved)}, outside the job's folder {base}: "
                      "apply uploads the files a job names, so it follows no link out of the job's folder; copy the "
                      "file into the job's folder")


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _data_path(value: str, info: ValidationInfo, *, hub_ok: bool = False, label: str = "") -> str:
    """A data file or folder, resolved against the job file and checked; with `hub_ok`, a name
    that is not a path here (a data set name such as openai/gsm8k) is kept as it is."""
    looks_like_path = value.startswith(("/", "./", "../", "~")) or Path(value).suffix.lower() in DATA_SUFFIXES
    path = resolve_path(value, base_folder(info))
    if hub_ok and not looks_like_path and not Path(path).exists():
        return value
    if checks_files(info) and not Path(path).exists():
        raise problem(f"no such file {path} (got {value!r})")
    _no_link_out(value, Path(path), info, label)
    return path


DEFAULT_MAX_TURNS = 6        # spec.environment.maxTurns when a job with episodes leaves it out

SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
OWN_DATA = ("tasks", "evalTasks", "dataset", "datasetConfig", "trainSplit", "evalSplit", "columns",
            "heldOutFraction", "path")
TASKS_HINT = "a JSONL file, one {\"prompt\": ...} per line (or .json, .csv, .parquet, a save_to_disk folder)"


class RewardSpec(Strict):
    """One of `spec.environment.rewards`: a function (or a reward model) and its weight in the
    step's reward."""
    function: str | None = None      # module:function, file.py:function, or a catalog environment's reward name
    # a sequence-classification model with one logit (a hub id or a folder), scored in the trainer
    model: str | None = None
    judge: JudgeSpec | None = None   # an LLM judge over HTTP, called from the trainer (runner.spec.judge)
    weight: float = 1.0
    name: str | None = None          # how metrics name it (default: the function's name, the model's last part)
    group: bool = False              # fn(completions, task) -> one number per completion of a prompt's group

    @model_validator(mode="wrap")
    @classmethod
    def _one_kind(cls, raw: Any, handler: Any) -> RewardSpec:
        """A function or a model, said beside every other problem of the reward."""
        try:
            spec, error = handler(raw), None
        except ValidationError as e:
            spec, error = None, e
        given = {k for k, v in raw.items() if v is not None} if isinstance(raw, dict) else set()
        found: list[tuple[tuple[str, ...], str]] = []
        kinds = sorted(given & {"function", "model", "judge"})
        if not kinds:
            found.append((("function",), "required: module:function, file.py:function, or a catalog environment's "
                          "reward name such as correct; or model: a reward model (a hub id or a folder); or judge: "
                          "an LLM judge ({url, model, prompt})"))
        elif len(kinds) > 1:
            found.append(((kinds[1],), f"give one of function, model or judge (got {', '.join(kinds)})"))
        elif kinds != ["function"] and raw.get("group"):
            found.append((("group",), f"is for functions: a {'reward model' if 'model' in given else 'judge'} scores "
                          "each completion on its own"))
        if found or error is not None:
            named = {loc for loc, _ in found}
            also = [e for e in error.errors() if tuple(e["loc"][:1]) not in named] if error else []
            raise problems_at("RewardSpec", found, also=also)
        return spec

    @field_validator("model")
    @classmethod
    def _model(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else _model_path(value, info)

    @field_validator("weight")
    @classmethod
    def _finite(cls, w: float) -> float:
        if not math.isfinite(w):
            raise problem(f"must be a finite number (got {w})")
        return w

    @field_validator("function")
    @classmethod
    def _function(cls, ref: str | None, info: ValidationInfo) -> str | None:
        return _ref(ref, info) if ref is not None and ":" in ref else ref

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        return reward_name(self.function) if self.function is not None else \
            model_label(self.model) if self.model is not None else "judge"


def model_label(model: str) -> str:
    """A reward model's name in metrics when the job gives none: its id's or folder's last part."""
    return Path(model.rstrip("/")).name


def _model_path(value: str, info: ValidationInfo) -> str:
    """A reward model: a folder (resolved against the job file, checked) or a hub id as written."""
    looks_like_path = value.startswith(("/", "./", "../", "~"))
    path = resolve_path(value, base_folder(info))
    if not looks_like_path and not Path(path).exists():
        return value                                    # org/name on the hub
    if checks_files(info) and not (Path(path) / "config.json").is_file():
        raise problem(f"no model folder {path} (no config.json there; got {value!r}): a folder saved by "
                      "save_pretrained, or a hub id such as org/name")
    return path


class EnvironmentSpec(Strict):
    """`spec.environment`: a catalog environment, or your own rewards with your tasks. Paths come
    out absolute, resolved against the job file's folder."""
    name: str = Field(min_length=1)
    reward: str | None = None        # your own: "module:function" or "file.py:function" (weight 1)
    rewards: tuple[RewardSpec, ...] = ()   # several, weighted; for a catalog environment, its reward names
    tasks: str | None = None         # your own: train tasks (.jsonl, .json, .csv, .parquet, a save_to_disk folder)
    evalTasks: str | None = None     # your own: held-out tasks, same formats
    dataset: str | None = None       # your own: a data set name for datasets.load_dataset, or a save_to_disk folder
    datasetConfig: str | None = None  # the data set's configuration (subset), e.g. main
    dataFiles: dict[str, str] | None = None   # {train: PATH, test: PATH}, as datasets' data_files
    trainSplit: str = "train"
    evalSplit: str = "test"
    columns: dict[str, str] = {}     # task key -> column, e.g. {prompt: question, answer: answer}
    heldOutFraction: float | None = Field(None, gt=0, lt=1)   # held out from train when no eval split/file
    path: tuple[str, ...] = ()       # folders put on the grader's sys.path
    # multi-turn: "file.py:Class" or "module:Class", one object per episode, reset(task, seed) and
    # step(reply) -> grpo_run.Step (docs/environments.md); each task is handed to reset
    episodes: str | None = None
    maxTurns: int | None = Field(None, ge=1)   # with episodes: replies per episode at most (default DEFAULT_MAX_TURNS)
    # tools for chat models: typed functions, "file.py:function" or "module:function"; a reply that
    # calls them (Qwen's <tool_call> JSON) is answered with their results, rendered by the chat
    # template; the first reply that calls none ends the episode, or goes to `episodes` when given
    tools: tuple[str, ...] = ()
    toolTimeoutSeconds: float | None = Field(None, gt=0)   # one tool call at most (default rewardTimeoutSeconds)
    # one step call at most; a step past it ends its episode ("stepTime"); unset, a step past
    # rewardTimeoutSeconds fails the job as the environment's failure
    stepTimeoutSeconds: float | None = Field(None, gt=0)
    # {file's field (reward, tasks, dataFiles.train, ...): sha256 of its bytes}, recorded by `apply`
    # from the files it uploads; a resuming node uses the stored copies only if they still match
    sha256: dict[str, str] = {}

    @field_validator("sha256")
    @classmethod
    def _hashes(cls, hashes: dict[str, str]) -> dict[str, str]:
        for field, digest in hashes.items():
            if not SHA256_RE.match(digest):
                raise problem(f"{field}: must be a sha256 as 64 lowercase hex digits (got {fmt(digest)}); "
                              "apply records these itself: leave sha256 out of a job file")
        return hashes

    @field_validator("reward", "episodes")
    @classmethod
    def _reward(cls, ref: str | None, info: ValidationInfo) -> str | None:
        return None if ref is None else _ref(ref, info, "Class" if info.field_name == "episodes" else "function")

    @field_validator("tools")
    @classmethod
    def _tools(cls, refs: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        return tuple(_ref(ref, info, "function") for ref in refs)

    @property
    def plays_episodes(self) -> bool:
        """Episodes: an environment that talks back, or tools that answer the model's calls."""
        return self.episodes is not None or bool(self.tools)

    @field_validator("tasks", "evalTasks")
    @classmethod
    def _task_file(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else _data_path(value, info)

    @field_validator("dataset")
    @classmethod
    def _dataset(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else _data_path(value, info, hub_ok=True)

    @field_validator("dataFiles")
    @classmethod
    def _data_files(cls, files: dict[str, str] | None, info: ValidationInfo) -> dict[str, str] | None:
        if files is None:
            return None
        if "train" not in files:
            raise problem(f"needs a train file: {{train: train.parquet, test: test.parquet}} (got {fmt(files)})")
        return {split: _data_path(path, info, label=f"{split}: ") for split, path in files.items()}

    @field_validator("path")
    @classmethod
    def _search_path(cls, folders: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        return tuple(resolve_path(p, base_folder(info)) for p in folders)

    @model_validator(mode="wrap")
    @classmethod
    def _kind(cls, raw: Any, handler: Any, info: ValidationInfo) -> EnvironmentSpec:
        """Catalog or your own, checked on what was written, beside every other problem."""
        if isinstance(raw, str):
            raw = {"name": raw}
        if isinstance(raw, dict):
            raw = {**raw, **{k: tuple([raw[k]] if isinstance(raw[k], str) else raw[k])
                             for k in ("path", "rewards", "tools") if isinstance(raw.get(k), (str, list))}}
            if isinstance(raw.get("rewards"), tuple):
                raw["rewards"] = tuple({"function": r} if isinstance(r, str) else r for r in raw["rewards"])
        try:
            env, error = handler(raw), None
        except ValidationError as e:
            env, error = None, e
        given = raw if isinstance(raw, dict) else {}
        found = _environment_problems(given)
        if found or error is not None:
            named = {loc for loc, _ in found}          # what was written in the wrong place: said once
            also = [e for e in error.errors() if tuple(e["loc"][:1]) not in named] if error else []
            raise problems_at("EnvironmentSpec", found, also=also)
        found = _path_problems(env.path, info) if given.get("path") else []
        if found:
            raise problems_at("EnvironmentSpec", found)
        if not env.is_catalog and not env.path:
            return env.model_copy(update={"path": (str(base_folder(info)),)})
        return env

    @property
    def is_catalog(self) -> bool:
        return self.reward is None and self.name in CATALOG

    @property
    def reads_tasks(self) -> bool:
        """Whether it reads your tasks (tasks, dataset, dataFiles): your own environment, or a
        catalog one that takes them (code)."""
        own = self.tasks is not None or self.dataset is not None or self.dataFiles is not None
        return not self.is_catalog or (own and CATALOG[self.name].task_problem is not None)

    def reward_list(self) -> tuple[tuple[str, str, float], ...]:
        """(name, ref or catalog reward name, weight) of each reward; () for a catalog default."""
        if self.reward is not None:
            return ((reward_name(self.reward), self.reward, 1.0),)
        return tuple((r.label, r.function, r.weight) for r in self.rewards)

    def to_dict(self) -> dict[str, Any]:
        out = self.model_dump(exclude_none=True, exclude_defaults=True)
        out["name"] = self.name
        if self.rewards:
            out["rewards"] = [r.model_dump(mode="json", exclude_none=True, exclude={"group"} if not r.group else None)
                              for r in self.rewards]
        if self.path:
            out["path"] = list(self.path)
        if self.tools:
            out["tools"] = list(self.tools)
        return out


def _path_problems(folders: tuple[str, ...], info: ValidationInfo) -> list[tuple[tuple[str, ...], str]]:
    """A job file's `path` (import folders for its rewards) must lie in the job's own folder and be
    no folder of the node's that a reward is kept from (trainer.grader.reach): the reward would read
    it. Not checked for a job read back from storage (check_files off): `resume` gives a reward
    only its stored files' folder (runner.jobs.envfiles)."""
    from grpo_run.trainer.grader.reach import node_places, why_not

    if not checks_files(info):
        return []
    base, places = os.path.realpath(base_folder(info)), node_places()
    found: list[tuple[tuple[str, ...], str]] = []
    for i, folder in enumerate(folders):
        real = os.path.realpath(folder)
        why = why_not(real, places)
        if not (real == base or real.startswith(base.rstrip(os.sep) + os.sep)):
            found.append((("path", i), f"{folder} is outside the job's folder {base}: a reward may import only from "
                          "the job's own folder (other folders of this machine stay out of its reach); move the "
                          "modules next to the job file"))
        elif why:
            found.append((("path", i), f"{folder} cannot be given to a reward to read: {why}; put the job file and its "
                          "modules in a folder of their own"))
    return found


def _environment_problems(given: dict[str, Any]) -> list[tuple[tuple[str, ...], str]]:
    """Which fields a catalog environment takes, which your own needs, on what was written."""
    found: list[tuple[tuple[str, ...], str]] = []
    name = given.get("name")
    if not isinstance(name, str) or not name:
        return found
    has = {k for k, v in given.items() if v not in (None, (), {}, [])}
    if "maxTurns" in has and not has & {"episodes", "tools"}:
        found.append((("maxTurns",), "goes with episodes (file.py:Class, the environment that talks back) or tools"))
    if "stepTimeoutSeconds" in has and "episodes" not in has:
        found.append((("stepTimeoutSeconds",), "goes with episodes (file.py:Class, whose step it limits)"))
    if "toolTimeoutSeconds" in has and "tools" not in has:
        found.append((("toolTimeoutSeconds",), "goes with tools (file.py:function, each a tool the model may call)"))
    if name in CATALOG and "reward" not in has and "tools" in has:
        found.append((("tools",), f"go with your own tasks and rewards, and {name!r} is a catalog environment's name: "
                      "give the environment a name of its own, tasks with chat prompts, and a reward"))
        return found
    if name in CATALOG and "reward" not in has and "episodes" in has:
        found.append((("episodes",), f"goes with your own tasks, and {name!r} is a catalog environment's name: give "
                      "the environment a name of its own, and tasks (each one handed to reset)"))
        return found
    if name in CATALOG and "reward" not in has:
        entry = CATALOG[name]
        own_data = sorted(has & set(OWN_DATA), key=OWN_DATA.index)
        if entry.task_problem is None:
            found += [((key,), f"only for environments with your own reward (catalog environment {name!r} "
                       "makes its own tasks)") for key in own_data]
        elif has & {"tasks", "dataset", "dataFiles"}:    # your tasks, checked as your own environment's
            found += _source_problems(has)
        else:
            found += [((key,), f"goes with tasks, dataset or dataFiles (your own tasks); without them {name!r} "
                       "uses its built-in tasks") for key in own_data]
        if "dataFiles" in has and not entry.data and entry.task_problem is None:
            found.append((("dataFiles",), f"catalog environment {name!r} makes its own tasks; dataFiles is for "
                          + ", ".join(n for n, e in CATALOG.items() if e.data)))
        for i, r in enumerate(given.get("rewards") or ()):
            fn = r.get("function") if isinstance(r, dict) else None
            if isinstance(fn, str) and ":" not in fn and fn not in entry.rewards:
                found.append((("rewards", i, "function"), f"{name} has no reward {fn!r}: it has "
                              + ", ".join(entry.rewards) + "; or give module:function"))
        labels = [_label(r) for r in given.get("rewards") or () if isinstance(r, dict)]
        for label in sorted({x for x in labels if x and labels.count(x) > 1}):
            found.append((("rewards",), f"two rewards are named {label!r}: give one of them a name (name: ...)"))
        return found
    if not has & {"reward", "rewards", "tasks", "dataset", "dataFiles"}:
        found.append((("name",), f"unknown catalog environment (got {name!r}): available: "
                      + ", ".join(CATALOG) + "; or give reward, tasks and evalTasks for your own"))
        return found
    if "reward" in has and "rewards" in has:
        found.append((("rewards",), "give reward (one function) or rewards (several, weighted), not both"))
    elif not has & {"reward", "rewards", "episodes"}:
        found.append((("reward",), "required: module:function or file.py:function, or rewards: "
                      "[{function: ..., weight: ...}], or episodes: file.py:Class (an environment that talks back)"))
    for i, r in enumerate(given.get("rewards") or ()):
        fn = r.get("function") if isinstance(r, dict) else None
        if isinstance(fn, str) and ":" not in fn:
            found.append((("rewards", i, "function"), f"must be module:function or file.py:function (got {fn!r}); "
                          "reward names are for catalog environments"))
    labels = [_label(r) for r in given.get("rewards") or () if isinstance(r, dict)]
    for label in sorted({x for x in labels if x and labels.count(x) > 1}):
        found.append((("rewards",), f"two rewards are named {label!r}: give one of them a name (name: ...)"))
    return found + _source_problems(has)


def _source_problems(has: set[str]) -> list[tuple[tuple[str, ...], str]]:
    """Where your own tasks come from: one source, and its held-out tasks."""
    found: list[tuple[tuple[str, ...], str]] = []
    sources = sorted(has & {"tasks", "dataset", "dataFiles"})
    if len(sources) > 1:
        found.append(((sources[1],), f"give one source of tasks: tasks, dataset or dataFiles (got {', '.join(sources)})"))
    if not sources:
        found.append((("tasks",), f"required with reward: {TASKS_HINT}; or dataset / dataFiles"))
        found.append((("evalTasks",), f"required with reward: {TASKS_HINT}; or heldOutFraction"))
    elif sources == ["tasks"] and not has & {"evalTasks", "heldOutFraction"}:
        found.append((("evalTasks",), f"required with reward: {TASKS_HINT}; or heldOutFraction to hold out part of tasks"))
    if "evalTasks" in has and sources != ["tasks"]:
        found.append((("evalTasks",), "goes with tasks; with dataset or dataFiles the held-out tasks are evalSplit"))
    if "heldOutFraction" in has and "evalTasks" in has:
        found.append((("heldOutFraction",), "give evalTasks or heldOutFraction, not both"))
    if "datasetConfig" in has and "dataset" not in has:
        found.append((("datasetConfig",), "goes with dataset (the data set's subset)"))
    for key in ("trainSplit", "evalSplit"):
        if key in has and sources == ["tasks"]:
            found.append(((key,), "goes with dataset or dataFiles; a tasks file is one split"))
    return found


def _label(reward: dict[str, Any]) -> str | None:
    """The name a reward is recorded under (RewardSpec.label), from what was written."""
    fn, model = reward.get("function"), reward.get("model")
    name = reward.get("name") or (reward_name(fn) if isinstance(fn, str) else
                                  model_label(model) if isinstance(model, str) else
                                  "judge" if isinstance(reward.get("judge"), dict) else None)
    return name if isinstance(name, str) else None
