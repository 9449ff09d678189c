"""The Python API's job path: `grpo_run.apply`, `grpo_run.get` and the Job handle, on the library
the CLI uses (runner/jobs/run.py): the same checks, the same run, and a refusal in the CLI's words."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

import grpo_run
from grpo_run.checkpoint.storage.lease import Lease
from grpo_run.runner.cli.commands import main
from tests.runner.jobs.test_resume import REPO, grpo_run as cli, write_job


def test_import_grpo_run_loads_nothing_but_itself():
    """Every `python -m grpo_run.…` child (the grader's stdlib-only worker among them) imports
    grpo_run/__init__ first: it loads no other module of ours and nothing outside the stdlib."""
    code = ("import sys; before = set(sys.modules); import grpo_run; "
            "print(sorted(m for m in set(sys.modules) - before "
            "if m.split('.')[0] not in sys.stdlib_module_names and m != 'grpo_run'))")
    out = subprocess.run([sys.executable, "-P", "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert set(grpo_run.__all__) <= set(dir(grpo_run))
    assert all(getattr(grpo_run, name).__doc__ for name in grpo_run.__all__)     # each one documented


def test_a_dry_run_returns_the_job_with_its_estimate(tmp_path):
    doc = grpo_run.apply(write_job(tmp_path), dry_run=True)
    assert doc["metadata"]["name"] == "resumable" and doc["status"]["phase"] == "Pending"
    assert doc["status"]["estimate"]["memory"]["parameters"] > 0
    assert not (tmp_path / "grpo-run-home" / "runs").exists()            # nothing started


def test_a_bad_job_file_raises_job_error_with_the_clis_words(tmp_path, capsys):
    job = write_job(tmp_path, numGenerations=1)
    assert main(["apply", "-f", str(job)]) == 2
    said = capsys.readouterr().err.strip()
    with pytest.raises(grpo_run.JobError) as e:
        grpo_run.apply(job)
    assert str(e.value) == said and "spec.parameters.numGenerations" in said
    with pytest.raises(grpo_run.JobError) as e:
        grpo_run.apply(tmp_path / "missing.yaml")
    assert str(e.value) == f"no such job file: {tmp_path / 'missing.yaml'}"
    with pytest.raises(grpo_run.JobError, match="no job 'nothing-here'"):
        grpo_run.get("nothing-here")
    with pytest.raises(grpo_run.JobError, match="must be lowercase letters"):
        grpo_run.get("Bad_Name")


def test_apply_trains_in_the_foreground_and_the_handle_reports_and_exports(tmp_path):
    job = grpo_run.apply(write_job(tmp_path))
    assert job.status()["phase"] == "Succeeded" and job.status()["step"] == 8
    assert grpo_run.get("resumable").status() == job.status()
    png = job.report(tmp_path / "run.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (tmp_path / "run.md").exists()
    out = job.export(tmp_path / "adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in out.iterdir()}
    assert job.wait(timeout_s=0)["phase"] == "Succeeded"
    with pytest.raises(grpo_run.JobError, match="name it FILE.png"):
        job.report(tmp_path / "run.jpg")


def test_detach_submits_and_the_handle_follows_the_job_in_storage(tmp_path):
    storage = str(tmp_path / "bucket")
    job = grpo_run.apply(write_job(tmp_path, storage), detach=True)
    assert job.storage == storage and job.status()["phase"] == "Pending"
    assert not (tmp_path / "grpo-run-home" / "runs").exists()            # nothing trained here
    with pytest.raises(TimeoutError, match="still Pending"):
        job.wait(timeout_s=0.2, poll_s=0.1)
    cli(tmp_path / "node", "resume", "resumable", "--storage", storage)   # a node with nothing but the URI
    assert job.wait(timeout_s=30, poll_s=0.1)["phase"] == "Succeeded"
    assert grpo_run.get("resumable", storage=storage).status()["step"] == 8


def test_a_job_another_node_holds_raises_run_error(tmp_path, capsys):
    storage = str(tmp_path / "bucket")
    file = write_job(tmp_path, storage)
    other = Lease(f"{storage}/resumable", holder="node-b")
    other.acquire()
    try:
        with pytest.raises(grpo_run.RunError) as e:
            grpo_run.apply(file)
    finally:
        other.release()
    assert e.value.exit_code == 5 and "another node holds the job" in str(e.value)
    assert yaml.safe_load(file.read_text())["metadata"]["name"] == "resumable"
