"""The trainer as the supervisor's child process: `python -m trainer.child WORK/runspec.json`.

It runs one Attempt (trainer.run) and reports how it ended through its exit status, which
runner.supervisor reads to decide between done, restart and give up. SIGTERM/SIGINT ask it to
stop at the last completed step; SIGUSR1 asks for a checkpoint at the next step boundary.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path

from state.record import Phase
from trainer.run import Attempt, JobFailed, RunSpec

log = logging.getLogger(__name__)

# Exit statuses, read by runner.supervisor:
CHILD_SUCCEEDED = 0
CHILD_CRASHED = 1          # an unexpected exception: the supervisor restarts it (crash limit)
CHILD_PREEMPTED = 3        # stopped on request (SIGTERM/SIGINT) with the last completed step durable
CHILD_BUDGET = 4           # maxCostUSD reached; checkpoint durable
CHILD_CODE_ERROR = 10      # the user's code (reward function) failed on every try: restarting cannot help
CHILD_STORAGE_CONFIG = 11  # bad bucket or credentials: restarting cannot help
CHILD_INFRA_ERROR = 12     # object storage unavailable past the retry budget: worth a restart
PHASE_EXIT = {Phase.SUCCEEDED: CHILD_SUCCEEDED, Phase.PREEMPTED: CHILD_PREEMPTED,
              Phase.BUDGET_EXCEEDED: CHILD_BUDGET}


def child_main(argv: list[str] | None = None) -> int:
    import signal

    from checkpoint.store import StorageConfigError, StorageUnavailable

    argv = sys.argv[1:] if argv is None else argv
    spec_path = Path(argv[0])
    spec = RunSpec.from_json(spec_path.read_text())
    work = spec_path.parent
    _child_logging(work)
    stop = threading.Event()
    attempt: Attempt | None = None

    def on_stop(signum, frame):  # noqa: ARG001 - Event.set only; the main thread never waits on it
        stop.set()

    def on_checkpoint(signum, frame):  # noqa: ARG001
        if attempt is not None:
            attempt.checkpoint_requested = True

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    signal.signal(signal.SIGUSR1, on_checkpoint)
    progress = os.environ.get("GRPO_RUN_PROGRESS") == "1"
    try:
        attempt = Attempt(spec, work, stop=stop, progress=progress)
        outcome = attempt.run()
    except JobFailed as e:
        log.error("%s", e)
        return CHILD_CODE_ERROR
    except StorageConfigError as e:
        log.error("%s", e)
        return CHILD_STORAGE_CONFIG
    except StorageUnavailable as e:
        log.error("%s", e)
        return CHILD_INFRA_ERROR
    except Exception:
        log.exception("the trainer crashed")
        return CHILD_CRASHED
    if outcome.message:
        log.info("%s", outcome.message)
    return PHASE_EXIT[outcome.phase]


def _child_logging(work: Path) -> None:
    """Warnings and errors to the terminal; everything, progress lines included, to logs/."""
    import warnings

    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    to_file = logging.FileHandler(logs / "trainer.log")
    to_file.setFormatter(fmt)
    to_file.setLevel(logging.INFO)
    to_terminal = logging.StreamHandler(sys.stderr)
    to_terminal.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    to_terminal.setLevel(logging.INFO)
    # The terminal has the progress bar; it gets the phases (trainer.run) and any warning.
    to_terminal.addFilter(lambda r: r.levelno >= logging.WARNING or r.name == "trainer.run")
    root = logging.getLogger()
    root.setLevel(logging.WARNING)
    root.addHandler(to_file)
    root.addHandler(to_terminal)
    for name in ("trainer", "checkpoint", "state"):
        logging.getLogger(name).setLevel(logging.INFO)
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass


if __name__ == "__main__":
    sys.exit(child_main())
