"""Runs of the same name never share checkpoints: a job submitted again after its record was
deleted counts, prunes, restores and exports only its own run's, and never deletes the earlier
run's. A checkpoint is trained from only when it names this run, its step is within maxSteps and
its weights were not sealed non-finite."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from grpo_run.checkpoint.manifest import CheckpointInvalid, checkpoint_dir, finalize_checkpoint, staging_dir
from grpo_run.checkpoint.storage.store import Store
from grpo_run.checkpoint.sync import CHECKPOINTS, FINAL, Uploader, remote_discover
from grpo_run.runner.books.books import Books
from grpo_run.runner.supervisor.durability import Durability

OLD = "0ld0ld0ld0ld0ld0ld0ld0ld0ld0ld00"      # the earlier run's id
MAX_STEPS = 200


def make_checkpoint(root: Path, step: int, **meta) -> Path:
    staging = staging_dir(root, step)
    (staging / "adapter").mkdir(parents=True)
    (staging / "adapter" / "adapter_model.safetensors").write_bytes(f"weights at step {step} {meta}".encode() * 50)
    (staging / "adapter" / "adapter_config.json").write_text('{"r": 8}')
    (staging / "trainer_state.json").write_text(json.dumps({"step": step}))
    final = checkpoint_dir(root, step)
    finalize_checkpoint(staging, final, step=step, meta=meta)
    return final


def upload(store: Store, prefix: str, folder: Path) -> None:
    """Put a checkpoint in storage under `prefix` as an uploader does (keeping everything)."""
    with Uploader(store, prefix, keep=100) as uploader:
        uploader.submit(folder)
        assert uploader.wait(timeout=30)


def everything(store: Store, prefix: str) -> dict[str, bytes]:
    return {key: store.get_bytes(key) for key in store.list(prefix)}


@pytest.fixture
def store(tmp_path) -> Store:
    return Store(str(tmp_path / "store" / "job"))


@pytest.fixture
def durability(tmp_path, store):
    """This run's Durability on a fresh node (a new record: a new run id), keep 3."""
    made = []

    def make(node: str = "node-b", books: Books | None = None) -> Durability:
        books = books or Books(store, tmp_path / node, name="job", manifest={"kind": "TrainingJob"},
                               usd_per_hour=None, max_cost_usd=None)
        d = Durability(store, tmp_path / node, books, job="job", keep=3, max_steps=MAX_STEPS,
                       on_lease_lost=lambda e: None, on_fatal=lambda e: None)
        made.append(d)
        return d
    yield make
    for d in made:
        d.close()
        d.books.close()


def earlier_run(tmp_path: Path, store: Store) -> dict[str, bytes]:
    """What an earlier run of the same name left: checkpoints 100, 110, 120 and its final weights,
    under its own prefixes and (as before run prefixes) directly under checkpoints/ and final/."""
    for step in (100, 110, 120):
        ckpt = make_checkpoint(tmp_path / "old", step, run=OLD, finite=True)
        upload(store, f"{CHECKPOINTS}/{OLD}", ckpt)
        upload(store, CHECKPOINTS, ckpt)
    final = make_checkpoint(tmp_path / "old-final", 200, run=OLD, final=True, finite=True)
    upload(store, f"{FINAL}/{OLD}", final)
    upload(store, FINAL, final)
    return {**everything(store, CHECKPOINTS), **everything(store, FINAL)}


@pytest.mark.trust
def test_a_run_submitted_again_keeps_counts_and_restores_only_its_own_checkpoints(tmp_path, store, durability,
                                                                               figures):
    left = earlier_run(tmp_path, store)
    d = durability()
    assert d.restore() == 0                                # nothing of this run: from the beginning

    ours = tmp_path / "node-b" / "checkpoints"
    for step in (5, 10, 15, 20):
        d.sealed(step, make_checkpoint(ours, step, run=d.books.run_id, finite=True))
        assert d.uploads.wait(timeout=30)                  # the step just sealed is durable
        assert set(d.uploads.durable_steps()) <= {5, 10, 15, 20}
    assert d.uploads.durable_steps() == [20, 15, 10]        # keep 3 of this run's, not of all
    assert d.durable == 20 and sorted(r["step"] for r in d.books.record.checkpoints() if r["durable"]) == [5, 10, 15, 20]
    assert {k: v for k, v in {**everything(store, CHECKPOINTS), **everything(store, FINAL)}.items()
            if k in left} == left                          # the earlier run's files, every byte
    assert remote_discover(store, f"{CHECKPOINTS}/{d.books.run_id}") == [20, 15, 10]

    # another node resumes this run: its checkpoint, not the earlier run's newer ones
    again = durability("node-c", books=Books(store, tmp_path / "node-c", name="job", manifest={"kind": "TrainingJob"},
                                             usd_per_hour=None, max_cost_usd=None))
    assert again.books.run_id == d.books.run_id
    assert again.restore() == 20
    figures.add("trust", actor='ordinary failure', tried='a job submitted again under a name whose earlier run left checkpoints',
                protection='checkpoints/<runId>/: each run lists, prunes and restores its own', outcome="keep 3 of its own; the earlier run's files intact", held=True)


