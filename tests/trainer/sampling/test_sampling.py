"""Sampling controls: top-k, top-p, the repetition penalty, stop strings, every EOS id, and
truncated completions left out of the loss."""

import dataclasses
import math
import pytest
import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from grpo_run.trainer.sampling import sampler
from grpo_run.trainer.sampling import filters
from grpo_run.trainer.config import GRPOParams, parse_parameters
from grpo_run.trainer.envs.catalog import user_environment
from grpo_run.trainer.trainer import GRPOTrainer
from grpo_run.runner.home import ensure_model


class Scripted(torch.nn.Module):
    """A causal LM stand-in: its k-th forward call (0: the prompt) gives `script(k)` ([N, V]) as
    the logits of every position it is asked about."""

    def __init__(self, script):
        super().__init__()
        self.script, self.calls = script, 0

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None, past_key_values=None,
                logits_to_keep=None):
        step = self.script(self.calls)
        self.calls += 1
        logits = step.unsqueeze(1).expand(-1, input_ids.size(1), -1)
        return CausalLMOutputWithPast(logits=logits, past_key_values=torch.zeros(1))


def emitting(rows: list[list[int]], vocab: int) -> Scripted:
    """A model that emits rows[i][k] as row i's k-th completion token (greedy or not)."""
    table = torch.full((len(rows), len(rows[0]), vocab), -30.0)
    for i, row in enumerate(rows):
        for k, tok in enumerate(row):
            table[i, k, tok] = 30.0
    return Scripted(lambda k: table[:, min(k, table.size(1) - 1)])


def random_model(n: int, vocab: int, steps: int, seed: int = 0) -> Scripted:
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(steps + 1, n, vocab, generator=gen) * 3
    return Scripted(lambda k: table[k])


def prompt(n: int, length: int = 3):
    return torch.full((n, length), 3, dtype=torch.long), torch.ones(n, length, dtype=torch.long)


# --- the filters, by hand ------------------------------------------------------------------

def test_top_k_keeps_the_k_largest_logits_and_ties_with_the_kth():
    logits = torch.tensor([[1.0, 4.0, 2.0, 2.0, 0.5]])
    inf = float("-inf")
    assert filters.top_k_filter(logits, 2).tolist() == [[inf, 4.0, 2.0, 2.0, inf]]   # the tie at 2.0 stays
    assert filters.top_k_filter(logits, 1).tolist() == [[inf, 4.0, inf, inf, inf]]
    assert filters.top_k_filter(logits, 99).tolist() == logits.tolist()


def test_top_p_keeps_the_smallest_set_of_most_likely_tokens_reaching_p():
    # probabilities 0.05, 0.5, 0.15, 0.3 (shuffled, so the order is undone correctly)
    logits = torch.tensor([[0.05, 0.5, 0.15, 0.3]]).log()
    kept = lambda p: (filters.top_p_filter(logits, p) > float("-inf")).squeeze(0).tolist()   # noqa: E731
    assert kept(0.4) == [False, True, False, False]     # 0.5 alone reaches 0.4
    assert kept(0.7) == [False, True, False, True]      # 0.5 + 0.3 = 0.8 reaches 0.7; 0.5 did not
    assert kept(0.9) == [False, True, True, True]       # 0.95
    assert kept(0.99) == [True, True, True, True]
    assert kept(1e-6) == [False, True, False, False]    # never fewer than one


def test_the_filters_agree_with_transformers_warpers():
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1)) * 2
    ids = torch.zeros(6, 1, dtype=torch.long)
    assert torch.equal(filters.top_k_filter(logits, 7), TopKLogitsWarper(7)(ids, logits.clone()))
    for p in (0.3, 0.75, 0.9):
        assert torch.equal(filters.top_p_filter(logits, p), TopPLogitsWarper(p)(ids, logits.clone())), p


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    seen = torch.tensor([[True, True, False, False]])
    out = filters.apply_repetition_penalty(logits, seen, 2.0)
    assert out.tolist() == [[1.0, -2.0, 0.5, 3.0]]
    hf = RepetitionPenaltyLogitsProcessor(2.0)(torch.tensor([[0, 1, 0]]), logits.clone())
    assert torch.equal(out, hf)


# --- sample ----------------------------------------------------------------------------------

