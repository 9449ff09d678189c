"""The TrainingJob file: kubectl-style YAML, parsed into a frozen, validated TrainingJob.

Every problem in a file is collected and reported at once, each line naming the field, what
was given and what is allowed; unknown keys are errors (a typo must never be silently ignored).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from runner.estimate import GPUS
from trainer.config import GRPOParams, coerce, parse_parameters, to_yaml_dict, unknown_keys
from trainer.envs import CATALOG
from trainer.tinymodel import TINY_NAMES, TINY_PREFIX, is_tiny

API_VERSION = "grpo-run/v1"
KIND = "TrainingJob"
RUNTIMES = ("grpo-lora",)
NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
SPEC_FIELDS = ["runtime", "model", "environment", "parameters", "maxCostUSD", "gpu", "pricing", "storage", "notices"]
NOTICE_CLOUDS = ("aws", "gcp", "azure")
NOTICE_URLS = {"awsMetadataURL": "GRPO_RUN_AWS_METADATA_URL", "gcpMetadataURL": "GRPO_RUN_GCP_METADATA_URL",
               "azureMetadataURL": "GRPO_RUN_AZURE_METADATA_URL"}
PRICING_FIELDS = ["usdPerHour", "stepSeconds"]
ENV_FIELDS = ["name", "reward", "tasks", "evalTasks", "path"]


class JobError(ValueError):
    """A job file with problems; `problems` holds one line per problem."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: {len(problems)} problem{'s' if len(problems) != 1 else ''}:\n"
                         + "\n".join("  " + p for p in problems))


@dataclass(frozen=True)
class EnvironmentSpec:
    name: str
    reward: str | None = None        # user environments: "module:function" or "file.py:function"
    tasks: str | None = None         # user environments: JSONL of train tasks
    evalTasks: str | None = None     # user environments: JSONL of held-out tasks
    path: tuple[str, ...] = ()       # folders put on the grader's sys.path

    @property
    def is_catalog(self) -> bool:
        return self.reward is None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        for key in ("reward", "tasks", "evalTasks"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.path:
            out["path"] = list(self.path)
        return out


@dataclass(frozen=True)
class Pricing:
    """`spec.pricing`: the user's own numbers for `spec.gpu`, overriding the estimate's table."""
    usdPerHour: float | None = None   # what this node costs you per hour
    stepSeconds: float | None = None  # seconds per training step (wins over measured and reference)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in PRICING_FIELDS if getattr(self, k) is not None}


@dataclass(frozen=True)
class Notices:
    """`spec.notices`: which clouds' spot notices to watch and where their metadata services are
    (defaults: the GRPO_RUN_*_METADATA_URL variables, else the clouds' own addresses)."""
    clouds: str | tuple[str, ...] = "auto"   # auto | none | a list of aws, gcp, azure
    urls: tuple[tuple[str, str], ...] = ()    # (env var, URL) pairs from the *MetadataURL fields

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"clouds": self.clouds if isinstance(self.clouds, str) else list(self.clouds)}
        by_var = dict(self.urls)
        for key, var in NOTICE_URLS.items():
            if var in by_var:
                out[key] = by_var[var]
        return out


@dataclass(frozen=True)
class TrainingJob:
    name: str
    model: str
    environment: EnvironmentSpec
    parameters: GRPOParams = field(default_factory=GRPOParams)
    runtime: str = "grpo-lora"
    maxCostUSD: float | None = None
    gpu: str | None = None
    storage: str | None = None        # default: $GRPO_RUN_HOME/store
    pricing: Pricing | None = None    # overrides for the cost estimate of spec.gpu
    notices: Notices | None = None    # spot-notice watchers (default: auto-detect the cloud)

    def to_dict(self) -> dict[str, Any]:
        """The job as a manifest, every default filled in (what `get tj -o yaml` shows)."""
        spec: dict[str, Any] = {"runtime": self.runtime, "model": self.model,
                                "environment": self.environment.to_dict(),
                                "parameters": to_yaml_dict(self.parameters)}
        for key in ("maxCostUSD", "gpu", "storage"):
            if getattr(self, key) is not None:
                spec[key] = getattr(self, key)
        if self.pricing is not None:
            spec["pricing"] = self.pricing.to_dict()
        if self.notices is not None:
            spec["notices"] = self.notices.to_dict()
        return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": self.name}, "spec": spec}


