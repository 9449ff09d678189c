"""The run's record: append-only migrations, a lifecycle that refuses impossible moves, one
transaction per change, and a snapshot that is a whole database."""

from __future__ import annotations

import inspect
import sqlite3
import threading
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from grpo_run.state.phases import ALLOWED_TRANSITIONS, InvalidTransition, Phase
from grpo_run.state.migrations import MIGRATIONS
from grpo_run.state.record import Record, RecordDamaged, check_fetched

SPEC = {"runtime": "grpo-lora", "model": "tiny", "parameters": {"saveSteps": 25},
        "storage": "s3://bucket/prefix"}


@pytest.fixture
def record(tmp_path):
    rec = Record(tmp_path / "run.db")
    rec.init_job("my-grpo-lora", SPEC)
    yield rec
    rec.close()


def is_utc_iso(text: str) -> bool:
    return datetime.fromisoformat(text).utcoffset() == timedelta(0)


# --- schema -----------------------------------------------------------------------------------

def test_migrations_run_once_and_are_recorded(tmp_path):
    Record(tmp_path / "run.db").close()
    reopened = Record(tmp_path / "run.db")

    assert reopened.applied_migrations() == [name for name, _ in MIGRATIONS]
    reopened.close()


def test_a_record_from_a_newer_grpo_run_is_refused(tmp_path):
    Record(tmp_path / "run.db").close()
    with sqlite3.connect(tmp_path / "run.db") as conn:
        conn.execute("INSERT INTO migrations (name, applied) VALUES ('9999_future', 'x')")

    with pytest.raises(RuntimeError, match="newer grpo-run"):
        Record(tmp_path / "run.db")


def test_every_phase_is_documented_with_a_comment():
    source = inspect.getsource(Phase)
    for phase in Phase:
        line = next(line for line in source.splitlines() if f"{phase.name} = " in line)
        assert "#" in line, f"{phase.name} has no comment"


# --- the job and its phase --------------------------------------------------------------------

def test_a_new_job_starts_pending_with_its_spec(record):
    job = record.job()

    assert job["name"] == "my-grpo-lora"
    assert job["spec"] == SPEC
    assert job["phase"] is Phase.PENDING and job["phase"] == "Pending"
    assert is_utc_iso(job["created"]) and is_utc_iso(job["updated"])


def test_init_job_is_idempotent_for_the_same_name(record):
    record.init_job("my-grpo-lora", SPEC)
    assert record.job()["phase"] is Phase.PENDING
    assert len(record.transitions()) == 1


def test_one_record_holds_one_job(record):
    with pytest.raises(ValueError, match="belongs to job 'my-grpo-lora'"):
        record.init_job("another-job", SPEC)


def test_no_job_yet_is_none(tmp_path):
    with Record(tmp_path / "run.db") as rec:
        assert rec.job() is None


def test_a_run_walks_through_its_phases_to_success(record):
    for phase in (Phase.BASELINE_EVAL, Phase.TRAINING, Phase.FINAL_EVAL, Phase.SUCCEEDED):
        record.set_phase(phase, f"now {phase.value}")

    assert record.job()["phase"] is Phase.SUCCEEDED
    assert record.job()["message"] == "now Succeeded"
    assert [(t["from"], t["to"]) for t in record.transitions()] == [
        (None, Phase.PENDING), (Phase.PENDING, Phase.BASELINE_EVAL),
        (Phase.BASELINE_EVAL, Phase.TRAINING), (Phase.TRAINING, Phase.FINAL_EVAL),
        (Phase.FINAL_EVAL, Phase.SUCCEEDED)]


@pytest.mark.parametrize("stopped", [Phase.PREEMPTED, Phase.FAILED, Phase.BUDGET_EXCEEDED])
@pytest.mark.parametrize("resumed", [Phase.BASELINE_EVAL, Phase.TRAINING, Phase.FINAL_EVAL])
def test_a_stopped_run_resumes_into_the_phase_it_was_in(record, stopped, resumed):
    record.set_phase(Phase.BASELINE_EVAL)
    record.set_phase(stopped, "node went away")
    record.set_phase(resumed, "resumed")
    assert record.job()["phase"] is resumed


def test_a_hard_kill_leaves_the_phase_which_a_resume_re_enters(record):
    record.set_phase(Phase.BASELINE_EVAL)
    record.set_phase(Phase.TRAINING)
    record.set_phase(Phase.TRAINING, "resumed at step 50")  # staying put is always allowed
    assert record.job()["message"] == "resumed at step 50"


