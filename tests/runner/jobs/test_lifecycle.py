"""Ending a job: `grpo-run cancel` stops it for good at a step boundary with its checkpoint kept,
`grpo-run delete` clears its name, `--version` says what is installed, and every command meets a
bad storage URL, refused credentials or a missing job with one line and no traceback."""

import importlib.metadata
import json
import time
from pathlib import Path

import pytest

from grpo_run.checkpoint.storage.lease import Lease
from grpo_run.checkpoint.storage.store import Store
from grpo_run.runner.cli.commands import main
from grpo_run.runner.exits import EXIT_CANCELLED, EXIT_HELD, EXIT_OK, EXIT_USAGE
from grpo_run.runner.jobs.cancel import CANCEL_KEY, request_cancel
from grpo_run.state.phases import InvalidTransition, Phase
from grpo_run.state.record import RECORD_FILE, Record
from tests.runner.jobs.test_resume import grpo_run, status, write_job
from tests.runner.supervisor.test_supervisor import start_apply, wait_for_training


def stored_job(storage: str, phase: Phase, name: str = "resumable") -> Store:
    """A job's record in `storage` that has reached `phase` (no training: only the record)."""
    store = Store(f"{storage}/{name}")
    local = Path(storage).parent / f"{name}-{phase}.db"
    with Record(local) as record:
        record.init_job(name, {"metadata": {"name": name}, "spec": {"storage": storage}})
        for step in {Phase.PENDING: [], Phase.TRAINING: [Phase.TRAINING],
                     Phase.SUCCEEDED: [Phase.TRAINING, Phase.FINAL_EVAL, Phase.SUCCEEDED]}[phase]:
            record.set_phase(step)
        record.snapshot(local.with_suffix(".snap"))
    store.put_file(local.with_suffix(".snap"), RECORD_FILE)
    return store


def stored_phase(store: Store, tmp: Path) -> str:
    store.get_file(RECORD_FILE, tmp / "check.db")
    with Record(tmp / "check.db") as record:
        return str(record.job()["phase"])


def test_version_is_the_installed_distributions(capsys):
    assert main(["--version"]) == EXIT_OK
    assert capsys.readouterr().out.strip() == f"grpo-run {importlib.metadata.version('grpo-run')}"


def test_cancelled_is_terminal(tmp_path):
    with Record(tmp_path / "run.db") as record:
        record.init_job("resumable", {})
        record.set_phase(Phase.TRAINING)
        record.set_phase(Phase.CANCELLED)
        with pytest.raises(InvalidTransition, match="Cancelled -> Training is not allowed"):
            record.set_phase(Phase.TRAINING)


# --- cancel ------------------------------------------------------------------------------------

def test_cancel_stops_a_running_job_at_a_step_boundary_and_delete_clears_it(tmp_path, s3_env):
    url = s3_env.url
    job = write_job(tmp_path, url, maxSteps=2000, saveSteps=500)     # far longer than the test waits
    node = start_apply(tmp_path / "node-a", job, GRPO_RUN_NOTICES="none")
    wait_for_training(tmp_path / "node-a", node, min_step=2)

    asked = grpo_run(tmp_path / "laptop", "cancel", "resumable", "--storage", url)
    requested = time.monotonic()
    assert "cancel requested" in asked.stdout and "stops at its next step boundary" in asked.stdout
    out, err = node.communicate(timeout=180)
    assert node.returncode == EXIT_CANCELLED, err[-3000:]
    print(f"\ncancel returned -> node exited {time.monotonic() - requested:.2f} s")

    st = status(tmp_path / "reader", url)                             # another home: from storage alone
    assert st["phase"] == "Cancelled" and 2 <= st["step"] < 2000, out
    assert st["checkpoints"]["latestDurable"] == st["step"]           # no completed step lost, and durable
    assert st["attempts"][-1]["reason"] == "Cancelled"
    assert "cancelled by cancel@" in st["message"]
    assert f"resumable: Cancelled after {st['step']} steps" in out
    print(f"stopped after step {st['step']} of 2000; checkpoint at step {st['checkpoints']['latestDurable']} durable")

    # the node's own machine exports it without --storage (the storage its run used)
    exported = grpo_run(tmp_path / "node-a", "export", "resumable", "--out", str(tmp_path / "adapter"))
    assert f"the checkpoint at step {st['step']}" in exported.stdout
    # a fresh node never trains it again
    again = grpo_run(tmp_path / "node-b", "resume", "resumable", "--storage", url)
    assert "resumable: cancelled (" in again.stdout
    assert status(tmp_path / "reader", url)["step"] == st["step"]

    sibling = Store(f"{url}/resumable-2")
    sibling.put_bytes("keep.txt", b"another job's")
    gone = grpo_run(tmp_path / "laptop", "delete", "resumable", "--storage", url, "--yes")
    assert "resumable: deleted" in gone.stdout
    assert Store(f"{url}/resumable").list("") == []                  # nothing under the job's prefix
    assert sibling.list("") == ["keep.txt"]                         # whole path components only
    assert grpo_run(tmp_path / "reader", "get", "tj", "resumable", "--storage", url, check=False).returncode == 2


