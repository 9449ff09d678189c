"""`grpo_run.train(..., episodes=Class, max_turns=N)`: the environment class travels with the job
as its source (grpo_run.package), rewards become optional, and the job is the one a job file with
spec.environment.episodes describes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import grpo_run
from grpo_run import Step
from grpo_run.package import Unpackable, package_environment

OFFSET = 1


def _answer(task: dict) -> str:
    return str((int(task["low"]) + OFFSET) % 10)


class Echo:
    """Done when the reply is the task's answer; says '-' otherwise."""

    def reset(self, task: dict, seed: int) -> str:
        self.task = task
        return task["prompt"]

    def step(self, reply: str) -> Step:
        right = reply.strip() == _answer(self.task)
        return Step(observation=None if right else "-", reward=float(right), done=right)


def test_an_environment_class_is_packaged_with_what_its_methods_use():
    source = package_environment(Echo)
    assert "class Echo:" in source and "def _answer(task: dict)" in source and "OFFSET = 1" in source
    assert "from grpo_run.trainer.episodes.step import Step" in source
    namespace: dict = {}
    exec(compile(source, "Echo.py", "exec"), namespace)
    env = namespace["Echo"]()
    assert env.reset({"prompt": "3-5:", "low": 3}, 0) == "3-5:"
    assert env.step("4") == Step(observation=None, reward=1.0, done=True)


def test_what_is_not_a_class_is_refused_and_rewards_are_needed_without_episodes():
    with pytest.raises(grpo_run.JobError, match=r"episodes: episodes .* is a function, not a class"):
        grpo_run.train(model="tiny:char", name="x", tasks=[{"prompt": "1"}], held_out_fraction=0.5,
                       episodes=_answer)
    with pytest.raises(grpo_run.JobError, match="rewards: give a list of functions"):
        grpo_run.train(model="tiny:char", name="x", tasks=[{"prompt": "1"}], held_out_fraction=0.5)

    class Local:
        pass

    with pytest.raises(Unpackable, match="defined inside a function"):
        package_environment(Local)


SCRIPT = textwrap.dedent('''
    import grpo_run
    from grpo_run import Step


    class Guess:
        def reset(self, task, seed):
            self.secret = int(task["low"]) + seed % 3
            return task["prompt"]

        def step(self, reply):
            if reply.strip() == str(self.secret):
                return Step(observation=None, reward=1.0, done=True)
            return Step(observation="+" if reply.strip() < str(self.secret) else "-", reward=0.0, done=False)


    tasks = [{"prompt": f"{lo}-{lo + 2}:", "low": lo} for lo in range(8)]
    job = grpo_run.train(model="tiny:char", name="guess-api", tasks=tasks[:6], eval_tasks=tasks[6:],
                         episodes=Guess, max_turns=3, num_generations=4, prompts_per_step=2,
                         max_completion_length=1, max_steps=2, save_steps=1, seed=1)
    status = job.status()
    print(status["phase"], sorted(status["lastStep"]["rewards"]), status["lastStep"]["episodeTurns"] <= 3)
''')


def test_a_script_trains_an_environment_class_in_the_foreground(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(tmp_path / "script.py")], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "GRPO_RUN_HOME": str(tmp_path / "home")}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "Succeeded ['episode'] True"
    packaged = (tmp_path / "home" / "python" / "guess-api" / "Guess.py").read_text()
    assert "class Guess:" in packaged


TOOLS_SCRIPT = textwrap.dedent('''
    import grpo_run


    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first.
            b: The second.
        """
        return a + b


    def answered(completion: str, task: dict) -> float:
        return float(completion.rstrip().endswith(str(task["answer"])))


    tasks = [{"prompt": [{"role": "user", "content": f"{a} + 2?"}], "answer": a + 2} for a in range(8)]
    job = grpo_run.train(model="tiny:chat", name="tools-api", tasks=tasks[:6], eval_tasks=tasks[6:],
                         rewards=[answered], tools=[add], max_turns=2, num_generations=2, prompts_per_step=2,
                         max_completion_length=8, max_steps=1, seed=1)
    status = job.status()
    print(status["phase"], sorted(status["lastStep"]["rewards"]), "toolCalls" in status["lastStep"])
''')


def test_a_script_trains_with_tools_each_packaged_with_its_source(tmp_path):
    (tmp_path / "script.py").write_text(TOOLS_SCRIPT)
    proc = subprocess.run([sys.executable, str(tmp_path / "script.py")], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "GRPO_RUN_HOME": str(tmp_path / "home")}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "Succeeded ['answered'] True"
    assert "def add(a: int, b: int) -> int:" in (tmp_path / "home" / "python" / "tools-api" / "tools" / "add.py").read_text()


def test_a_tool_that_is_not_a_function_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_RUN_HOME", str(tmp_path / "home"))
    with pytest.raises(grpo_run.JobError, match=r"tools\[0\]: tool .* is a"):
        grpo_run.train(model="tiny:chat", name="x", tasks=[{"prompt": "1"}], held_out_fraction=0.5,
                       rewards=[_answer], tools=[print])
    assert not (tmp_path / "home" / "python" / "x").exists()
