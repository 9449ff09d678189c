"""Storage's record is the job's history: a node whose own copy is older (a copy read before
another node ran the job, a node back with its old disk) never uploads it over storage's, and
decides what the job needs from storage's copy, fetched once it holds the lease."""

import shutil

import pytest

from grpo_run.checkpoint.storage.store import StorageUnavailable, Store
from grpo_run.runner.books.books import Books
from grpo_run.runner.books.replica import StaleRecord, stored_record
from grpo_run.state.phases import Phase
from grpo_run.state.record import RECORD_FILE

MANIFEST = {"kind": "TrainingJob", "metadata": {"name": "job"}}


def books(store: Store, work) -> Books:
    """The books as a supervisor opens them once it holds the job's lease."""
    return Books(store, work, name="job", manifest=MANIFEST, usd_per_hour=36.0, max_cost_usd=None)


def in_storage(store: Store) -> dict:
    with stored_record(store) as record:
        return {"phase": record.job()["phase"], "steps": [s["step"] for s in record.steps()],
                "attempts": [(a["node"], a["reason"]) for a in record.attempts()],
                "ledger": record.value("ledger")}


@pytest.mark.trust
def test_a_node_back_with_its_old_record_does_not_roll_storage_back(tmp_path, figures):
    store = Store(str(tmp_path / "store"))
    a = books(store, tmp_path / "node-a")
    a.enter_phase(Phase.TRAINING)
    a.start_attempt("node-a", from_step=0)
    for step in (1, 2):
        a.log_step(step, {"loss": 0.5, "identicalGroups": 0.0})
    a.sync(wait=True)
    a.close()
    old_disk = tmp_path / "node-a-disk.db"
    shutil.copy(tmp_path / "node-a" / RECORD_FILE, old_disk)       # node A's disk as it was when it went away

    b = books(store, tmp_path / "node-b")                          # the job continues on node B, to the end
    b.close_dangling_attempts()
    b.start_attempt("node-b", from_step=2)
    for step in (3, 4, 5):
        b.log_step(step, {"loss": 0.25, "identicalGroups": 0.0})
    b.enter_phase(Phase.FINAL_EVAL)
    b.finish(Phase.SUCCEEDED, "Succeeded", "done")
    b.close()
    finished = in_storage(store)

    shutil.copy(old_disk, tmp_path / "node-a" / RECORD_FILE)       # node A comes back with its disk
    again = books(store, tmp_path / "node-a")
    try:
        assert again.succeeded()                                   # decided from storage's record
        again.sync(wait=True)
    finally:
        again.close()
    assert in_storage(store) == finished
    assert finished["phase"] == Phase.SUCCEEDED and finished["steps"] == [1, 2, 3, 4, 5]
    assert [node for node, _ in finished["attempts"]] == ["node-a", "node-b"]
    assert set(finished["ledger"]) == {"1", "2"}
    assert list((tmp_path / "node-a").glob(f".set-aside-{RECORD_FILE}-*"))   # the old copy is kept, aside
    figures.add("trust", actor='ordinary failure', tried='a node comes back with its disk and an old record, and resumes',
                protection="storage's record replaces a local copy that lacks storage's generation", outcome='the old copy set aside; nothing rolled back', held=True)


def test_a_record_older_than_storages_is_refused_and_said_so(tmp_path):
    """Two holders at once (a lease misjudged): the one whose record is older uploads nothing."""
    store = Store(str(tmp_path / "store"))
    a = books(store, tmp_path / "node-a")
    a.sync(wait=True)
    b = books(store, tmp_path / "node-b")                          # storage's record: a's
    b.start_attempt("node-b", from_step=0)
    b.log_step(1, {"loss": 0.5, "identicalGroups": 0.0})
    b.sync(wait=True)
    newer = in_storage(store)
    try:
        a.log_step(7, {"loss": 0.1, "identicalGroups": 0.0})
        with pytest.raises(StaleRecord, match="storage holds a newer record of job job .*roll the job back"):
            a.sync(wait=True)
        assert in_storage(store) == newer
        assert newer["steps"] == [1] and newer["attempts"] == [("node-b", None)]
    finally:
        a.close()
        b.close()


