"""The record's small values: each key named once, in state/values.py, with its type."""

from __future__ import annotations

import ast
from pathlib import Path

from grpo_run.state import values
from grpo_run.state.record import Record

REPO = Path(__file__).resolve().parents[2]


def named() -> list[values.Value]:
    found = [v for v in vars(values).values() if isinstance(v, values.Value)]
    return found + list(values.EVAL_BATCHES.values())


def test_each_key_has_one_name_and_a_retired_key_never_comes_back():
    keys = [v.key for v in named()]
    assert len(keys) == len(set(keys))
    assert not set(keys) & set(values.RETIRED)


def test_a_value_never_written_reads_as_nothing_or_as_empty(tmp_path):
    with Record(tmp_path / "state.db") as record:
        assert values.RUN_ID.get(record) is None
        assert values.LEDGER.get(record) == {} and values.HELD_OUT.get(record) == []
        values.LEDGER.set(record, {"1": {"seconds": 2.0, "usd": 0.01, "usdPerHour": 18.0}})
        assert values.LEDGER.get(record)["1"]["usd"] == 0.01
        assert record.value("ledger")["1"]["seconds"] == 2.0      # the key records have always used


def test_no_key_is_spelled_outside_values():
    spelled = [f"{path.relative_to(REPO)}:{node.lineno}"
               for folder in ("runner", "trainer", "checkpoint", "state")
               for path in sorted((REPO / folder).rglob("*.py")) if path != REPO / "state" / "values.py"
               for node in ast.walk(ast.parse(path.read_text(), str(path)))
               if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
               and node.func.attr in ("value", "set_value") and node.args
               and isinstance(node.args[0], (ast.Constant, ast.JoinedStr))]
    assert not spelled, "\n".join(spelled)
