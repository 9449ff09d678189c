"""Whole-group rewards (`group: true`): the function gets the G completions of one prompt and its
task, returns G rewards; in the same sandbox, under the same error rules: a crash, a wrong length
or a value that is not a finite number fails the group (retried whole), never becomes scores."""

from __future__ import annotations

import pytest
import yaml

from grpo_run.runner.environments import build_environment
from grpo_run.runner.spec.job import load_job
from grpo_run.trainer.grader.grader import Grader, RewardFunctionError
from grpo_run.trainer.grader.scoring import Scorer

GROUPS = '''
CALLS = []


def seen(completions, task):
    """Each completion's reward says which group it was scored in: the task's id, the group's size
    and its place in the group."""
    return [task["id"] * 100 + len(completions) * 10 + i for i in range(len(completions))]


def rank(completions, task):
    """0 for the shortest of the group ... G-1 for the longest (ties by order)."""
    order = sorted(range(len(completions)), key=lambda i: (len(completions[i]), i))
    return [float(order.index(i)) for i in range(len(completions))]


def flaky(completions, task):
    """Fails the first time it sees the second group: the retry must send that group whole."""
    CALLS.append(len(completions))
    if task["id"] == 2 and CALLS.count(-1) == 0:
        CALLS.append(-1)
        raise ConnectionError("judge hiccup")
    return [float(len(CALLS))] * len(completions)


def alone(completion, task):
    return float(task["id"])


def crashes(completions, task):
    raise RuntimeError("the judge fell over")


def too_few(completions, task):
    return [1.0]


def not_finite(completions, task):
    return [float("nan")] * len(completions)
'''


@pytest.fixture
def rewards(tmp_path) -> str:
    path = tmp_path / "groups.py"
    path.write_text(GROUPS)
    return str(path)


def test_a_group_reward_sees_each_prompts_completions_together_and_in_order(rewards):
    completions = [f"c{i}" for i in range(7)]
    tasks = [{"id": 1}] * 4 + [{"id": 2}] * 3
    with Grader(f"{rewards}:seen", group=True) as grader:
        assert grader.score(completions, tasks, [4, 3]) == [140, 141, 142, 143, 230, 231, 232]
        assert grader.score(completions, tasks) == [110, 110, 110, 110, 210, 210, 210]   # no groups: each alone


def test_a_failed_group_is_retried_whole(rewards):
    with Grader(f"{rewards}:flaky", group=True, retries=1) as grader:
        scores = grader.score(["a", "b", "c", "d"], [{"id": 1}, {"id": 1}, {"id": 2}, {"id": 2}], [2, 2])
    assert scores == [1.0, 1.0, 4.0, 4.0]      # calls: group 1, group 2 (raised), group 2 again


@pytest.mark.parametrize("function, kind, says", [
    ("crashes", "exception", "RuntimeError: the judge fell over"),
    ("too_few", "invalid", "returned 1 values for a group of 3 completions"),
    ("not_finite", "invalid", "completion 0 of the group: returned nan"),
])
def test_a_group_reward_that_fails_is_its_error_never_a_score(rewards, function, kind, says):
    with Grader(f"{rewards}:{function}", group=True, retries=1) as grader, pytest.raises(RewardFunctionError) as e:
        grader.score(["a", "b", "c"], [{"id": 1}] * 3, [3])
    assert e.value.kind == kind and says in str(e.value) and "the group of completions 0-2 of 3" in str(e.value)


def test_groups_that_do_not_add_up_are_refused(rewards):
    with Grader(f"{rewards}:seen", group=True) as grader, pytest.raises(ValueError, match="do not split 3"):
        grader.score(["a", "b", "c"], [{"id": 1}] * 3, [2, 2])


def test_group_true_in_a_job_file_reaches_the_scorer_and_reads_back(tmp_path, rewards):
    (tmp_path / "tasks.jsonl").write_text('{"prompt": "a", "id": 1}\n{"prompt": "b", "id": 2}\n')
    doc = {"apiVersion": "grpo-run/v1", "kind": "TrainingJob", "metadata": {"name": "groups"},
           "spec": {"runtime": "grpo-lora", "model": "tiny:char", "environment": {
               "name": "mine", "tasks": "tasks.jsonl", "heldOutFraction": 0.5,
               "rewards": [{"function": f"{rewards}:rank", "group": True, "weight": 0.5},
                           {"function": f"{rewards}:alone"}]}}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    job = load_job(tmp_path / "job.yaml")
    env = build_environment(job)
    assert [(r.name, r.group) for r in env.rewards] == [("rank", True), ("alone", False)]
    assert [r.get("group") for r in job.environment.to_dict()["rewards"]] == [True, None]
    with Scorer(env.rewards, search_path=env.search_path) as scorer:
        by_name = scorer.score(["aaa", "a", "aa", "b"], [{"id": 1}] * 3 + [{"id": 2}], [3, 1])
    assert by_name == {"rank": [2.0, 0.0, 1.0, 0.0], "alone": [1.0, 1.0, 1.0, 2.0]}


def lengths(completions, task):
    return [float(len(c)) for c in completions]


def test_the_python_api_marks_a_group_reward_with_a_dict():
    from grpo_run import JobError
    from grpo_run.training import _packaged_rewards

    packaged = _packaged_rewards([{"function": lengths, "weight": 0.5, "group": True}])
    assert [(name, weight, group) for name, _, weight, group in packaged] == [("lengths", 0.5, True)]
    with pytest.raises(JobError, match=r"rewards\[0\]: a dict takes function, weight and group"):
        _packaged_rewards([{"function": lengths, "groups": True}])
