"""What a supervisor is given and what it gives back: the job as resolved for this node
(RunSpec, built by runner.spec.job), the restart limits, and the result the CLI reports. Apart
from the supervisor so that the job spec and each attempt can name them without importing it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from grpo_run.checkpoint.manifest import KEEP_CHECKPOINTS
from grpo_run.trainer.config import GRPOParams
from grpo_run.trainer.envs.catalog import Environment


@dataclass(frozen=True)
class RunSpec:
    """What the supervisor needs for a job, resolved by the caller (runner.spec.job) from the
    TrainingJob."""
    name: str
    manifest: dict[str, Any]         # the job as the user wrote it, defaults filled (never credentials)
    model: str                       # what from_pretrained takes: a hub id or a folder
    env: Environment
    params: GRPOParams
    storage: str                     # URL of this job's folder in object storage
    keep_checkpoints: int = KEEP_CHECKPOINTS
    model_name: str | None = None    # the model as the user named it (saved adapters say this)
    usd_per_hour: float | None = None  # the GPU's rate, for the cost ledger (None: cost unknown)
    max_cost_usd: float | None = None  # spec.maxCostUSD: stop cleanly before a step would pass it
    processes: int = 1               # spec.resources.processes, resolved: > 1 runs the trainer under accelerate
    sandbox_strict: bool = False     # spec.sandbox or the node's GRPO_RUN_SANDBOX, resolved (runner.spec.job)
    # (local file, key in storage, sha256) of the environment files `apply` sends, written once the
    # lease is held (runner.envfiles); () on resume, which uses the stored copies
    environment_uploads: tuple[tuple[str, str, str], ...] = ()
    tracking: dict[str, Any] | None = None   # spec.tracking as this node writes it (resume: the node decides the URLs)


@dataclass(frozen=True)
class RestartLimits:
    """How many times each kind of trainer failure is restarted on this node before giving up.
    Code errors (the user's reward function) and storage configuration errors are never
    restarted: the same input fails the same way."""
    crashes: int = 3            # the trainer process died or raised unexpectedly
    infrastructure: int = 5     # object storage unavailable past its own retries
    backoff_s: float = 2.0      # doubled after each restart, at most 60 s (plus jitter: checkpoint.retry)

    def limit(self, kind: Literal["crashes", "infrastructure"]) -> int:
        """The restarts allowed for failures of `kind`."""
        return {"crashes": self.crashes, "infrastructure": self.infrastructure}[kind]


@dataclass
class SupervisorResult:
    exit_code: int              # runner.exits
    message: str = ""
    notice: str | None = None   # the notice's source when one ended the run
    notice_to_durable_s: float | None = None
    durable_step: int | None = None
    code_error: bool = False          # failed in the job's own code or numbers (a reward): a resume replays it
    already_succeeded: bool = False   # storage's record, read under the lease, said Succeeded: nothing was run