def test_default_sampling_draws_exactly_as_plain_temperature_sampling():
    # What sampling was before the controls: softmax(logits / T), one multinomial per token.
    n, vocab, steps, t = 5, 11, 6, 0.8
    ids, mask = prompt(n)
    gen = torch.Generator().manual_seed(7)
    out = sampler.sample(random_model(n, vocab, steps), ids, mask, max_new_tokens=steps, temperature=t,
                      eos_ids=(vocab + 5,), pad_id=0, generator=gen)
    ref_gen, script = torch.Generator().manual_seed(7), random_model(n, vocab, steps).script
    expected = [torch.multinomial(torch.softmax(script(k) / t, -1), 1, generator=ref_gen).squeeze(1)
                for k in range(steps)]
    assert torch.equal(out.ids, torch.stack(expected, 1))
    assert torch.equal(gen.get_state(), ref_gen.get_state())
    assert out.truncated.all() and out.mask.all()


@pytest.mark.parametrize("ahead", [1, 2, 3, 7])
def test_each_groups_draws_are_its_own_generators_multinomials_however_far_ahead_noise_is_drawn(ahead, monkeypatch):
    # three groups of two rows, each its own generator; noise drawn `ahead` tokens at a time
    n, vocab, steps, t = 6, 11, 7, 0.8
    monkeypatch.setattr(sampler._Draws, "AHEAD_ELEMENTS", ahead * n * vocab)
    ids, mask = prompt(n)
    gens = [torch.Generator().manual_seed(20 + g) for g in range(3)]
    out = sampler.sample(random_model(n, vocab, steps), ids, mask, max_new_tokens=steps, temperature=t,
                         eos_ids=(vocab + 5,), pad_id=0, generator=gens)
    refs, script = [torch.Generator().manual_seed(20 + g) for g in range(3)], random_model(n, vocab, steps).script
    expected = [torch.cat([torch.multinomial(block, 1, generator=g).squeeze(1)
                           for block, g in zip(torch.softmax(script(k) / t, -1).split(2), refs)])
                for k in range(steps)]
    assert torch.equal(out.ids, torch.stack(expected, 1))
    assert all(torch.equal(g.get_state(), r.get_state()) for g, r in zip(gens, refs))


def test_a_nan_probability_fails_the_sampling_as_multinomial_does():
    n, vocab = 4, 9
    logits = torch.randn(n, vocab)
    logits[2, 3] = float("nan")
    ids, mask = prompt(n)
    with pytest.raises(RuntimeError, match="nan"):
        sampler.sample(Scripted(lambda k: logits), ids, mask, max_new_tokens=3, temperature=1.0, eos_ids=(vocab + 1,),
                       pad_id=0, generator=torch.Generator().manual_seed(0))


def test_top_k_of_one_samples_exactly_what_greedy_picks():
    n, vocab, steps = 6, 40, 8
    ids, mask = prompt(n)
    greedy = sampler.sample(random_model(n, vocab, steps), ids, mask, max_new_tokens=steps, temperature=0.0,
                         eos_ids=(1,), pad_id=0, generator=None)
    top1 = sampler.sample(random_model(n, vocab, steps), ids, mask, max_new_tokens=steps, temperature=1.5,
                       eos_ids=(1,), pad_id=0, generator=torch.Generator().manual_seed(3), top_k=1)
    assert torch.equal(top1.ids, greedy.ids) and torch.equal(top1.mask, greedy.mask)


def test_sampling_with_top_p_draws_only_from_the_nucleus():
    # every step: probabilities 0.5, 0.3, 0.15, 0.05; top-p 0.7 keeps tokens 0 and 1
    n = 200
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(n, -1)
    ids, mask = prompt(n)
    out = sampler.sample(Scripted(lambda k: probs), ids, mask, max_new_tokens=3, temperature=1.0, eos_ids=(9,),
                      pad_id=0, generator=torch.Generator().manual_seed(0), top_p=0.7)
    assert set(out.ids.unique().tolist()) == {0, 1}