def test_an_upload_whose_answer_was_lost_is_not_taken_for_another_nodes(tmp_path):
    store = Store(str(tmp_path / "store"))
    a = books(store, tmp_path / "node-a")
    put_file = store.put_file

    def lands_then_fails(local, key):
        put_file(local, key)
        raise StorageUnavailable("the answer was lost")

    try:
        a.log_step(1, {"loss": 0.5, "identicalGroups": 0.0})
        store.put_file = lands_then_fails
        with pytest.raises(StorageUnavailable):
            a.sync(wait=True)
        store.put_file = put_file
        a.log_step(2, {"loss": 0.25, "identicalGroups": 0.0})
        a.sync(wait=True)                                          # storage's newer copy is its own
        assert in_storage(store)["steps"] == [1, 2]
    finally:
        a.close()


def test_a_supervisor_that_finds_the_job_succeeded_once_it_holds_the_lease_runs_nothing(tmp_path, monkeypatch):
    """Its copy was read while another node trained the job, which finished before the lease
    came free: what storage's record says, read under the lease, decides."""
    from grpo_run.runner.exits import EXIT_OK
    from grpo_run.runner.home import job_store_url
    from grpo_run.runner.spec.job import load_job
    from grpo_run.runner.supervisor.runspec import build_run_spec
    from grpo_run.runner.supervisor.supervisor import Supervisor
    from tests.runner.jobs.test_resume import write_job

    monkeypatch.setenv("GRPO_RUN_HOME", str(tmp_path / "home"))
    job = load_job(write_job(tmp_path, str(tmp_path / "store")))
    url = job_store_url(str(tmp_path / "store"), job.name)
    store = Store(url)
    other = Books(store, tmp_path / "node-a", name=job.name, manifest=job.to_dict(), usd_per_hour=36.0,
                  max_cost_usd=None)
    other.enter_phase(Phase.TRAINING)
    other.start_attempt("node-a", from_step=0)
    other.log_step(1, {"loss": 0.5, "identicalGroups": 0.0})
    other.sync(wait=True)
    (tmp_path / "node-b").mkdir()
    shutil.copy(tmp_path / "node-a" / RECORD_FILE, tmp_path / "node-b" / RECORD_FILE)   # read while A trained
    other.enter_phase(Phase.FINAL_EVAL)
    other.finish(Phase.SUCCEEDED, "Succeeded", "done")
    other.close()
    finished = in_storage(store)

    result = Supervisor(build_run_spec(job, url), tmp_path / "node-b", store=store, watchers=[]).run()
    assert result.exit_code == EXIT_OK and "already succeeded" in result.message
    assert in_storage(store) == finished
    assert finished["phase"] == Phase.SUCCEEDED and finished["attempts"] == [("node-a", "Succeeded")]


def test_resume_says_already_succeeded_when_the_job_finished_while_it_waited_for_the_lease(
        tmp_path, monkeypatch, capsys):
    """Its first look at storage saw the job running; the holder finished before the lease came
    free: the node says what a node that looked later says, not the run's summary as if it ran."""
    import threading

    from grpo_run.runner.jobs import run as jobs
    from grpo_run.runner.exits import EXIT_OK
    from grpo_run.runner.home import job_store_url
    from grpo_run.runner.jobs.envfiles import environment_uploads, with_file_hashes
    from grpo_run.runner.spec.job import load_job
    from grpo_run.runner.supervisor.runspec import build_run_spec
    from tests.runner.jobs.test_resume import write_job

    monkeypatch.setenv("GRPO_RUN_HOME", str(tmp_path / "node-b"))
    monkeypatch.setenv("GRPO_RUN_NOTICES", "none")
    job = with_file_hashes(load_job(write_job(tmp_path, str(tmp_path / "store"))))     # as apply reads it
    url = job_store_url(str(tmp_path / "store"), job.name)
    store = Store(url)
    manifest = build_run_spec(job, url, local=job, uploads=environment_uploads(job)).manifest   # as node A's apply
    other = Books(store, tmp_path / "node-a", name=job.name, manifest=manifest, usd_per_hour=36.0,
                  max_cost_usd=None)
    other.enter_phase(Phase.TRAINING)
    other.start_attempt("node-a", from_step=0)
    other.log_step(1, {"loss": 0.5, "identicalGroups": 0.0})
    other.enter_phase(Phase.FINAL_EVAL)
    other.finish(Phase.SUCCEEDED, "Succeeded", "done")
    other.close()
    finished = in_storage(store)
    monkeypatch.setattr(jobs, "before_the_lease", lambda job, store: (None, None, None))    # it looked while node A trained

    assert jobs.run_job(job, output=None, stop=threading.Event(), store=store) == EXIT_OK
    said = capsys.readouterr().out
    assert said == f"{job.name}: already succeeded; nothing to do\n", said
    assert in_storage(store) == finished
