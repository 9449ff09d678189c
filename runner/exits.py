"""`grpo-run`'s exit statuses, defined once (the CLI's --help, the supervisor, deploy/ say them)."""

EXIT_OK = 0
EXIT_FAILED = 1          # the job failed (reward function error, training error)
EXIT_USAGE = 2           # bad arguments or a bad job file; nothing was started
EXIT_PREEMPTED = 3       # stopped by a preemption notice or signal; `grpo-run resume` continues it
EXIT_BUDGET = 4          # stopped at spec.maxCostUSD with a checkpoint; resume with a larger budget
EXIT_HELD = 5            # another node holds the job; nothing was started here
EXIT_CANCELLED = 6       # stopped by `grpo-run cancel` with a durable checkpoint; the job is over (resume of a
                         # cancelled job exits 0: nothing to do, so a boot unit or a K8s Job retry ends quietly)
EXIT_INTERRUPTED = 130   # Ctrl-C at the terminal (128 + SIGINT, as shells report it)


class Refused(Exception):
    """A command's refusal, or a failure before anything ran, in the words `grpo-run` prints: raised
    by the library (runner/jobs/run.py) so that the CLI and the Python API tell it the same way.
    `message`: the text (one line, or a job file's problems one per line); `exit_code`: the status
    the CLI exits with (EXIT_USAGE for bad input, EXIT_FAILED for a failure of the moment,
    EXIT_HELD when another node holds the job); `prefixed`: the CLI prints it after `error: `."""

    def __init__(self, message: str, exit_code: int, *, prefixed: bool = True) -> None:
        super().__init__(message)
        self.message, self.exit_code, self.prefixed = message, exit_code, prefixed

    @property
    def text(self) -> str:
        """What the CLI prints on stderr."""
        return f"error: {self.message}" if self.prefixed else self.message
