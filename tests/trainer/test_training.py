"""The GRPO trainer on the tiny local model: what a step changes, and what it must not."""

import math

import pytest
import torch

from grpo_run.trainer.config import GRPOParams
from grpo_run.trainer.envs.catalog import catalog_environment, user_environment
from grpo_run.trainer.trainer import GRPOTrainer, batch_indices
from grpo_run.runner.home import ensure_model


def small(**kw):
    base = dict(numGenerations=4, promptsPerStep=2, maxCompletionLength=4, maxSteps=4, evalTasks=8,
                learningRate=2e-3, seed=0)
    base.update(kw)
    return GRPOParams(**base)


@pytest.fixture(scope="module")
def length_reward(tmp_path_factory):
    """A reward that differs between almost any two samples, so every step has signal."""
    path = tmp_path_factory.mktemp("rewards") / "length_reward.py"
    path.write_text("def score(completion, task):\n    return float(len(completion))\n")
    return f"{path}:score"


@pytest.fixture
def make_trainer(length_reward):
    def make(params):
        arith = catalog_environment("arithmetic", seed=params.seed, n_eval=params.evalTasks)
        env = user_environment(name="length", reward_ref=length_reward, tasks=list(arith.train_tasks),
                               eval_tasks=list(arith.eval_tasks))
        return GRPOTrainer(ensure_model("tiny:char"), env, params)
    return make


def snapshot(model, *, lora: bool):
    return {n: p.detach().clone() for n, p in model.named_parameters() if ("lora_" in n) == lora}


def test_lora_steps_change_the_adapter_and_leave_the_base_byte_identical(make_trainer):
    tr = make_trainer(small())
    try:
        base, adapter = snapshot(tr.model, lora=False), snapshot(tr.model, lora=True)
        for step in range(3):
            tr.train_step(step)
        after_base, after_adapter = snapshot(tr.model, lora=False), snapshot(tr.model, lora=True)
    finally:
        tr.close()
    assert base.keys() == after_base.keys() and len(base) > 0
    for name in base:
        assert base[name].numpy().tobytes() == after_base[name].numpy().tobytes(), name
    assert any(not torch.equal(adapter[n], after_adapter[n]) for n in adapter)


def test_the_update_through_the_decoders_forward_ends_with_the_same_adapter_bytes(make_trainer):
    from grpo_run.trainer.model import llama

    adapters = []
    for fast in (True, False):
        tr = make_trainer(small())
        try:
            if fast:
                assert isinstance(tr.update.fast_forward, llama.LlamaFamily)
            else:
                tr.update.__dict__["fast_forward"] = None        # the model's own forward
            for step in range(3):
                tr.train_step(step)
            adapters.append({n: t.numpy().tobytes() for n, t in snapshot(tr.model, lora=True).items()})
        finally:
            tr.close()
    assert adapters[0] == adapters[1]
    tr = make_trainer(small(lora={"r": 8, "dropout": 0.1}))
    try:
        assert tr.update.fast_forward is None                   # dropout: only the model's own forward applies it
    finally:
        tr.close()


def test_a_step_reports_the_metrics_a_user_watches(make_trainer):
    tr = make_trainer(small())
    try:
        m = tr.train_step(0)
    finally:
        tr.close()
    for key in ("rewardMean", "rewardStd", "identicalGroups", "solvedGroups", "noSignalGroups", "completionLength",
                "truncatedFraction", "tokenEntropy", "loss", "gradNorm"):
        assert key in m
    assert "kl" not in m                      # beta 0: no KL computed at all
    assert "clipRatio" not in m               # numIterations 1: the ratio is 1, nothing is ever clipped
    assert m["identicalGroups"] == pytest.approx(m["solvedGroups"] + m["noSignalGroups"])
    assert 0 < m["tokenEntropy"] <= math.log(len(tr.tokenizer))    # at most the uniform distribution's
    assert 0 <= m["identicalGroups"] <= 1 and 1 <= m["completionLength"] <= 4


def test_beta_with_lora_uses_the_disabled_adapter_as_reference_without_loading_weights(make_trainer):
    tr = make_trainer(small(beta=0.04))
    try:
        assert tr.reference is None
        m0 = tr.train_step(0)
        m1 = tr.train_step(1)
    finally:
        tr.close()
    assert m0["kl"] == pytest.approx(0.0, abs=1e-6)   # adapter starts as the identity (B = 0)
    assert m1["kl"] > 0                                  # after one update the policy has moved


