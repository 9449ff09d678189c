"""`spec.tracking`, the schema: which trackers a job writes to (the writers: runner/books/trackers.py)."""

from __future__ import annotations

import importlib.util
from typing import Any

from pydantic import ValidationInfo, field_validator

from grpo_run.runner.spec.environment import base_folder, resolve_path
from grpo_run.trainer.config import Strict, fmt, problem


class MlflowSpec(Strict):
    """`spec.tracking.mlflow`: where the MLflow tracking server (or file store) is."""
    trackingURI: str
    experiment: str | None = None       # default: the job's name

    @field_validator("trackingURI")
    @classmethod
    def _uri(cls, v: str) -> str:
        if not v:
            raise problem("must be a tracking URI such as http://mlflow:5000 or file:///srv/mlruns (got '')")
        return v


class WandbSpec(Strict):
    """`spec.tracking.wandb`: the W&B project (credentials come from the environment, as usual)."""
    project: str
    entity: str | None = None
    mode: str | None = None             # online | offline | disabled (default: W&B's own, WANDB_MODE)

    @field_validator("mode")
    @classmethod
    def _mode(cls, v: str | None) -> str | None:
        if v not in (None, "online", "offline", "disabled"):
            raise problem(f"must be online, offline or disabled (got {fmt(v)})")
        return v


class Tracking(Strict):
    """`spec.tracking`: each tracker optional; none is on unless named here."""
    tensorboard: bool | str | None = None
    mlflow: MlflowSpec | None = None
    wandb: WandbSpec | None = None

    @field_validator("tensorboard")
    @classmethod
    def _tensorboard(cls, v: bool | str | None, info: ValidationInfo) -> bool | str | None:
        if v == "":
            raise problem("must be true (event files in the job's storage) or a folder or URL (got '')")
        if v not in (None, False):
            _installed("tensorboard", "tensorboard")
        if isinstance(v, str) and "://" not in v:     # a folder: relative to the job file's, as spec.storage
            try:
                return resolve_path(v, base_folder(info))
            except (OSError, ValueError, RuntimeError) as e:
                raise problem(f"not a usable folder (got {fmt(v)}): {e}") from None
        return v

    @field_validator("mlflow", "wandb")
    @classmethod
    def _package(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None:
            _installed(info.field_name, info.field_name)
        return v

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


def _installed(package: str, field: str) -> None:
    """The house error when a tracker's package is missing: checked before anything runs."""
    if importlib.util.find_spec(package) is None:
        raise problem(f"needs the {package} package, which is not installed: pip install 'grpo-run[{field}]' "
                      f"(or leave spec.tracking.{field} out)")
