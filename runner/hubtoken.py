"""On `resume`, the hub ids a stored spec names (the model, reward models, a data set) are what a
bucket writer chose; this node's Hugging Face token may reach private or gated repos, whose weights
(`method: Full`) or prompts (the record's samples) would then land in the bucket. So a resumed job
fetches from the hub with the node's token only when the node allows every id it names:
`GRPO_RUN_HUB_ALLOW` lists ids (`org/name`), owners (`org/*`) or `*`. Otherwise it runs with the
token withheld (HF_TOKEN and HUGGING_FACE_HUB_TOKEN out of the environment, and huggingface_hub told
to send no implicit token, the token file included): public repos load as before, a private or
gated one fails as it would for anyone. A job applied on this node (its operator's own file) is
not narrowed.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from grpo_run.runner.spec.job import TrainingJob

log = logging.getLogger(__name__)

HUB_ALLOW_ENV = "GRPO_RUN_HUB_ALLOW"
TOKEN_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
NO_IMPLICIT_TOKEN = "HF_HUB_DISABLE_IMPLICIT_TOKEN"


def _hub_id(value: str | None) -> str | None:
    """`value` if it names a hub repo (org/name), not a folder, a file or a built-in model."""
    if not value or value.startswith(("/", "./", "../", "~", "tiny:")) or Path(value).suffix in (".jsonl", ".json",
                                                                                                ".csv", ".parquet"):
        return None
    return value


def hub_ids(job: TrainingJob) -> list[str]:
    """The hub repos `job` would fetch: its model, its reward models, its data set."""
    env = job.environment
    found = [_hub_id(job.model), _hub_id(env.dataset if not env.is_catalog or env.dataset else None)]
    found += [_hub_id(r.model) for r in env.rewards if r.model is not None]
    return list(dict.fromkeys(i for i in found if i))


def allowed(repo: str, environ: dict[str, str] | None = None) -> bool:
    rules = [r.strip() for r in (os.environ if environ is None else environ).get(HUB_ALLOW_ENV, "").split(",")]
    return any(r == "*" or r == repo or (r.endswith("/*") and repo.startswith(r[:-1])) for r in rules if r)


def not_allowed(job: TrainingJob, environ: dict[str, str] | None = None) -> list[str]:
    return [repo for repo in hub_ids(job) if not allowed(repo, environ)]


@contextlib.contextmanager
def token_for_stored(job: TrainingJob) -> Iterator[bool]:
    """For the run of a stored `job`: the node's token withheld (in this process's environment,
    which the trainer's inherits, and in huggingface_hub if it is loaded) unless the node allows
    every hub id the job names; restored afterwards. Yields whether the token is withheld."""
    refused = not_allowed(job)
    if not refused:
        yield False
        return
    log.warning("%s: fetching %s from the Hugging Face hub without this node's token: the stored spec chose them "
                "(list them in %s on this node to use its token)", job.name, ", ".join(refused), HUB_ALLOW_ENV)
    saved = {name: os.environ.get(name) for name in (*TOKEN_VARIABLES, NO_IMPLICIT_TOKEN)}
    constants = _hub_constants()
    for name in TOKEN_VARIABLES:
        os.environ.pop(name, None)
    os.environ[NO_IMPLICIT_TOKEN] = "1"
    if constants is not None:
        setattr(constants, NO_IMPLICIT_TOKEN, True)
    try:
        yield True
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        constants = _hub_constants()          # loaded meanwhile, perhaps: it read the setting then
        if constants is not None:
            setattr(constants, NO_IMPLICIT_TOKEN, (saved[NO_IMPLICIT_TOKEN] or "").upper() in ("1", "ON", "YES", "TRUE"))


def _hub_constants():
    """huggingface_hub.constants if this process has loaded it (it reads its settings at import)."""
    import sys

    return sys.modules.get("huggingface_hub.constants")
