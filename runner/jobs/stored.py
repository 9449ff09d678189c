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
  notice (a fake preemption, again and again).
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
    without it), a TensorBoard folder or URL left out (`true`, the job's own storage, stays).
    What is left out is said in a warning. The spec in the record is not changed."""
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
    if ignored:
        log.warning("%s: not using the URLs the spec in storage names: %s; this node's configuration decides "
                    "(resume --trust-stored-urls, or %s=1, uses them: only for storage no one else can write)",
                    job.name, "; ".join(ignored), TRUST_STORED_URLS_ENV)
    return job.model_copy(update=update) if update else job
