"""The Python examples run as a user runs them: examples/train.py as a script, and
examples/notebook.py's cells top to bottom (with fewer steps: the rest as copied)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.runner.jobs.test_resume import REPO


def run(args: list[str], cwd) -> str:
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env={**os.environ}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_the_training_script_trains_reports_and_exports(tmp_path):
    out = run([str(REPO / "examples" / "train.py"), "--max-steps", "2"], tmp_path)
    assert "larger-digit: Succeeded at step 2" in out and "'close':" in out and "'correct':" in out
    assert (tmp_path / "larger-digit.png").exists() and (tmp_path / "larger-digit-adapter" / "adapter_config.json").exists()


def test_the_notebooks_cells_run_top_to_bottom(tmp_path):
    source = (REPO / "examples" / "notebook.py").read_text()
    assert source.count("max_steps=300, save_steps=50") == 1
    (tmp_path / "notebook.py").write_text(source.replace("max_steps=300, save_steps=50", "max_steps=2, save_steps=1"))
    run([str(tmp_path / "notebook.py")], tmp_path)
    assert (tmp_path / "larger-digit-notebook.png").exists()
    assert (tmp_path / "larger-digit-notebook-adapter" / "adapter_model.safetensors").exists()
