"""Episodes environments in the grader's sandboxed worker: reset and step answered there, what
they return checked, and every failure of theirs the user's code's failure, never a score."""

import os
import textwrap

import pytest

import grpo_run
from grpo_run.trainer.episodes.host import EnvironmentFailed, EnvironmentHost, Reply
from grpo_run.trainer.episodes.limits import Truncation

GUESS = '''
from grpo_run import Step

class Guess:
    def reset(self, task, seed):
        self.secret, self.turns = task["secret"], 0
        return task["prompt"]

    def step(self, reply):
        self.turns += 1
        if reply.strip() == str(self.secret):
            return Step(observation=None, reward=1.0, done=True)
        return Step(observation="+" if reply.strip() < str(self.secret) else "-", reward=0.0, done=False)
'''


def env_file(tmp_path, source, name="env.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


def test_each_episode_has_its_own_object_that_answers_its_replies(tmp_path):
    ref = env_file(tmp_path, GUESS) + ":Guess"
    with EnvironmentHost(ref, timeout_s=5) as host:
        prompts = host.reset([{"prompt": "?", "secret": 3}, {"prompt": "!", "secret": 7}], [1, 2])
        assert prompts == ["?", "!"]
        assert host.step([0, 1], ["5", "7"]) == [Reply(observation="-", reward=0.0, done=False),
                                                 Reply(observation=None, reward=1.0, done=True)]
        assert host.step([0], ["3"]) == [Reply(observation=None, reward=1.0, done=True)]


def test_the_public_step_is_the_one_environments_import():
    step = grpo_run.Step(observation="hi", reward=0.5, done=False)
    assert (step.observation, step.reward, step.done) == ("hi", 0.5, False)


def test_a_chat_messages_prompt_and_observation_pass_as_they_are(tmp_path):
    ref = env_file(tmp_path, '''
        from grpo_run import Step
        class Chat:
            def reset(self, task, seed):
                return [{"role": "user", "content": "seed %d" % seed}]
            def step(self, reply):
                return Step(observation=[{"role": "user", "content": "again"}], reward=0.25, done=False)
    ''') + ":Chat"
    with EnvironmentHost(ref, timeout_s=5) as host:
        assert host.reset([{}], [42]) == [[{"role": "user", "content": "seed 42"}]]
        assert host.step([0], ["x"]) == [Reply(observation=[{"role": "user", "content": "again"}], reward=0.25,
                                               done=False)]


def test_an_environment_that_raises_is_its_codes_failure_never_a_score(tmp_path):
    ref = env_file(tmp_path, '''
        class Boom:
            def reset(self, task, seed):
                return "go"
            def step(self, reply):
                raise RuntimeError("the board broke")
    ''') + ":Boom"
    with EnvironmentHost(ref, timeout_s=5) as host:
        host.reset([{}], [0])
        with pytest.raises(EnvironmentFailed, match="raised in the step of episode 0") as e:
            host.step([0], ["x"])
    assert "the board broke" in str(e.value) and e.value.kind == "exception"


@pytest.mark.parametrize("returned, said", [
    ("3", "step must return grpo_run.Step"),
    ("Step(observation='x', reward=float('nan'), done=False)", "reward nan"),
    ("Step(observation='x', reward=1, done=1)", "done must be True or False"),
    ("Step(observation=None, reward=1, done=False)", "needs an observation"),
    ("Step(observation=5, reward=1, done=False)", "observation returned 5"),
])
def test_a_step_that_returns_what_it_may_not_is_refused_saying_what(tmp_path, returned, said):
    ref = env_file(tmp_path, f'''
        from grpo_run import Step
        class Bad:
            def reset(self, task, seed):
                return "go"
            def step(self, reply):
                return {returned}
    ''') + ":Bad"
    with EnvironmentHost(ref, timeout_s=5) as host:
        host.reset([{}], [0])
        with pytest.raises(EnvironmentFailed, match="returned what it may not") as e:
            host.step([0], ["x"])
    assert said in str(e.value)


def test_a_reset_that_returns_no_prompt_is_refused(tmp_path):
    ref = env_file(tmp_path, '''
        class Bad:
            def reset(self, task, seed):
                return 7
            def step(self, reply):
                pass
    ''') + ":Bad"
    with EnvironmentHost(ref, timeout_s=5) as host:
        with pytest.raises(EnvironmentFailed, match="reset returned 7"):
            host.reset([{}], [0])


def test_a_step_that_hangs_past_its_time_is_a_timeout(tmp_path):
    ref = env_file(tmp_path, '''
        import time
        class Slow:
            def reset(self, task, seed):
                return "go"
            def step(self, reply):
                time.sleep(60)
    ''') + ":Slow"
    with EnvironmentHost(ref, timeout_s=0.5) as host:
        host.reset([{}], [0])
        with pytest.raises(EnvironmentFailed, match="timed out"):
            host.step([0], ["x"])


def test_an_environment_that_kills_its_process_is_reported_so(tmp_path):
    ref = env_file(tmp_path, '''
        import os
        class Dies:
            def reset(self, task, seed):
                return "go"
            def step(self, reply):
                os._exit(3)
    ''') + ":Dies"
    with EnvironmentHost(ref, timeout_s=5) as host:
        host.reset([{}], [0])
        with pytest.raises(EnvironmentFailed, match="killed its process"):
            host.step([0], ["x"])


def test_the_environment_runs_without_the_trainers_secrets(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
    ref = env_file(tmp_path, '''
        import os
        from grpo_run import Step
        class Peek:
            def reset(self, task, seed):
                return os.environ.get("AWS_SECRET_ACCESS_KEY", "none")
            def step(self, reply):
                return Step(observation=None, reward=0.0, done=True)
    ''') + ":Peek"
    with EnvironmentHost(ref, timeout_s=5) as host:
        assert host.reset([{}], [0]) == ["none"]
    assert os.environ["AWS_SECRET_ACCESS_KEY"].startswith("wJalr")


@pytest.mark.parametrize("source, said", [
    ("def Guess(): pass", "not a class"),
    ("class Guess:\n    def reset(self, task):\n        pass\n    def step(self, reply):\n        pass",
     "Guess.reset must be reset(self, task: dict, seed: int)"),
    ("class Guess:\n    def reset(self, task, seed):\n        pass", "Guess has no method step(self, reply: str)"),
    ("class Guess:\n    def __init__(self, size):\n        pass\n    def reset(self, task, seed):\n        pass\n"
     "    def step(self, reply):\n        pass", "must take no arguments"),
])
def test_a_class_that_is_no_environment_is_refused_at_load_naming_what_is_wrong(tmp_path, source, said):
    ref = env_file(tmp_path, source) + ":Guess"
    with pytest.raises(EnvironmentFailed, match="cannot load environment") as e:
        EnvironmentHost(ref, timeout_s=5)
    assert said in e.value.summary


def test_an_environment_that_reads_outside_its_folder_is_refused_as_a_reward_would_be(tmp_path, tmp_path_factory):
    secret = tmp_path_factory.mktemp("elsewhere") / "answers.txt"
    secret.write_text("42\n")
    ref = env_file(tmp_path, f'''
        class Peek:
            def reset(self, task, seed):
                return open({str(secret)!r}).read()
            def step(self, reply):
                pass
    ''') + ":Peek"
    with EnvironmentHost(ref, timeout_s=5) as host:
        with pytest.raises(EnvironmentFailed, match="did what the grader refuses") as e:
            host.reset([{}], [0])
    assert f"reading '{secret}' was refused" in str(e.value) and e.value.kind == "refused"


def test_a_forged_reply_frame_is_the_environments_failure_never_training_data():
    from grpo_run.trainer.episodes.host import frame_value

    good = {"ok": {"observation": "+", "reward": 0.5, "done": False}}
    assert frame_value("step", good) == (Reply(observation="+", reward=0.5, done=False), None)
    assert frame_value("reset", {"ok": [{"role": "user", "content": "hi"}]}) == ([{"role": "user", "content": "hi"}],
                                                                                 None)
    tooled = {"ok": {"observation": None, "reward": 0.0, "done": True, "truncated": "toolTime", "toolCalls": 2,
                     "toolErrors": 1}}
    assert frame_value("step", tooled) == (Reply(None, 0.0, True, Truncation.TOOL_TIME, 2, 1), None)
    for op, frame in [("step", {"ok": {"observation": "+", "reward": 1e9, "done": False}}),
                      ("step", {"ok": {"observation": "+", "reward": float("nan"), "done": False}}),
                      ("step", {"ok": {"observation": None, "reward": 1.0, "done": False}}),
                      ("step", {"ok": {"observation": 5, "reward": 1.0, "done": False}}),
                      ("step", {"ok": {"observation": "+", "reward": True, "done": False}}),
                      ("step", {"ok": {"observation": "+", "reward": 1.0, "done": False, "extra": 1}}),
                      ("step", {"ok": {"observation": None, "reward": 0.0, "done": True, "truncated": "maxTurns"}}),
                      ("step", {"ok": {"observation": "+", "reward": 0.0, "done": False, "toolCalls": -1}}),
                      ("reset", {"ok": 3}), ("reset", {"ok": [{"role": "user"}]}), ("reset", {"nothing": 1})]:
        value, failure = frame_value(op, frame)
        assert failure is not None and failure.kind == "invalid", frame


SLOW_STEP = '''
import time
from grpo_run import Step

class Slow:
    def reset(self, task, seed):
        return task["prompt"]

    def step(self, reply):
        time.sleep(float(reply))
        return Step(observation="more", reward=1.0, done=False)
'''


def test_a_step_past_step_timeout_seconds_ends_its_episode_and_the_others_go_on(tmp_path):
    ref = env_file(tmp_path, SLOW_STEP) + ":Slow"
    with EnvironmentHost(ref, timeout_s=5, step_timeout_s=0.3) as host:
        host.reset([{"prompt": "a"}, {"prompt": "b"}], [1, 2])
        assert host.step([0, 1], ["30", "0"]) == [
            Reply(observation=None, reward=0.0, done=True, truncated=Truncation.STEP_TIME),
            Reply(observation="more", reward=1.0, done=False)]
        assert host.step([1], ["0"]) == [Reply(observation="more", reward=1.0, done=False)]
    with EnvironmentHost(ref, timeout_s=0.3) as host:              # no stepTimeoutSeconds: the job's failure
        host.reset([{"prompt": "a"}], [1])
        with pytest.raises(EnvironmentFailed, match="timed out"):
            host.step([0], ["30"])


def test_a_long_prompt_and_observation_reach_the_trainer_whole(tmp_path):
    # never cut (the episode loop bounds them by tokens: `context`); an error's text alone is capped
    ref = env_file(tmp_path, '''
        from grpo_run import Step
        class Long:
            def reset(self, task, seed):
                return "p" * 5_003
            def step(self, reply):
                return Step(observation="o" * 9_004, reward=0.0, done=False)
    ''') + ":Long"
    with EnvironmentHost(ref, timeout_s=5) as host:
        assert host.reset([{}], [0]) == ["p" * 5_003]
        assert host.step([0], ["x"]) == [Reply(observation="o" * 9_004, reward=0.0, done=False)]