def test_full_fine_tuning_with_beta_loads_a_frozen_reference(make_trainer):
    tr = make_trainer(small(method="Full", beta=0.04, learningRate=1e-4))
    try:
        assert tr.reference is not None
        assert not any(p.requires_grad for p in tr.reference.parameters())
        before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
        tr.train_step(0)
        changed = [n for n, p in tr.model.named_parameters() if not torch.equal(before[n], p)]
    finally:
        tr.close()
    assert len(changed) > len(before) // 2


@pytest.mark.parametrize("loss_type", ["dapo", "dr_grpo"])
def test_every_loss_type_trains(loss_type, make_trainer):
    tr = make_trainer(small(lossType=loss_type, numIterations=2))
    try:
        m = tr.train_step(0)
    finally:
        tr.close()
    assert m["loss"] == m["loss"]          # not NaN
    assert 0 <= m["clipRatio"] <= 1        # numIterations 2: the second update's ratio can be clipped


def test_qlora_trains_a_lora_adapter_on_a_4bit_base(make_trainer):
    tr = make_trainer(small(method="QLoRA", promptsPerStep=1))
    try:
        import bitsandbytes as bnb

        assert any(isinstance(m, bnb.nn.Linear4bit) for m in tr.model.modules())
        adapter = snapshot(tr.model, lora=True)
        tr.train_step(0)
        tr.train_step(1)
        after = snapshot(tr.model, lora=True)
    finally:
        tr.close()
    assert any(not torch.equal(adapter[n], after[n]) for n in adapter)


def test_the_same_seed_gives_byte_identical_adapters_and_training_states(make_trainer):
    import random

    import numpy as np

    from grpo_run.trainer.checkpointing.snapshot import TRAINING_STATE, state_files

    results, states = [], []
    for run in range(2):
        random.seed(run)                      # two processes: the generators start from anywhere
        np.random.seed(run)
        tr = make_trainer(small())
        try:
            for step in range(2):
                tr.train_step(step)
            results.append({n: p.detach().numpy().tobytes() for n, p in tr.model.named_parameters() if "lora_" in n})
            tensors = state_files(tr, 2)[TRAINING_STATE].tensors      # the optimizer's moments and the RNGs
            states.append({k: b"".join(t.numpy().tobytes() for t in (v if isinstance(v, list) else [v]))
                           for k, v in tensors.items()})
        finally:
            tr.close()
    assert results[0] == results[1]
    assert {"rng.torch", "rng.numpy", "rng.python"} <= states[0].keys()
    assert states[0] == states[1]


def test_each_epoch_visits_every_train_task_once():
    seen = [i for step in range(5) for i in batch_indices(seed=3, step=step, per_step=4, n_tasks=20)]
    assert sorted(seen) == list(range(20))
    assert batch_indices(3, 7, 4, 20) == batch_indices(3, 7, 4, 20)


def test_evaluation_is_greedy_and_repeatable(make_trainer):
    tr = make_trainer(small())
    try:
        a, b = tr.evaluate(tr.env.eval_tasks), tr.evaluate(tr.env.eval_tasks)
    finally:
        tr.close()
    assert a == b and a.tasks == 8


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_a_micro_batched_step_equals_the_single_batch_step(loss_type, make_trainer):
    # B x G = 8 completions; micro-batches of 3 (3 + 3 + 2) against all 8 at once, with a KL term
    # so the reference's log-probabilities are micro-batched too. Gradients are compared as they
    # stand after the step (clipping scales both alike).
    results = []
    for micro in (None, 3):
        tr = make_trainer(small(lossType=loss_type, beta=0.04, microBatchSize=micro, maxGradNorm=1e9))
        try:
            metrics = tr.train_step(0)
            grads = {n: p.grad.detach().clone() for n, p in tr.model.named_parameters() if p.grad is not None}
        finally:
            tr.close()
        results.append((metrics, grads))
    (whole, whole_grads), (micro, micro_grads) = results
    assert whole["microBatches"] == 1 and micro["microBatches"] == 3
    torch.testing.assert_close(micro["loss"], whole["loss"])
    torch.testing.assert_close(micro["kl"], whole["kl"])
    assert whole_grads.keys() == micro_grads.keys() and whole_grads
    for name in whole_grads:
        torch.testing.assert_close(micro_grads[name], whole_grads[name], msg=name)
    assert any(g.abs().sum() > 0 for g in whole_grads.values())


@pytest.fixture(scope="module")
def half_signal_reward(tmp_path_factory):
    """The completion's length for tasks with an odd answer, 1.0 for the others: groups of
    even-answer tasks carry no signal."""
    path = tmp_path_factory.mktemp("rewards") / "half_signal.py"
    path.write_text("def score(completion, task):\n"
                    "    return float(len(completion)) if int(task['answer']) % 2 else 1.0\n")
    return f"{path}:score"


