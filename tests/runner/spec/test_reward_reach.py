"""What a job may give its reward to read (review N2): a job file's `environment.path` lies in the
job's own folder, and a resumed job's reward imports from its stored files' folder only, whatever
the stored spec says. The grader's own line (trainer.grader.reach) is tested with the sandbox, in
tests/trainer/grader/test_sandbox_secrets.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from grpo_run.checkpoint.storage.store import Store
from grpo_run.runner.cli.commands import EXIT_USAGE, main
from grpo_run.runner.jobs.envfiles import environment_uploads, localize_environment, with_file_hashes
from grpo_run.runner.spec.job import JobError, load_job, parse_job
from grpo_run.runner.supervisor.uploads import upload_environment

pytestmark = pytest.mark.trust
SECRET = "FAKE-FILE-SECRET-42"


def job_file(folder: Path, **environment) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "rewards.py").write_text("def leak(completion, task):\n    raise RuntimeError(open(task['path']).read())\n")
    (folder / "tasks.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    env = {"name": "mine", "reward": "rewards.py:leak", "tasks": "tasks.jsonl", "heldOutFraction": 0.5, **environment}
    doc = {"apiVersion": "grpo-run/v1", "kind": "TrainingJob", "metadata": {"name": "reach"},
           "spec": {"runtime": "grpo-lora", "model": "tiny:char",
                    "environment": {k: v for k, v in env.items() if v is not None},
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


# what apply uploads (review N9) -----------------------------------------------------------------


@pytest.mark.parametrize("field", ["tasks", "dataFiles", "reward"])
def test_apply_follows_no_symbolic_link_out_of_the_job_folder(tmp_path, field, figures):
    """The review's repro: a bundle's `extra.json -> ~/adc.json` would be uploaded to the bucket."""
    adc = tmp_path / "home" / "adc.json"
    adc.parent.mkdir()
    adc.write_text(json.dumps({"client_id": "x", "refresh_token": SECRET}))
    folder = tmp_path / "bundle"
    job = job_file(folder)
    link = folder / ("leak.py" if field == "reward" else "extra.json")
    link.symlink_to(adc)
    doc = yaml.safe_load(job.read_text())
    env = doc["spec"]["environment"]
    if field == "tasks":
        env.update(tasks="extra.json", columns={"prompt": "client_id"})
    elif field == "dataFiles":
        del env["tasks"]
        env.update(dataFiles={"train": "tasks.jsonl", "extra": "extra.json"}, columns={"prompt": "client_id"})
    else:
        env["reward"] = "leak.py:leak"
    job.write_text(yaml.safe_dump(doc))
    where = {"tasks": "tasks", "dataFiles": "dataFiles: extra", "reward": "reward"}[field]
    with pytest.raises(JobError, match=rf"spec.environment.{where}: .* is a symbolic link to {adc}, outside the job's "
                                       "folder"):
        load_job(job)
    figures.add("trust", actor="bundle author", tried=f"a {field} symlink to ~/adc.json in the job's folder",
                protection="apply follows no link out of the job folder", outcome="refused, nothing uploaded", held=True)


def test_a_link_inside_the_job_folder_and_a_path_written_outside_it_are_kept(tmp_path):
    outside = tmp_path / "data" / "train.jsonl"
    outside.parent.mkdir()
    outside.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    job = job_file(tmp_path / "job", tasks=str(outside))
    (tmp_path / "job" / "same.jsonl").symlink_to(tmp_path / "job" / "tasks.jsonl")
    assert load_job(job).environment.tasks == str(outside)
    job = job_file(tmp_path / "job", tasks="same.jsonl")
    assert load_job(job).environment.tasks == str((tmp_path / "job" / "tasks.jsonl").resolve())


# the judge's key (review N10) -------------------------------------------------------------------


def judged(tmp_path: Path, key: str) -> Path:
    return job_file(tmp_path / "judged", rewards=[{"function": "rewards.py:leak"},
                                                  {"judge": {"url": "http://127.0.0.1:9/v1", "model": "m",
                                                             "prompt": "Rate {completion}", "apiKeyEnv": key}}],
                    reward=None)


def test_a_judge_sends_as_its_key_only_a_variable_the_node_lists(tmp_path, monkeypatch, figures):
    from grpo_run.runner.spec.judge import judges_refused

    monkeypatch.setenv("GRPO_RUN_ALLOW_JUDGES", "1")
    monkeypatch.delenv("GRPO_RUN_JUDGE_KEYS", raising=False)
    stored = load_job(judged(tmp_path, "AWS_SECRET_ACCESS_KEY"))
    (refusal,) = judges_refused(stored.environment)
    assert refusal.startswith("spec.environment.rewards.1.judge.apiKeyEnv: this node does not let a judge send its "
                              "variable AWS_SECRET_ACCESS_KEY (it lets: none): add AWS_SECRET_ACCESS_KEY to "
                              "GRPO_RUN_JUDGE_KEYS")
    monkeypatch.setenv("GRPO_RUN_JUDGE_KEYS", "OPENAI_API_KEY, JUDGE_KEY")
    assert judges_refused(stored.environment)[0].split(" (it lets: ")[1].startswith("JUDGE_KEY, OPENAI_API_KEY)")
    assert judges_refused(load_job(judged(tmp_path, "JUDGE_KEY")).environment) == []
    figures.add("trust", actor="bucket writer", tried="a stored judge with apiKeyEnv AWS_SECRET_ACCESS_KEY",
                protection="GRPO_RUN_JUDGE_KEYS, the node's list", outcome="refused before the lease", held=True)


# a dry run on a machine without every layer (review N11) ----------------------------------------


def test_a_dry_run_on_a_machine_without_every_layer_of_the_sandbox_never_imports_the_reward(tmp_path, figures):
    """A bundle's top-level code must not run on the submitting machine with less than the full
    sandbox: here a process that cannot make namespaces, as in a container under Docker's profile."""
    import subprocess
    import sys

    from tests.nonamespaces import without_namespaces
    from tests.runner.jobs.test_resume import REPO

    job = job_file(tmp_path / "bundle")
    (tmp_path / "bundle" / "rewards.py").write_text("print('IMPORTED ON THE SUBMITTING MACHINE', flush=True)\n"
                                                    "def leak(completion, task):\n    return 0.0\n")
    program = without_namespaces('''
        import sys
        from grpo_run.runner.cli.commands import main
        sys.exit(main(["apply", "--dry-run", "-f", sys.argv[1]]))
    ''')
    done = subprocess.run([sys.executable, "-c", program, str(job)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "IMPORTED" not in done.stdout + done.stderr
    assert ("spec.environment.reward: not loaded on this machine, which cannot sandbox it fully (missing: network"
            in done.stdout + done.stderr)
    figures.add("trust", actor="bundle author", tried="run top-level code at `apply --dry-run` on a machine "
                "without namespaces", protection="the preflight loads rewards only in the strict sandbox",
                outcome="not imported, said in a note", held=True)


# the node's Hugging Face token on resume (review N5) ----------------------------------------------


def stored_job_naming(tmp_path: Path, model: str) -> "TrainingJob":  # noqa: F821
    doc = yaml.safe_load(job_file(tmp_path / "hub").read_text())
    doc["spec"]["model"] = model
    return parse_job(doc, base=Path("/"), check_files=False)


def headers_sent() -> dict:
    from huggingface_hub.utils import build_hf_headers

    return build_hf_headers()


@pytest.mark.parametrize("allow", [None, "someone/*", "*"])
def test_a_resumed_job_fetches_hub_ids_with_the_nodes_token_only_where_the_node_allows_them(tmp_path, monkeypatch,
                                                                                            allow, figures):
    from grpo_run.runner.jobs import run as jobs

    monkeypatch.setenv("HF_TOKEN", "hf_FAKE_NODE_TOKEN_123456")
    if allow is None:
        monkeypatch.delenv("GRPO_RUN_HUB_ALLOW", raising=False)
    else:
        monkeypatch.setenv("GRPO_RUN_HUB_ALLOW", allow)
    stored = stored_job_naming(tmp_path, "someone/private-model")
    seen = {}

    def run(job, **kwargs):            # what the resumed run (the CLI's work, the trainer it starts) holds
        seen.update(env=os.environ.get("HF_TOKEN"), sent=headers_sent().get("authorization"))
        return 0

    monkeypatch.setattr(jobs, "_run_job", run)
    assert jobs.run_job(stored, output=None, stop=None, trust_urls=False) == 0
    withheld = allow is None
    assert seen == ({"env": None, "sent": None} if withheld else
                    {"env": "hf_FAKE_NODE_TOKEN_123456", "sent": "Bearer hf_FAKE_NODE_TOKEN_123456"})
    assert os.environ["HF_TOKEN"] == "hf_FAKE_NODE_TOKEN_123456"          # the node's own, after the run
    assert headers_sent().get("authorization") == "Bearer hf_FAKE_NODE_TOKEN_123456"
    assert jobs.run_job(stored, output=None, stop=None, trust_urls=None) == 0     # applied here: the operator's own
    assert seen["env"] == "hf_FAKE_NODE_TOKEN_123456"
    if withheld:
        figures.add("trust", actor="bucket writer", tried="a stored `model: someone/private-model` on resume",
                    protection="the node's HF token only for ids in GRPO_RUN_HUB_ALLOW", outcome="fetched without it",
                    held=True)
