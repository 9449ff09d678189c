"""vLLM for a full fine-tune (the trainer's weights loaded into the engine every sync), and an
engine that cannot start; in a module of their own, so the other module's engine is not in the
same process (an in-process engine on a CPU counts the whole process's memory against its share)."""

from __future__ import annotations

import pytest
import torch

from grpo_run.trainer import grpo
from grpo_run.trainer.config import GRPOParams
from grpo_run.trainer.envs.catalog import catalog_environment, user_environment
from grpo_run.trainer.trainer import GRPOTrainer
from tests.trainer.sampling.test_vllm_engine import prompts, tiny64  # noqa: F401 (the session's model fixture)


def test_a_full_fine_tune_s_weights_reach_the_engine_every_sync(tiny64, tmp_path):
    (tmp_path / "length.py").write_text("def score(completion, task):\n    return float(len(completion))\n")
    arith = catalog_environment("arithmetic", seed=0, n_eval=6)
    env = user_environment(name="length", reward_ref=f"{tmp_path / 'length.py'}:score", tasks=list(arith.train_tasks),
                           eval_tasks=list(arith.eval_tasks))
    params = GRPOParams(numGenerations=4, promptsPerStep=2, maxCompletionLength=8, maxSteps=4, evalTasks=6,
                        method="Full", learningRate=2e-3, seed=0, sampler="vllm", vllm={"gpuMemoryUtilization": 0.1})
    tr = GRPOTrainer(str(tiny64), env, params, work=tmp_path)
    try:
        ids, mask = prompts(tr, 4)
        tr.sampler.load_policy(tr.model)
        before = tr.sampler.sample(ids, mask, [5], temperature=1.0, should_stop=lambda: False)
        with torch.no_grad():                       # weights far from the base's
            gen = torch.Generator().manual_seed(4)
            for p in tr.model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        tr.sampler.load_policy(tr.model)
        out = tr.sampler.sample(ids, mask, [5], temperature=1.0, should_stop=lambda: False)
        with torch.no_grad():
            policy = grpo.completion_logprobs(tr.model, ids, mask, out.ids, out.mask, 1.0)
        m = out.mask.bool()
        assert (policy[m] - out.logprobs[m]).abs().max() < 1e-3
        assert not torch.equal(before.logprobs, out.logprobs)
        assert tr.sampler.status()["engine"] == "vllm"
    finally:
        tr.close()


def test_a_share_too_small_for_the_engine_fails_naming_the_field_and_the_fix(tiny64, tmp_path):
    from grpo_run.trainer.sampling.vllm_engine import VllmSampler
    from grpo_run.trainer.sampling.engines import EngineRefused

    with pytest.raises(EngineRefused, match=r"spec.parameters.vllm.gpuMemoryUtilization: 0.001: vLLM could not start "
                                            r"with it .*raise it, or use sampler: native"):
        VllmSampler(str(tiny64), method="LoRA", lora_rank=8, dtype=torch.float32, device=torch.device("cpu"),
                    gpu_memory_utilization=0.001, work=tmp_path)