def test_a_submitted_job_once_cancelled_is_never_started(tmp_path):
    storage = str(tmp_path / "bucket")
    laptop, node = tmp_path / "laptop", tmp_path / "node"
    grpo_run(laptop, "apply", "-f", str(write_job(tmp_path, storage)), "--detach")

    cancelled = grpo_run(laptop, "cancel", "resumable")              # the storage --detach remembered
    assert "resumable: Cancelled (it was Pending)" in cancelled.stdout
    assert json.loads(grpo_run(laptop, "get", "tj", "resumable", "-o", "json").stdout)["status"]["phase"] == "Cancelled"

    resumed = grpo_run(node, "resume", "resumable", "--storage", storage)
    assert resumed.returncode == EXIT_OK and "resumable: cancelled (" in resumed.stdout
    assert not (node / "runs" / "resumable" / "checkpoints").exists()

    again = grpo_run(laptop, "cancel", "resumable")
    assert "already Cancelled; nothing changed" in again.stdout
    # export follows the remembered storage too: its own answer there, not "no job record" in this home's
    exported = grpo_run(laptop, "export", "resumable", "--out", str(tmp_path / "adapter"), check=False)
    assert exported.returncode == EXIT_USAGE and f"{storage}/resumable" in exported.stderr


def test_a_node_that_takes_the_job_after_a_cancel_request_ends_it_without_training(tmp_path):
    storage = str(tmp_path / "bucket")
    grpo_run(tmp_path / "laptop", "apply", "-f", str(write_job(tmp_path, storage)), "--detach")
    request_cancel(Store(f"{storage}/resumable"), by="operator")     # the request, the record still Pending

    resumed = grpo_run(tmp_path / "node", "resume", "resumable", "--storage", storage, check=False)
    assert resumed.returncode == EXIT_CANCELLED, resumed.stderr[-2000:]
    st = status(tmp_path / "reader", storage)
    assert st["phase"] == "Cancelled" and st["step"] == 0 and "cancelled by operator" in st["message"]
    assert not (tmp_path / "node" / "runs" / "resumable" / "checkpoints").exists()


def test_cancel_of_a_succeeded_job_changes_nothing(tmp_path, capsys):
    storage = str(tmp_path / "bucket")
    store = stored_job(storage, Phase.SUCCEEDED)
    assert main(["cancel", "resumable", "--storage", storage]) == EXIT_OK
    assert "already Succeeded; nothing changed" in capsys.readouterr().out
    assert not store.exists(CANCEL_KEY) and stored_phase(store, tmp_path) == "Succeeded"


def test_a_job_that_succeeds_while_cancel_runs_stays_succeeded(tmp_path, capsys, monkeypatch):
    import grpo_run.runner.jobs.cancel as lifecycle

    storage = str(tmp_path / "bucket")
    store = stored_job(storage, Phase.TRAINING)
    asked = lifecycle.request_cancel

    def the_node_finishes_first(store_, by):   # between cancel's first read and its lease
        stored_job(storage, Phase.SUCCEEDED)
        asked(store_, by)

    monkeypatch.setattr(lifecycle, "request_cancel", the_node_finishes_first)
    assert main(["cancel", "resumable", "--storage", storage]) == EXIT_OK
    assert "already Succeeded; nothing changed" in capsys.readouterr().out
    assert stored_phase(store, tmp_path) == "Succeeded"


# --- delete ------------------------------------------------------------------------------------

