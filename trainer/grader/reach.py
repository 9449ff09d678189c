"""Which folders of its own a reward function may be given to read: its file's folder and its
search path (`environment.path`), but never a node folder that holds credentials, other jobs'
files or other workers' scratch, whatever the job file or a stored spec names.

The runner already refuses a job file whose `environment.path` leaves the job's folder, and on
`resume` uses only the stored copies of the environment's files (runner/jobs/envfiles.py). This is the
grader's own line, decided in the trainer's process (the worker only applies it): a folder is never
granted when it
  * is / or holds one of the node's places: the home folder, the shared temporary folders (/tmp,
    /var/tmp, /dev/shm, $TMPDIR), the mounted service-account secrets (/var/run/secrets,
    /run/secrets);
  * lies inside the secrets, a hidden folder of the home folder (~/.aws, ~/.cache/huggingface,
    ~/.config/gcloud, ~/.ssh), GRPO_RUN_HOME (every job's work folder, plan and record), or another
    grader worker's scratch folder (grpo-grader-* in a temporary folder);
except a job's own stored environment files on this node (GRPO_RUN_HOME/runs/NAME/environment/,
where `resume` fetches them) and the folder the Python API writes a job's reward functions into
(GRPO_RUN_HOME/python/NAME/, api/training.py). A reward file whose folder is not granted is given its own file alone
(a job file in the home folder or in /tmp). A job folder that holds GRPO_RUN_HOME is granted (the
default, ~/.grpo-run, is in the home folder, which is never granted; elsewhere it is the operator's
own layout, and `resume` never uses a stored folder). Stdlib and the protocol's names only: it runs in the trainer.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from grpo_run.trainer.protocol import HOME_ENV

TEMP_ROOTS = ("/tmp", "/var/tmp", "/dev/shm")
SECRETS = ("/var/run/secrets", "/run/secrets")
SCRATCH_PREFIX = "grpo-grader-"      # process.WorkerProcess.spawn makes each worker's scratch so
STORED = "environment"               # GRPO_RUN_HOME/runs/NAME/environment: resume's copies of the files
PYTHON_API = "python"                # GRPO_RUN_HOME/python/NAME: what grpo_run.train() wrote for job NAME


@dataclass(frozen=True)
class Places:
    """The node's folders a reward is kept from (all real paths)."""
    home: str
    temp: tuple[str, ...]
    grpo_run_home: str
    secrets: tuple[str, ...]


def node_places(environ: Mapping[str, str] | None = None) -> Places:
    env = os.environ if environ is None else environ
    home = os.path.realpath(os.path.expanduser(env.get("HOME") or "~"))
    grpo_home = os.path.realpath(os.path.expanduser(env.get(HOME_ENV) or os.path.join(home, ".grpo-run")))
    temp = {os.path.realpath(p) for p in (*TEMP_ROOTS, tempfile.gettempdir())}
    return Places(home=home, temp=tuple(sorted(temp)), grpo_run_home=grpo_home,
                  secrets=tuple(sorted({os.path.realpath(p) for p in SECRETS})))


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def why_not(folder: str, places: Places) -> str | None:
    """Why the reward may not be given `folder` to read (in words), or None when it may."""
    real = os.path.realpath(folder)
    held = [p for p in (places.home, *places.temp, *places.secrets) if _inside(p, real)]
    if real == os.sep or held:
        return f"it holds {held[0] if held else 'every folder'}"
    runs = os.path.join(places.grpo_run_home, "runs")
    if _inside(real, runs):
        parts = Path(os.path.relpath(real, runs)).parts
        if len(parts) >= 2 and parts[1] == STORED:
            return None                                     # a job's own stored environment files
    written = os.path.join(places.grpo_run_home, PYTHON_API)
    if _inside(real, written) and real != written:
        return None                                         # one job's reward functions, as train() wrote them
    if _inside(real, places.grpo_run_home):
        return f"it lies in GRPO_RUN_HOME ({places.grpo_run_home}: the jobs' work folders, plans and records)"
    for secrets in places.secrets:
        if _inside(real, secrets):
            return f"it lies in {secrets} (mounted service-account secrets)"
    if _inside(real, places.home) and real != places.home:
        first = Path(os.path.relpath(real, places.home)).parts[0]
        if first.startswith("."):
            return f"it lies in {os.path.join(places.home, first)} (a hidden folder of the home folder: credentials)"
    for temp in places.temp:
        if _inside(real, temp) and real != temp and Path(os.path.relpath(real, temp)).parts[0].startswith(SCRATCH_PREFIX):
            return "it lies in another grader worker's scratch folder"
    return None
