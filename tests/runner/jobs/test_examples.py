"""The examples a user copies work as the README says: the custom-reward job (its own tasks and
reward functions) trains to Succeeded through the real command, its rewards scored in the grader."""
from __future__ import annotations

import importlib.util
import json
import shutil

import yaml

from tests.runner.jobs.test_resume import REPO, grpo_run

EXAMPLE = REPO / "examples" / "custom-reward"


def copy_example(example, folder, **parameters):
    """`example` copied to `folder` as a user copies it, its job's spec.parameters updated with
    `parameters` (a short run); the copied job file."""
    shutil.copytree(example, folder)
    job = yaml.safe_load((folder / "job.yaml").read_text())
    job["spec"]["parameters"].update(parameters)
    (folder / "job.yaml").write_text(yaml.safe_dump(job))
    return folder / "job.yaml"


def load_rewards():
    spec = importlib.util.spec_from_file_location("example_rewards", EXAMPLE / "rewards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_custom_reward_example_scores_what_its_docstrings_say():
    rewards = load_rewards()
    task = {"prompt": "3,7=", "answer": "7"}
    assert rewards.correct("7", task) == 1.0 and rewards.correct(" 7 ", task) == 1.0
    assert rewards.correct("3", task) == 0.0 and rewards.correct("", task) == 0.0
    assert rewards.close("7", task) == 1.0 and rewards.close("x", task) == 0.0
    assert rewards.close("6", task) > rewards.close("3", task) > rewards.close("0", task) > 0.0
    tasks = [json.loads(line) for line in (EXAMPLE / "tasks.jsonl").read_text().splitlines()]
    assert len(tasks) == 90 and all(t["answer"] == max(t["prompt"][0], t["prompt"][2]) for t in tasks)


def test_the_custom_reward_example_trains_to_succeeded_as_copied(tmp_path):
    """Copied elsewhere (paths relative to the job file), a few steps: both rewards reach the record."""
    job = copy_example(EXAMPLE, tmp_path / "my-reward", maxSteps=4, saveSteps=2)
    done = grpo_run(tmp_path / "home", "apply", "-f", str(job))
    assert "custom-reward: Succeeded after 4 steps" in done.stdout, done.stdout + done.stderr
    status = json.loads(grpo_run(tmp_path / "home", "get", "tj", "custom-reward", "-o", "json").stdout)["status"]
    assert set(status["lastStep"]["rewards"]) == {"correct", "close"}
    assert status["final"]["tasks"] == 27
