"""A model the job names that is not there to load: restarting the trainer cannot bring it."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


class ModelMissing(RuntimeError):
    """The model is not a folder on this node and not a hub repository this node may read (no such
    id or revision, or a gated or private one without a token). A lost connection to the hub is
    not this: the trainer crashes and is restarted, as for any failure that may pass."""


def _why(error: BaseException, ref: str) -> str | None:
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError, RevisionNotFoundError

    seen = error
    while seen is not None:
        if isinstance(seen, HFValidationError):      # what from_pretrained makes of a folder that is not here
            return (f"{ref} is not a folder on this node, nor a hub id; a job that other nodes run needs a hub id, "
                    "or the folder at this same path on every node")
        if isinstance(seen, GatedRepoError):          # a subclass of RepositoryNotFoundError: first
            return f"{ref} is gated on the hub: accept its terms with the account whose HF_TOKEN the node has"
        if isinstance(seen, RepositoryNotFoundError):
            return (f"{ref} is not on the hub, or is private: check the id, or give the node an HF_TOKEN that may "
                    "read it")
        if isinstance(seen, RevisionNotFoundError):
            return f"{ref}: no such revision on the hub"
        seen = seen.__cause__ or seen.__context__
    return None


@contextmanager
def loading(what: str, ref: str) -> Iterator[None]:
    """Around from_pretrained: a model that is not there raises ModelMissing, naming `what` (the
    job's field) and what to do; every other error passes as it was."""
    try:
        yield
    except OSError as e:
        why = _why(e, ref)
        if why is None:
            raise
        raise ModelMissing(f"{what}: {why}") from e
