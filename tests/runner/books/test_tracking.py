"""spec.tracking: MLflow (a local file store) and W&B (offline mode) continue one tracker run
across a restarted trainer, each step logged once; bad tracking fields are named."""

import json
from pathlib import Path

import pytest

from grpo_run.runner.spec.job import JobError, parse_job
from tests.runner.views.test_report import with_tracking
from tests.runner.jobs.test_resume import grpo_run, write_job

JOB = {"apiVersion": "grpo-run/v1", "kind": "TrainingJob", "metadata": {"name": "t"},
       "spec": {"model": "tiny:char", "environment": {"name": "arithmetic"}}}


def problems(tracking) -> list[str]:
    with pytest.raises(JobError) as e:
        parse_job({**JOB, "spec": {**JOB["spec"], "tracking": tracking}})
    return e.value.problems


def test_bad_tracking_fields_are_named_with_the_fix():
    assert problems({"tensorboard": ""}) == [
        "spec.tracking.tensorboard: must be true (event files in the job's storage) or a folder or URL (got '')"]
    assert problems({"wandb": {"project": "p", "mode": "sometimes"}}) == [
        "spec.tracking.wandb.mode: must be online, offline or disabled (got 'sometimes')"]
    assert problems({"mlflow": {}})[0].startswith("spec.tracking.mlflow.trackingURI: required")
    assert problems({"neptune": True})[0].startswith("spec.tracking.neptune: unknown field")
    job = parse_job({**JOB, "spec": {**JOB["spec"], "tracking": {"tensorboard": True}}})
    assert job.to_dict()["spec"]["tracking"] == {"tensorboard": True}
    job = parse_job({**JOB, "spec": {**JOB["spec"], "tracking": {"tensorboard": "tb"}}}, base=Path("/srv/jobs"))
    assert job.to_dict()["spec"]["tracking"] == {"tensorboard": "/srv/jobs/tb"}     # beside the job file


def wandb_records(path: Path):
    """The protobuf records of a .wandb file: a 7-byte header (":W&B", magic, version), then
    LevelDB's log format (32 KiB blocks; records of 7-byte header + payload, split FIRST/MIDDLE/LAST
    across blocks). W&B 0.31 ships no Python reader for it."""
    data, pos, block, parts = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:                # a block's tail too short for a header: padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        payload, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            yield payload
        elif kind in (2, 3):
            parts = (b"" if kind == 2 else parts) + payload
        elif kind == 4:
            yield parts + payload


def wandb_history(folder: Path) -> list[dict]:
    """The history rows W&B wrote offline, in the order written, across every attempt's run folder."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for path in sorted(folder.glob("wandb/offline-run-*/run-*.wandb")):
        for data in wandb_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def test_mlflow_and_wandb_continue_one_run_across_a_restart_without_a_duplicate_step(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")   # MLflow 3 keeps its file store behind this
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    (tmp_path / "wandb-dir").mkdir()
    uri = f"file://{tmp_path / 'mlruns'}"
    job = with_tracking(write_job(tmp_path), {"mlflow": {"trackingURI": uri, "experiment": "grpo"},
                                              "wandb": {"project": "grpo", "mode": "offline"}})
    done = grpo_run(tmp_path / "node", "apply", "-f", str(job), fault="backward@5/trainer")
    assert "restart 1 of 3 (crashes)" in done.stderr and "tracker" not in done.stderr, done.stderr[-2000:]

    from mlflow.tracking import MlflowClient

    from grpo_run.state.record import Record

    with Record(tmp_path / "node" / "runs" / "resumable" / "state.db") as record:
        run_id, mlflow_run = record.value("runId"), record.value("tracking.mlflowRunId")
        steps = record.steps()
    client = MlflowClient(tracking_uri=uri)
    [run] = client.search_runs([client.get_experiment_by_name("grpo").experiment_id])
    assert run.info.run_id == mlflow_run and run.data.tags["grpo-run.runId"] == run_id
    history = client.get_metric_history(mlflow_run, "train/loss")
    assert [m.step for m in history] == list(range(1, 9))              # steps 5.. redone, logged once
    assert [m.value for m in history] == [s["loss"] for s in steps]
    assert [m.step for m in client.get_metric_history(mlflow_run, "eval/final/meanReward")] == [8]
    # what the model wrote: an artifact per step, the steps redone written over, not beside
    assert [a.path for a in client.list_artifacts(mlflow_run, "samples/step")] == \
        [f"samples/step/{step:07d}.md" for step in range(1, 9)]
    local = client.download_artifacts(mlflow_run, "samples/step/0000008.md", str(tmp_path / "artifacts"))
    assert "| completion | reward | by name | advantage |" in Path(local).read_text()

    rows = wandb_history(tmp_path / "wandb-dir")
    runs = sorted(p.name for p in (tmp_path / "wandb-dir" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(name.split("-", 3)[-1].startswith(run_id) for name in runs)  # one W&B run id
    trained = [r["step"] for r in rows if "train/loss" in r]
    assert trained == list(range(1, 9))
    tables = [r for r in rows if r.get("samples/step/_type") == "table-file"]
    assert [r["step"] for r in tables] == list(range(1, 9))                   # a Table a step, once
    assert {r["samples/step/nrows"] for r in tables} == {2 * 4}                 # a row per completion


def test_a_tracker_whose_package_is_missing_is_refused_before_anything_runs_naming_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("tensorboard", "wandb")
                        else real(name, *a))
    assert problems({"tensorboard": True, "wandb": {"project": "p"}}) == [
        "spec.tracking.tensorboard: needs the tensorboard package, which is not installed: pip install "
        "'grpo-run[tensorboard]' (or leave spec.tracking.tensorboard out)",
        "spec.tracking.wandb: needs the wandb package, which is not installed: pip install 'grpo-run[wandb]' "
        "(or leave spec.tracking.wandb out)"]
