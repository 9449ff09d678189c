"""grpo-run as users install it: a wheel, not an editable checkout (SPEC §7).

The wheel's only top-level name is `grpo_run`; the folders runner/, trainer/, checkpoint/,
state/ and deploy/ are mapped under it. Installed (not editable) into a fresh virtual
environment, it runs from a folder that holds a user's own `trainer/`, `state.py` and
`runner.py`: the CLI, a deploy file (templates are package data), a dry run and a short real job,
whose trainer, checkpoint writer and grader are child processes that must import the installed
package, never the decoys.

The fresh environment gets its dependencies from this test's own environment through a `.pth`
line (nothing large is downloaded); that line adds the folder to sys.path without running the
`.pth` files in it, so the editable install's finder never reaches the fresh environment.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import yaml

from tests.runner.views.browser import needs_chromium

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("runner", "trainer", "checkpoint", "state")


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_every_package_folder_is_listed_for_the_wheel():
    setuptools = _pyproject()["tool"]["setuptools"]
    folders = {"grpo_run." + str(init.parent.relative_to(REPO)).replace("/", ".")
               for top in FOLDERS for init in (REPO / top).rglob("__init__.py")}
    assert set(setuptools["packages"]) == folders | {"grpo_run.deploy", "grpo_run", "grpo_run.runner.views.dashboard.static"}
    assert setuptools["package-dir"] == {**{f"grpo_run.{f}": f for f in (*FOLDERS, "deploy")}, "grpo_run": "api"}
    # a folder of modules without __init__.py would be left out of the wheel silently
    orphans = [str(p.relative_to(REPO)) for top in (*FOLDERS, "api") for p in (REPO / top).rglob("*.py")
               if not (p.parent / "__init__.py").exists()]
    assert not orphans


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # From a copy of the tracked files: setuptools' build/ folder inside the checkout would keep
    # modules deleted since the last build, and put them into the wheel.
    source = tmp_path_factory.mktemp("source")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out), str(source)], check=True, capture_output=True, text=True)
    (found,) = out.glob("grpo_run-*.whl")
    return found


def test_the_wheel_installs_one_top_level_name_with_its_templates(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"grpo_run"}
    assert "grpo_run/deploy/grpo-run-resume.service" in names
    assert "grpo_run/deploy/cloud-init.yaml" in names
    assert "grpo_run/trainer/grader/worker.py" in names


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed, not editable; its dependencies through a .pth line."""
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "_deps_from_the_test_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                   check=True, capture_output=True, text=True)
    return venv


@pytest.fixture
def decoys(tmp_path) -> Path:
    """A user's project folder whose own modules share our folders' names."""
    folder = tmp_path / "my-project"
    (folder / "trainer").mkdir(parents=True)
    (folder / "trainer" / "__init__.py").write_text("raise ImportError('the decoy trainer package was imported')\n")
    (folder / "trainer" / "config.py").write_text("raise ImportError('the decoy trainer.config was imported')\n")
    (folder / "state.py").write_text("raise ImportError('the decoy state.py was imported')\n")
    (folder / "runner.py").write_text("raise ImportError('the decoy runner.py was imported')\n")
    (folder / "checkpoint").mkdir()
    (folder / "checkpoint" / "__init__.py").write_text("raise ImportError('the decoy checkpoint was imported')\n")
    # Even a folder named like ours: a child that put its working folder first on sys.path (no
    # cwd=, no PYTHONSAFEPATH) would merge it into the grpo_run namespace and import this.
    (folder / "grpo_run" / "trainer").mkdir(parents=True)
    (folder / "grpo_run" / "trainer" / "__init__.py").write_text("raise ImportError('the decoy grpo_run.trainer')\n")
    return folder