@pytest.mark.parametrize("phase", [p for p in Phase if p is not Phase.SUCCEEDED])
def test_succeeded_is_terminal(record, phase):
    for step in (Phase.BASELINE_EVAL, Phase.TRAINING, Phase.FINAL_EVAL, Phase.SUCCEEDED):
        record.set_phase(step)
    with pytest.raises(InvalidTransition, match="Succeeded -> "):
        record.set_phase(phase)
    record.set_phase(Phase.SUCCEEDED)  # except to itself


def test_a_refused_transition_changes_nothing(record):
    before = (record.job(), record.transitions())
    with pytest.raises(InvalidTransition, match="Pending -> FinalEval is not allowed"):
        record.set_phase(Phase.FINAL_EVAL)
    assert (record.job(), record.transitions()) == before


def test_phases_can_be_given_as_their_names(record):
    record.set_phase("BaselineEval")
    assert record.job()["phase"] is Phase.BASELINE_EVAL


def test_every_phase_has_a_row_in_the_transition_table():
    assert set(ALLOWED_TRANSITIONS) == set(Phase)


def test_set_phase_before_init_job_is_an_error(tmp_path):
    with Record(tmp_path / "run.db") as rec, pytest.raises(RuntimeError, match="init_job"):
        rec.set_phase(Phase.TRAINING)


# --- attempts ---------------------------------------------------------------------------------

def test_attempts_record_where_and_how_each_ended(record):
    first = record.start_attempt("node-a")
    record.end_attempt(first, "Preempted", "spot notice")
    second = record.start_attempt("node-b")

    attempts = record.attempts()
    assert [(a["id"], a["node"], a["reason"], a["message"]) for a in attempts] == [
        (first, "node-a", "Preempted", "spot notice"), (second, "node-b", None, "")]
    assert is_utc_iso(attempts[0]["started"]) and is_utc_iso(attempts[0]["ended"])
    assert attempts[1]["ended"] is None


def test_an_attempt_keeps_the_step_it_started_from_and_the_last_one_it_completed(record):
    first = record.start_attempt("node-a", from_step=0)
    for step in range(1, 8):
        record.log_step(step, {"loss": 1.0})
    # killed without a word after step 7; the next node closes it before starting its own
    record.end_attempt(first, "Crashed", "the node stopped without a word")
    second = record.start_attempt("node-b", from_step=4)          # steps 5, 6 and 7 are redone
    for step in range(5, 9):
        record.log_step(step, {"loss": 0.5})
    record.end_attempt(second, "Preempted")
    third = record.start_attempt("node-c", from_step=8)
    record.end_attempt(third, "Preempted")                          # ended before any step

    assert [(a["from_step"], a["to_step"]) for a in record.attempts()] == [(0, 7), (4, 8), (8, 8)]


def test_an_attempt_ends_once(record):
    attempt = record.start_attempt("node-a")
    record.end_attempt(attempt, "Preempted")
    record.end_attempt(attempt, "Preempted")  # the same again is a no-op
    with pytest.raises(ValueError, match="already ended as Preempted"):
        record.end_attempt(attempt, "Succeeded")
    with pytest.raises(ValueError, match="no attempt 999"):
        record.end_attempt(999, "Crashed")


# --- metrics, evaluations, checkpoints, values ------------------------------------------------

def test_steps_are_upserted_and_listed_in_order(record):
    record.log_step(2, {"loss": 0.9, "reward": 0.1})
    record.log_step(1, {"loss": 1.0, "reward": 0.0})
    record.log_step(2, {"loss": 0.7, "reward": 0.3})  # redone after a resume

    assert record.steps() == [{"step": 1, "loss": 1.0, "reward": 0.0},
                              {"step": 2, "loss": 0.7, "reward": 0.3}]


def test_the_newest_steps_alone_come_back_in_order(record):
    for step in (3, 1, 4, 2, 5):
        record.log_step(step, {"loss": float(step)})
    assert [s["step"] for s in record.steps(last=2)] == [4, 5]
    assert [s["step"] for s in record.steps(last=10)] == [1, 2, 3, 4, 5]


def test_scalar_tensors_in_metrics_are_stored_as_numbers(record):
    numpy = pytest.importorskip("numpy")
    record.log_step(1, {"loss": numpy.float32(0.5), "rewards": numpy.array([1, 0])})
    assert record.steps() == [{"step": 1, "loss": 0.5, "rewards": [1, 0]}]


