"""This node's places: `GRPO_RUN_HOME` (default `~/.grpo-run`) with its work folders, its default
store and its model cache, and `tiny:NAME`, the built-in demo models, resolved to a folder there."""

from __future__ import annotations

import os
from pathlib import Path

from grpo_run.trainer.protocol import HOME_ENV

TINY_PREFIX = "tiny:"
TINY_NAMES = ("char", "char64", "chat", "chat-tools")
# tiny:char64: the demo's model with head_dim 64 (tiny:char's is 16), which vLLM's CPU attention serves
# tiny:chat-tools: tiny:chat set to open every answer with a tool call (examples/calculator-tools)


def grpo_run_home() -> Path:
    """GRPO_RUN_HOME, or ~/.grpo-run when it is unset or empty (as the reward sandbox reads it:
    trainer.grader.reach keeps rewards out of the same folder)."""
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".grpo-run").expanduser()


home = grpo_run_home


def default_storage() -> str:
    return str(home() / "store")


def job_store_url(storage: str | None, name: str) -> str:
    return f"{(storage or default_storage()).rstrip('/')}/{name}"


def work_dir(name: str) -> Path:
    return home() / "runs" / name


# A tiny model rebuilt differently gets a folder of its own: a home built before keeps working
# (tiny-chat-2: its chat template renders tools and their results, as Qwen's does).
_TINY_FOLDERS = {"chat": "tiny-chat-2"}


def is_tiny(model: str) -> bool:
    return model.startswith(TINY_PREFIX)


def tiny_model_path(model: str) -> Path:
    """Where `tiny:NAME` lives once built. Raises ValueError for an unknown NAME."""
    name = model[len(TINY_PREFIX):]
    if name not in TINY_NAMES:
        raise ValueError(f"unknown tiny model {model!r}; available: " + ", ".join(TINY_PREFIX + n for n in TINY_NAMES))
    return grpo_run_home() / "models" / _TINY_FOLDERS.get(name, f"tiny-{name}")


def ensure_model(model: str) -> str:
    """Resolve `spec.model` to what `from_pretrained` takes: builds `tiny:*` on first use."""
    if not is_tiny(model):
        return model
    path = tiny_model_path(model)
    if not (path / "config.json").exists():
        from grpo_run.trainer.model.tinymodel import build_named

        build_named(model[len(TINY_PREFIX):], path)
    return str(path)
