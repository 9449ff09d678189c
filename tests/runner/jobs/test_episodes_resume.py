"""A job with episodes, killed in the middle of a step's episodes and resumed on a fresh node from
storage alone, ends with the adapter an uninterrupted run ends with, byte for byte: the step's
episodes are played again from reset with the same seeds, and draw the same tokens."""

import json
import re
import shutil
import signal

import pytest
import yaml

from tests.runner.jobs.test_resume import REPO, grpo_run

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


UNSEEDED = """
import random

from grpo_run import Step


class Guess:
    def reset(self, task, seed):
        self.turns = 0
        return task["prompt"]

    def step(self, reply):
        self.turns += 1
        return Step(observation=str(random.randint(0, 9)), reward=float(reply.strip() == "7"), done=self.turns >= 2)
"""


@pytest.mark.fault
def test_an_environment_that_answers_a_replayed_step_differently_fails_the_job_saying_so(tmp_path):
    """The trainer is killed after step 4's backward pass; its restart resumes from the newest
    durable checkpoint and replays the steps after it, whose first answers the record kept: an
    environment that draws its answers without the episode's seed answers the same guesses
    differently, and the job fails as the environment's failure, naming the fix, instead of
    continuing a run it is not."""
    folder = tmp_path / "job"
    folder.mkdir()
    job = write_job(folder)
    (folder / "env.py").write_text(UNSEEDED)
    run = grpo_run(tmp_path / "home", "apply", "-f", str(job), fault="backward@3/trainer", check=False)
    assert run.returncode != 0 and "Traceback" not in run.stdout
    said = run.stdout + run.stderr
    assert re.search(r"step [1-4] was replayed after a resume", said), said
    assert "not deterministic given its task and seed" in said and "random.Random(seed)" in said, said
    status = json.loads(grpo_run(tmp_path / "home", "get", "tj", "talking", "-o", "json").stdout)["status"]
    assert status["phase"] == "Failed" and [a["reason"] for a in status["attempts"]][0] == "Crashed"


@pytest.mark.fault
def test_every_task_is_trained_once_per_epoch_across_kills_as_the_record_counts_them(tmp_path):
    """Two epochs of the 28 tasks (4 a step: 7 steps an epoch), the node killed in step 6's
    episodes and the job resumed elsewhere, whose trainer is then killed after step 11's backward
    pass and restarted: every step's groups are kept (sampleGroups = promptsPerStep), and in each
    epoch every task was trained exactly once, counted from the record in storage."""
    from collections import Counter

    storage = str(tmp_path / "storage")
    folder = tmp_path / "job"
    folder.mkdir()
    job = write_job(folder, storage)
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["parameters"].update(promptsPerStep=4, sampleGroups=4, maxSteps=14, saveSteps=3)
    job.write_text(yaml.safe_dump(doc))
    killed = grpo_run(tmp_path / "node-a", "apply", "-f", str(job), fault="sample@5", check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    done = grpo_run(tmp_path / "node-b", "resume", "talking", "--storage", storage, fault="backward@10/trainer")
    assert "restart 1 of 3 (crashes)" in done.stderr, done.stderr[-2000:]
    rows = json.loads(grpo_run(tmp_path / "node-c", "samples", "talking", "--storage", storage, "--last", "14",
                               "-o", "json").stdout)
    groups = {(r["step"], r["group"]): r["prompt"] for r in rows}
    assert sorted({s for s, _ in groups}) == list(range(1, 15)) and len(groups) == 14 * 4
    tasks = Counter(json.loads(line)["prompt"] for line in (folder / "tasks.jsonl").read_text().splitlines())
    assert len(tasks) == 28
    for epoch in (range(1, 8), range(8, 15)):
        assert Counter(p for (s, _), p in groups.items() if s in epoch) == tasks
    status = json.loads(grpo_run(tmp_path / "node-c", "get", "tj", "talking", "--storage", storage,
                                 "-o", "json").stdout)["status"]
    assert status["phase"] == "Succeeded" and [a["reason"] for a in status["attempts"]] == \
        ["Crashed", "Crashed", "Succeeded"]