def test_each_completion_sums_the_entropy_of_the_distributions_its_tokens_were_drawn_from():
    # every step: probabilities 0.5, 0.3, 0.15, 0.05 over tokens 0-3, never an EOS: 3 tokens each;
    # top-p 0.7 renormalises tokens 0 and 1 to 0.625 / 0.375
    n = 4
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(n, -1)
    ids, mask = prompt(n)
    h = -(0.5 * math.log(0.5) + 0.3 * math.log(0.3) + 0.15 * math.log(0.15) + 0.05 * math.log(0.05))   # 1.1542
    h_p = -(0.625 * math.log(0.625) + 0.375 * math.log(0.375))                                          # 0.6616
    for top_p, each in ((1.0, h), (0.7, h_p)):
        out = sampler.sample(Scripted(lambda k: probs), ids, mask, max_new_tokens=3, temperature=1.0, eos_ids=(9,),
                             pad_id=0, generator=torch.Generator().manual_seed(0), top_p=top_p)
        torch.testing.assert_close(out.entropy, torch.full((n,), 3 * each))
    greedy = sampler.sample(Scripted(lambda k: probs), ids, mask, max_new_tokens=3, temperature=0.0, eos_ids=(9,),
                            pad_id=0, generator=None)
    assert greedy.entropy.tolist() == [0.0] * n                       # nothing drawn


def test_greedy_decoding_penalises_prompt_and_completion_tokens_but_not_padding():
    # Constant logits: token 1 (3.0) beats token 2 (2.0); penalty 2 makes a seen 1 worth 1.5.
    # Row 0 prompt [3, 3]; row 1 [pad=1, 3] (the pad is no token of the prompt); row 2 [1, 3].
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0, -1.0]).expand(3, -1)
    ids = torch.tensor([[3, 3], [1, 3], [1, 3]])
    mask = torch.tensor([[1, 1], [0, 1], [1, 1]])
    run = lambda penalty: sampler.sample(Scripted(lambda k: logits), ids, mask, max_new_tokens=3,   # noqa: E731
                                      temperature=0.0, eos_ids=(4,), pad_id=1, generator=None,
                                      repetition_penalty=penalty).ids.tolist()
    assert run(1.0) == [[1, 1, 1]] * 3
    assert run(2.0) == [[1, 2, 1], [1, 2, 1], [2, 1, 1]]


def test_every_eos_id_given_ends_a_completion():
    rows = [[5, 7, 6, 6], [5, 8, 6, 6], [5, 6, 6, 6]]          # 7 and 8 both end a completion
    ids, mask = prompt(3)
    out = sampler.sample(emitting(rows, 10), ids, mask, max_new_tokens=4, temperature=0.0, eos_ids=(7, 8),
                      pad_id=0, generator=None)
    assert out.ids.tolist() == [[5, 7, 0, 0], [5, 8, 0, 0], [5, 6, 6, 6]]
    assert out.mask.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    assert out.truncated.tolist() == [False, False, True]


# --- in the trainer ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reward_ref(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "length_reward.py"
    path.write_text("def score(completion, task):\n    return float(len(completion))\n")
    return f"{path}:score"


def make_trainer(model: str, reward_ref: str, **params) -> GRPOTrainer:
    tasks = [{"prompt": f"{a}+{b}="} for a in range(4) for b in range(4)]
    env = user_environment(name="t", reward_ref=reward_ref, tasks=tasks[4:], eval_tasks=tasks[:4])
    base = dict(numGenerations=4, promptsPerStep=2, maxCompletionLength=8, learningRate=2e-3, maxGradNorm=1e9)
    return GRPOTrainer(ensure_model(model), env, GRPOParams(**{**base, **params}))


def test_a_stop_string_ends_a_completion_at_the_token_that_completes_it(reward_ref):
    tr = make_trainer("tiny:chat", reward_ref, stopStrings=("is 4", "problem step"))
    try:
        tok = tr.tokenizer
        texts = ["The answer is 42. Natalia sold clips", "Solve the problem step by step.",
                 "Natalia sold 48 clips in April."]
        rows = [tok(t, add_special_tokens=False).input_ids[:8] for t in texts]
        assert [len(r) for r in rows] == [8, 8, 8]
        tr.sampler.model = emitting(rows, len(tok))
        out = tr.rollout.play([{"prompt": "go"}] * 3, None, 0.0)
        # "is 4" is completed inside " 42" (the whole token stays, as transformers' generate does);
        # "problem step" spans " problem" and " step"
        assert out.texts == ["The answer is 42", "Solve the problem step", tok.decode(rows[2])]
        assert out.mask.sum(1).tolist() == [4, 5, 8]
        assert out.ended.tolist() == [False, False, True]
    finally:
        tr.close()


