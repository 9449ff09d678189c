"""The TrainingJob file: kubectl-style YAML, validated by pydantic into a frozen TrainingJob.

Every problem in a file is collected and reported at once, each line naming the field, what
was given and what is allowed; unknown keys are errors (a typo must never be silently ignored).
Checks that need more than one field (the catalog's task counts, QLoRA on this machine) run once
every field on its own is valid.
"""

from __future__ import annotations

import errno
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from grpo_run.runner.spec.hardware import Pricing, Resources, positive_number
from grpo_run.runner.spec.environment import EnvironmentSpec, base_folder, resolve_path
from grpo_run.runner.spec.gpus import GPUS, canonical_name, spelled_like, suggestion
from grpo_run.runner.spec.yamlfile import FileRefused, load as load_yaml, read_text, value_problems
from grpo_run.runner.notices.clouds import (AWS_METADATA_URL_ENV, AZURE_METADATA_URL_ENV, CLOUDS, GCP_METADATA_URL_ENV)
from grpo_run.runner.spec.tracking import Tracking
from grpo_run.trainer.config import GRPOParams, Strict, fmt, problem, problems_at, problems_in, to_yaml_dict
from grpo_run.trainer.envs.catalog import CATALOG
from grpo_run.runner.home import TINY_NAMES, TINY_PREFIX, is_tiny

API_VERSION = "grpo-run/v1"
KIND = "TrainingJob"
RUNTIMES = ("grpo-lora",)
STORAGE_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "file", "local", "memory")   # what checkpoint.storage.store opens
NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
NOTICE_URLS = {"awsMetadataURL": AWS_METADATA_URL_ENV, "gcpMetadataURL": GCP_METADATA_URL_ENV,
               "azureMetadataURL": AZURE_METADATA_URL_ENV}
USER_ENV_EXAMPLE = "{name: my-env, reward: rewards.py:score, tasks: train.jsonl, evalTasks: eval.jsonl}"
MAX_LINE = 1000              # a problem line longer than this has the middle of its value left out


