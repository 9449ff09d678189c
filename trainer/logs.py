"""Logging for grpo-run's processes: the trainer's file and terminal, and quieter libraries."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from logging.handlers import RotatingFileHandler
from pathlib import Path


# trainer.log is rotated at LOG_MAX_BYTES, the last LOG_BACKUPS kept (trainer.log.1 the newest): a
# long run, or a reward that warns on every call, holds at most 256 MiB of log on the node's disk.
# The checkpoint writer appends to the same file and follows the rotation (a WatchedFileHandler).
LOG_MAX_BYTES = 64 << 20
LOG_BACKUPS = 3
REPORTED = {"reported": True}   # log.error(..., extra=REPORTED): in trainer.log, not on the terminal


def trainer_logging(work: Path, rank: int = 0, progress_lines: bool = False) -> None:
    """Warnings and errors to the terminal; everything, progress lines included, to logs/
    (trainer.log, rotated: LOG_MAX_BYTES; rank k > 0 of several processes: trainer.rank<k>.log). `progress_lines`: the
    progress lines to the terminal too, from rank 0 (where no bar is drawn: stderr piped to a
    file, nohup, CI, a node's journal)."""
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    to_file = RotatingFileHandler(logs / ("trainer.log" if rank == 0 else f"trainer.rank{rank}.log"),
                                  maxBytes=LOG_MAX_BYTES, backupCount=LOG_BACKUPS)
    to_file.setFormatter(fmt)
    to_file.setLevel(logging.INFO)
    to_terminal = logging.StreamHandler(sys.stderr)
    to_terminal.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    to_terminal.setLevel(logging.INFO)
    # The terminal has the progress bar (or, without one, the progress lines); it gets the phases (the
    # recipe's, from rank 0 only) and any warning.
    # An error the trainer also sends as its Failed event (REPORTED) goes to the file only: the supervisor says it once.
    shown = ("grpo_run.trainer.recipe", "grpo_run.trainer.progress") if progress_lines else ("grpo_run.trainer.recipe",)
    # vLLM's lines (its engine config, the kernels a CPU build lacks) go to the file unless they are errors
    to_terminal.addFilter(lambda r: not getattr(r, "reported", False) and (
        r.levelno >= (logging.ERROR if r.name.split(".")[0] == "vllm" else logging.WARNING)
        or (r.name in shown and rank == 0)))
    root = logging.getLogger()
    root.setLevel(logging.WARNING)
    root.addHandler(to_file)
    root.addHandler(to_terminal)
    for name in ("grpo_run.trainer", "grpo_run.checkpoint", "vllm"):
        logging.getLogger(name).setLevel(logging.INFO)
    quiet_libraries()
    warnings.filterwarnings("ignore", category=FutureWarning)


def quiet_libraries() -> None:
    """Libraries' own progress bars and advice would drown ours (the CLI calls this too)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)   # "no `kernels` package" on CPU: harmless
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers\.")
    warnings.filterwarnings("ignore", message=r".*is deprecated.*", category=FutureWarning)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass
