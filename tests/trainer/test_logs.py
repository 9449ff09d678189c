"""trainer.log is rotated: a long run (or a reward that warns on every call) cannot fill the node's
disk with it, and the checkpoint writer, which appends to the same file, follows the rotation."""

from __future__ import annotations

import logging

import pytest

from grpo_run.trainer import logs


@pytest.fixture
def root_handlers():
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    yield
    for handler in root.handlers[len(before):]:
        handler.close()
    root.handlers[:] = before
    root.setLevel(level)


def test_trainer_log_is_rotated_keeping_a_bounded_number_of_files(tmp_path, monkeypatch, root_handlers):
    monkeypatch.setattr(logs, "LOG_MAX_BYTES", 10_000)
    logs.trainer_logging(tmp_path)
    log = logging.getLogger("grpo_run.trainer.test")
    for i in range(2_000):                                   # ~200 KB of lines
        log.info("line %05d %s", i, "x" * 60)
    files = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert files == ["trainer.log", "trainer.log.1", "trainer.log.2", "trainer.log.3"]
    assert sum(p.stat().st_size for p in (tmp_path / "logs").iterdir()) <= 4 * 10_000
    assert "line 01999" in (tmp_path / "logs" / "trainer.log").read_text()