def test_each_eos_id_of_the_generation_config_ends_a_completion(reward_ref):
    # tiny:chat, like Qwen's instruct models: generation_config.eos_token_id = [<|im_end|>, <|endoftext|>]
    tr = make_trainer("tiny:chat", reward_ref)
    try:
        tok = tr.tokenizer
        im_end, endoftext = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
        assert tr.sampler.settings.stop_token_ids == (im_end, endoftext) and tok.eos_token_id == im_end
        the, answer = tok("The answer", add_special_tokens=False).input_ids
        rows = [[the, endoftext, the, the], [the, answer, im_end, the], [the, answer, the, answer]]
        tr.sampler.model = emitting(rows, len(tok))
        out = tr.rollout.play([{"prompt": "go"}] * 3, None, 0.0)
        assert out.mask.sum(1).tolist() == [2, 3, 8]     # the third never ends: cut at maxCompletionLength
        assert out.ended.tolist() == [False, False, True]
        assert out.texts[:2] == ["The", "The answer"]
    finally:
        tr.close()


def test_masked_truncated_completions_give_a_step_no_loss_and_no_gradient(reward_ref):
    # With no EOS id, every completion runs to maxCompletionLength: all truncated.
    results = {}
    for masked in (False, True):
        tr = make_trainer("tiny:char", reward_ref, maskTruncatedCompletions=masked, maxCompletionLength=3)
        try:
            tr.sampler.settings = dataclasses.replace(tr.sampler.settings, stop_token_ids=())
            lora = {n: p.detach().clone() for n, p in tr.model.named_parameters() if "lora_" in n}
            metrics = tr.train_step(0)
            grads = [p.grad for n, p in tr.model.named_parameters() if "lora_" in n and p.grad is not None]
            changed = any(not torch.equal(lora[n], p) for n, p in tr.model.named_parameters() if "lora_" in n)
        finally:
            tr.close()
        results[masked] = (metrics, grads, changed)
    (plain, plain_grads, plain_changed), (masked, masked_grads, masked_changed) = results[False], results[True]
    assert plain["truncatedFraction"] == masked["truncatedFraction"] == 1.0
    assert plain["completionLength"] == masked["completionLength"] == 3.0      # still counted
    assert plain["rewardMean"] == masked["rewardMean"]                          # still scored
    assert any(g.abs().sum() > 0 for g in plain_grads) and plain_changed
    assert masked["loss"] == 0.0 and masked["gradNorm"] == 0.0
    assert all(g.abs().sum() == 0 for g in masked_grads) and not masked_changed


def test_a_step_reports_the_fraction_of_truncated_completions(reward_ref):
    tr = make_trainer("tiny:char", reward_ref, maxCompletionLength=4)
    try:
        plus = tr.tokenizer.convert_tokens_to_ids("+")           # a common character: some end early
        tr.sampler.settings = dataclasses.replace(tr.sampler.settings, stop_token_ids=(plus,))
        metrics = tr.train_step(0)
    finally:
        tr.close()
    assert 0 < metrics["truncatedFraction"] < 1
    assert (metrics["truncatedFraction"] * 8).is_integer()          # of B x G = 8 completions


# --- the parameters ---------------------------------------------------------------------------

def test_sampling_parameters_take_yaml_lists_and_report_what_is_allowed():
    p = GRPOParams.model_validate({"stopStrings": ["</answer>", "\n\n"], "topP": 0.9, "topK": 50,
                                   "repetitionPenalty": 1.1, "maskTruncatedCompletions": True})
    assert p.stopStrings == ("</answer>", "\n\n")
    problems: list[str] = []
    parse_parameters({"topP": 0, "topK": -1, "repetitionPenalty": 0.0, "stopStrings": ["x", ""]},
                     "spec.parameters", problems)
    assert problems == [
        "spec.parameters.topP: must be > 0 (got 0)",
        "spec.parameters.topK: must be >= 0 (got -1)",
        "spec.parameters.repetitionPenalty: must be > 0 (got 0.0)",
        "spec.parameters.stopStrings: must be a list of non-empty strings like [\"</answer>\"] (got ['x', ''])",
    ]
