"""A run ends in one place, from one table (runner/supervisor/endings.py): every ending's phase,
attempt reason and exit status, and the record takes no other reason."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from grpo_run.runner.exits import EXIT_BUDGET, EXIT_CANCELLED, EXIT_FAILED, EXIT_OK, EXIT_PREEMPTED
from grpo_run.runner.supervisor.endings import ENDINGS, End
from grpo_run.state.phases import STOPPED, TERMINAL, AttemptEnd, Phase
from grpo_run.state.record import Record

SUPERVISOR = Path(__file__).resolve().parents[3] / "runner" / "supervisor" / "supervisor.py"


def test_every_ending_has_its_phase_reason_and_exit_status():
    assert set(ENDINGS) == set(End)
    assert {e: tuple(r) for e, r in ENDINGS.items()} == {
        End.SUCCEEDED: (Phase.SUCCEEDED, AttemptEnd.SUCCEEDED, EXIT_OK),
        End.FAILED: (Phase.FAILED, AttemptEnd.FAILED, EXIT_FAILED),
        End.CRASHED_OUT: (Phase.FAILED, AttemptEnd.CRASHED, EXIT_FAILED),
        End.PREEMPTED: (Phase.PREEMPTED, AttemptEnd.PREEMPTED, EXIT_PREEMPTED),
        End.BUDGET_EXCEEDED: (Phase.BUDGET_EXCEEDED, AttemptEnd.BUDGET_EXCEEDED, EXIT_BUDGET),
        End.CANCELLED: (Phase.CANCELLED, AttemptEnd.CANCELLED, EXIT_CANCELLED),
        # several nodes: a lost rank is the attempt's crash, the job resumable, every node exits 3
        End.GROUP_LOST: (Phase.PREEMPTED, AttemptEnd.CRASHED, EXIT_PREEMPTED)}
    assert all(r.phase in TERMINAL for r in ENDINGS.values())
    # a resumable ending exits non-zero: a boot unit or a Job restarts the node's supervisor
    assert all(r.exit_code != EXIT_OK for r in ENDINGS.values() if r.phase in STOPPED)


def test_the_supervisor_finishes_a_run_in_one_place_only():
    """books.finish is called once in supervisor.py (in _end); every other ending names a row."""
    tree = ast.parse(SUPERVISOR.read_text())
    finishes = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute) and node.func.attr == "finish"]
    assert len(finishes) == 1
    (end,) = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "_end"]
    assert any(node is finishes[0] for node in ast.walk(end))


def test_the_record_takes_an_attempt_end_and_refuses_any_other_reason(tmp_path):
    with Record(tmp_path / "state.db") as record:
        record.init_job("j", {"spec": {}})
        first = record.start_attempt("node-a")
        with pytest.raises(ValueError):
            record.end_attempt(first, "Stopped", "not a reason the record knows")
        record.end_attempt(first, AttemptEnd.PREEMPTED, "spot notice", notice="aws")
        (row,) = record.attempts()
        assert row["reason"] == "Preempted" and type(row["reason"]) is str     # stored as its value
