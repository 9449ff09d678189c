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
