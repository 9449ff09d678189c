"""`grpo-run samples` on a job with episodes: each episode with its turns and the limit that ended
it (the whole episode's text as the completion); single-turn samples read as before."""

from grpo_run.runner.views.completions import render, rows


def group(**episode):
    completion = {"text": "3+5-4", "rewards": {"episode": 0.5}, "reward": 0.5, "advantage": 1.0, "length": 3,
                  "truncated": bool(episode.get("truncatedBy")), **episode}
    other = dict(completion, reward=0.0, advantage=-1.0)
    return [{"step": 4, "item": 0, "prompt": "2-6:", "completions": [completion, other], "solved": False}]


def test_an_episode_shows_its_turns_and_the_limit_that_ended_it():
    text = render(group(turns=3, truncatedBy="maxTurns"), "step")
    assert "3 turns, 3 tokens written (ended at maxTurns)" in text
    assert "1 turn, 3 tokens written  " in render(group(turns=1, truncatedBy=None), "step")
    (row, _) = rows(group(turns=3, truncatedBy="context"), "step")
    assert row["turns"] == 3 and row["truncatedBy"] == "context"


def test_a_single_turn_completion_reads_as_before():
    text = render(group(), "step")
    assert "3 tokens  " in text and "turn" not in text
    assert "turns" not in rows(group(), "step")[0]
