"""An episodes environment that raises fails the job as the user's code's failure, through the
real command: one attempt, phase Failed, the environment's own error in the record, never a
score and never restarted."""

import json

import yaml

from tests.runner.jobs.test_resume import grpo_run

BROKEN = '''
class Broken:
    def reset(self, task, seed):
        return task["prompt"]

    def step(self, reply):
        raise KeyError("the board is gone")
'''


def test_an_environment_that_raises_fails_the_job_once_saying_so(tmp_path):
    (tmp_path / "env.py").write_text(BROKEN)
    (tmp_path / "tasks.jsonl").write_text("".join(f'{{"prompt": "{i}-{i + 2}:"}}\n' for i in range(4)))
    (tmp_path / "eval.jsonl").write_text('{"prompt": "7-9:"}\n')
    job = {"apiVersion": "grpo-run/v1", "kind": "TrainingJob", "metadata": {"name": "broken"},
           "spec": {"model": "tiny:char", "environment": {"name": "broken", "episodes": "env.py:Broken",
                                                          "tasks": "tasks.jsonl", "evalTasks": "eval.jsonl"},
                    "parameters": {"numGenerations": 2, "promptsPerStep": 1, "maxCompletionLength": 1,
                                   "maxSteps": 2, "saveSteps": 1, "sampler": "native"}}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    done = grpo_run(tmp_path / "home", "apply", "-f", str(tmp_path / "job.yaml"), check=False)
    assert done.returncode != 0
    status = json.loads(grpo_run(tmp_path / "home", "get", "tj", "broken", "-o", "json").stdout)["status"]
    assert status["phase"] == "Failed"
    assert [a["reason"] for a in status["attempts"]] == ["Failed"]
    message = status["attempts"][0]["message"]
    assert message.startswith("environment failed: environment ") and "the board is gone" in message
    assert "raised in the step of episode 0" in message        # in the baseline evaluation, the first to play
