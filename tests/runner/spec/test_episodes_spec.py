"""`spec.environment.episodes` and `maxTurns` in a job file: validated with the other fields, the
class loaded in the grader's sandbox at --dry-run time, and each mistake one line naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from grpo_run.runner.cli.commands import EXIT_USAGE, main
from grpo_run.runner.jobs.envfiles import local_files, with_file_hashes
from grpo_run.runner.environments import build_environment
from grpo_run.runner.spec.job import load_job

GUESS = '''
from grpo_run import Step

class Guess:
    def reset(self, task, seed):
        return task["prompt"]

    def step(self, reply):
        return Step(observation=None, reward=1.0, done=True)
'''


@pytest.fixture
def folder(tmp_path) -> Path:
    (tmp_path / "env.py").write_text(GUESS)
    (tmp_path / "train.jsonl").write_text('{"prompt": "1", "secret": 1}\n{"prompt": "2", "secret": 2}\n')
    (tmp_path / "eval.jsonl").write_text('{"prompt": "3", "secret": 3}\n')
    return tmp_path


def write_job(folder: Path, **environment) -> Path:
    env = {"name": "guess", "episodes": "env.py:Guess", "tasks": "train.jsonl", "evalTasks": "eval.jsonl",
           **environment}
    doc = {"apiVersion": "grpo-run/v1", "kind": "TrainingJob", "metadata": {"name": "guess"},
           "spec": {"model": "tiny:char", "environment": {k: v for k, v in env.items() if v is not None},
                    "parameters": {"maxSteps": 2, "saveSteps": 1, "sampler": "native"}}}
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def dry_run(capsys, job: Path) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["apply", "-f", str(job), "--dry-run", "-o", "json"])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_job_with_episodes_needs_no_reward_and_the_trainer_gets_the_class_and_its_turns(folder):
    job = load_job(write_job(folder, maxTurns=3))
    env = build_environment(job)
    assert env.rewards == () and env.episodes.ref == f"{folder / 'env.py'}:Guess" and env.episodes.max_turns == 3
    assert env.train_tasks[0] == {"prompt": "1", "secret": 1}


def test_max_turns_defaults_to_six(folder):
    assert build_environment(load_job(write_job(folder))).episodes.max_turns == 6


def test_a_dry_run_of_a_job_with_episodes_passes(capsys, folder):
    code, out, err = dry_run(capsys, write_job(folder))
    assert code == 0, err
    assert json.loads(out)["spec"]["environment"]["episodes"] == f"{folder / 'env.py'}:Guess"


@pytest.mark.parametrize("environment, said", [
    ({"maxTurns": 0}, "spec.environment.maxTurns: must be >= 1 (got 0)"),
    ({"episodes": "missing.py:Guess"}, "spec.environment.episodes: no such file"),
    ({"episodes": "env.py"}, "spec.environment.episodes: must be module:Class or file.py:Class (got 'env.py')"),
    ({"episodes": None, "maxTurns": 3, "reward": "env.py:Guess"}, "spec.environment.maxTurns: goes with episodes"),
    ({"name": "arithmetic"}, "spec.environment.episodes: goes with your own tasks"),
    ({"stepTimeoutSeconds": 0}, "spec.environment.stepTimeoutSeconds: must be > 0 (got 0)"),
    ({"episodes": None, "stepTimeoutSeconds": 3, "reward": "env.py:Guess"},
     "spec.environment.stepTimeoutSeconds: goes with episodes"),
    ({"toolTimeoutSeconds": 3}, "spec.environment.toolTimeoutSeconds: goes with tools"),
    ({"tools": ["env.py"]}, "spec.environment.tools: must be module:function or file.py:function (got 'env.py')"),
])
def test_bad_episodes_fields_are_refused_naming_the_field(capsys, folder, environment, said):
    code, _, err = dry_run(capsys, write_job(folder, **environment))
    assert code == EXIT_USAGE and said in err


@pytest.mark.parametrize("source, ref, said", [
    (GUESS, "env.py:Gues", "spec.environment.episodes: {env} has no 'Gues'; it defines: Guess: give one of those "
                          "after the ':' (env.py:CLASS)"),
    ("class Guess:\n    def reset(self, task, seed):\n        pass\n", "env.py:Guess",
     "spec.environment.episodes: Guess has no method step(self, reply: str)"),
    ("class Guess:\n    def reset(self, task):\n        pass\n    def step(self, reply):\n        pass\n", "env.py:Guess",
     "spec.environment.episodes: Guess.reset must be reset(self, task: dict, seed: int) (it is reset(self, task))"),
    ("def Guess(task, seed):\n    pass\n", "env.py:Guess", "spec.environment.episodes: Guess is a function, not a class"),
    ("class Guess(\n", "env.py:Guess", "spec.environment.episodes: {env}:1: SyntaxError"),
])
def test_an_environment_that_is_no_class_with_reset_and_step_is_refused_at_dry_run(capsys, folder, source, ref, said):
    (folder / "env.py").write_text(source)
    code, _, err = dry_run(capsys, write_job(folder, episodes=ref))
    assert code == EXIT_USAGE, err
    assert said.format(env=folder / "env.py") in err


def test_the_environments_file_travels_with_the_job(folder):
    job = with_file_hashes(load_job(write_job(folder)))
    assert local_files(job.environment)["episodes"] == str(folder / "env.py")
    assert set(job.environment.sha256) == {"episodes", "tasks", "evalTasks"}


def test_score_says_an_episodes_only_job_has_no_reward_functions_to_score_completions_with(capsys, folder):
    (folder / "completions.jsonl").write_text('{"task": 0, "completion": "1"}\n')
    capsys.readouterr()
    code = main(["score", "-f", str(write_job(folder)), "--completions", str(folder / "completions.jsonl")])
    assert code == EXIT_USAGE
    assert "scores the episodes it plays, not completions" in capsys.readouterr().err


def test_a_dry_run_warns_of_prompts_tiny_char_cannot_read(capsys, tmp_path):
    """tiny:char reads 20 tokens (digits, + = - : , | and space): a newcomer's first own tasks
    and environment, in words, would train on <unk>s. The dry run says so, for the task files'
    prompts and for the prompt the environment's reset returns; it does not refuse (a warning)."""
    (tmp_path / "env.py").write_text(GUESS.replace('return task["prompt"]', 'return "digit " + task["prompt"]'))
    (tmp_path / "train.jsonl").write_text('{"prompt": "1:", "secret": 1}\n{"prompt": "guess 2:", "secret": 2}\n')
    (tmp_path / "eval.jsonl").write_text('{"prompt": "3:", "secret": 3}\n')
    code, out, err = dry_run(capsys, write_job(tmp_path))
    assert code == 0, err
    assert ("warning: spec.environment.tasks: train.jsonl row 2's prompt 'guess 2:' has characters the model's "
            "tokenizer does not know ('g' 'u' 'e' 's'): each becomes <unk>, one and the same token to the model; "
            "it reads only ' +,-0123456789:=|' (docs/environments.md)") in err
    assert "warning: spec.environment.episodes: reset's first prompt 'digit 1:' has characters" in err
    assert "eval.jsonl" not in err                                     # its prompts are all known


def test_a_dry_run_of_prompts_tiny_char_reads_says_nothing_of_them(capsys, folder):
    code, out, err = dry_run(capsys, write_job(folder))
    assert code == 0 and "does not know" not in err, err
