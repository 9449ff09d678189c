"""GRPO on episodes with the tiny local models: the ids trained are the ids sampled (turn
boundaries included), observations are never trained, the group is G episodes of one task, and a
seeded step replays byte for byte."""

import textwrap

import pytest
import torch

from grpo_run.runner.home import ensure_model
from grpo_run.trainer import grpo
from grpo_run.trainer.config import GRPOParams
from grpo_run.trainer.envs.catalog import EpisodeSettings, user_environment
from grpo_run.trainer.episodes.host import EnvironmentFailed
from grpo_run.trainer.trainer import GRPOTrainer

CHAT_ENV = '''
from grpo_run import Step

class Talk:
    """Asks again twice, then ends; rewards a reply by its length, so groups differ."""
    def reset(self, task, seed):
        self.turn = 0
        return [{"role": "user", "content": task["prompt"]}]

    def step(self, reply):
        self.turn += 1
        done = self.turn >= 3
        return Step(observation=None if done else "Again?", reward=float(len(reply) % 5), done=done)
'''

BROKEN_ENV = '''
class Broken:
    def reset(self, task, seed):
        return task["prompt"]

    def step(self, reply):
        raise ValueError("no board here")
'''


def params(**kw):
    base = dict(numGenerations=4, promptsPerStep=2, maxCompletionLength=5, maxSteps=4, learningRate=2e-3, seed=3,
                sampler="native")
    base.update(kw)
    return GRPOParams(**base)


