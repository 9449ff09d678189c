"""`grpo-run logs -f` follows trainer.log across its rotation (trainer.logs rotates it): what was
written before the rotation and what comes after it are both printed."""

from __future__ import annotations

import time

from grpo_run.runner.cli.commands import EXIT_OK, main
from grpo_run.runner.home import work_dir
from grpo_run.state.phases import Phase
from grpo_run.state.record import RECORD_FILE, Record


def test_logs_follow_goes_on_to_the_new_file_after_a_rotation(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GRPO_RUN_HOME", str(tmp_path / "home"))
    work = work_dir("rotating")
    (work / "logs").mkdir(parents=True)
    log = work / "logs" / "trainer.log"
    log.write_text("before\n")
    with Record(work / RECORD_FILE) as record:
        record.init_job("rotating", {"model": "tiny"})
        record.set_phase(Phase.CANCELLED, "done")                  # a finished job: -f ends at the file's end
    rotated = []

    def rotate_once(seconds: float) -> None:                      # the trainer, between two reads
        if not rotated:
            with open(log, "a") as f:
                f.write("last line of the old file\n")
            log.rename(log.with_name("trainer.log.1"))
            log.write_text("first line of the new file\n")
            rotated.append(True)

    monkeypatch.setattr(time, "sleep", rotate_once)
    assert main(["logs", "rotating", "-f"]) == EXIT_OK
    assert capsys.readouterr().out == "before\nlast line of the old file\nfirst line of the new file\n"