def test_completions_without_signal_are_left_out_of_the_update_which_stays_the_same(half_signal_reward,
                                                                                    monkeypatch):
    from grpo_run.trainer import grpo

    every_row = grpo.learning_rows

    def trainer():
        params = small(promptsPerStep=4, microBatchSize=2, maxGradNorm=1e9)
        arith = catalog_environment("arithmetic", seed=0, n_eval=params.evalTasks)
        env = user_environment(name="half", reward_ref=half_signal_reward, tasks=list(arith.train_tasks),
                               eval_tasks=list(arith.eval_tasks))
        return GRPOTrainer(ensure_model("tiny:char"), env, params)

    results = []
    for leave_out in (True, False):
        with monkeypatch.context() as m:
            if not leave_out:
                m.setattr(grpo, "learning_rows", lambda adv, beta: every_row(adv, beta=1.0))
            tr = trainer()
            try:
                metrics = tr.train_step(0)
                grads = {n: p.grad.detach().clone() for n, p in tr.model.named_parameters() if p.requires_grad}
            finally:
                tr.close()
        results.append((metrics, grads))
    (left_out, left_out_grads), (every, every_grads) = results
    assert 0 < left_out["identicalGroups"] < 1                  # the step had groups of both kinds
    assert left_out["microBatches"] < every["microBatches"] == 8
    torch.testing.assert_close(left_out["loss"], every["loss"])
    for name in every_grads:
        torch.testing.assert_close(left_out_grads[name], every_grads[name], msg=name)
    assert any(g.abs().sum() > 0 for g in every_grads.values())


def test_a_step_without_any_signal_still_steps_the_optimizer(tmp_path):
    reward = tmp_path / "constant.py"
    reward.write_text("def score(completion, task):\n    return 1.0\n")
    params = small(weightDecay=0.1)
    arith = catalog_environment("arithmetic", seed=0, n_eval=params.evalTasks)
    env = user_environment(name="flat", reward_ref=f"{reward}:score", tasks=list(arith.train_tasks),
                           eval_tasks=list(arith.eval_tasks))
    tr = GRPOTrainer(ensure_model("tiny:char"), env, params)
    try:
        before = snapshot(tr.model, lora=True)
        metrics = tr.train_step(0)
        states = [tr.optimizer.state[p] for p in tr.optimizer.param_groups[0]["params"]]
        after = snapshot(tr.model, lora=True)
    finally:
        tr.close()
    assert metrics["identicalGroups"] == 1.0 and metrics["microBatches"] == 0
    assert states and all(int(s["step"]) == 1 for s in states)            # Adam counted the step
    assert any(not torch.equal(before[n], after[n]) for n in before)       # and weight decay applied


def test_the_selective_log_softmax_equals_the_full_one_in_value_and_gradient():
    from grpo_run.trainer.grpo import token_logprobs

    torch.manual_seed(0)
    logits = torch.randn(3, 7, 50, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 50, (3, 7))
    full = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    chunked = token_logprobs(logits, tokens, 0.7, chunk_elements=3 * 2 * 50)    # 2 positions per chunk
    torch.testing.assert_close(chunked, full.float())
    weights = torch.randn(3, 7)
    (g_full,) = torch.autograd.grad((full.float() * weights).sum(), logits)
    (g_chunked,) = torch.autograd.grad((chunked * weights).sum(), logits)
    torch.testing.assert_close(g_chunked, g_full)


# --- non-finite numbers never reach the weights ---------------------------------------------

def lora_weights(tr) -> dict[str, bytes]:
    return {n: p.detach().numpy().tobytes() for n, p in tr.model.named_parameters() if "lora_" in n}


def test_a_nan_loss_fails_the_step_before_the_optimizer_steps(make_trainer, monkeypatch):
    from grpo_run.trainer import grpo
    from grpo_run.trainer.trainer import NonFiniteStep

    reduce_loss = grpo.reduce_loss
    monkeypatch.setattr(grpo, "reduce_loss", lambda *a, **k: reduce_loss(*a, **k) * float("nan"))
    tr = make_trainer(small())
    try:
        before = lora_weights(tr)
        with pytest.raises(NonFiniteStep, match=r"step 1: the loss is nan") as raised:
            tr.train_step(0)
        assert lora_weights(tr) == before                 # nothing of the step was applied
        assert not any(tr.optimizer.state.values())       # Adam never stepped
    finally:
        tr.close()
    assert (raised.value.step, raised.value.what) == (1, "loss")