def _grpo_run(venv: Path, folder: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run([str(venv / "bin" / "grpo-run"), *args], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_the_installed_package_is_the_wheel_not_the_checkout(installed, decoys):
    python = installed / "bin" / "python"
    out = subprocess.run([str(python), "-P", "-c", "import grpo_run.runner.cli.commands as c, grpo_run.trainer.child as t; "
                          "import grpo_run, inspect; print(c.__file__); print(t.__file__); print(grpo_run.__file__); "
                          "print(inspect.getfile(grpo_run.apply))"], cwd=decoys, check=True, capture_output=True,
                         text=True).stdout.split()
    assert len(out) == 4 and all(Path(p).is_relative_to(installed) for p in out), out     # the Python API too


def test_the_cli_and_deploy_run_from_a_folder_with_decoys(installed, decoys):
    help_ = _grpo_run(installed, decoys, "--help")
    assert help_.returncode == 0, help_.stderr
    assert "apply" in help_.stdout
    unit = _grpo_run(installed, decoys, "deploy", "systemd", "--storage", "s3://bucket/prefix", "--job", "my-job")
    assert unit.returncode == 0, unit.stderr
    assert "ExecStart=/opt/grpo-run/.venv/bin/grpo-run resume" in unit.stdout     # the template, filled in


@pytest.mark.slow
def test_a_dry_run_and_a_short_job_run_from_a_folder_with_decoys(installed, decoys, tmp_path):
    job = yaml.safe_load((REPO / "examples" / "tiny-arithmetic.yaml").read_text())
    job["metadata"]["name"] = "from-the-wheel"
    job["spec"]["parameters"].update(maxSteps=4, saveSteps=2, numGenerations=4, promptsPerStep=4)
    job["spec"]["gpu"] = "L40S"                   # so the dry run says whether it fits
    (decoys / "job.yaml").write_text(yaml.safe_dump(job))

    dry = _grpo_run(installed, decoys, "apply", "-f", "job.yaml", "--dry-run", "-o", "yaml")
    assert dry.returncode == 0, dry.stderr
    assert yaml.safe_load(dry.stdout)["status"]["estimate"]["memory"]["fits"] is True

    run = _grpo_run(installed, decoys, "apply", "-f", "job.yaml")
    assert run.returncode == 0, run.stdout + run.stderr
    got = _grpo_run(installed, decoys, "get", "tj", "from-the-wheel", "-o", "yaml")
    status = yaml.safe_load(got.stdout)["status"]
    assert status["phase"] == "Succeeded" and status["step"] == 4
    assert status["final"]["tasks"] == status["baseline"]["tasks"] > 0      # the grader scored every task


@contextlib.contextmanager
def _dashboard(venv: Path, folder: Path, storage: Path):
    """`grpo-run dashboard` of the installed wheel, run from `folder`: its address."""
    import re

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH", "VIRTUAL_ENV")}
    proc = subprocess.Popen([str(venv / "bin" / "grpo-run"), "dashboard", "--storage", str(storage),
                             "--port", "0"], cwd=folder, env={**env, "GRPO_RUN_HOME": str(folder / "home")},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        address = re.search(r"http://127\.0\.0\.1:\d+/", line)
        assert address, (line, proc.stderr.read() if proc.poll() is not None else "")
        yield address.group(0)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_dashboard_serves_its_pages_and_charting_library_from_the_installed_wheel(installed, decoys):
    import urllib.request

    with _dashboard(installed, decoys, decoys / "bucket") as address:
        for path, says in (("", b"/static/dashboard.js"), ("job/x", b"/static/uPlot.iife.min.js"),
                           ("static/uPlot.iife.min.js", b"uPlot"), ("static/uPlot.LICENSE", b"MIT"),
                           ("api/jobs", b'"jobs":[]')):
            with urllib.request.urlopen(address + path, timeout=30) as r:
                assert r.status == 200 and says in r.read(), path


@needs_chromium
def test_the_installed_wheels_dashboard_draws_a_preempted_and_resumed_run_in_a_browser(installed, decoys):
    from tests.runner.views.browser import Browser
    from tests.runner.views.test_dashboard import finished_job, running_job

    finished_job(decoys / "bucket")
    running_job(decoys / "bucket")
    with _dashboard(installed, decoys, decoys / "bucket") as address:
        browser = Browser()
        try:
            browser.open(address)
            rows = browser.until("document.querySelectorAll('#jobs tbody tr').length == 2 && "
                                 "Array.from(document.querySelectorAll('#jobs tbody tr'), r => r.cells[1].textContent)")
            assert rows == ["Succeeded", "Training"]
            browser.open(address + "job/finished-run")
            first = browser.until("document.querySelectorAll('#timeline li').length == 2 && "
                                  "document.querySelector('#timeline li').textContent")
            assert first.startswith("attempt 1 on node-a: steps 0 \u2192 3, Preempted (aws)")
            charts = browser.until("document.querySelectorAll('#charts .chart canvas').length >= 5 && "
                                   "document.querySelectorAll('#charts .chart canvas').length")
            assert charts >= 5                  # uPlot, from the wheel's package data, drew them
        finally:
            browser.close()
