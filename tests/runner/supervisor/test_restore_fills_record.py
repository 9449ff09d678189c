"""A checkpoint carries the metrics so far (SPEC §4): a node lost within DURABLE_SYNC_S of a
checkpoint becoming durable leaves storage's record without that checkpoint's last steps, and the
resume, which starts after them, fills them in from the checkpoint."""

import json

from grpo_run.checkpoint.manifest import checkpoint_dir, finalize_checkpoint
from grpo_run.checkpoint.storage.store import Store
from grpo_run.checkpoint.sync import CHECKPOINTS, Uploader, run_prefix
from grpo_run.runner.books.books import Books
from grpo_run.runner.supervisor.durability import Durability
from grpo_run.trainer.protocol import STEP_METRICS, STEP_SAMPLES, TRAINER_STATE

MANIFEST = {"kind": "TrainingJob", "metadata": {"name": "job"}}


def metrics(step: int) -> dict:
    return {"loss": 1.0 / step, "rewardMean": float(step), "identicalGroups": 0.0}


def group(step: int, text: str) -> dict:
    return {"item": 0, "prompt": f"{step}+1=", "solved": False, "completions": [
        {"text": text, "rewards": {"correct": 0.0}, "reward": 0.0, "advantage": 0.0, "length": 2, "truncated": False}]}


def books(store: Store, work) -> Books:
    return Books(store, work, name="job", manifest=MANIFEST, usd_per_hour=36.0, max_cost_usd=None)


def durability(store: Store, work, b: Books) -> Durability:
    return Durability(store, work, b, job="job", keep=3, max_steps=10, on_lease_lost=lambda lost: None,
                      on_fatal=lambda error: None)


def test_steps_a_lost_node_left_out_of_storage_are_filled_in_from_the_checkpoint_and_never_twice(tmp_path):
    store = Store(str(tmp_path / "store"))
    a = books(store, tmp_path / "node-a")
    a.start_attempt("node-a", from_step=0)
    for step in (1, 2):
        a.log_step(step, metrics(step))
    a.add_samples("step", 2, [group(2, "as the record has it")])
    a.sync(wait=True)                       # storage's record: steps 1-2
    for step in (3, 4):
        a.log_step(step, metrics(step))     # within RECORD_SYNC_S: not uploaded
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "weights.bin").write_bytes(b"w" * 64)
    (staging / TRAINER_STATE).write_text(json.dumps({"step": 4}))   # the step it resumes after: its manifest's
    # the checkpoint's metrics as the trainer writes them; step 2's differ from the record's on
    # purpose: a step the record has is kept as the record has it
    steps = [{"step": s, **metrics(s)} for s in (1, 2, 3, 4)]
    steps[1]["loss"] = 99.0
    (staging / STEP_METRICS).write_text(json.dumps(steps))
    # and the samples of its steps: those of the steps filled in are filled in too
    (staging / STEP_SAMPLES).write_text(json.dumps({str(s): [group(s, "from the checkpoint")] for s in (2, 3, 4)}))
    final = checkpoint_dir(tmp_path / "node-a" / "checkpoints", 4)
    manifest = finalize_checkpoint(staging, final, step=4, meta={"job": "job", "run": a.run_id})
    with Uploader(store, run_prefix(CHECKPOINTS, a.run_id)) as up:      # where this run's checkpoints lie
        up.submit(final, manifest)
        assert up.wait()
    a.close()                               # node A is lost: its record's steps 3-4 never reached storage

    b = books(store, tmp_path / "node-b")
    try:
        assert [s["step"] for s in b.record.steps()] == [1, 2]
        restore = durability(store, tmp_path / "node-b", b)
        assert restore.restore() == 4
        assert restore.restore() == 4       # a second attempt restores it again
        restore.close()
        got = b.record.steps()
        samples = b.record.samples("step", [1, 2, 3, 4])
    finally:
        b.close()
    assert [s["step"] for s in got] == [1, 2, 3, 4]
    assert got[1]["loss"] == 0.5 and "costUSD" in got[1]                # as the record had it
    assert {k: got[2][k] for k in metrics(3)} == metrics(3)
    assert {k: got[3][k] for k in metrics(4)} == metrics(4)
    assert [(s["step"], s["completions"][0]["text"]) for s in samples] == \
        [(2, "as the record has it"), (3, "from the checkpoint"), (4, "from the checkpoint")]
