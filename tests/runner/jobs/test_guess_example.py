"""The episodes example a user copies (examples/guess-number) plays what its docstring says and
trains to Succeeded through the real command, its environment run in the grader's sandbox."""

import importlib.util
import json

from tests.runner.jobs.test_examples import copy_example
from tests.runner.jobs.test_resume import REPO, grpo_run

EXAMPLE = REPO / "examples" / "guess-number"


def guess_class():
    spec = importlib.util.spec_from_file_location("example_guess", EXAMPLE / "env.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Guess


def test_the_environment_answers_higher_lower_and_scores_fewer_guesses_higher():
    env = guess_class()()
    assert env.reset({"prompt": "2-6:", "low": 2, "high": 6}, seed=3) == "2-6:"
    assert env.secret == 5                                                     # 2 + 3 % 5
    assert (env.step("3").observation, env.step("7").observation, env.step("x").observation) == ("+", "-", ":")
    last = env.step("5")
    assert last.done and last.reward == 0.25 and last.observation is None      # the 4th guess
    fresh = guess_class()()
    fresh.reset({"prompt": "2-6:", "low": 2, "high": 6}, seed=3)
    assert fresh.step("5").reward == 1.0
    tasks = [json.loads(line) for line in (EXAMPLE / "tasks.jsonl").read_text().splitlines()]
    held = [json.loads(line) for line in (EXAMPLE / "eval.jsonl").read_text().splitlines()]
    assert {t["prompt"] for t in tasks}.isdisjoint(t["prompt"] for t in held) and len(tasks) == 28


def test_the_example_trains_to_succeeded_as_copied(tmp_path):
    job = copy_example(EXAMPLE, tmp_path / "guess", maxSteps=3, saveSteps=2)
    done = grpo_run(tmp_path / "home", "apply", "-f", str(job))
    assert "guess-number: Succeeded after 3 steps" in done.stdout, done.stdout + done.stderr
    status = json.loads(grpo_run(tmp_path / "home", "get", "tj", "guess-number", "-o", "json").stdout)["status"]
    assert set(status["lastStep"]["rewards"]) == {"episode"}
    assert 1 <= status["lastStep"]["episodeTurns"] <= 4
    assert status["final"]["tasks"] == 8 and status["sampler"]["engine"] == "native"
    shown = json.loads(grpo_run(tmp_path / "home", "samples", "guess-number", "-o", "json").stdout)
    assert shown and all(1 <= r["turns"] <= 4 and r["truncatedBy"] in (None, "maxTurns") for r in shown)
    text = grpo_run(tmp_path / "home", "samples", "guess-number").stdout
    assert " written" in text and "prompt: " in text
