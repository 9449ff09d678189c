"""A job with a group reward trains with each prompt's G completions scored together, and a run
killed mid-training and resumed ends byte-identical to one never interrupted."""

import json
import signal
from pathlib import Path

import pytest
import yaml

from tests.runner.jobs.test_resume import exported_bytes, grpo_run

G = 4
RANK = '''
def rank(completions, task):
    """0 for the shortest of the group ... G-1 for the longest (ties by order): the group's mean
    is (G - 1) / 2 exactly when it is called with whole groups of G."""
    order = sorted(range(len(completions)), key=lambda i: (len(completions[i]), i))
    return [float(order.index(i)) for i in range(len(completions))]
'''


def write_job(folder: Path) -> Path:
    (folder / "rewards.py").write_text("def length(completion, task):\n    return float(len(completion))\n" + RANK)
    (folder / "train.jsonl").write_text("".join(f'{{"prompt": "{a}+{b}="}}\n' for a in range(5) for b in range(5)))
    (folder / "eval.jsonl").write_text('{"prompt": "7+8="}\n{"prompt": "9+9="}\n')
    spec = {"runtime": "grpo-lora", "model": "tiny:char",
            "environment": {"name": "ranked", "tasks": "train.jsonl", "evalTasks": "eval.jsonl",
                            "rewards": [{"function": "rewards.py:length"},
                                        {"function": "rewards.py:rank", "group": True, "weight": 0.5}]},
            "parameters": {"numGenerations": G, "promptsPerStep": 2, "maxCompletionLength": 4,
                           "maxSteps": 6, "saveSteps": 2, "learningRate": 0.002}}
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "grpo-run/v1", "kind": "TrainingJob",
                                    "metadata": {"name": "resumable"}, "spec": spec}))
    return path


def last_step(home: Path) -> dict:
    return json.loads(grpo_run(home, "get", "tj", "resumable", "-o", "json").stdout)["status"]["lastStep"]


@pytest.mark.fault
@pytest.mark.slow
def test_a_group_reward_sees_whole_groups_and_a_resumed_run_scores_byte_identically(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    grpo_run(tmp_path / "home-a", "apply", "-f", str(write_job(tmp_path / "a")))
    reference = exported_bytes(tmp_path / "home-a", None, tmp_path / "export-a")
    steps = last_step(tmp_path / "home-a")
    assert steps["step"] == 6 and steps["rewards"]["rank"] == (G - 1) / 2     # whole groups of G, every step

    killed = grpo_run(tmp_path / "home-b", "apply", "-f", str(write_job(tmp_path / "b")), fault="backward@3",
                      check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    grpo_run(tmp_path / "home-b", "resume", "resumable")
    assert exported_bytes(tmp_path / "home-b", None, tmp_path / "export-b") == reference
    resumed = last_step(tmp_path / "home-b")
    assert resumed["rewards"] == steps["rewards"] and resumed["rewardMean"] == steps["rewardMean"]
