"""What a job may give its reward to read (review N2): a job file's `environment.path` lies in the
job's own folder, and a resumed job's reward imports from its stored files' folder only, whatever
the stored spec says. The grader's own line (trainer.grader.reach) is tested with the sandbox, in
tests/trainer/test_sandbox_secrets.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from grpo_run.checkpoint.storage.store import Store
from grpo_run.runner.cli.commands import EXIT_USAGE, main
from grpo_run.runner.envfiles import environment_uploads, localize_environment, with_file_hashes
from grpo_run.runner.spec.job import JobError, load_job, parse_job
from grpo_run.runner.supervisor.uploads import upload_environment

pytestmark = pytest.mark.trust
SECRET = "FAKE-FILE-SECRET-42"


def job_file(folder: Path, **environment) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "rewards.py").write_text("def leak(completion, task):\n    raise RuntimeError(open(task['path']).read())\n")
    (folder / "tasks.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    doc = {"apiVersion": "grpo-run/v1", "kind": "TrainingJob", "metadata": {"name": "reach"},
           "spec": {"runtime": "grpo-lora", "model": "tiny:char",
                    "environment": {"name": "mine", "reward": "rewards.py:leak", "tasks": "tasks.jsonl",
                                    "heldOutFraction": 0.5, **environment},
                    "parameters": {"rewardTimeoutSeconds": 2}}}
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_score_refuses_a_job_file_whose_path_names_the_home_folders_credentials(tmp_path, monkeypatch, capsys):
    """The review's repro: `path: [HOME/.aws]` and a reward that raises the file's text."""
    home = tmp_path / "home"
    (home / ".aws").mkdir(parents=True)
    (home / ".aws" / "credentials").write_text(f"[default]\naws_secret_access_key = {SECRET}\n")
    monkeypatch.setenv("HOME", str(home))
    job = job_file(tmp_path / "job", path=[str(home / ".aws")])
    rows = tmp_path / "c.jsonl"
    rows.write_text(json.dumps({"completion": "x", "path": str(home / ".aws" / "credentials")}) + "\n")
    assert main(["score", "-f", str(job), "--completions", str(rows)]) == EXIT_USAGE
    out = capsys.readouterr()
    assert SECRET not in out.out + out.err
    assert f"spec.environment.path.0: {home / '.aws'} is outside the job's folder" in out.err


@pytest.mark.parametrize("folder", ["lib", ".", "../elsewhere"])
def test_a_job_files_path_must_lie_in_its_own_folder(tmp_path, folder):
    job = job_file(tmp_path / "job", path=[folder])
    (tmp_path / "job" / "lib").mkdir()
    (tmp_path / "elsewhere").mkdir()
    if folder == "../elsewhere":
        with pytest.raises(JobError, match=r"spec.environment.path.0: .*elsewhere is outside the job's folder"):
            load_job(job)
    else:
        assert load_job(job).environment.path == (str((tmp_path / "job" / folder).resolve()),)


def test_a_job_file_in_a_folder_of_grpo_run_home_cannot_name_it(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_RUN_HOME", str(tmp_path / "grpo"))
    job = job_file(tmp_path / "grpo" / "runs" / "other", path=["."])
    with pytest.raises(JobError, match=r"spec.environment.path.0: .* cannot be given to a reward to read: it lies in "
                                       r"GRPO_RUN_HOME"):
        load_job(job)


def test_resume_gives_the_reward_its_stored_folder_only_whatever_the_stored_path_says(tmp_path):
    """A bucket writer's `path: [~/.aws, /]` in the stored spec: never on the resuming node's search path."""
    applied = with_file_hashes(load_job(job_file(tmp_path / "job")))
    store = Store(f"file://{tmp_path / 'bucket'}/reach")
    upload_environment(environment_uploads(applied), store)
    doc = yaml.safe_load(job_file(tmp_path / "job").read_text())
    doc["spec"]["environment"] = {**applied.environment.to_dict(), "path": ["/root/.aws", "/", "/var/run/secrets"]}
    stored = parse_job(doc, base=Path("/"), check_files=False)
    assert "/root/.aws" in stored.environment.path

    local = localize_environment(stored, store, tmp_path / "node" / "runs" / "reach")
    assert local.environment.path == (str(tmp_path / "node" / "runs" / "reach" / "environment" / "reward"),)
