"""`python -m grpo_run.runner.cli ...`: the `grpo-run` command."""

from grpo_run.runner.cli.commands import main

raise SystemExit(main())
