"""The episode loop with a stand-in sampler and environment: ids appended as sampled, masks beside
them, and the limits that end an episode said by name."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from grpo_run.trainer.episodes.host import Reply
from grpo_run.trainer.episodes.loop import left_padded, run_episodes
from grpo_run.trainer.seeds import member_seed as episode_seed, turn_seed

PAD, EOS = 0, 1


class Words:
    """A tokenizer of one id per character ('a' -> 97), EOS 1; no chat template."""
    name_or_path = "words"

    def __call__(self, text, add_special_tokens=True):
        return SimpleNamespace(input_ids=[ord(c) for c in text])

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i > 1)


class Renderer:
    tokenizer = Words()

    def first(self, prompt):
        return [ord(c) for c in prompt], None

    def observation(self, conversation, reply_ids, reply, observation):
        return [ord(c) for c in observation], None


class Replies:
    """Samples `reply` (ids) for every row, and records what it was asked."""

    def __init__(self, reply):
        self.reply, self.asked = reply, []

    def __call__(self, ids, mask, seeds):
        self.asked.append(([row[m.bool()].tolist() for row, m in zip(ids, mask)], list(seeds)))
        n, t = ids.size(0), len(self.reply)
        return SimpleNamespace(ids=torch.tensor([self.reply] * n), mask=torch.ones(n, t, dtype=torch.long),
                               entropy=torch.ones(n))


class Env:
    """Says 'no' until turn `done_at` (1-based), then done; reward 0.5 a turn."""

    def __init__(self, done_at):
        self.done_at, self.turn, self.told = done_at, {}, []

    def reset(self, tasks, seeds):
        self.turn = {i: 0 for i in range(len(tasks))}
        return [t["prompt"] for t in tasks]

    def step(self, episodes, replies):
        self.told.append((list(episodes), list(replies)))
        out = []
        for i in episodes:
            self.turn[i] += 1
            done = self.turn[i] >= self.done_at
            out.append(Reply(observation=None if done else "no", reward=0.5, done=done))
        return out


def play(reply, env, *, max_turns=5, context=100, tasks=None):
    sample = Replies(reply)
    played = run_episodes(sample, Renderer(), env, tasks or [{"prompt": "hi"}], [7] * len(tasks or [1]),
                          max_turns=max_turns, context=context, pad_id=PAD)
    return played, sample


def sequence(played, i):
    return played.ids[i][played.mask[i].bool()].tolist()


def test_an_episode_is_its_replies_and_observations_appended_with_the_replies_alone_learnt():
    played, sample = play([ord("y"), EOS], Env(done_at=3))
    no = [ord("n"), ord("o")]
    assert sequence(played, 0) == [ord("y"), EOS] + no + [ord("y"), EOS] + no + [ord("y"), EOS]
    assert played.loss_mask[0].tolist() == [1, 1, 0, 0, 1, 1, 0, 0, 1, 1]
    assert played.prompt_ids[0].tolist() == [ord("h"), ord("i")]
    # each turn's prompt is exactly the sequence so far: nothing re-tokenized
    assert [rows[0] for rows, _ in sample.asked] == [[104, 105], [104, 105, 121, 1, 110, 111],
                                                     [104, 105, 121, 1, 110, 111, 121, 1, 110, 111]]
    assert played.rewards == [1.5] and played.turns == [3] and played.truncated == [None]
    assert played.replies == [["y", "y", "y"]]


def test_an_episode_that_reaches_max_turns_ends_with_what_it_has_and_says_so():
    played, _ = play([ord("y"), EOS], Env(done_at=99), max_turns=2)
    assert played.turns == [2] and played.truncated == ["maxTurns"]
    assert sequence(played, 0) == [ord("y"), EOS, ord("n"), ord("o"), ord("y"), EOS]    # no observation after the last


def test_a_reply_past_the_context_is_cut_there_and_never_shown_to_the_environment():
    env = Env(done_at=99)
    played, _ = play([ord("y")] * 4, env, context=2 + 4 + 2 + 3)       # prompt, reply, observation, 3 of the next
    assert played.truncated == ["context"] and played.turns == [2]
    assert sequence(played, 0) == [ord("y")] * 4 + [ord("n"), ord("o")] + [ord("y")] * 3
    assert len(env.told) == 1                                           # the cut reply was not told


def test_an_observation_that_leaves_no_room_for_a_reply_ends_the_episode_without_it():
    played, _ = play([ord("y"), EOS], Env(done_at=99), context=2 + 2 + 2)
    assert played.truncated == ["context"] and sequence(played, 0) == [ord("y"), EOS]


def test_episodes_of_a_batch_end_on_their_own_and_the_rest_go_on():
    class Staggered(Env):
        def step(self, episodes, replies):
            out = super().step(episodes, replies)
            return [dataclasses.replace(o, done=True, observation=None) if i == 0 else o for i, o in zip(episodes, out)]

    played, sample = play([ord("y"), EOS], Staggered(done_at=2), tasks=[{"prompt": "a"}, {"prompt": "b"}])
    assert played.turns == [1, 2] and played.truncated == [None, None]
    assert len(sample.asked[1][0]) == 1                                  # turn 2 sampled the running one alone
    assert played.loss_mask[0].tolist() == [1, 1, 0, 0, 0, 0]            # right-padded with mask 0


def test_each_turn_draws_from_its_episodes_own_seed():
    _, sample = play([ord("y"), EOS], Env(done_at=2))
    assert [seeds for _, seeds in sample.asked] == [[turn_seed(7, 0)], [turn_seed(7, 1)]]
    assert len({episode_seed(5, k) for k in range(8)} | {episode_seed(6, 0)}) == 9
    assert turn_seed(7, 0) != turn_seed(7, 1) != turn_seed(8, 0)


def test_left_padding_puts_each_row_at_the_right():
    ids, mask = left_padded([[5], [6, 7]], PAD)
    assert ids.tolist() == [[PAD, 5], [6, 7]] and mask.tolist() == [[0, 1], [1, 1]]


def test_an_observation_the_model_cannot_render_is_the_environments_failure():
    from grpo_run.trainer.episodes.host import EnvironmentFailed

    class NoTemplate(Renderer):
        def observation(self, conversation, reply_ids, reply, observation):
            raise ValueError("the tokenizer of words has no chat template")

    with pytest.raises(EnvironmentFailed, match="episode 0's observation after turn 1 cannot be rendered"):
        run_episodes(Replies([ord("y"), EOS]), NoTemplate(), Env(done_at=3), [{"prompt": "hi"}], [7], max_turns=3,
                     context=100, pad_id=PAD)
