"""The run's books in storage: what a node lost at the worst moment leaves for the next one."""

import json

import pytest

from grpo_run.checkpoint.storage.store import Store
from grpo_run.runner.books.books import Books
from grpo_run.runner.books.evals import BASELINE
from grpo_run.trainer.protocol import EvalSummary

RESULT = {"meanReward": 0.25, "rewards": {"correct": 0.25}, "tasks": 2, "solved": 0, "batches": 1, "reusedBatches": 0}
SUMMARY = EvalSummary(**RESULT)          # as the trainer reports it (Evaluated)


def books(store: Store, work) -> Books:
    return Books(store, work, name="job", manifest={"kind": "TrainingJob", "metadata": {"name": "job"}},
                 usd_per_hour=None, max_cost_usd=None)


def test_a_node_lost_between_its_baseline_and_the_cache_file_leaves_the_baseline_counted(tmp_path):
    store = Store(str(tmp_path / "store"))

    class NodeLost(Exception):
        pass

    put_bytes = store.put_bytes

    def dies_at_the_cache(key, data, *args, **kwargs):
        if key == BASELINE:
            raise NodeLost()
        return put_bytes(key, data, *args, **kwargs)

    a = books(store, tmp_path / "node-a")
    store.put_bytes = dies_at_the_cache
    with pytest.raises(NodeLost):
        a.record_eval("baseline", SUMMARY, "fp", no_signal=False)
    a.close()
    store.put_bytes = put_bytes

    b = books(store, tmp_path / "node-b")                      # a fresh node: the record from storage
    try:
        assert b.cached_baseline("fp", 8) == SUMMARY            # reused, not computed again
        assert b.record.eval("baseline")["runs"] == 1          # and the one computation still counted
    finally:
        b.close()


def answer(item: int, text: str) -> dict:
    """A held-out task's kept completion, as the trainer's Samples event carries it."""
    return {"item": item, "prompt": f"{item}+1=", "solved": False, "completions": [
        {"text": text, "rewards": {"score": 0.5}, "reward": 0.5, "advantage": None, "length": 3, "truncated": False}]}


def baseline_ran(store: Store, work, groups: list[dict]) -> list[dict]:
    """A node that computed the baseline (its samples reported before it) and whose record was
    then deleted (the job to be submitted again): the samples as `grpo-run samples` read them."""
    a = books(store, work)
    try:
        a.add_samples("baseline", 0, groups)
        a.record_eval("baseline", SUMMARY, "fp", no_signal=False)
        ran = a.record.samples("baseline", [0])
    finally:
        a.close()
    store.delete("state.db")
    return ran


def test_a_baseline_reused_from_storage_s_cache_brings_back_the_samples_it_kept(tmp_path):
    store = Store(str(tmp_path / "store"))
    ran = baseline_ran(store, tmp_path / "node-a", [answer(0, "2"), answer(1, "3")])
    assert len(ran) == 2
    b = books(store, tmp_path / "node-b")                      # a new record: only baseline.json to go on
    try:
        assert b.cached_baseline("fp", sample_tasks=8) == SUMMARY
        assert b.record.samples("baseline", b.record.sample_steps("baseline")) == ran
    finally:
        b.close()
    c = books(store, tmp_path / "node-c")                      # sampleEvalTasks now 1: the first task's
    try:
        assert c.cached_baseline("fp", sample_tasks=1) == SUMMARY
        assert c.record.samples("baseline", c.record.sample_steps("baseline")) == ran[:1]
    finally:
        c.close()


def test_a_cached_baseline_that_kept_fewer_tasks_than_now_asked_gives_those_and_says_so(tmp_path, caplog):
    store = Store(str(tmp_path / "store"))
    ran = baseline_ran(store, tmp_path / "node-a", [answer(0, "2")])      # it ran with sampleEvalTasks 1
    b = books(store, tmp_path / "node-b")
    try:
        with caplog.at_level("INFO", logger="grpo_run.runner.books.books"):
            assert b.cached_baseline("fp", sample_tasks=8) == SUMMARY      # reused, not run again
        assert b.record.samples("baseline", b.record.sample_steps("baseline")) == ran
        assert "kept the completions of 1 of the 2 held-out tasks sampleEvalTasks now keeps" in caplog.text
    finally:
        b.close()


LONG = {"item": 0, "prompt": "1+1=", "solved": False, "completions": [
    {"text": "2" * 5000, "rewards": {"correct": 0.0}, "reward": 0.0, "length": 5000, "truncated": False}]}


@pytest.mark.parametrize("samples", [None, "not a list", [{"item": 0}], [LONG]],
                         ids=["none", "garbled", "incomplete", "uncapped"])
