"""A job read back from storage (`resume`) is what someone wrote into the bucket, not what this
node's operator wrote: a collaborator, a leaked node key or another job can write it. What it
may decide on the node is narrowed here (its environment files: runner/jobs/envfiles.py).

- Its name must be its folder's: a record copied under another job's folder would otherwise
  train, and write, as that job.
- The URLs it would make this node contact come from the node's own configuration, unless the
  operator says the bucket is theirs alone (`resume --trust-stored-urls`, or
  GRPO_RUN_TRUST_STORED_URLS=1): MLflow sends the node's MLFLOW_TRACKING_TOKEN (or basic-auth
  variables) to its tracking URI, a TensorBoard folder or URL is written with the node's
  credentials outside the job's folder, and any HTTP 200 from a metadata URL counts as a spot
  notice (a fake preemption, again and again). A vLLM server (spec.parameters.vllm.server)
  would receive every step's prompts and the policy, and choose the completions the job trains
  on: the node names it in GRPO_RUN_VLLM_SERVER.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:                  # the CLI imports this module for its help text: keep it light
    from grpo_run.runner.spec.job import TrainingJob

log = logging.getLogger(__name__)

TRUST_STORED_URLS_ENV = "GRPO_RUN_TRUST_STORED_URLS"
MLFLOW_URI_ENV = "MLFLOW_TRACKING_URI"      # MLflow's own variable: the node's tracking server
VLLM_SERVER_ENV = "GRPO_RUN_VLLM_SERVER"    # the node's vLLM server, for a resumed job with vllm.mode: server


def trusts_stored_urls() -> bool:
    """The node's environment opts in to the stored spec's URLs (GRPO_RUN_TRUST_STORED_URLS=1)."""
    return os.environ.get(TRUST_STORED_URLS_ENV, "").strip().lower() in ("1", "true", "yes")


def check_folder_name(folder: str, storage: str) -> None:
    """Refuse a job folder found in storage whose name no job can have (before anything of it is
    fetched into a work folder of that name). Raises ValueError."""
    from grpo_run.runner.spec.job import name_problem

    trouble = name_problem(folder)
    if trouble:
        raise ValueError(f"error: {storage} holds a folder {folder!r} that is no job's name: {trouble}; "
                         "name the job to resume: grpo-run resume NAME")


def check_stored_name(job: TrainingJob, folder: str, storage: str) -> None:
    """Refuse a stored job that is not the one its folder names. Raises ValueError."""
    check_folder_name(folder, storage)
    if job.name != folder:
        raise ValueError(f"error: the job stored in {storage}/{folder} says its name is {job.name!r}, not "
                         f"{folder!r}: its record was copied or written there by hand, so this node refuses it; "
                         f"apply the job's file again (grpo-run apply -f FILE --detach)")


def as_this_node_runs_it(job: TrainingJob, *, trust_urls: bool) -> TrainingJob:
    """The stored `job` with the URLs it names replaced by this node's configuration (unless
    `trust_urls`): the notices' metadata URLs left out (GRPO_RUN_*_METADATA_URL or the clouds'
    own addresses apply), MLflow's tracking URI from MLFLOW_TRACKING_URI (MLflow left out
    without it), a TensorBoard folder or URL left out (`true`, the job's own storage, stays), the
    vLLM server from GRPO_RUN_VLLM_SERVER. What is left out is said in a warning. The spec in the
    record is not changed. Raises ValueError for a job that samples on a vLLM server when this
    node names none (or names one that is no server's address)."""
    from grpo_run.runner.spec.job import NOTICE_URLS

    if trust_urls:
        return job
    update, ignored = {}, []
    if job.notices is not None and job.notices.urls:
        ignored += [f"spec.notices.{key}" for key in NOTICE_URLS if getattr(job.notices, key)]
        update["notices"] = job.notices.model_copy(update={key: None for key in NOTICE_URLS})
    tracking = job.tracking
    if tracking is not None:
        changed = {}
        if isinstance(tracking.tensorboard, str):
            ignored.append("spec.tracking.tensorboard (a folder or URL; true writes to the job's storage)")
            changed["tensorboard"] = None
        if tracking.mlflow is not None:
            node_uri = os.environ.get(MLFLOW_URI_ENV)
            if node_uri:
                changed["mlflow"] = tracking.mlflow.model_copy(update={"trackingURI": node_uri})
            else:
                changed["mlflow"] = None
            if node_uri != tracking.mlflow.trackingURI:
                instead = f"{MLFLOW_URI_ENV} of this node instead" if node_uri else \
                    f"MLflow left out: set {MLFLOW_URI_ENV} on this node"
                ignored.append(f"spec.tracking.mlflow.trackingURI ({instead})")
        if changed:
            update["tracking"] = tracking.model_copy(update=changed)
    vllm = job.parameters.vllm
    if vllm.mode == "server":
        server = _node_vllm_server(job.name)
        if server != vllm.server:
            ignored.append(f"spec.parameters.vllm.server ({VLLM_SERVER_ENV} of this node instead)")
            update["parameters"] = job.parameters.model_copy(update={"vllm": vllm.model_copy(update={"server": server})})
    if ignored:
        log.warning("%s: not using the URLs the spec in storage names: %s; this node's configuration decides "
                    "(resume --trust-stored-urls, or %s=1, uses them: only for storage no one else can write)",
                    job.name, "; ".join(ignored), TRUST_STORED_URLS_ENV)
    return job.model_copy(update=update) if update else job


def _node_vllm_server(name: str) -> str:
    """This node's GRPO_RUN_VLLM_SERVER, checked as spec.parameters.vllm.server is. Raises ValueError."""
    from pydantic import ValidationError

    from grpo_run.trainer.config import VllmParams

    given = os.environ.get(VLLM_SERVER_ENV, "").strip()
    if not given:
        raise ValueError(f"error: {name} samples on a vLLM server (spec.parameters.vllm.mode: server), and on resume "
                         f"this node names it, not the spec in storage: set {VLLM_SERVER_ENV}=http://HOST:PORT on this "
                         f"node (resume --trust-stored-urls, or {TRUST_STORED_URLS_ENV}=1, uses the stored one: only "
                         "for storage no one else can write)")
    try:
        return VllmParams(mode="server", server=given).server
    except ValidationError as e:
        why = e.errors()[0]["msg"].removeprefix("Value error, ")
        raise ValueError(f"error: {VLLM_SERVER_ENV}={given!r} in this node's environment: {why}") from None
