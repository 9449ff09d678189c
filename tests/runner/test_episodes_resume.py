"""A job with episodes, killed in the middle of a step's episodes and resumed on a fresh node from
storage alone, ends with the adapter an uninterrupted run ends with, byte for byte: the step's
episodes are played again from reset with the same seeds, and draw the same tokens."""

import json
import shutil
import signal

import pytest
import yaml

from tests.runner.test_resume import REPO, grpo_run

EXAMPLE = REPO / "examples" / "guess-number"
STEPS = 6


def write_job(folder, storage=None):
    for name in ("env.py", "tasks.jsonl", "eval.jsonl"):
        shutil.copy(EXAMPLE / name, folder / name)
    job = yaml.safe_load((EXAMPLE / "job.yaml").read_text())
    job["metadata"]["name"] = "talking"
    job["spec"]["parameters"].update(numGenerations=4, promptsPerStep=2, maxSteps=STEPS, saveSteps=2,
                                     evalBatchSize=4)
    if storage:
        job["spec"]["storage"] = storage
    (folder / "job.yaml").write_text(yaml.safe_dump(job))
    return folder / "job.yaml"


def exported(home, storage, out):
    grpo_run(home, "export", "talking", *(["--storage", storage] if storage else []), "--out", str(out))
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


@pytest.mark.fault
@pytest.mark.parametrize("fault", ["sample@3", "backward@2"])
def test_a_job_with_episodes_killed_mid_step_and_resumed_elsewhere_ends_byte_identical(tmp_path, fault):
    reference = tmp_path / "reference"
    reference.mkdir()
    grpo_run(reference / "home", "apply", "-f", str(write_job(reference)))
    uninterrupted = exported(reference / "home", None, reference / "export")

    killed = tmp_path / "killed"
    killed.mkdir()
    storage = str(tmp_path / "storage")
    run = grpo_run(killed / "node-a", "apply", "-f", str(write_job(killed, storage)), fault=fault, check=False)
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    for name in ("job.yaml", "env.py", "tasks.jsonl", "eval.jsonl"):
        (killed / name).unlink()               # a fresh node: nothing but what storage holds
    grpo_run(killed / "node-b", "resume", "talking", "--storage", storage)
    assert exported(killed / "node-c", storage, killed / "export") == uninterrupted

    status = json.loads(grpo_run(killed / "node-c", "get", "tj", "talking", "--storage", storage,
                                 "-o", "json").stdout)["status"]
    assert status["phase"] == "Succeeded" and status["step"] == STEPS
    assert [a["reason"] for a in status["attempts"]] == ["Crashed", "Succeeded"]