def test_delete_needs_yes_and_refuses_a_job_a_node_holds_unless_forced(tmp_path, capsys):
    storage = str(tmp_path / "bucket")
    store = stored_job(storage, Phase.TRAINING)
    work = tmp_path / "grpo-run-home" / "runs" / "resumable"
    work.mkdir(parents=True)

    assert main(["delete", "resumable", "--storage", storage]) == EXIT_USAGE
    assert "add --yes" in capsys.readouterr().err and store.list("") == [RECORD_FILE]

    node = Lease(store.url, holder="node-x")
    node.acquire()                           # a live node's lease (ttl 60 s)
    assert main(["delete", "resumable", "--storage", storage, "--yes"]) == EXIT_HELD
    err = capsys.readouterr().err
    assert "held by node-x" in err and "--force" in err and RECORD_FILE in store.list("") and work.exists()

    assert main(["delete", "resumable", "--storage", storage, "--yes", "--force"]) == EXIT_OK
    assert store.list("") == [] and not work.exists()
    assert main(["delete", "resumable", "--storage", storage, "--yes"]) == EXIT_USAGE     # nothing left
    assert "no job 'resumable'" in capsys.readouterr().err


# --- errors: one line, never a traceback -------------------------------------------------------

def commands(storage: str, tmp: Path) -> dict[str, list[str]]:
    return {"get": ["get", "tj", "resumable", "--storage", storage],
            "get-all": ["get", "tj", "--storage", storage],
            "report": ["report", "resumable", "--storage", storage, "--out", str(tmp / "r.png")],
            "export": ["export", "resumable", "--storage", storage, "--out", str(tmp / "out")],
            "resume": ["resume", "resumable", "--storage", storage],
            "cancel": ["cancel", "resumable", "--storage", storage],
            "delete": ["delete", "resumable", "--storage", storage, "--yes"]}


def one_line_error(capsys, caplog, argv: list[str]) -> tuple[int, str]:
    caplog.clear()
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    said = out + err + caplog.text
    assert "Traceback" not in said, (argv, said)
    assert code in (1, 2), (argv, code, said)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), (argv, err)
    return code, lines[0]


def test_a_bad_storage_url_gets_one_line_from_every_command(tmp_path, capsys, caplog):
    bad = "ftp://bucket/prefix"
    for name, argv in {**commands(bad, tmp_path),
                       "deploy": ["deploy", "cloud-init", "--storage", bad, "--job", "resumable"]}.items():
        code, line = one_line_error(capsys, caplog, argv)
        assert "ftp" in line and "s3://bucket/prefix" in line, (name, line)       # the cause and the fix
    job = write_job(tmp_path, bad)
    capsys.readouterr()
    assert main(["apply", "-f", str(job), "--dry-run"]) == EXIT_USAGE       # a job file's problem: exit 2
    err = capsys.readouterr().err
    assert "spec.storage: unsupported scheme 'ftp'" in err and "Traceback" not in err


@pytest.mark.parametrize("keys", ["wrong", "none"])
def test_refused_or_missing_credentials_get_one_line_from_every_command(tmp_path, s3_env, capsys, caplog,
                                                                       monkeypatch, keys):
    if keys == "wrong":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    else:
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    for name, argv in commands(s3_env.url, tmp_path).items():
        code, line = one_line_error(capsys, caplog, argv)
        assert code == 1 and "credentials" in line.lower(), (name, line)


def test_a_missing_job_gets_one_line_from_every_command(tmp_path, s3_env, capsys, caplog):
    for name, argv in {**commands(s3_env.url, tmp_path), "logs": ["logs", "resumable"]}.items():
        if name == "get-all":       # an empty storage lists no jobs: not an error
            continue
        code, line = one_line_error(capsys, caplog, argv)
        assert code == 2 and "resumable" in line, (name, line)


def test_a_storage_error_while_looking_for_a_cancel_request_is_not_the_runs_error(tmp_path, monkeypatch):
    """The look happens beside a record upload or a lease renewal: its failure is only a look
    missed, and the next one still finds the request."""
    import grpo_run.runner.supervisor.supervisor as supervisor
    from grpo_run.checkpoint.storage.store import StorageUnavailable
    from grpo_run.runner.home import job_store_url
    from grpo_run.runner.spec.job import load_job
    from grpo_run.runner.supervisor.runspec import build_run_spec

    job = load_job(write_job(tmp_path, str(tmp_path / "store")))
    url = job_store_url(str(tmp_path / "store"), job.name)
    looks: list[str] = []

    def flaky(store):               # the first look fails, the next finds the request
        looks.append(store.url)
        if len(looks) == 1:
            raise StorageUnavailable("storage did not answer (injected)")
        return {"by": "operator"}

    monkeypatch.setattr(supervisor, "cancel_requested", flaky)
    result = supervisor.Supervisor(build_run_spec(job, url), tmp_path / "node", watchers=[]).run()
    assert result.exit_code == EXIT_CANCELLED and "cancelled by operator" in result.message
    assert len(looks) >= 2