def _fmt(v: Any) -> str:
    return repr(v) if isinstance(v, str) else str(v)


def _resolve(path: str, base: Path) -> str:
    """A path from the job file, relative to the file's folder; `module:function` refs untouched."""
    p = Path(path).expanduser()
    return str(p if p.is_absolute() else (base / p).resolve())


def _looks_like_path(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~")) or Path(model).expanduser().exists()


def _check_model(model: str, base: Path, problems: list[str]) -> str:
    if is_tiny(model):
        if model[len(TINY_PREFIX):] not in TINY_NAMES:
            problems.append(f"spec.model: unknown built-in model (got {model!r}): available: "
                            + ", ".join(TINY_PREFIX + n for n in TINY_NAMES))
        return model
    if not _looks_like_path(model) and not (base / model).exists():
        return model  # a hub id such as Qwen/Qwen3-0.6B; checked when it is loaded
    folder = Path(_resolve(model, base))
    if not folder.is_dir():
        problems.append(f"spec.model: no such folder (got {model!r}): give a folder holding config.json, "
                        "a hub id such as Qwen/Qwen3-0.6B, or tiny:char for the built-in demo model")
    elif not (folder / "config.json").exists():
        problems.append(f"spec.model: {folder} has no config.json (got {model!r}): point at the folder "
                        "`save_pretrained` wrote")
    return str(folder)


def _check_reward_ref(ref: str, base: Path, problems: list[str], check_files: bool = True) -> str:
    module, sep, func = ref.rpartition(":")
    if not sep or not module or not func.isidentifier():
        problems.append(f"spec.environment.reward: must be module:function or file.py:function (got {ref!r})")
        return ref
    if module.endswith(".py"):
        path = Path(_resolve(module, base))
        if check_files and not path.is_file():
            problems.append(f"spec.environment.reward: no such file {path} (got {ref!r})")
        return f"{path}:{func}"
    return ref


def _parse_environment(raw: Any, base: Path, problems: list[str], check_files: bool = True) -> EnvironmentSpec | None:
    where = "spec.environment"
    if raw is None:
        problems.append(f"{where}: required: a catalog environment such as {{name: arithmetic}} "
                        "or {name: my-env, reward: rewards.py:score, tasks: train.jsonl, evalTasks: eval.jsonl}")
        return None
    if isinstance(raw, str):
        raw = {"name": raw}
    if not isinstance(raw, Mapping):
        problems.append(f"{where}: must be a mapping (got {_fmt(raw)})")
        return None
    problems += unknown_keys(raw, ENV_FIELDS, where)
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        problems.append(f"{where}.name: required, a string (got {_fmt(name)})")
        return None
    if "reward" not in raw:
        if name not in CATALOG:
            problems.append(f"{where}.name: unknown catalog environment (got {name!r}): available: "
                            + ", ".join(CATALOG) + "; or give reward, tasks and evalTasks for your own")
            return None
        for key in ("tasks", "evalTasks", "path"):
            if key in raw:
                problems.append(f"{where}.{key}: only for environments with your own reward "
                                f"(catalog environment {name!r} makes its own tasks)")
        return EnvironmentSpec(name=name)
    reward = raw["reward"]
    if not isinstance(reward, str):
        problems.append(f"{where}.reward: must be a string like rewards.py:score (got {_fmt(reward)})")
        return None
    reward = _check_reward_ref(reward, base, problems, check_files)
    files: dict[str, str | None] = {}
    for key in ("tasks", "evalTasks"):
        value = raw.get(key)
        if value is None:
            problems.append(f"{where}.{key}: required with reward: a JSONL file, one {{\"prompt\": ...}} per line")
            files[key] = None
        elif not isinstance(value, str):
            problems.append(f"{where}.{key}: must be a file path (got {_fmt(value)})")
            files[key] = None
        else:
            files[key] = _resolve(value, base)
            if check_files and not Path(files[key]).is_file():
                problems.append(f"{where}.{key}: no such file {files[key]} (got {value!r})")
    path_raw = raw.get("path", [])
    if isinstance(path_raw, str):
        path_raw = [path_raw]
    if not isinstance(path_raw, list) or not all(isinstance(p, str) for p in path_raw):
        problems.append(f"{where}.path: must be a list of folders (got {_fmt(path_raw)})")
        path_raw = []
    search = tuple(_resolve(p, base) for p in path_raw) or (str(base),)
    return EnvironmentSpec(name=name, reward=reward, tasks=files["tasks"], evalTasks=files["evalTasks"], path=search)


def _parse_pricing(raw: Any, problems: list[str]) -> Pricing | None:
    where = "spec.pricing"
    if raw is None:
        return None
    if not isinstance(raw, Mapping) or not raw:
        problems.append(f"{where}: must be a mapping with usdPerHour and/or stepSeconds, e.g. "
                        f"{{usdPerHour: 2.1, stepSeconds: 0.5}} (got {_fmt(raw)})")
        return None
    problems += unknown_keys(raw, PRICING_FIELDS, where)
    values: dict[str, float] = {}
    for key in PRICING_FIELDS:
        if key not in raw:
            continue
        value, err = coerce(raw[key], float)
        if err or not math.isfinite(value) or value <= 0:
            problems.append(f"{where}.{key}: must be a number > 0 (got {_fmt(raw[key])})")
        else:
            values[key] = value
    return Pricing(**values)


def _parse_notices(raw: Any, problems: list[str]) -> Notices | None:
    where = "spec.notices"
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        problems.append(f"{where}: must be a mapping like {{clouds: [aws]}} (got {_fmt(raw)})")
        return None
    problems += unknown_keys(raw, ["clouds", *NOTICE_URLS], where)
    clouds = raw.get("clouds", "auto")
    if isinstance(clouds, list) and clouds and all(c in NOTICE_CLOUDS for c in clouds):
        clouds = tuple(clouds)
    elif clouds not in ("auto", "none"):
        problems.append(f"{where}.clouds: must be auto, none, or a list of {', '.join(NOTICE_CLOUDS)} (got {_fmt(clouds)})")
        clouds = "auto"
    urls = []
    for key, var in NOTICE_URLS.items():
        if key in raw:
            url = raw[key]
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                problems.append(f"{where}.{key}: must be an http:// URL (got {_fmt(url)})")
            else:
                urls.append((var, url.rstrip("/")))
    return Notices(clouds=clouds, urls=tuple(urls))


def parse_job(doc: Any, *, source: str = "job", base: Path | None = None,
              check_files: bool = True) -> TrainingJob:
    """A TrainingJob from a parsed YAML document. Raises JobError listing every problem.

    `base` is the folder relative paths in the job are resolved against (the job file's folder).
    `check_files=False` (resume on a fresh node): the environment's files may be in storage only.
    """
    base = base or Path.cwd()
    problems: list[str] = []
    if not isinstance(doc, Mapping):
        raise JobError(source, [f"the file must be a YAML mapping with apiVersion, kind, metadata and spec (got {type(doc).__name__})"])
    problems += unknown_keys(doc, ["apiVersion", "kind", "metadata", "spec", "status"], "")
    problems = [p.lstrip(".") for p in problems]
    if doc.get("apiVersion") != API_VERSION:
        problems.append(f"apiVersion: must be {API_VERSION} (got {_fmt(doc.get('apiVersion'))})")
    if doc.get("kind") != KIND:
        problems.append(f"kind: must be {KIND} (got {_fmt(doc.get('kind'))})")
    meta = doc.get("metadata")
    name = None
    if not isinstance(meta, Mapping):
        problems.append("metadata: required, with a name: metadata: {name: my-grpo-lora}")
    else:
        problems += unknown_keys(meta, ["name", "labels", "annotations"], "metadata")
        name = meta.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            problems.append(f"metadata.name: must be lowercase letters, digits and '-', 1-63 characters, "
                            f"starting and ending with a letter or digit (got {_fmt(name)})")
    spec = doc.get("spec")
    if not isinstance(spec, Mapping):
        problems.append("spec: required: a mapping with at least model and environment")
        raise JobError(source, problems)
    problems += unknown_keys(spec, SPEC_FIELDS, "spec")

    runtime = spec.get("runtime", "grpo-lora")
    if runtime not in RUNTIMES:
        problems.append(f"spec.runtime: must be one of {', '.join(RUNTIMES)} (got {_fmt(runtime)}); "
                        "choose LoRA, QLoRA or Full with spec.parameters.method")
    model = spec.get("model")
    if not isinstance(model, str) or not model:
        problems.append(f"spec.model: required: a hub id, a local folder, or tiny:char (got {_fmt(model)})")
        model = None
    else:
        model = _check_model(model, base, problems)
    env = _parse_environment(spec.get("environment"), base, problems, check_files)
    params = parse_parameters(spec.get("parameters"), "spec.parameters", problems)

    max_cost = None
    if spec.get("maxCostUSD") is not None:
        max_cost, err = coerce(spec["maxCostUSD"], float)
        if err or max_cost <= 0:
            problems.append(f"spec.maxCostUSD: must be a number > 0 (got {_fmt(spec['maxCostUSD'])}); leave it out for no limit")
            max_cost = None
    gpu = spec.get("gpu")
    if gpu is not None and gpu not in GPUS:
        problems.append(f"spec.gpu: must be one of {', '.join(GPUS)} (got {_fmt(gpu)})")
    pricing = _parse_pricing(spec.get("pricing"), problems)
    notices = _parse_notices(spec.get("notices"), problems)
    storage = spec.get("storage")
    if storage is not None and (not isinstance(storage, str) or not storage):
        problems.append(f"spec.storage: must be a URL such as s3://bucket/prefix or a folder (got {_fmt(storage)})")
    elif isinstance(storage, str) and "://" not in storage:
        storage = _resolve(storage, base)

    if env is not None and env.is_catalog:
        try:
            CATALOG[env.name][0](params.seed, params.trainTasks, params.evalTasks)
        except ValueError as e:
            problems.append(f"spec.parameters.evalTasks: {e}")
    elif env is not None:
        for key in ("trainTasks", "evalTasks"):
            if getattr(params, key) is not None:
                problems.append(f"spec.parameters.{key}: only for catalog environments; your environment's "
                                f"{'tasks' if key == 'trainTasks' else 'evalTasks'} file sets them")

    if params.method == "QLoRA" and not problems:
        from trainer.policy import QLoRAUnavailable, check_qlora, pick_device

        try:
            check_qlora(pick_device())
        except QLoRAUnavailable as e:
            problems.append(f"spec.parameters.method: QLoRA cannot run here: {e}")

    if problems:
        raise JobError(source, problems)
    return TrainingJob(name=name, model=model, environment=env, parameters=params, runtime=runtime,
                       maxCostUSD=max_cost, gpu=gpu, storage=storage, pricing=pricing, notices=notices)


def load_job(path: str | Path) -> TrainingJob:
    """Read and validate a job file. Raises JobError (problems listed) or FileNotFoundError."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise JobError(str(path), [f"not valid YAML: {e}"]) from None
    return parse_job(doc, source=str(path), base=path.resolve().parent)


def build_environment(job: TrainingJob):
    """The trainer's Environment for this job: catalog tasks generated from the seed, or the
    user's reward and task files. Raises ValueError naming a bad task file."""
    from trainer.envs import catalog_environment, read_tasks, user_environment

    env, p = job.environment, job.parameters
    if env.is_catalog:
        return catalog_environment(env.name, seed=p.seed, n_train=p.trainTasks, n_eval=p.evalTasks)
    return user_environment(name=env.name, reward_ref=env.reward, tasks=read_tasks(Path(env.tasks)),
                            eval_tasks=read_tasks(Path(env.evalTasks)), search_path=env.path)


def build_run_spec(job: TrainingJob, storage_url: str, *, local: TrainingJob | None = None):
    """What the supervisor needs for `job`, its outputs under `storage_url`.
    `local`: the same job with its environment files where they are on this node."""
    from runner.supervisor import RunSpec
    from trainer.tinymodel import ensure_model

    return RunSpec(name=job.name, manifest=job.to_dict(), model=ensure_model(job.model),
                   env=build_environment(local or job), params=job.parameters, storage=storage_url,
                   model_name=job.model, usd_per_hour=usd_per_hour(job), max_cost_usd=job.maxCostUSD)


def usd_per_hour(job: TrainingJob) -> float | None:
    """The rate the cost ledger charges: spec.pricing.usdPerHour, else spec.gpu's table rate."""
    if job.pricing is not None and job.pricing.usdPerHour is not None:
        return job.pricing.usdPerHour
    if job.gpu is not None:
        from runner.estimate import lookup_gpu

        return lookup_gpu(job.gpu).usd_per_hour
    return None
