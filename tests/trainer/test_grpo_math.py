"""GRPO's math against hand-computed values (SPEC §1's worked example among them)."""

import math

import pytest
import torch

from grpo_run.trainer.grpo import (clipped_token_loss, group_advantages, identical_group_fraction, k3_kl, reduce_loss,
                                   solved_group_fraction, token_logprobs, truncated_is_weights)

SPEC_REWARDS = torch.tensor([1, 0, 0, 1, 1, 0, 0, 0], dtype=torch.float32)


def test_population_std_reproduces_the_spec_worked_example():
    adv = group_advantages(SPEC_REWARDS, 8, unbiased=False)
    # mean 0.375, population std sqrt(0.234375) = 0.484
    assert adv[0].item() == pytest.approx(1.29, abs=0.005)
    assert adv[1].item() == pytest.approx(-0.77, abs=0.005)
    assert adv[0].item() == pytest.approx(0.625 / math.sqrt(0.234375))


def test_sample_std_reproduces_the_spec_worked_example():
    adv = group_advantages(SPEC_REWARDS, 8, unbiased=True)
    # sample std sqrt(0.234375 * 8 / 7) = 0.518
    assert adv[0].item() == pytest.approx(1.21, abs=0.005)
    assert adv[1].item() == pytest.approx(-0.72, abs=0.005)


def test_a_group_of_equal_rewards_gets_zero_advantages_never_nan():
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5])
    for unbiased in (True, False):
        adv = group_advantages(rewards, 4, unbiased=unbiased)
        assert not torch.isnan(adv).any()
        assert torch.equal(adv, torch.zeros(12))


def test_groups_are_normalised_independently():
    rewards = torch.tensor([0.0, 1.0, 10.0, 30.0])
    adv = group_advantages(rewards, 2, unbiased=False)
    assert torch.allclose(adv, torch.tensor([-1.0, 1.0, -1.0, 1.0]))


def test_dr_grpo_advantages_are_centred_but_not_scaled():
    adv = group_advantages(torch.tensor([0.0, 1.0, 1.0, 1.0]), 4, unbiased=False, scale=False)
    assert torch.allclose(adv, torch.tensor([-0.75, 0.25, 0.25, 0.25]))


def test_rewards_that_do_not_fill_whole_groups_are_refused():
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(6), 4, unbiased=True)


def test_identical_group_fraction_counts_groups_that_teach_nothing():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    assert identical_group_fraction(rewards, 2) == 0.75


def test_solved_groups_are_the_identical_ones_where_every_completion_scored_1():
    # groups: (1, 1) solved; (0, 1) has signal; (0, 0) no signal; (1.5, 1.5) identical, but a
    # second reward made the sum: solved by the first reward's 1.0
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.5, 1.5])
    primary = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    assert solved_group_fraction(rewards, primary, 2) == 0.5
    assert identical_group_fraction(rewards, 2) - solved_group_fraction(rewards, primary, 2) == 0.25   # no signal


def test_clipping_bounds_the_ratio_on_the_side_the_advantage_pushes():
    logps = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))   # ratios 1.5, 0.5, 1.1 against old = 0
    old = torch.zeros(1, 3)
    loss, clipped = clipped_token_loss(logps, old, torch.tensor([2.0]), epsilon=0.2)
    # positive advantage: min(r*A, clip(r)*A) = 1.2*2, 0.5*2, 1.1*2
    assert torch.allclose(loss, -torch.tensor([[2.4, 1.0, 2.2]]))
    assert clipped.tolist() == [[True, False, False]]
    loss, clipped = clipped_token_loss(logps, old, torch.tensor([-1.0]), epsilon=0.2)
    # negative advantage: min(-r, -clip(r)) = -1.5, -0.8, -1.1
    assert torch.allclose(loss, torch.tensor([[1.5, 0.8, 1.1]]))
    assert clipped.tolist() == [[False, True, False]]


def test_k3_kl_is_zero_at_the_reference_and_matches_the_formula():
    logps = torch.tensor([[-1.0, -2.0]])
    assert torch.equal(k3_kl(logps, logps), torch.zeros(1, 2))
    ref = torch.tensor([[-1.5, -1.0]])
    d = ref - logps
    assert torch.allclose(k3_kl(logps, ref), torch.exp(d) - d - 1)
    assert (k3_kl(logps, ref) > 0).all()


def test_loss_normalisations_follow_their_papers():
    per_token = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    # grpo: per-sequence means (1.0 and 4.0), averaged
    assert reduce_loss(per_token, mask, "grpo", 8).item() == pytest.approx(2.5)
    # dapo: all 5 tokens of the batch weigh the same: 8 / 5
    assert reduce_loss(per_token, mask, "dapo", 8).item() == pytest.approx(1.6)
    # dr_grpo: a constant denominator, 2 completions x 8 max tokens
    assert reduce_loss(per_token, mask, "dr_grpo", 8).item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="loss type"):
        reduce_loss(per_token, mask, "ppo", 8)


def test_token_logprobs_scale_logits_by_the_sampling_temperature():
    logits = torch.tensor([[[2.0, 0.0]]])
    tokens = torch.tensor([[0]])
    at_1 = token_logprobs(logits, tokens, 1.0).item()
    at_2 = token_logprobs(logits, tokens, 2.0).item()
    assert at_1 == pytest.approx(math.log(math.exp(2) / (math.exp(2) + 1)))
    assert at_2 == pytest.approx(math.log(math.exp(1) / (math.exp(1) + 1)))


def test_truncated_importance_weights_are_the_probability_ratio_capped():
    trainer = torch.tensor([[-1.0, -2.0, -0.5]])
    engine = torch.tensor([[-1.5, -2.0, -0.1]])
    w = truncated_is_weights(trainer, engine, cap=1.2)
    # exp(0.5) = 1.6487 capped at 1.2; exp(0) = 1; exp(-0.4) = 0.6703 (never raised to 1: only capped above)
    assert torch.allclose(w, torch.tensor([[1.2, 1.0, math.exp(-0.4)]]))
    assert truncated_is_weights(trainer.requires_grad_(), engine, cap=3.0).requires_grad is False