@pytest.mark.trust
def test_export_takes_this_runs_weights_never_an_earlier_runs_final(tmp_path, store, durability, figures):
    from grpo_run.runner.jobs.export import export_weights

    earlier_run(tmp_path, store)
    d = durability()
    d.restore()
    d.sealed(5, make_checkpoint(tmp_path / "node-b" / "checkpoints", 5, run=d.books.run_id, finite=True))
    assert d.uploads.wait(timeout=30)
    d.books.sync(wait=True)                                 # the record in storage names this run

    said = export_weights(store.url, tmp_path / "out")
    assert said == "the checkpoint at step 5 (the job has not finished)"
    assert b"weights at step 5" in (tmp_path / "out" / "adapter_model.safetensors").read_bytes()
    figures.add("trust", actor='ordinary failure', tried='export a job whose earlier run of the same name finished',
                protection="final/<runId>/ of the record's run", outcome="this run's checkpoint, never the earlier final", held=True)


@pytest.mark.parametrize("fields, step, says", [
    ({"finite": True}, 20, "carries no run id"),
    ({"run": OLD, "finite": True}, 20, "written by another run of job job"),
    ({"run": "THIS", "finite": True}, MAX_STEPS + 1, f"past spec.parameters.maxSteps ({MAX_STEPS})"),
    ({"run": "THIS", "finite": False}, 20, "weights are not finite numbers"),
], ids=["no-run-id", "another-run", "past-maxSteps", "not-finite"])
@pytest.mark.trust
def test_a_checkpoint_not_of_this_run_or_out_of_bounds_is_never_trained_from(tmp_path, store, durability, caplog,
                                                                               fields, step, says, figures):
    """In storage under the run's own prefix (a bucket writer put it there) it is skipped; on the
    node it is set aside (renamed, not deleted); the run continues from the newest good one."""
    d = durability()
    run = d.books.run_id
    fields = {k: run if v == "THIS" else v for k, v in fields.items()}
    upload(store, f"{CHECKPOINTS}/{run}", make_checkpoint(tmp_path / "sealed", 10, run=run, finite=True))
    upload(store, f"{CHECKPOINTS}/{run}", make_checkpoint(tmp_path / "planted", step, **fields))

    assert d.restore() == 10                                   # from storage: the bad one skipped
    assert says in caplog.text

    local = tmp_path / "node-b" / "checkpoints"
    make_checkpoint(local, step, **fields)                     # the same, sealed on the node
    assert d.restore() == 10
    assert not checkpoint_dir(local, step).exists()
    assert [p.name.startswith(".set-aside-") for p in local.iterdir() if f"{step:08d}" in p.name] == [True]
    figures.add("trust", actor="bucket writer", tried=f"plant a checkpoint: {says}",
                protection="a checkpoint must name this run, be finite and be at most maxSteps",
                outcome="skipped in storage, set aside on the node; resumed from the good one", held=True)


def test_a_checkpoint_reported_after_the_trainer_pruned_it_is_skipped_and_the_next_one_uploads(
        tmp_path, durability, caplog):
    # A busy node reads the trainer's events late: by then the writer (keeping its newest few)
    # may have pruned the checkpoint reported. Not an error, and never a traceback: a newer one follows.
    d = durability()
    assert d.restore() == 0
    ours = tmp_path / "node-b" / "checkpoints"
    pruned = make_checkpoint(ours, 4, run=d.books.run_id, finite=True)
    shutil.rmtree(pruned)
    with caplog.at_level(logging.INFO):
        d.sealed(4, pruned)
    assert "pruned locally" in caplog.text and "Traceback" not in caplog.text
    d.sealed(8, make_checkpoint(ours, 8, run=d.books.run_id, finite=True))
    assert d.uploads.wait(timeout=30) and d.uploads.durable_steps() == [8]

    damaged = make_checkpoint(ours, 12, run=d.books.run_id, finite=True)
    (damaged / "manifest.json").unlink()
    with pytest.raises(CheckpointInvalid):                 # there but broken: still an error
        d.sealed(12, damaged)