def test_an_infinite_gradient_norm_fails_the_step_before_the_optimizer_steps(make_trainer):
    from grpo_run.trainer.trainer import NonFiniteStep

    tr = make_trainer(small())
    try:
        tr.train_step(0)
        before = lora_weights(tr)
        tr.trainable[0].register_hook(lambda grad: grad * float("inf"))     # the loss stays finite
        with pytest.raises(NonFiniteStep, match=r"step 2: the gradient norm is (inf|nan)"):
            tr.train_step(1)
        assert lora_weights(tr) == before
    finally:
        tr.close()


def test_rewards_a_weight_carries_past_float32_fail_the_step(tmp_path):
    """Each reward is within MAX_ABS_REWARD (the grader checks); the weighted sum can still
    overflow float32, which would make NaN advantages."""
    from grpo_run.trainer.envs.catalog import Reward
    from grpo_run.trainer.trainer import NonFiniteStep

    reward = tmp_path / "ten.py"
    reward.write_text("def score(completion, task):\n    return 10.0\n")
    params = small()
    arith = catalog_environment("arithmetic", seed=0, n_eval=params.evalTasks)
    env = user_environment(name="heavy", rewards=(Reward("ten", f"{reward}:score", 1e38),),
                           tasks=list(arith.train_tasks), eval_tasks=list(arith.eval_tasks))
    tr = GRPOTrainer(ensure_model("tiny:char"), env, params)
    try:
        before = lora_weights(tr)
        with pytest.raises(NonFiniteStep, match=r"step 1: the weighted sum of a completion's rewards .* is inf"):
            tr.train_step(0)
        assert lora_weights(tr) == before
    finally:
        tr.close()


def test_a_step_keeps_its_first_groups_for_people_to_read(make_trainer):
    tr = make_trainer(small(sampleGroups=1))
    try:
        m = tr.train_step(0)
        prompts = [tr.env.train_tasks[i]["prompt"] for i in batch_indices(0, 0, 2, len(tr.env.train_tasks))]
    finally:
        tr.close()
    group, = tr.samples                                   # the first of the step's 2 groups
    assert group.item == 0 and group.prompt == prompts[0] and len(group.completions) == 4
    for c in group.completions:
        assert c.rewards == {"score": c.reward} and c.reward == float(len(c.text))   # the length reward, by name
        assert 1 <= c.length <= 4 and (c.length == 4 or not c.truncated)   # only a full-length one is cut
    assert sum(c.advantage for c in group.completions) == pytest.approx(0.0, abs=1e-5)
    assert m["rewardMean"] >= 0


def test_every_evaluation_keeps_the_same_first_held_out_tasks_batch_by_batch(make_trainer):
    tr = make_trainer(small(sampleEvalTasks=3, evalBatchSize=2))
    reported = []
    try:
        ev = tr.evaluate(tr.env.eval_tasks, on_samples=reported.append)
    finally:
        tr.close()
    assert [[g.item for g in batch] for batch in reported] == [[0, 1], [2]]      # batches of 2 tasks
    assert [g.prompt for g in ev.samples] == [t["prompt"] for t in tr.env.eval_tasks[:3]]
    assert [g.completions[0].reward for g in ev.samples] == list(ev.rewards[:3])


def test_solved_groups_are_told_apart_from_groups_without_signal(tmp_path):
    metrics = {}
    for score in (1.0, 0.0):
        reward = tmp_path / f"constant{int(score)}.py"
        reward.write_text(f"def score(completion, task):\n    return {score}\n")
        arith = catalog_environment("arithmetic", seed=0, n_eval=8)
        env = user_environment(name="flat", reward_ref=f"{reward}:score", tasks=list(arith.train_tasks),
                               eval_tasks=list(arith.eval_tasks))
        tr = GRPOTrainer(ensure_model("tiny:char"), env, small())
        try:
            metrics[score] = tr.train_step(0)
        finally:
            tr.close()
    assert (metrics[1.0]["solvedGroups"], metrics[1.0]["noSignalGroups"]) == (1.0, 0.0)
    assert (metrics[0.0]["solvedGroups"], metrics[0.0]["noSignalGroups"]) == (0.0, 1.0)


def test_samples_can_be_turned_off(make_trainer):
    tr = make_trainer(small(sampleGroups=0, sampleEvalTasks=0))
    reported = []
    try:
        tr.train_step(0)
        ev = tr.evaluate(tr.env.eval_tasks, on_samples=reported.append)
    finally:
        tr.close()
    assert tr.samples == [] and ev.samples == () and reported == []