def test_the_baseline_counts_only_the_runs_actually_computed(record):
    record.record_eval("baseline", {"meanReward": 0.25, "tasks": 8}, computed=True,
                       fingerprint="fp-1")
    record.record_eval("baseline", {"meanReward": 0.25, "tasks": 8}, computed=False,
                       fingerprint="fp-1")  # resumed: reused from the cache

    assert record.eval("baseline") == {"meanReward": 0.25, "tasks": 8, "runs": 1,
                                       "fingerprint": "fp-1", "source": "cache"}

    record.record_eval("baseline", {"meanReward": 0.3, "tasks": 8}, computed=True,
                       fingerprint="fp-2")  # the fingerprint changed: computed again
    assert record.eval("baseline")["runs"] == 2
    assert record.eval("baseline")["source"] == "computed"
    assert record.eval("final") is None


def test_eval_kinds_are_baseline_or_final(record):
    with pytest.raises(ValueError, match="baseline"):
        record.record_eval("midway", {}, computed=True, fingerprint="x")


def test_checkpoints_become_durable_and_stay_so(record):
    record.add_checkpoint(25, durable=False)
    record.add_checkpoint(50, durable=False)
    record.add_checkpoint(25, durable=True)
    record.add_checkpoint(25, durable=False)  # late news never undoes durability

    assert [(c["step"], c["durable"]) for c in record.checkpoints()] == [(25, True), (50, False)]


def test_values_round_trip_as_json(record):
    record.set_value("costUSD", 1.25)
    record.set_value("diagnostics", {"rewardSignal": "ok", "identicalGroups": [3, 7]})

    assert record.value("costUSD") == 1.25
    assert record.value("diagnostics") == {"rewardSignal": "ok", "identicalGroups": [3, 7]}
    assert record.value("missing", default="none") == "none"


@pytest.mark.parametrize("spec", [
    {"storage": "s3://bucket/p", "aws_secret_access_key": "abc"},
    {"env": {"HF_TOKEN": "hf_abc"}},
    {"storage": "https://user:hunter2@example.com/x"},
    {"env": {"AZURE_STORAGE_CONNECTION_STRING": "DefaultEndpointsProtocol=https;AccountName=a;AccountKey=abc=="}},
    {"storage": "https://acct.blob.core.windows.net/c/p?sv=2024-01-01&sp=r&sig=c2lnbmF0dXJlMTIzNDU%3D"},
    {"note": "BlobEndpoint=https://a.blob.core.windows.net/;SharedAccessSignature=sv=2024&sig=abcdefgh1234"},
])
def test_credentials_are_never_stored(tmp_path, spec):
    with Record(tmp_path / "run.db") as rec:
        with pytest.raises(ValueError, match="credential"):
            rec.init_job("job", spec)
        with pytest.raises(ValueError, match="credential"):
            rec.set_value("settings", spec)
        assert rec.job() is None


# --- files ------------------------------------------------------------------------------------

def test_a_snapshot_is_a_whole_database_with_everything_in_it(record, tmp_path):
    record.set_phase(Phase.BASELINE_EVAL)
    record.record_eval("baseline", {"meanReward": 0.5}, computed=True, fingerprint="fp")
    record.log_step(1, {"loss": 1.0})

    record.snapshot(tmp_path / "snapshots" / "record.db")

    assert sorted(p.name for p in (tmp_path / "snapshots").iterdir()) == ["record.db"]
    with Record(tmp_path / "snapshots" / "record.db") as copy:
        assert copy.job()["phase"] is Phase.BASELINE_EVAL
        assert copy.eval("baseline")["runs"] == 1
        assert copy.steps() == [{"step": 1, "loss": 1.0}]


def test_a_snapshot_taken_while_another_thread_writes_is_consistent(record, tmp_path):
    def write_steps():
        for step in range(200):
            record.log_step(step, {"loss": 1.0 / (step + 1)})

    writer = threading.Thread(target=write_steps)
    writer.start()
    record.snapshot(tmp_path / "snap.db")
    writer.join()

    with Record(tmp_path / "snap.db") as copy:
        steps = [s["step"] for s in copy.steps()]
    assert steps == list(range(len(steps)))  # a prefix of the writes, never a torn one
    assert len(record.steps()) == 200


