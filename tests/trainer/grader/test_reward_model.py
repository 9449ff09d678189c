"""Reward models (`rewards: [{model: FOLDER}]`): a one-logit sequence classifier scores prompt +
completion in the trainer's process, batched, without gradients; a job with a function and a
reward model trains and records both; the baseline's fingerprint covers the model's weights."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from grpo_run.runner.cli.commands import EXIT_OK, main
from grpo_run.runner.home import ensure_model
from grpo_run.trainer.grader.rewardmodel import RewardModel


def build_reward_model(out: Path, *, seed: int = 0, labels: int = 1) -> str:
    """The demo's tiny model (built locally) with a sequence-classification head of `labels` outputs."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    base = ensure_model("tiny:char")
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=labels)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)       # a head that tells texts apart clearly
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory) -> str:
    return build_reward_model(tmp_path_factory.mktemp("rm") / "rm")


def test_a_batch_scores_each_completion_as_it_scores_alone(reward_model):
    rm = RewardModel(reward_model)
    tasks = [{"prompt": "1+2="}, {"prompt": "3+4="}, {"prompt": [{"role": "user", "content": "5+5="}]}]
    completions = ["3", "7 and more text", ""]
    together = rm.score(completions, tasks)
    alone = [rm.score([c], [t])[0] for c, t in zip(completions, tasks)]
    assert together == pytest.approx(alone, abs=1e-5) and len(set(together)) == 3
    assert not any(p.requires_grad for p in rm.model.parameters())


def test_a_model_with_more_than_one_output_is_refused(tmp_path):
    with pytest.raises(ValueError, match="has 2 outputs .num_labels.; a reward model has one logit"):
        RewardModel(build_reward_model(tmp_path / "two", labels=2))


def write_job(folder: Path, reward_model: str) -> str:
    (folder / "rewards.py").write_text("def length(completion, task):\n    return float(len(completion))\n")
    (folder / "train.jsonl").write_text("".join(f'{{"prompt": "{a}+{b}="}}\n' for a in range(4) for b in range(4)))
    (folder / "eval.jsonl").write_text('{"prompt": "7+8="}\n{"prompt": "9+9="}\n')
    spec = {"runtime": "grpo-lora", "model": "tiny:char",
            "environment": {"name": "judged", "tasks": "train.jsonl", "evalTasks": "eval.jsonl",
                            "rewards": [{"function": "rewards.py:length"},
                                        {"model": reward_model, "weight": 0.5, "name": "rm"}]},
            "parameters": {"numGenerations": 4, "promptsPerStep": 2, "maxCompletionLength": 4, "maxSteps": 3,
                           "saveSteps": 3, "learningRate": 0.002}}
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "grpo-run/v1", "kind": "TrainingJob",
                                    "metadata": {"name": "judged"}, "spec": spec}))
    return str(path)


def test_a_job_with_a_function_and_a_reward_model_trains_and_records_both(tmp_path, reward_model, capsys):
    job = write_job(tmp_path, reward_model)
    assert main(["apply", "-f", job]) == EXIT_OK
    capsys.readouterr()
    assert main(["get", "tj", "judged", "-o", "json"]) == EXIT_OK
    status = json.loads(capsys.readouterr().out)["status"]
    assert status["phase"] == "Succeeded" and status["step"] == 3
    for rewards in (status["lastStep"]["rewards"], status["baseline"]["rewards"], status["final"]["rewards"]):
        assert set(rewards) == {"length", "rm"} and all(math.isfinite(v) for v in rewards.values())

    (tmp_path / "rows.jsonl").write_text('{"prompt": "1+2=", "completion": "3"}\n')
    assert main(["score", "-f", job, "--completions", str(tmp_path / "rows.jsonl"), "-o", "json"]) == EXIT_OK
    [scored] = json.loads(capsys.readouterr().out)
    expected = RewardModel(reward_model).score(["3"], [{"prompt": "1+2="}])[0]
    assert scored["rewards"] == {"length": 1.0, "rm": pytest.approx(expected)}
    assert scored["total"] == pytest.approx(1.0 + 0.5 * expected)


def test_the_baseline_fingerprint_covers_the_reward_models_weights(tmp_path):
    from grpo_run.runner.books.fingerprint import baseline_fingerprint
    from grpo_run.runner.environments import build_environment
    from grpo_run.runner.spec.job import load_job

    build_reward_model(tmp_path / "rm", seed=0)
    job = load_job(write_job(tmp_path, "./rm"))
    assert job.environment.rewards[1].model == str(tmp_path / "rm")     # resolved against the job file
    before = baseline_fingerprint("tiny:char", build_environment(job), job.parameters)
    assert baseline_fingerprint("tiny:char", build_environment(job), job.parameters) == before
    build_reward_model(tmp_path / "rm", seed=1)
    assert baseline_fingerprint("tiny:char", build_environment(job), job.parameters) != before


def test_a_node_without_the_reward_models_folder_fails_the_job_at_once_naming_it(tmp_path, capsys, monkeypatch):
    """Submitted from a machine that has the folder, run by a node that has not: the job fails on
    its first try with the reward model named and what to do, not restarted to the crash limit."""
    import shutil

    from grpo_run.runner.cli.commands import EXIT_FAILED

    folder = build_reward_model(tmp_path / "rm")
    path = Path(write_job(tmp_path, folder))
    doc = yaml.safe_load(path.read_text())
    doc["spec"]["storage"] = str(tmp_path / "bucket")
    path.write_text(yaml.safe_dump(doc))
    capsys.readouterr()
    assert main(["apply", "-f", str(path), "--detach"]) == EXIT_OK
    assert (f"note: spec.environment.rewards.1.model: {folder} is a folder on this machine: a node runs this job "
            "only if the same folder is at that path there") in capsys.readouterr().err
    shutil.rmtree(folder)                                  # the node has no such folder
    monkeypatch.setenv("GRPO_RUN_HOME", str(tmp_path / "node"))
    assert main(["resume", "judged", "--storage", str(tmp_path / "bucket")]) == EXIT_FAILED
    said = capsys.readouterr().err
    assert main(["get", "tj", "judged", "-o", "json"]) == EXIT_OK
    status = json.loads(capsys.readouterr().out)["status"]
    why = f"reward model: {folder} is not a folder on this node, nor a hub id"
    assert status["phase"] == "Failed" and why in status["message"], status
    assert [a["reason"] for a in status["attempts"]] == ["Failed"], status["attempts"]
    assert why in said and "Traceback" not in said


def test_a_model_that_is_not_there_is_named_and_other_load_errors_pass_as_they_were(tmp_path):
    from transformers import AutoTokenizer

    from grpo_run.trainer.model.missing import ModelMissing, loading

    gone = str(tmp_path / "gone")
    with pytest.raises(ModelMissing, match=f"^spec.model: {gone} is not a folder on this node, nor a hub id"):
        with loading("spec.model", gone):
            AutoTokenizer.from_pretrained(gone)
    with pytest.raises(OSError, match="^a disk error$") as raised:     # may pass: the trainer is restarted
        with loading("spec.model", gone):
            raise OSError("a disk error")
    assert not isinstance(raised.value, ModelMissing)
