"""A cached baseline of a job with episodes is reused only for the same environment: its class's
file (by content, wherever it was fetched to) and maxTurns are in the fingerprint."""

from grpo_run.runner.books.fingerprint import baseline_fingerprint
from grpo_run.trainer.config import GRPOParams
from grpo_run.trainer.envs.catalog import EpisodeSettings, user_environment


def env(path, max_turns=4):
    tasks = [{"prompt": "1-3:"}]
    return user_environment(name="guess", tasks=tasks, eval_tasks=tasks,
                            episodes=EpisodeSettings(f"{path}:Guess", max_turns))


def test_the_episodes_file_and_max_turns_are_in_the_baselines_fingerprint(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, copy = tmp_path / "a" / "env.py", tmp_path / "b" / "env.py"
    first.write_text("class Guess: ...\n")
    copy.write_text("class Guess: ...\n")
    p = GRPOParams()
    fp = baseline_fingerprint("tiny:char", env(first), p)
    assert baseline_fingerprint("tiny:char", env(copy), p) == fp          # the same file fetched elsewhere
    assert baseline_fingerprint("tiny:char", env(first, max_turns=5), p) != fp
    copy.write_text("class Guess: pass  # changed\n")
    assert baseline_fingerprint("tiny:char", env(copy), p) != fp
    tasks = [{"prompt": "1-3:"}]
    single = user_environment(name="guess", tasks=tasks, eval_tasks=tasks, reward_ref=f"{first}:Guess")
    assert baseline_fingerprint("tiny:char", single, p) != fp