def test_a_cached_baseline_without_readable_samples_is_reused_without_them(tmp_path, samples):
    """A cache written before baselines kept samples has none; one whose samples do not read is
    still a baseline (its scores), reused with none."""
    store = Store(str(tmp_path / "store"))
    store.put_bytes(BASELINE, json.dumps({**RESULT, "fingerprint": "fp",
                                          **({} if samples is None else {"samples": samples})}).encode())
    b = books(store, tmp_path / "node-b")
    try:
        assert b.cached_baseline("fp", sample_tasks=8) == SUMMARY
        assert b.record.sample_steps("baseline") == []
    finally:
        b.close()


def test_a_baseline_json_that_is_not_json_is_ignored_and_the_baseline_evaluated_again(tmp_path, caplog):
    store = Store(str(tmp_path / "store"))
    store.put_bytes(BASELINE, b"\xff{not json")
    b = books(store, tmp_path / "node-b")
    try:
        with caplog.at_level("WARNING"):
            assert b.cached_baseline("fp", sample_tasks=8) is None
        assert "storage's baseline.json is not JSON: ignored; the baseline is evaluated again" in caplog.text
    finally:
        b.close()


@pytest.mark.parametrize("change, where", [
    ({"meanReward": "high"}, "meanReward"), ({"meanReward": None}, "meanReward"), ({"tasks": -1}, "tasks"),
    ({"solved": 3}, "the document"), ({"rewards": {"correct": [1e308] * 3}}, "rewards"),
    ({"rewards": {"x" * 201: 0.5}}, "rewards"), ({"rewards": {f"r{i}": 0.0 for i in range(65)}}, "rewards"),
    ({"batches": {"nested": "object"}}, "batches")])
def test_a_cached_baseline_whose_scores_do_not_read_as_a_trainer_s_is_evaluated_again(tmp_path, caplog, change, where):
    """Whoever can write the job's storage prefix is not trusted: scores that are not what a
    trainer reports never reach the record, the status or the report (the fingerprint is no
    secret: it is in the record beside it)."""
    store = Store(str(tmp_path / "store"))
    store.put_bytes(BASELINE, json.dumps({**RESULT, **change, "fingerprint": "fp"}).encode())
    b = books(store, tmp_path / "node-b")
    try:
        with caplog.at_level("WARNING"):
            assert b.cached_baseline("fp", sample_tasks=8) is None
        assert b.record.eval("baseline") is None
        assert f"storage's baseline.json does not read as a baseline ({where}: " in caplog.text, caplog.text
    finally:
        b.close()


def test_a_baseline_in_a_record_restored_from_storage_reads_as_a_trainer_s_or_is_evaluated_again(tmp_path, caplog):
    """The record comes back from the same untrusted prefix as baseline.json: its baseline is
    held to the same model (trainer.protocol.EvalSummary) before the status and report show it."""
    store = Store(str(tmp_path / "store"))
    a = books(store, tmp_path / "node-a")
    a.record.record_eval("baseline", {**RESULT, "solved": 5}, computed=True, fingerprint="fp")   # 5 of 2 tasks
    a.sync(wait=True)
    a.close()
    b = books(store, tmp_path / "node-b")
    try:
        with caplog.at_level("WARNING"):
            assert b.cached_baseline("fp", sample_tasks=8) is None
        assert "the record's baseline does not read as a baseline (the document: " in caplog.text, caplog.text
    finally:
        b.close()


def test_episode_digests_are_kept_until_a_durable_checkpoint_holds_their_step_and_planted_ones_are_dropped(tmp_path):
    """What a resume's trainer is handed to check its replayed steps against (runner.books.replays)."""
    from grpo_run.state import values

    store = Store(str(tmp_path / "store"))
    a = books(store, tmp_path / "node-a")
    try:
        digest = ":".join(["0123456789abcdef"] * 3)
        for step in (1, 2, 3):
            a.log_step(step, {"rewardMean": 0.5, "identicalGroups": 0.0}, [digest] * 4)
        assert a.episode_digests() == {1: [digest] * 4, 2: [digest] * 4, 3: [digest] * 4}
        a.note_durable([2])
        assert a.episode_digests() == {3: [digest] * 4}
        saved = values.EPISODE_DIGESTS.get(a.record)
        values.EPISODE_DIGESTS.set(a.record, {**saved, "4": ["not a digest"], "x": [digest], "5": "nope"})
        assert a.episode_digests() == {3: [digest] * 4}
    finally:
        a.close()