class JobError(ValueError):
    """A job file with problems; `problems` holds one line per problem."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = [_printable(p) for p in problems]
        super().__init__(f"{source}: {len(problems)} problem{'s' if len(problems) != 1 else ''}:\n"
                         + "\n".join("  " + p for p in self.problems))


def _printable(line: str) -> str:
    """`line` as a terminal can show it: lone surrogates (from a key, say) as \\udXXX escapes, and the
    middle left out when a value in it (a megabyte string, a huge list) makes it longer than
    MAX_LINE, keeping the field at the start and the fix at the end."""
    line = line.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(line) <= MAX_LINE:
        return line
    keep = MAX_LINE // 2 - 20
    return f"{line[:keep]}…[{len(line) - 2 * keep:,} characters left out]…{line[-keep:]}"


def _path_trouble(e: Exception, value: Any) -> str:
    """What is wrong with a path the system refuses to look at, in the house format."""
    got = fmt(getattr(e, "filename", None) or value)
    if isinstance(e, OSError) and e.errno == errno.ENAMETOOLONG:
        return f"the path is too long (got {got}): each folder or file name is at most 255 bytes"
    if isinstance(e, OSError):
        return f"the path cannot be looked at (got {got}): {e.strerror or e}"
    if isinstance(e, ValueError):                # Path.exists on a string with a NUL in it
        return f"the path has a NUL character in it (got {got}): remove it"
    return f"cannot expand the ~ in the path (got {got}): {e}; write the folder out in full"


def _unusable_paths(e: BaseException) -> bool:
    """`e` is how pathlib refuses a path (too long, `~user` unknown, a NUL), not a bug to hide."""
    return isinstance(e, (OSError, ValueError)) or (isinstance(e, RuntimeError) and not isinstance(e, RecursionError))


class Notices(Strict):
    """`spec.notices`: which clouds' spot notices to watch and where their metadata services are
    (defaults: the GRPO_RUN_*_METADATA_URL variables, else the clouds' own addresses)."""
    clouds: str | tuple[str, ...] = Field("auto", json_schema_extra={"like": "{clouds: [aws]}"})
    awsMetadataURL: str | None = None
    gcpMetadataURL: str | None = None
    azureMetadataURL: str | None = None

    @field_validator("clouds", mode="before")
    @classmethod
    def _clouds(cls, v: Any) -> Any:
        if v in ("auto", "none"):
            return v
        if isinstance(v, (list, tuple)) and v and all(c in CLOUDS for c in v):
            return tuple(v)
        raise problem(f"must be auto, none, or a list of {', '.join(CLOUDS)} (got {fmt(v)})")

    @field_validator("awsMetadataURL", "gcpMetadataURL", "azureMetadataURL")
    @classmethod
    def _url(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("http://", "https://")):
            raise problem(f"must be an http:// URL (got {fmt(url)})")
        return url.rstrip("/") if url else url

    @property
    def urls(self) -> tuple[tuple[str, str], ...]:
        """(environment variable, URL) for each metadata address the job sets."""
        return tuple((var, getattr(self, key)) for key, var in NOTICE_URLS.items() if getattr(self, key))

    def to_dict(self) -> dict[str, Any]:
        out = self.model_dump(exclude_none=True)
        out["clouds"] = self.clouds if isinstance(self.clouds, str) else list(self.clouds)
        return out


class TrainingJob(Strict):
    """A validated job: `metadata.name` and the fields of `spec`. Validate a document with
    `parse_job` (relative paths resolve against the job file's folder)."""
    name: str
    model: str = Field(json_schema_extra={"required": "a hub id, a local folder, or tiny:char"})
    environment: EnvironmentSpec = Field(json_schema_extra={"required": "a catalog environment such as "
                                         "{name: arithmetic} or " + USER_ENV_EXAMPLE, "like": "{name: arithmetic}"})
    parameters: GRPOParams = Field(default_factory=GRPOParams,
                                   json_schema_extra={"like": "{numGenerations: 8, maxSteps: 100}"})
    runtime: Literal[RUNTIMES] = "grpo-lora"
    maxCostUSD: float | None = None
    gpu: str | None = None            # SkyPilot's name (runner.spec.gpus), or any card spec.pricing describes
    storage: str | None = None        # default: $GRPO_RUN_HOME/store
    pricing: Pricing | None = None    # overrides for the cost estimate of spec.gpu
    resources: Resources | None = None  # processes per node (default 1)
    nodes: int | None = Field(None, json_schema_extra={"like": "2"})   # the nodes the job trains on (default 1)
    notices: Notices | None = None    # spot-notice watchers (default: auto-detect the cloud)
    tracking: Tracking | None = None  # experiment trackers (TensorBoard, MLflow, W&B), all off by default
    # the reward sandbox: strict runs reward functions only with every layer in force (network
    # and filesystem isolation, signal scope, seccomp); best-effort runs them with what the node
    # allows and says what is missing. Unset: the node's GRPO_RUN_SANDBOX (the deploy files set
    # strict), else best-effort. A node set to strict is never lowered by a job (sandbox_strict).
    sandbox: Literal["strict", "best-effort"] | None = Field(None, json_schema_extra={"like": "strict"})

    @field_validator("model")
    @classmethod
    def _model(cls, model: str, info: ValidationInfo) -> str:
        base = base_folder(info)
        if not model:
            raise problem("required: a hub id, a local folder, or tiny:char (got '')")
        if is_tiny(model):
            if model[len(TINY_PREFIX):] not in TINY_NAMES:
                raise problem(f"unknown built-in model (got {model!r}): available: "
                              + ", ".join(TINY_PREFIX + n for n in TINY_NAMES))
            return model
        try:
            looks_like_path = model.startswith(("/", "./", "../", "~")) or Path(model).expanduser().exists()
            if not looks_like_path and not (base / model).exists():
                return model  # a hub id such as Qwen/Qwen3-0.6B; checked when it is loaded
            folder = Path(resolve_path(model, base))
            is_folder, has_config = folder.is_dir(), (folder / "config.json").exists()
        except Exception as e:
            if not _unusable_paths(e):
                raise
            raise problem(_path_trouble(e, model)) from None
        if not is_folder:
            raise problem(f"no such folder (got {model!r}): give a folder holding config.json, "
                          "a hub id such as Qwen/Qwen3-0.6B, or tiny:char for the built-in demo model")
        if not has_config:
            raise problem(f"{folder} has no config.json (got {model!r}): point at the folder `save_pretrained` wrote")
        return str(folder)

    @field_validator("gpu")
    @classmethod
    def _gpu(cls, v: str | None) -> str | None:
        guess = None if v is None or canonical_name(v) else spelled_like(v)
        if guess:
            raise problem(f"unknown GPU (got {fmt(v)}): did you mean {guess}? Names are SkyPilot's, as written")
        return v

    @field_validator("runtime", mode="before")
    @classmethod
    def _runtime(cls, v: Any) -> Any:
        if v not in RUNTIMES:
            raise problem(f"must be one of {', '.join(RUNTIMES)} (got {fmt(v)}); "
                          "choose LoRA, QLoRA or Full with spec.parameters.method")
        return v

    @field_validator("nodes", mode="before")
    @classmethod
    def _nodes(cls, v: Any) -> Any:
        if v is not None and (type(v) is not int or v < 1):
            raise problem(f"must be a whole number of nodes, 1 or more (got {fmt(v)}); each node is started with "
                          "`grpo-run resume NAME --nnodes N --node-rank R --master HOST:PORT` (docs/multi-gpu.md)")
        return v

    @field_validator("maxCostUSD", mode="before")
    @classmethod
    def _budget(cls, v: Any) -> Any:
        return None if v is None else positive_number(v, "; leave it out for no limit")

    @field_validator("storage")
    @classmethod
    def _storage(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None and not v:
            raise problem("must be a URL such as s3://bucket/prefix or a folder (got '')")
        scheme = v.split("://", 1)[0].lower() if v and "://" in v else ""
        if scheme and scheme not in STORAGE_SCHEMES:     # checkpoint.storage.store opens only these
            raise problem(f"unsupported scheme {scheme!r} in {v!r}: use s3://bucket/prefix (AWS, MinIO, "
                          f"SeaweedFS, R2), gs://bucket/prefix, az://container/prefix, file:///path or a folder")
        try:
            return v if v is None or "://" in v else resolve_path(v, base_folder(info))
        except Exception as e:
            if not _unusable_paths(e):
                raise
            raise problem(_path_trouble(e, v)) from None

    @field_validator("environment", mode="wrap")
    @classmethod
    def _environment(cls, raw: Any, handler: Any) -> EnvironmentSpec:
        """runner.environment's checks, with two inputs they would fail on turned into problems:
        `rewards` that is not a list (it is iterated), and a path the system refuses to look at
        (too long, `~user` unknown), named on spec.environment."""
        rewards = raw.get("rewards") if isinstance(raw, dict) else None
        if rewards is not None and not isinstance(rewards, (str, list, tuple)):
            raise problems_at("EnvironmentSpec", [(("rewards",), "must be a list like [{function: correct, "
                                                   f"weight: 1.0}}] or one reward's name (got {fmt(rewards)})")])
        try:
            return handler(raw)
        except Exception as e:
            if isinstance(e, ValidationError) or not _unusable_paths(e):
                raise
            raise problem("a path in it: " + _path_trouble(e, raw)) from None

    @model_validator(mode="after")
    def _together(self) -> TrainingJob:
        """What needs more than one field: catalog task counts, user task files vs counts, QLoRA here."""
        found: list[tuple[tuple[str, ...], str]] = []
        params, env = self.parameters, self.environment
        if env.is_catalog:
            if not CATALOG[env.name].data:               # a data set's counts are checked when it loads
                try:
                    CATALOG[env.name].make(params.seed, params.trainTasks, params.evalTasks)
                except ValueError as e:
                    found.append((("parameters", "evalTasks"), str(e)))
        else:
            for key in ("trainTasks", "evalTasks"):
                if getattr(params, key) is not None:
                    found.append((("parameters", key), "only for catalog environments; your environment's "
                                  "own tasks set them"))
        processes = self.resources.processes if self.resources is not None else 1
        if processes != "auto" and params.promptsPerStep < processes:
            found.append((("resources", "processes"), f"{processes} processes need promptsPerStep >= {processes} "
                          f"(got {params.promptsPerStep}): each process samples whole groups of its own; raise "
                          "spec.parameters.promptsPerStep or ask for fewer processes"))
        if self.nodes and processes != "auto" and params.promptsPerStep < processes * self.nodes:
            found.append((("nodes",), f"{self.nodes} nodes of {processes} process{'es' if processes > 1 else ''} need "
                          f"promptsPerStep >= {processes * self.nodes} (got {params.promptsPerStep}): each process "
                          "samples whole groups of its own; raise spec.parameters.promptsPerStep or use fewer nodes"))
        if params.staleness and env.plays_episodes:
            found.append((("parameters", "staleness"), f"is {params.staleness}, and an environment with episodes "
                          "or tools cannot sample asynchronously yet: its sandboxed worker plays one episode loop at a "
                          "time, and the held-out evaluations play while the producer would; set staleness: 0"))
        if params.staleness and (processes != 1 or self.nodes):
            found.append((("parameters", "staleness"), f"is {params.staleness}, and asynchronous sampling runs on "
                          "one trainer process yet (its producer is a thread beside the update); set "
                          "spec.resources.processes: 1 without nodes, or staleness: 0"))
        if params.evalSteps is not None and params.evalSteps >= params.maxSteps:
            found.append((("parameters", "evalSteps"), f"must be < maxSteps ({params.maxSteps}) to evaluate while "
                          "training; the final evaluation runs after the last step anyway"))
        if self.gpu is not None and canonical_name(self.gpu) is None and (
                self.pricing is None or self.pricing.usdPerHour is None or self.pricing.memoryGB is None):
            guess = suggestion(self.gpu)
            found.append((("gpu",), f"unknown GPU (got {fmt(self.gpu)}){f': did you mean {guess}?' if guess else ''} "
                          f"Use one of {', '.join(GPUS)} (SkyPilot's names), or describe your card with "
                          "spec.pricing: {usdPerHour: 1.2, memoryGB: 32}"))
        if params.method == "QLoRA" and not found:
            from grpo_run.trainer.model.policy import QLoRAUnavailable, check_qlora, pick_device

            try:
                check_qlora(pick_device())
            except QLoRAUnavailable as e:
                found.append((("parameters", "method"), f"QLoRA cannot run here: {e}"))
        if found:
            raise problems_at("TrainingJob", found)
        return self

    def to_dict(self) -> dict[str, Any]:
        """The job as a manifest, every default filled in (what `get tj -o yaml` shows)."""
        spec: dict[str, Any] = {"runtime": self.runtime, "model": self.model,
                                "environment": self.environment.to_dict(),
                                "parameters": to_yaml_dict(self.parameters)}
        for key in ("maxCostUSD", "gpu", "storage", "sandbox", "nodes"):
            if getattr(self, key) is not None:
                spec[key] = getattr(self, key)
        if self.pricing is not None:
            spec["pricing"] = self.pricing.to_dict()
        if self.resources is not None:
            spec["resources"] = self.resources.to_dict()
        if self.notices is not None:
            spec["notices"] = self.notices.to_dict()
        if self.tracking is not None:
            spec["tracking"] = self.tracking.to_dict()
        return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": self.name}, "spec": spec}


class _Metadata(Strict):
    name: str = Field(json_schema_extra={"required": "metadata: {name: my-grpo-lora}"})
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None

    @field_validator("name", mode="before")
    @classmethod
    def _name(cls, v: Any) -> Any:
        trouble = name_problem(v)
        if trouble:
            raise problem(trouble)
        return v


def name_problem(v: Any) -> str | None:
    """What is wrong with `v` as a job's name (metadata.name, or a NAME on the command line); None
    when nothing. A name is a folder in storage and on the node, and a word in launch files."""
    if isinstance(v, str) and NAME_RE.fullmatch(v):     # fullmatch: `$` would let a final newline through
        return None
    return ("must be lowercase letters, digits and '-', 1-63 characters, "
            f"starting and ending with a letter or digit (got {fmt(v)})")


class _Document(Strict):
    """The envelope: apiVersion, kind, metadata; `spec` is validated as a TrainingJob."""
    apiVersion: Any = None
    kind: Any = None
    metadata: _Metadata = Field(json_schema_extra={"required": "with a name: metadata: {name: my-grpo-lora}",
                                                   "like": "{name: my-grpo-lora}"})
    spec: dict = Field(json_schema_extra={"required": "a mapping with at least model and environment",
                                          "like": "{model: ..., environment: ...}"})
    status: Any = None

    @field_validator("apiVersion", "kind", mode="before")
    @classmethod
    def _envelope(cls, v: Any, info: ValidationInfo) -> Any:
        want = {"apiVersion": API_VERSION, "kind": KIND}[info.field_name]
        if v != want:
            raise problem(f"must be {want} (got {fmt(v)})")
        return v


def parse_job(doc: Any, *, source: str = "job", base: Path | None = None,
              check_files: bool = True) -> TrainingJob:
    """A TrainingJob from a parsed YAML document. Raises JobError listing every problem.

    `base` is the folder relative paths in the job are resolved against (the job file's folder).
    `check_files=False` (resume on a fresh node): the environment's files may be in storage only.
    """
    if not isinstance(doc, dict):
        raise JobError(source, ["the file must be a YAML mapping with apiVersion, kind, metadata and spec "
                                f"(got {type(doc).__name__})"])
    whole, values, bad_keys = value_problems(doc)
    if whole:                                    # too deep or too big to validate safely
        raise JobError(source, whole)
    problems: list[str] = []
    name = None
    try:
        envelope = _Document.model_validate({"apiVersion": None, "kind": None, **doc})
        name = envelope.metadata.name
    except ValidationError as e:
        problems += problems_in(e, "", _Document)
    spec = doc.get("spec")
    if not isinstance(spec, dict):
        raise JobError(source, _with_value_problems(problems, values, bad_keys))
    fields = dict(spec)
    if "name" in fields:
        del fields["name"]
        problems.append("spec.name: unknown field; the job's name is metadata.name")
    try:
        job = TrainingJob.model_validate({**fields, "name": name or "-"},
                                         context={"base": base or Path.cwd(), "check_files": check_files})
    except ValidationError as e:
        problems += problems_in(e, "spec", TrainingJob)
    problems = _with_value_problems(problems, values, bad_keys)
    if problems:
        raise JobError(source, problems)
    return job


def _with_value_problems(problems: list[str], values: dict[str, str], bad_keys: list[str]) -> list[str]:
    """pydantic's problems with the value problems put in: a value problem replaces pydantic's line
    for the same field (it says what is wrong with the number or text itself), and is left out under
    a field that is unknown anyway; keys that are not text replace pydantic's lines about them."""
    if bad_keys:
        problems = [line for line in problems if "keys should be strings (got " not in line
                    and not line.split(": ", 1)[0].endswith(".[key]")]
    unknown = {line.split(": ", 1)[0] for line in problems if ": unknown field" in line}

    def moot(path: str) -> bool:
        return any(path == u or path.startswith(u + ".") for u in unknown)

    out, used = [], set()
    for line in problems:
        path = line.split(": ", 1)[0]
        if path in values and not moot(path):
            if path not in used:
                out.append(values[path])
                used.add(path)
        else:
            out.append(line)
    return out + [text for path, text in values.items() if path not in used and not moot(path)] + bad_keys


def load_job(path: str | Path) -> TrainingJob:
    """Read and validate a job file. Raises JobError (problems listed: a whole-file problem such as
    not YAML, not UTF-8, too large or too deeply nested, or each field's) or FileNotFoundError."""
    path = Path(path)
    try:
        doc = load_yaml(read_text(path))
    except FileRefused as e:
        raise JobError(str(path), [str(e)]) from None
    except yaml.YAMLError as e:
        raise JobError(str(path), [f"not valid YAML: {e}"]) from None
    return parse_job(doc, source=str(path), base=path.resolve().parent)
