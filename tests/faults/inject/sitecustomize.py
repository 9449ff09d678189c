"""Fault injection from outside (tests/faults/inject/grpo_run_faults.py), the way coverage.py
injects itself: a test that wants a fault point puts this folder on the node's PYTHONPATH
(tests/faults/harness.py `fault_env`), so every Python process of that node imports this module
at start-up. Without GRPO_RUN_FAULT it does nothing at all: one environment lookup."""

import os

if os.environ.get("GRPO_RUN_FAULT"):
    import grpo_run_faults

    grpo_run_faults.install()
