"""TRL's reward functions run unchanged: a function whose parameters are TRL's (`prompts`,
`completions`, `**columns`) is called once per request with the task columns as lists and returns
a list; a per-completion function keeps `(completion, task)`. A batched function's failure is a
failure (RewardFunctionError), never a score."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_run.trainer.grader.grader import Grader, RewardFunctionError
from grpo_run.trainer.grader.worker import is_batched

# Copied from TRL's GRPOTrainer documentation ("Using a custom reward function"), unchanged.
TRL_REWARDS = r'''
import re


def reward_func(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]
'''

OURS = '''
CALLS = []


def calls(prompts, completions, **columns):
    CALLS.append(len(completions))
    return [float(len(CALLS))] * len(completions)      # the call's number: one call per request


def named_only(prompts, completions, answer):
    return [float(c == a) + len(p) for p, c, a in zip(prompts, completions, answer)]


def crashes(prompts, completions, **columns):
    raise ValueError("the reward broke")


def too_few(prompts, completions, **columns):
    return [1.0]


def not_a_list(prompts, completions, **columns):
    return 1.0


def nan_inside(completions, **columns):
    return [0.0, float("nan")]


def per_completion(completion, task):
    return float(len(completion))
'''


@pytest.fixture
def rewards(tmp_path: Path) -> Path:
    (tmp_path / "trl_rewards.py").write_text(TRL_REWARDS)
    (tmp_path / "ours.py").write_text(OURS)
    return tmp_path


def score(folder: Path, ref: str, completions, tasks) -> list[float]:
    with Grader(str(folder / ref), retries=0) as grader:
        return grader.score(completions, tasks)


def test_trl_reward_functions_from_its_documentation_run_unchanged(rewards):
    tasks = [{"prompt": "1+1?", "ground_truth": "2"}, {"prompt": "2+2?", "ground_truth": "4"}]
    assert score(rewards, "trl_rewards.py:reward_func", [r"\boxed{2}", r"\boxed{5}"], tasks) == [1.0, 0.0]
    chat = [{"prompt": [{"role": "user", "content": "think"}]}] * 2     # chat prompts: completions as TRL gives them
    assert score(rewards, "trl_rewards.py:format_reward_func",
                 ["<think>x</think><answer>1</answer>", "no"], chat) == [1.0, 0.0]


def test_a_batched_function_is_called_once_per_request_with_the_columns(rewards):
    tasks = [{"prompt": "ab", "answer": "x"}, {"prompt": "abc", "answer": "y"}, {"prompt": "a", "answer": "z"}]
    with Grader(str(rewards / "ours.py:calls"), retries=0) as grader:
        assert grader.score(["1", "2", "3"], tasks) == [1.0, 1.0, 1.0]
        assert grader.score(["4"], tasks[:1]) == [2.0]
    assert score(rewards, "ours.py:named_only", ["x", "n", "z"], tasks) == [3.0, 3.0, 2.0]
    assert score(rewards, "ours.py:per_completion", ["1", "22"], tasks[:2]) == [1.0, 2.0]


@pytest.mark.parametrize("name, said", [("crashes", "ValueError: the reward broke"),
                                        ("too_few", "returned 1 values for 2 completions"),
                                        ("not_a_list", "returns a list with one number per completion"),
                                        ("nan_inside", "completion 1 of the batch: returned nan")])
def test_a_batched_functions_failure_is_an_error_never_a_score(rewards, name, said):
    with pytest.raises(RewardFunctionError) as e:
        score(rewards, f"ours.py:{name}", ["a", "b"], [{"prompt": "p"}, {"prompt": "q"}])
    assert said in str(e.value)


def test_the_signature_decides_how_a_function_is_called():
    def trl(prompts, completions, **kwargs): ...
    def only_completions(completions, **kwargs): ...
    def ours(completion, task): ...
    def prompt_first(prompts, answers): ...
    assert is_batched(trl) and is_batched(only_completions) and is_batched(prompt_first)
    assert not is_batched(ours) and not is_batched(len)
