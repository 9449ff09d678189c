"""What a supervisor is given and what it gives back: the job as resolved for this node
(RunSpec, built by build_run_spec from the TrainingJob and the node's own settings), the restart
limits, and the result the CLI reports. Apart from the supervisor so that the CLI and each
attempt can name them without importing it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Literal

from grpo_run.checkpoint.manifest import KEEP_CHECKPOINTS
from grpo_run.runner.spec.gpus import canonical_name
from grpo_run.runner.spec import hardware
from grpo_run.runner.spec.hardware import node_processes
from grpo_run.runner.environments import build_environment
from grpo_run.runner.spec.job import JobError, TrainingJob
from grpo_run.runner.spec.judge import judges_refused
from grpo_run.trainer.config import GRPOParams
from grpo_run.trainer.envs.catalog import Environment
from grpo_run.trainer.startup import clock


@dataclass(frozen=True)
class RunSpec:
    """What the supervisor needs for a job, resolved for this node from the TrainingJob
    (build_run_spec)."""
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
    # lease is held (runner.jobs.envfiles); () on resume, which uses the stored copies
    environment_uploads: tuple[tuple[str, str, str], ...] = ()
    tracking: dict[str, Any] | None = None   # spec.tracking as this node writes it (resume: the node decides the URLs)
    nodes: "Nodes | None" = None     # one node of several (runner.jobs.nodes); None: this node alone
    estimate: dict[str, Any] | None = None   # apply's status.estimate, recorded (None: resume keeps the recorded one)


@dataclass(frozen=True)
class Nodes:
    """This node's place among a job's nodes: how many, its rank (0 holds the lease, writes the
    record and storage), and rank 0's host:port for the rendezvous."""
    count: int
    rank: int
    master: str

    def environment(self) -> dict[str, str]:
        """What the trainer's launcher reads (trainer.launch.machines)."""
        from grpo_run.trainer.protocol import MASTER_ENV, NODE_RANK_ENV, NODES_ENV

        return {NODES_ENV: str(self.count), NODE_RANK_ENV: str(self.rank), MASTER_ENV: self.master}


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


def build_run_spec(job: TrainingJob, storage_url: str, *, local: TrainingJob | None = None,
                   uploads: tuple[tuple[str, str, str], ...] = (), nodes: Nodes | None = None,
                   model_path: Callable[[str], str] | None = None,
                   estimate: dict[str, Any] | None = None) -> RunSpec:
    """What the supervisor needs for `job` on this node, its outputs under `storage_url`: the
    processes this node's GPUs allow, the judges this node allows, its sandbox and the rate.
    `local`: the same job as this node runs it (its environment files where they are on this
    node; on resume, the node's own tracker, notice and vLLM server URLs). `uploads`: the environment files
    `apply` sends once the lease is held (runner.jobs.envfiles.environment_uploads). `model_path`:
    spec.model resolved on this node (default runner.home.ensure_model; a trainer started early
    may be building the tiny demo model: runner.supervisor.spawn)."""
    from grpo_run.runner.home import ensure_model

    processes = node_processes(job.resources)
    gpus = hardware.node_gpus()
    if gpus and processes > gpus:
        raise JobError(job.name, [f"spec.resources.processes: {processes} processes, one per GPU, but this node has "
                                  f"{gpus} GPU{'s' if gpus > 1 else ''}: ask for at most {gpus}, or auto"])
    everywhere = processes * (nodes.count if nodes else 1)     # the job's processes on all its nodes
    if nodes is not None and everywhere > job.parameters.promptsPerStep:
        raise JobError(job.name, [f"spec.nodes: {nodes.count} nodes of {processes} process{'es' if processes > 1 else ''} "
                                  f"are {everywhere} processes, more than promptsPerStep "
                                  f"({job.parameters.promptsPerStep}): each process samples whole groups of its own; "
                                  "raise promptsPerStep or use fewer nodes"])
    if processes > job.parameters.promptsPerStep:      # auto, on a node with more GPUs than prompts
        raise JobError(job.name, [f"spec.resources.processes: auto is {processes} GPUs on this node, more than "
                                  f"promptsPerStep ({job.parameters.promptsPerStep}): each process samples whole "
                                  "groups of its own; raise promptsPerStep or give a number of processes"])
    refused = judges_refused(job.environment, processes)    # the node's call: a stored job cannot allow itself
    if refused:
        raise JobError(job.name, refused)
    here = local or job
    with clock().part("model fetch"):
        model = (model_path or ensure_model)(job.model)
    return RunSpec(name=job.name, manifest=job.to_dict(), model=model,
                   env=build_environment(here), params=here.parameters, storage=storage_url,
                   model_name=job.model, usd_per_hour=usd_per_hour(job, everywhere),
                   max_cost_usd=job.maxCostUSD, processes=processes, sandbox_strict=sandbox_strict(job),
                   environment_uploads=uploads, tracking=here.tracking.to_dict() if here.tracking is not None else None,
                   nodes=nodes, estimate=estimate)


SANDBOX_ENV = "GRPO_RUN_SANDBOX"    # the node's own setting: "strict" on nodes (the deploy files set it)


def sandbox_strict(job: TrainingJob) -> bool:
    """Whether this node runs the job's reward functions only in the full sandbox: spec.sandbox,
    or the node's GRPO_RUN_SANDBOX. The node's strict wins over a job's best-effort: on `resume`
    the spec comes from storage, and whoever can write there must not lower the node's guard.
    Raises JobError for a GRPO_RUN_SANDBOX that is neither value."""
    node = os.environ.get(SANDBOX_ENV, "").strip()
    if node not in ("", "strict", "best-effort"):
        raise JobError(job.name, [f"{SANDBOX_ENV}={node!r} in this node's environment: set it to strict or "
                                  "best-effort, or unset it to follow spec.sandbox"])
    return node == "strict" or job.sandbox == "strict"


def usd_per_hour(job: TrainingJob, gpus: int = 1) -> float | None:
    """The rate the cost ledger charges for `gpus` GPUs (every process of the job has one):
    spec.pricing.usdPerHour per GPU, else what the estimate charges: spec.gpu's table rate per GPU,
    or the whole instances where AWS rents the card only in bigger ones (estimate.shapes)."""
    if job.pricing is not None and job.pricing.usdPerHour is not None:
        return job.pricing.usdPerHour * gpus
    name = canonical_name(job.gpu) if job.gpu is not None else None
    if name is not None:
        from grpo_run.runner.estimate.shapes import whole_on_demand
        from grpo_run.runner.spec.gpus import lookup_gpu

        nodes = job.nodes or 1
        whole = whole_on_demand(name, max(gpus // nodes, 1), nodes)
        if whole is not None:
            return whole[0]
        rate = lookup_gpu(job.gpu).usd_per_hour
        return None if rate is None else rate * gpus
    return None
