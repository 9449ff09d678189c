"""scripts/reliability writes docs/reliability.md again from the tests' figures; the sections a
benchmark measured (bench/goodput.py's goodput) are below KEEP_MARKER and carried over."""

from __future__ import annotations

import json

from tests.faults.report import KEEP_MARKER, main


def _figures(folder):
    figures = folder / "figures.jsonl"
    figures.write_text(json.dumps({"kind": "notice", "test": "tests/faults/x.py::t", "source": "aws", "phase": "sampling",
                                   "exit_seconds": 2.0, "notice_to_durable_seconds": 1.0, "steps_lost": 0,
                                   "outcome": "Preempted"}) + "\n")
    return figures


def test_a_rewritten_page_keeps_what_follows_the_marker_and_nothing_above_it(tmp_path, capsys):
    figures = _figures(tmp_path)
    page = tmp_path / "reliability.md"
    page.write_text(f"# old\n\n## Notices\n\nold figures\n\n{KEEP_MARKER}\n\n## Goodput\n\n| R | goodput |\n")
    assert main([str(figures), "--commit", "abc", "--keep", str(page)]) == 0
    written = capsys.readouterr().out
    assert written.endswith(f"\n{KEEP_MARKER}\n\n## Goodput\n\n| R | goodput |\n")
    assert "old figures" not in written and written.count(KEEP_MARKER) == 1
    assert "| sampling | aws | 2.00 |" in written.split(KEEP_MARKER)[0]


def test_a_page_without_the_marker_is_written_from_the_figures_alone(tmp_path, capsys):
    figures = _figures(tmp_path)
    page = tmp_path / "reliability.md"
    page.write_text("# old\n\nold text\n")
    assert main([str(figures), "--commit", "abc", "--keep", str(page)]) == 0
    assert "old text" not in capsys.readouterr().out