def test_a_node_lost_without_a_word_is_charged_up_to_its_newest_step_and_each_upload_carries_the_spend(tmp_path):
    from datetime import datetime, timedelta

    store = Store(str(tmp_path / "store"))
    a = Books(store, tmp_path / "node-a", name="job", manifest={"kind": "TrainingJob", "metadata": {"name": "job"}},
              usd_per_hour=36.0, max_cost_usd=None)
    attempt = a.start_attempt("node-a", from_step=0)
    a.ledger._t0 -= 20                            # 20 s into the attempt, the record is uploaded
    a.sync(wait=True)
    assert a.record.value("ledger")[str(attempt)]["seconds"] >= 20
    # the node then trains on for 30 s more and dies: its last upload had the step 50 s in
    started = datetime.fromisoformat(a.record.attempts()[0]["started"])
    a.record.db["steps"].insert({"step": 1, "metrics": "{}", "logged": (started + timedelta(seconds=50)).isoformat()})
    a.sync(wait=True)
    a.close()

    b = Books(store, tmp_path / "node-b", name="job", manifest={"kind": "TrainingJob", "metadata": {"name": "job"}},
              usd_per_hour=36.0, max_cost_usd=None)
    b.close_dangling_attempts()
    entry = b.record.value("ledger")[str(attempt)]
    assert entry["seconds"] == 50.0 and entry["usd"] == 0.5                 # 50 s at $36/h
    assert b.record.attempts()[0]["reason"] == "Crashed"
    b.close()


def test_a_notice_between_a_crash_and_its_restart_ends_the_job_preempted_and_leaves_the_crash_recorded(tmp_path):
    from grpo_run.state.phases import Phase

    store = Store(str(tmp_path / "store"))
    a = books(store, tmp_path / "node-a")
    try:
        a.start_attempt("node-a", from_step=0)
        a.end_attempt("Crashed", "trainer killed by SIGKILL")          # the restart's backoff begins
        a.finish(Phase.PREEMPTED, "Preempted", "notice from aws between attempts", notice="aws")
        assert a.record.job()["phase"] == Phase.PREEMPTED
        assert [t["reason"] for t in a.record.attempts()] == ["Crashed"]
    finally:
        a.close()


def test_nothing_outside_the_books_writes_the_record():
    """Books is the record's one writer: the supervisor, the CLI and the views go through it or
    only read (opening a record to read it is fine)."""
    import ast
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    writes = {"set_value", "set_phase", "set_spec", "add_checkpoint", "log_step", "record_eval", "start_attempt",
              "end_attempt", "init_job", "transaction"}
    found = [f"{path.relative_to(repo)}:{node.lineno} {node.func.attr}"
             for path in sorted((repo / "runner").rglob("*.py")) if "books" not in path.parts
             for node in ast.walk(ast.parse(path.read_text(), str(path)))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in writes
             and "record" in ast.unparse(node.func.value).lower()]
    assert not found, "\n".join(found)


def test_an_attempts_first_step_reaches_storage_at_once_so_a_node_lost_after_it_is_not_counted_as_poison(tmp_path):
    """A job is failed as one that takes its nodes down only after attempts that were lost before
    completing a step (runner.supervisor LOST_WITHOUT_PROGRESS): a node lost right after its
    first step must not look like one, although the record's regular upload (RECORD_SYNC_S) had
    not come yet."""
    store = Store(str(tmp_path / "store"))
    for n in range(2):                                       # two nodes lost before their first step
        node = books(store, tmp_path / f"node-{n}")
        node.close_dangling_attempts()
        node.start_attempt(f"node-{n}", from_step=0)
        node.close()                                         # SIGKILL: no word, nothing more uploaded
    third = books(store, tmp_path / "node-2")
    third.close_dangling_attempts()
    assert third.lost_without_progress() == (2, 0)
    third.start_attempt("node-2", from_step=0)
    third.log_step(1, {"loss": 0.0})                          # then lost right after its first step
    third.close()
    fourth = books(store, tmp_path / "node-3")
    fourth.close_dangling_attempts()
    assert [a["to_step"] for a in fourth.record.attempts()] == [0, 0, 1]
    assert fourth.lost_without_progress() == (0, 0)          # progress: the count starts over
    fourth.close()


def test_a_planted_huge_baseline_json_is_not_read_and_the_baseline_evaluated_again(tmp_path, caplog):
    from grpo_run.runner.books.evals import MAX_BASELINE_BYTES

    store = Store(str(tmp_path / "store"))
    store.put_bytes(BASELINE, b"{")
    with open(store._path(BASELINE), "r+b") as f:
        f.truncate(MAX_BASELINE_BYTES * 4)                     # sparse: memory only to whoever reads it whole
    b = books(store, tmp_path / "node-b")
    try:
        with caplog.at_level("WARNING"):
            assert b.cached_baseline("fp", sample_tasks=8) is None
        assert f"storage's baseline.json is larger than {MAX_BASELINE_BYTES:,} bytes: not read" in caplog.text
    finally:
        b.close()
