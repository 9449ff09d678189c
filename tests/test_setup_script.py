"""scripts/setup prints nothing a newcomer reads as a problem with their checkout: setuptools'
editable-install banner ("Please be careful with folders in your working directory...") is
filtered out of pip's output by the warnings filter the script gives the editable install, and
the CUDA check's import of torch before numpy is installed keeps its "Failed to initialize NumPy"
to itself. The filter is checked against a real editable install, offline, into a scratch prefix."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

SETUP = Path(__file__).resolve().parents[1] / "scripts" / "setup"


def editable_install(project: Path, prefix: Path, warnings_filter: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    if warnings_filter is not None:
        env["PYTHONWARNINGS"] = warnings_filter
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--no-index", "--prefix", str(prefix), "-e", str(project)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


def test_the_editable_installs_banner_is_left_out_of_setups_output(tmp_path):
    script = SETUP.read_text()
    (banner,) = re.findall(r'^EDITABLE_BANNER="([^"]+)"', script, re.M)
    (line,) = [line for line in script.splitlines() if "pip install" in line and " -e " in line]
    assert line.startswith('PYTHONWARNINGS="$EDITABLE_BANNER" ')
    project = tmp_path / "demo"
    (project / "demo_pkg").mkdir(parents=True)
    (project / "demo_pkg" / "__init__.py").write_text("")
    (project / "pyproject.toml").write_text('[build-system]\nrequires = ["setuptools"]\nbuild-backend = '
                                            '"setuptools.build_meta"\n[project]\nname = "demo-pkg"\nversion = "0.1"\n')
    assert "Please be careful with folders" in editable_install(project, tmp_path / "bare", None)   # the banner
    assert editable_install(project, tmp_path / "filtered", banner) == ""


def test_the_cuda_check_keeps_torchs_numpy_warning_to_itself():
    (check,) = [line for line in SETUP.read_text().splitlines() if "torch.version.cuda" in line]
    assert check.rstrip().endswith("2>/dev/null; then"), check
