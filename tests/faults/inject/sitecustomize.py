"""Fault injection from outside (tests/faults/inject/grpo_run_faults.py), the way coverage.py
injects itself: a test that wants a fault point puts this folder on the node's PYTHONPATH
(tests/faults/harness.py `fault_env`), so every Python process of that node imports this module
at start-up. Without GRPO_RUN_FAULT, and in the grader's worker (sandboxed, stdlib only, no
point fires there), it does nothing: one environment lookup."""

import os
import sys

if os.environ.get("GRPO_RUN_FAULT") and "grpo_run.trainer.grader.worker" not in sys.orig_argv:
    import grpo_run_faults

    grpo_run_faults.install()
