"""What a bucket writer can do: nothing a node would not do for its operator. A resumed job's files
are the copies `apply` recorded (by sha256), never a file of the node and never uploaded; nothing is
written to a job's storage before its lease; the URLs a node contacts are its own; names are
checked; storage's text reaches the terminal without control characters."""

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from grpo_run.runner.cli.commands import main
from grpo_run.runner.exits import EXIT_HELD, EXIT_OK, EXIT_USAGE
from grpo_run.runner.exits import EXIT_FAILED
from tests.runner.jobs.test_resume import REPO, write_job

SECRET = "FAKE-NODE-SECRET-123"

pytestmark = pytest.mark.trust


def plant(storage: Path, name: str, doc: dict, tmp_path: Path) -> None:
    """What a bucket writer does: a record holding its own spec, in the job's folder."""
    from grpo_run.checkpoint.storage.store import Store
    from grpo_run.state.record import Record

    made = tmp_path / "planted.db"
    with Record(made) as record:
        record.init_job(name, doc)
        record.snapshot(tmp_path / "planted-snapshot.db")
    Store(f"{storage}/{name}").put_file(tmp_path / "planted-snapshot.db", "state.db")


def files_under(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("recorded", [None, "0" * 64], ids=["no-sha256", "a-sha256-of-its-own"])
def test_a_planted_spec_naming_the_node_s_environ_sends_nothing_of_the_node_to_the_bucket(tmp_path, recorded, figures):
    storage = tmp_path / "bucket"
    doc = yaml.safe_load(write_job(tmp_path).read_text())     # length.py is on this node, at the planted path
    doc["spec"]["environment"] = {"name": "length", "reward": f"{tmp_path / 'length.py'}:score",
                                  "dataFiles": {"train": "/proc/self/environ"}, "heldOutFraction": 0.5}
    if recorded:
        doc["spec"]["environment"]["sha256"] = {"reward": recorded, "dataFiles.train": recorded}
    plant(storage, "resumable", doc, tmp_path)

    proc = subprocess.run([sys.executable, "-m", "grpo_run.runner.cli", "resume", "resumable", "--storage", str(storage)],
                          cwd=REPO, env={**os.environ, "GRPO_RUN_HOME": str(tmp_path / "node"),
                                         "AWS_SECRET_ACCESS_KEY": SECRET},
                          capture_output=True, text=True, timeout=300)
    leaked = [name for name, data in files_under(storage).items() if SECRET.encode() in data]
    assert not leaked
    assert not (storage / "resumable" / "environment").exists()      # resume uploads no file of the node's
    assert proc.returncode == EXIT_FAILED, proc.stderr[-3000:]
    assert ("records no sha256" if recorded is None else "is not in storage") in proc.stderr
    assert not (storage / "resumable" / "lease.json").exists()       # refused before the lease
    figures.add("trust", actor='bucket writer', tried='a stored spec with dataFiles: /proc/self/environ, resumed',
                protection='resume uses only the stored copies, checked by sha256', outcome='nothing of the node reached the bucket', held=True)


def test_resume_uses_the_stored_copies_and_refuses_one_replaced_since_apply(tmp_path, capsys, figures):
    from grpo_run.runner.jobs.envfiles import localize_environment
    from grpo_run.runner.jobs.find import find_job

    storage = str(tmp_path / "bucket")
    assert main(["apply", "-f", str(write_job(tmp_path, storage)), "--detach"]) == EXIT_OK
    stored, store = find_job("resumable", storage)
    assert set(stored.environment.sha256) == {"reward", "tasks", "evalTasks"}
    # this node has a file at the path the spec names, with other contents: it is not what was applied
    (tmp_path / "length.py").write_text("def score(completion, task):\n    return 0.0\n")
    here = localize_environment(stored, store, tmp_path / "work")
    reward_file = Path(here.environment.reward.rpartition(":")[0])
    assert reward_file.is_relative_to(tmp_path / "work") and "len(completion)" in reward_file.read_text()

    store.put_bytes("environment/reward/length.py", b"def score(completion, task):\n    return 1.0\n")
    with pytest.raises(ValueError, match="has sha256 [0-9a-f]{64}, not the [0-9a-f]{64} recorded when the job was applied"):
        localize_environment(stored, store, tmp_path / "work2")
    capsys.readouterr()
    assert main(["resume", "resumable", "--storage", storage]) == EXIT_FAILED
    assert "spec.environment.reward: the copy in storage (environment/reward/length.py) has sha256" in \
        capsys.readouterr().err
    assert not (tmp_path / "bucket" / "resumable" / "checkpoints").exists()     # nothing trained on it
    figures.add("trust", actor='bucket writer', tried='replace the stored reward file after apply',
                protection='the sha256 apply recorded', outcome='refused, naming the file', held=True)


def test_apply_records_the_files_hashes_and_refuses_a_file_that_is_not_the_one_pinned(tmp_path, capsys):
    from grpo_run.runner.jobs.envfiles import sha256_of

    job = write_job(tmp_path, str(tmp_path / "bucket"))
    assert main(["apply", "-f", str(job), "--detach", "-o", "yaml"]) == EXIT_OK
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["spec"]["environment"]["sha256"]["reward"] == sha256_of(tmp_path / "length.py")
    del shown["status"]
    job.write_text(yaml.safe_dump(shown))                 # get tj -o yaml, applied again: the same job
    assert main(["apply", "-f", str(job), "--detach"]) == EXIT_OK
    assert "already submitted with this spec" in capsys.readouterr().out
    (tmp_path / "length.py").write_text("def score(completion, task):\n    return 2.0\n")
    assert main(["apply", "-f", str(job), "--detach"]) == EXIT_USAGE
    assert "spec.environment.sha256.reward: " in capsys.readouterr().err


def test_apply_of_an_edited_file_against_a_held_job_writes_nothing_to_its_storage(tmp_path, capsys, figures):
    from grpo_run.checkpoint.storage.lease import Lease

    storage = tmp_path / "bucket"
    job = write_job(tmp_path, str(storage))
    assert main(["apply", "-f", str(job), "--detach"]) == EXIT_OK
    before = files_under(storage / "resumable")
    other = Lease(str(storage / "resumable"), holder="another-node")      # that node trains it
    other.acquire()
    try:
        (tmp_path / "length.py").write_text("def score(completion, task):\n    return 3.0\n")
        (tmp_path / "train.jsonl").write_text('{"prompt": "1+1="}\n{"prompt": "2+2="}\n')
        assert main(["apply", "-f", str(job)]) == EXIT_HELD
        after = files_under(storage / "resumable")
    finally:
        other.release()
    after.pop("lease.json")
    assert after == before
    assert "another node holds the job" in capsys.readouterr().err
    figures.add("trust", actor='ordinary failure', tried='apply an edited job file while another node runs the job',
                protection='environment files sent only under the lease', outcome='nothing written; told held', held=True)


@pytest.mark.parametrize("argv", [
    ["logs", "../elsewhere"],
    ["resume", "../elsewhere", "--storage", "STORAGE"],
    ["export", "../elsewhere", "--out", "OUT"],
    ["get", "tj", "../elsewhere"],
    ["report", "../elsewhere", "--out", "OUT.png"],
    ["resume", "job\n", "--storage", "STORAGE"],
    ["deploy", "k8s", "--storage", "s3://bucket/prefix", "--job", "x\ny", "--image", "img"],
], ids=lambda argv: argv[0] + ("-newline" if any("\n" in a for a in argv) else ""))
def test_a_name_on_the_command_line_is_checked_like_metadata_name(tmp_path, capsys, argv, figures):
    home = Path(os.environ["GRPO_RUN_HOME"])
    (home / "runs").mkdir(parents=True)
    (home / "elsewhere" / "logs").mkdir(parents=True)      # runs/../elsewhere: outside the work folders
    (home / "elsewhere" / "logs" / "trainer.log").write_text("NOT-THIS-JOB'S-LOG\n")
    (tmp_path / "bucket" / "elsewhere").mkdir(parents=True)
    argv = [a.replace("STORAGE", str(tmp_path / "bucket")).replace("OUT", str(tmp_path / "out")) for a in argv]
    assert main(argv) == EXIT_USAGE
    seen = capsys.readouterr()
    assert "NOT-THIS-JOB'S-LOG" not in seen.out
    assert "must be lowercase letters, digits and '-', 1-63 characters" in seen.err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.png").exists()
    figures.add("trust", actor='bucket writer', tried='a NAME such as ../elsewhere on the command line',
                protection="metadata.name's rule for every NAME", outcome='refused', held=True)


def test_a_stored_spec_whose_name_is_not_its_folder_s_is_refused(tmp_path, capsys, figures):
    storage = tmp_path / "bucket"
    assert main(["apply", "-f", str(write_job(tmp_path, str(storage))), "--detach"]) == EXIT_OK
    (storage / "victim").mkdir()
    shutil.copy(storage / "resumable" / "state.db", storage / "victim" / "state.db")   # copied under another name
    capsys.readouterr()
    assert main(["resume", "victim", "--storage", str(storage)]) == EXIT_USAGE
    assert "the job stored in" in (err := capsys.readouterr().err) and "says its name is 'resumable', not 'victim'" in err
    assert sorted(files_under(storage / "victim")) == ["state.db"]
    figures.add("trust", actor='bucket writer', tried='a record under A/ naming job B',
                protection="a stored name must be its folder's", outcome='refused', held=True)


def test_text_from_storage_is_printed_without_control_characters(tmp_path, capsys, figures):
    from grpo_run.checkpoint.storage.lease import Lease
    from grpo_run.runner.views.outcome import run_summary as _summary
    from grpo_run.runner.cli.output import printable
    from grpo_run.runner.text import printable_lines

    storage = str(tmp_path / "bucket")
    assert main(["apply", "-f", str(write_job(tmp_path, storage)), "--detach"]) == EXIT_OK
    other = Lease(f"{storage}/resumable", holder="\x1b[2J\x1b[Hjob done\r")     # a holder a bucket writer chose
    other.acquire()
    try:
        capsys.readouterr()
        assert main(["resume", "resumable", "--storage", storage]) == EXIT_HELD
    finally:
        other.release()
    err = capsys.readouterr().err
    assert "\\x1b[2J\\x1b[Hjob done\\x0d" in err and "\x1b" not in err and "\r" not in err
    said = _summary("j", {"phase": "Preempted", "message": "boom\x1b]0;owned\x07\nSucceeded", "step": 0},
                    SimpleNamespace(notice_to_durable_s=None))
    assert said.splitlines()[1] == "  boom\\x1b]0;owned\\x07\\x0aSucceeded"
    # a failure's message keeps its line breaks (a traceback), each further line indented under it
    assert printable_lines("boom\x1b]0;owned\x07\nSucceeded\r") == "boom\\x1b]0;owned\\x07\n    Succeeded\\x0d"
    assert printable("ok\x1b[2J\x1b[H\rdone\u202e\n") == "ok\\x1b[2J\\x1b[H\\x0ddone\\u202e\\x0a"
    figures.add("trust", actor='bucket writer', tried="terminal escape codes in a lease holder's name",
                protection='text from storage printed without control characters', outcome='escaped', held=True)


def test_on_resume_the_node_not_the_bucket_chooses_the_urls_it_contacts(tmp_path, monkeypatch, capsys, caplog, figures):
    """A stored spec's metadata URL answers 200 (a spot notice, again and again) and its MLflow URI
    would receive the node's token: a resume uses neither unless the operator says so."""
    from tests.emulators import AwsImdsEmulator

    from grpo_run.runner.jobs.run import watchers_for as _watchers
    from grpo_run.runner.jobs.find import find_job
    from grpo_run.runner.jobs.stored import as_this_node_runs_it, trusts_stored_urls

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("GRPO_RUN_TRUST_STORED_URLS", raising=False)
    storage = str(tmp_path / "bucket")
    theirs = tmp_path / "their-mlruns"
    with AwsImdsEmulator() as imds:
        imds.trigger_preempt()
        job = write_job(tmp_path, storage)
        doc = yaml.safe_load(job.read_text())
        doc["spec"].update(notices={"clouds": ["aws"], "awsMetadataURL": imds.url},
                           tracking={"mlflow": {"trackingURI": f"file://{theirs}"}})
        job.write_text(yaml.safe_dump(doc))
        assert main(["apply", "-f", str(job), "--detach"]) == EXIT_OK
        capsys.readouterr()
        assert main(["resume", "resumable", "--storage", storage]) == EXIT_OK      # not preempted
        assert "not using the URLs the spec in storage names: spec.notices.awsMetadataURL" in caplog.text
        assert not theirs.exists()                                             # MLflow never wrote there

        stored, _ = find_job("resumable", storage)
        assert stored.notices.awsMetadataURL == imds.url                      # the record keeps the spec as applied
        [watcher] = _watchers(as_this_node_runs_it(stored, trust_urls=False))
        assert watcher.base_url == os.environ["GRPO_RUN_AWS_METADATA_URL"]
        monkeypatch.setenv("MLFLOW_TRACKING_URI", "file:///srv/mlruns")
        assert as_this_node_runs_it(stored, trust_urls=False).tracking.mlflow.trackingURI == "file:///srv/mlruns"
        monkeypatch.setenv("GRPO_RUN_TRUST_STORED_URLS", "1")                 # the operator opts in
        assert trusts_stored_urls()
        [watcher] = _watchers(as_this_node_runs_it(stored, trust_urls=True))
        assert watcher.base_url == imds.url
    figures.add("trust", actor='bucket writer', tried='stored MLflow and spot-notice URLs',
                protection="on resume the node's own configuration chooses URLs", outcome='the stored URLs never contacted', held=True)


def test_apply_of_an_edited_file_against_a_finished_job_leaves_its_files_in_storage(tmp_path, capsys, figures):
    storage = tmp_path / "bucket"
    job = write_job(tmp_path, str(storage))
    assert main(["apply", "-f", str(job)]) == EXIT_OK
    before = {k: v for k, v in files_under(storage / "resumable").items() if k.startswith("environment/")}
    (tmp_path / "length.py").write_text("def score(completion, task):\n    return 4.0\n")
    capsys.readouterr()
    assert main(["apply", "-f", str(job)]) == EXIT_FAILED
    assert "already succeeded with a different spec (changed: spec.environment.sha256.reward)" in capsys.readouterr().err
    after = {k: v for k, v in files_under(storage / "resumable").items() if k.startswith("environment/")}
    assert after == before
    figures.add("trust", actor='ordinary failure', tried='apply an edited job file to a finished job',
                protection='uploads only once the record accepts the spec', outcome="the finished job's files intact", held=True)


def test_a_stored_split_name_that_would_step_out_of_its_folder_is_refused_naming_the_field(tmp_path, figures):
    from grpo_run.checkpoint.storage.store import Store
    from grpo_run.runner.jobs.envfiles import localize_environment
    from grpo_run.runner.spec.job import parse_job

    doc = yaml.safe_load(write_job(tmp_path).read_text())
    doc["spec"]["environment"] = {"name": "length", "reward": "/srv/job/length.py:score", "heldOutFraction": 0.5,
                                  "dataFiles": {"train": "/srv/job/t.jsonl", "../../../../escape": "/srv/job/e.jsonl"},
                                  "sha256": {"reward": "1" * 64, "dataFiles.train": "2" * 64,
                                             "dataFiles.../../../../escape": "3" * 64}}
    store = Store(str(tmp_path / "bucket" / "resumable"))      # (the store refuses such a key too, less clearly)
    with pytest.raises(ValueError, match=r"spec.environment.dataFiles.../../../../escape: the field .* cannot be a "
                                         r"file's name in storage"):
        localize_environment(parse_job(doc, check_files=False), store, tmp_path / "node" / "work")
    figures.add("trust", actor='bucket writer', tried='a stored dataFiles split named ../../x',
                protection='stored names checked before any fetch', outcome='refused, naming the field', held=True)