@pytest.fixture
def make(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_RUN_HOME", str(tmp_path / "home"))
    made = []

    def make(source, cls, model="tiny:chat", max_turns=6, **kw):
        (tmp_path / "env.py").write_text(textwrap.dedent(source))
        tasks = [{"prompt": f"Question {i}"} for i in range(6)]
        env = user_environment(name="talk", tasks=tasks, eval_tasks=tasks[:2], search_path=(str(tmp_path),),
                               episodes=EpisodeSettings(f"{tmp_path / 'env.py'}:{cls}", max_turns))
        made.append(GRPOTrainer(str(ensure_model(model)), env, params(**kw)))
        return made[-1]

    yield make
    for tr in made:
        tr.close()


def record_sampling(tr, monkeypatch):
    """Every sampling call's rows (unpadded) and what was sampled for each."""
    calls = []
    sample = tr.sampler.sample

    def recorded(ids, mask, seeds, **kw):
        out = sample(ids, mask, seeds, **kw)
        calls.append([(row[m.bool()].tolist(), c[cm.bool()].tolist())
                      for row, m, c, cm in zip(ids, mask, out.ids, out.mask)])
        return out

    monkeypatch.setattr(tr.sampler, "sample", recorded)
    return calls


def record_episodes(tr, monkeypatch):
    """Every batch of episodes the rollout plays (trainer.episodes.loop.Episodes)."""
    played = []
    play = tr.rollout.play

    def recorded(*args):
        batch = play(*args)
        played.append(batch.episodes)
        return batch

    monkeypatch.setattr(tr.rollout, "play", recorded)
    return played


def record_update(monkeypatch):
    """The update's inputs: each micro-batch's whole sequences (prompt + completion, unpadded),
    and its per-token log-probabilities (kept with their gradient)."""
    seen = []
    logprobs = grpo.completion_logprobs

    def recorded(model, p_ids, p_mask, c_ids, c_mask, temperature, **kw):
        out = logprobs(model, p_ids, p_mask, c_ids, c_mask, temperature, **kw)
        if out.requires_grad:
            out.retain_grad()
            seen.append(([p[pm.bool()].tolist() + c[cm.bool()].tolist()
                          for p, pm, c, cm in zip(p_ids, p_mask, c_ids, c_mask)], c_mask, out))
        return out

    monkeypatch.setattr(grpo, "completion_logprobs", recorded)
    return seen


def test_the_ids_trained_are_the_ids_sampled_turn_boundaries_included(make, monkeypatch):
    tr = make(CHAT_ENV, "Talk")
    played = record_episodes(tr, monkeypatch)
    calls, update = record_sampling(tr, monkeypatch), record_update(monkeypatch)
    tr.train_step(0)
    episodes = played[0]
    assert episodes.turns == [3] * 8 and episodes.truncated == [None] * 8
    for i in range(8):
        whole = episodes.prompt_ids[i][episodes.prompt_mask[i].bool()].tolist() + \
            episodes.ids[i][episodes.mask[i].bool()].tolist()
        # turn k's prompt is the sequence so far, and what it sampled follows it in the sequence
        for turn in calls:
            row, sampled = turn[i]
            assert whole[:len(row)] == row and whole[len(row):len(row) + len(sampled)] == sampled
        # the last turn's prompt and reply are the whole episode: the environment's turns between
        # them are what was sampled from, not text turned into ids again
        assert whole == calls[-1][i][0] + calls[-1][i][1]
    trained = [seq for rows, _, _ in update for seq in rows]
    assert trained                                                       # some episodes were learnt from
    for seq in trained:
        assert any(seq == calls[-1][i][0] + calls[-1][i][1] for i in range(8))
    # the boundaries are the template's: after each reply, <|im_end|>\n<|im_start|>user\nAgain?...
    text = tr.tokenizer.decode(episodes.ids[0][episodes.mask[0].bool()].tolist())
    assert text.count("<|im_start|>user\nAgain?<|im_end|>\n<|im_start|>assistant\n") == 2


def test_observation_tokens_get_no_gradient_and_sampled_ones_do(make, monkeypatch):
    tr = make(CHAT_ENV, "Talk")
    played = record_episodes(tr, monkeypatch)
    update = record_update(monkeypatch)
    metrics = tr.train_step(0)
    assert metrics["learningCompletions"] > 0
    episodes = played[0]
    checked = 0
    for rows, c_mask, logps in update:
        for r, seq in enumerate(rows):
            i = next(i for i in range(8) if seq == episodes.prompt_ids[i][episodes.prompt_mask[i].bool()].tolist()
                     + episodes.ids[i][episodes.mask[i].bool()].tolist())
            n = int(c_mask[r].sum())
            loss_mask, grad = episodes.loss_mask[i][:n], logps.grad[r][:n]
            assert (loss_mask == 0).any() and (loss_mask == 1).any()
            assert torch.all(grad[loss_mask == 0] == 0)                 # observations: exactly zero
            assert torch.all(grad[loss_mask == 1] != 0)                 # every sampled token learns
            checked += 1
    assert checked == metrics["learningCompletions"]


def test_the_group_is_g_episodes_of_one_task_each_seeded_apart(make, monkeypatch):
    tr = make(CHAT_ENV, "Talk")
    asked = []
    reset = tr.environment.reset
    monkeypatch.setattr(tr.environment, "reset", lambda tasks, seeds: asked.append((tasks, seeds)) or reset(tasks, seeds))
    tr.train_step(0)
    tasks, seeds = asked[0]            # what each episode's environment was reset with
    assert [t["prompt"] for t in tasks[:4]] == [tasks[0]["prompt"]] * 4 and tasks[4]["prompt"] != tasks[0]["prompt"]
    assert len(set(seeds)) == 8


def test_a_seeded_episode_step_replays_byte_for_byte(make):
    first, second = make(CHAT_ENV, "Talk"), make(CHAT_ENV, "Talk")
    for tr in (first, second):
        tr.train_step(0)
        tr.train_step(1)
    a, b = first.adapter_state(), second.adapter_state()
    assert a.keys() == b.keys()
    assert all(a[k].numpy().tobytes() == b[k].numpy().tobytes() for k in a)
    assert first.samples == second.samples


def test_max_turns_ends_episodes_and_their_samples_say_so(make):
    tr = make(CHAT_ENV, "Talk", max_turns=2)
    metrics = tr.train_step(0)
    assert metrics["episodeTurns"] == 2 and metrics["truncatedByMaxTurns"] == 1.0
    assert 2 <= metrics["completionLength"] <= 2 * 5          # the tokens the model wrote, not the observations
    assert tr.sampled_tokens_at_most == 10                     # Dr. GRPO's divisor: maxTurns x maxCompletionLength
    assert {c.truncatedBy for g in tr.samples for c in g.completions} == {"maxTurns"}
    assert {c.turns for g in tr.samples for c in g.completions} == {2}


def test_an_environment_that_raises_fails_the_step_and_is_never_a_score(make):
    tr = make(BROKEN_ENV, "Broken", model="tiny:char")
    with pytest.raises(EnvironmentFailed, match="no board here"):
        tr.train_step(0)


def test_an_evaluation_plays_each_held_out_task_as_an_episode(make):
    tr = make(CHAT_ENV, "Talk")
    result = tr.evaluate(tr.env.eval_tasks)
    assert result.tasks == 2 and set(result.byReward) == {"episode"}
    assert all(0 <= r <= 12 for r in result.rewards)
    assert tr.evaluate(tr.env.eval_tasks).rewards == result.rewards      # greedy: the same every time


def test_an_evaluations_samples_say_how_each_episode_ended_and_single_turn_ones_are_written_as_before(make):
    from grpo_run.trainer.protocol import SampleCompletion

    tr = make(CHAT_ENV, "Talk", max_turns=2)
    result = tr.evaluate(tr.env.eval_tasks)
    assert {(c.turns, c.truncatedBy) for g in result.samples for c in g.completions} == {(2, "maxTurns")}
    single = SampleCompletion(text="8", rewards={"correct": 1.0}, reward=1.0, length=1, truncated=False)
    assert set(single.model_dump()) == {"text", "rewards", "reward", "advantage", "length", "truncated"}


UNSEEDED_ENV = '''
import random
from grpo_run import Step

class Roll:
    """Answers with a number it draws without the episode's seed: not deterministic."""
    def reset(self, task, seed):
        return task["prompt"]

    def step(self, reply):
        return Step(observation=str(random.randint(0, 9)), reward=float(len(reply) % 3), done=False)
'''

SEEDED_ENV = UNSEEDED_ENV.replace("        return task", "        self.rng = random.Random(seed)\n        return task") \
    .replace("random.randint(0, 9)", "self.rng.randint(0, 9)")


@pytest.mark.parametrize("deterministic", [True, False], ids=["seeded", "unseeded"])
def test_a_replayed_step_whose_environment_answers_differently_fails_saying_so(make, deterministic):
    """A resume replays the steps after its checkpoint: a fresh trainer given the first play's
    digests (as the supervisor's plan gives them) goes on when the environment is deterministic
    given its seed, and fails as the environment's failure when it is not."""
    source = SEEDED_ENV if deterministic else UNSEEDED_ENV
    assert ("self.rng" in source) == deterministic
    first = make(source, "Roll", model="tiny:char", max_turns=4)
    first.train_step(0)
    recorded = list(first.episode_digests)
    assert len(recorded) == 8 and all(len(d) == 50 for d in recorded)
    again = make(source, "Roll", model="tiny:char", max_turns=4)
    again.replays = {1: recorded}
    if deterministic:
        again.train_step(0)
        assert again.episode_digests == recorded
        return
    with pytest.raises(EnvironmentFailed, match="step 1 was replayed after a resume, and episode .* got another "
                                                "answer from step to the same first reply than the first time"):
        again.train_step(0)


def test_a_replayed_episode_is_compared_by_its_first_prompt_and_its_first_answer():
    from grpo_run.trainer.episodes.replay import replay_problem

    a, b, c = "a" * 16, "b" * 16, "c" * 16
    before = [f"{a}:{b}:{c}", f"{a}:{b}:{c}"]
    assert replay_problem(3, {0: f"{a}:{b}:{c}", 1: f"{a}:{c}:{a}"}, before, 2) == ""   # a reply differs: not compared
    assert "episode 2 of its group 1 got another first prompt from reset" in \
        replay_problem(3, {1: f"{b}:{b}:{c}"}, before, 2)
    assert "episode 1 of its group 1 got another answer from step" in replay_problem(3, {0: f"{a}:{b}:{a}"}, before, 2)
    assert replay_problem(3, {0: f"{b}:{b}:{b}"}, None, 2) == ""                        # never recorded