def test_state_imports_neither_runner_nor_trainer():
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, grpo_run.state.record; "
            "print(sorted(m for m in sys.modules if m.split('.')[:2] in (['grpo_run', 'runner'], ['grpo_run', 'trainer'])))")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_an_attempt_whose_last_steps_never_reached_storage_got_at_least_as_far_as_the_next_ones_checkpoint(record):
    first = record.start_attempt("node-a", from_step=0)
    for step in range(1, 4):                  # the copy in storage has steps 1-3; checkpoint 4 is durable
        record.log_step(step, {"loss": 1.0})
    record.end_attempt(first, "Crashed", "the node stopped without a word")
    record.start_attempt("node-b", from_step=4)
    assert [(a["from_step"], a["to_step"]) for a in record.attempts()] == [(0, 4), (4, None)]


def _open_at_once(path, barrier, results):
    barrier.wait()
    try:
        with Record(path) as record:
            results.put(record.applied_migrations() == [name for name, _ in MIGRATIONS])
    except Exception as e:                 # what the supervisor would have died of
        results.put(f"{type(e).__name__}: {e}")


def test_processes_opening_a_new_record_at_once_all_open_it():
    """The supervisor creating its record while `grpo-run get` (or a test) opens it: both switch it
    to WAL, which SQLite can refuse one of them at once ("database is locked", no busy wait; seen
    in a clean-clone run as a node that died starting). 3 processes on 20 new records: before
    the fix about a third of such trials had one fail."""
    import multiprocessing
    import tempfile
    from pathlib import Path

    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory() as folder:
        for trial in range(20):
            barrier, results = ctx.Barrier(3), ctx.Queue()
            procs = [ctx.Process(target=_open_at_once, args=(Path(folder) / str(trial) / "state.db", barrier, results))
                     for _ in range(3)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(60)
            assert [results.get(timeout=5) for _ in procs] == [True] * 3, f"trial {trial}"


# --- a record fetched from storage ------------------------------------------------------------


def stored_copy(tmp_path) -> Path:
    """A whole record as a node uploads it (a snapshot), with steps on many pages."""
    with Record(tmp_path / "node.db") as rec:
        rec.init_job("job", SPEC)
        for step in range(1, 300):
            rec.log_step(step, {"loss": 0.5, "note": "x" * 200})
        rec.snapshot(tmp_path / "stored.db")
    return tmp_path / "stored.db"


def reads_whole(path: Path) -> bool:
    try:
        with sqlite3.connect(path) as conn:
            for (table,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall():
                conn.execute(f'SELECT * FROM "{table}"').fetchall()
        return True
    except sqlite3.DatabaseError:
        return False


def test_a_fetched_record_sqlite_cannot_read_whole_is_refused_naming_it_and_the_fix(tmp_path):
    stored = stored_copy(tmp_path)
    check_fetched(stored, "s3://b/job/state.db")                      # a whole one passes
    pages = stored.stat().st_size // 4096
    refused = []
    for page in range(2, pages + 1):                                  # each page's cell pointers zeroed in turn
        damaged = tmp_path / f"damaged-{page}.db"
        data = bytearray(stored.read_bytes())
        data[(page - 1) * 4096 + 8:(page - 1) * 4096 + 16] = bytes(8)
        damaged.write_bytes(bytes(data))
        try:
            check_fetched(damaged, "s3://b/job/state.db")
        except RecordDamaged as e:
            refused.append(str(e))
            continue
        assert reads_whole(damaged), f"page {page}: passed the check, yet SQLite cannot read it whole"
    assert any("SQLite's quick_check: On tree page" in message for message in refused)
    assert all(message.startswith("the record in storage (s3://b/job/state.db) ") and
               "Put a good copy back as s3://b/job/state.db" in message for message in refused)


def test_a_fetched_record_that_is_no_database_or_holds_a_trigger_is_refused(tmp_path):
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not a database at all" * 100)
    with pytest.raises(RecordDamaged, match=r"cannot be read as a record \(SQLite: file is not a database\)"):
        check_fetched(junk, "gs://b/job/state.db")
    stored = stored_copy(tmp_path)
    with sqlite3.connect(stored) as conn:      # planted: it would run on the node's next write
        conn.execute("CREATE TRIGGER wipe AFTER INSERT ON steps BEGIN DELETE FROM steps; END")
    with pytest.raises(RecordDamaged, match="holds what grpo-run never writes \\(trigger wipe\\)"):
        check_fetched(stored, "gs://b/job/state.db")


def test_the_record_trusts_no_function_its_schema_names(record):
    assert record._conn.execute("PRAGMA trusted_schema").fetchone() == (0,)
