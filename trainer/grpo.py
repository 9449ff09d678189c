"""GRPO's math, as pure functions with shape comments.

B = prompts in the step, G = completions per prompt (the group), T = completion tokens.
Every function here has a hand-computed test in tests/trainer/test_grpo_math.py.
"""

from __future__ import annotations


import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from grpo_run.trainer.config import LOGPROB_CHUNK_ELEMENTS, LOSS_TYPES
from grpo_run.trainer.model.llama import last_logits


def group_advantages(rewards: Tensor, group_size: int, *, unbiased: bool, scale: bool = True) -> Tensor:
    """Each completion's reward minus its group's mean, divided by the group's std.

    `unbiased=True` divides by the sample std (n-1), False by the population std (n).
    `scale=False` skips the division (Dr. GRPO). A group whose rewards are all equal gets
    advantages of exactly 0, never NaN: it carries no signal. Raises ValueError when the
    rewards do not split into whole groups.
    """
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.view(-1, group_size).to(torch.float64)         # [B, G]
    centred = grouped - grouped.mean(dim=1, keepdim=True)             # [B, G]
    if scale:
        std = grouped.std(dim=1, unbiased=unbiased, keepdim=True)     # [B, 1]
        # 0/0 for an all-equal group: the centred rewards are exactly 0 there, keep them.
        centred = torch.where(std > 0, centred / std.clamp_min(1e-12), torch.zeros_like(centred))
    return centred.view(-1).to(rewards.dtype)                         # [B*G]


def identical_group_fraction(rewards: Tensor, group_size: int) -> float:
    """Fraction of groups whose G rewards were all equal (they teach nothing)."""
    grouped = rewards.view(-1, group_size)                            # [B, G]
    same = (grouped == grouped[:, :1]).all(dim=1)                     # [B]
    return same.float().mean().item()


def solved_group_fraction(rewards: Tensor, primary: Tensor, group_size: int) -> float:
    """Fraction of groups that are identical (equal rewards) because every completion solved the
    task: its primary (first) reward is 1.0, as an evaluation counts a task solved. The rest of
    the identical groups all failed alike: no signal. rewards, primary [B*G]."""
    grouped = rewards.view(-1, group_size)                            # [B, G]
    same = (grouped == grouped[:, :1]).all(dim=1)                     # [B]
    solved = (primary.view(-1, group_size) == 1.0).all(dim=1)         # [B]
    return (same & solved).float().mean().item()


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float, *,
                   chunk_elements: int = LOGPROB_CHUNK_ELEMENTS) -> Tensor:
    """Log-probability of each sampled token under logits scaled as they were when sampling.

    logits [N, T, V], tokens [N, T] -> [N, T]. Temperature 0 (greedy) is treated as 1.
    A selective log-softmax: `logit[token] - logsumexp(logits)`, over chunks of token positions,
    so the full-vocabulary log-softmax [N, T, V] in fp32 never exists. Under autograd each chunk
    is recomputed in backward instead of kept (activation checkpointing), so what stays alive
    is the model's own logits and one fp32 chunk.
    """
    t = temperature if temperature > 0 else 1.0
    n, length, vocab = logits.shape
    if n * length * vocab <= chunk_elements:
        return _selected_logprobs(logits, tokens, t)
    width = max(1, chunk_elements // (n * vocab))                    # positions per chunk
    keep = torch.is_grad_enabled() and logits.requires_grad
    parts = []
    for chunk, toks in zip(logits.split(width, dim=1), tokens.split(width, dim=1)):   # [N, w, V], [N, w]
        if keep:
            parts.append(checkpoint(_selected_logprobs, chunk, toks, t, use_reentrant=False))
        else:
            parts.append(_selected_logprobs(chunk, toks, t))
    return torch.cat(parts, dim=1)                                    # [N, T]


def _selected_logprobs(logits: Tensor, tokens: Tensor, temperature: float) -> Tensor:
    scaled = logits.float() / temperature                             # [N, w, V]
    picked = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)      # [N, w]
    return picked - torch.logsumexp(scaled, dim=-1)                   # [N, w]


def k3_kl(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """Per-token KL(policy || reference) estimate k3 = exp(r - p) - (r - p) - 1 (>= 0). [N, T]."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def clipped_token_loss(logps: Tensor, old_logps: Tensor, advantages: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    """PPO's clipped surrogate per token, negated to minimise.

    logps, old_logps [N, T]; advantages [N] (every token of a completion gets its advantage).
    Returns (loss [N, T], clipped [N, T] bool: where the clip bound was the active term).
    """
    ratio = torch.exp(logps - old_logps)                              # [N, T]
    adv = advantages.unsqueeze(1)                                     # [N, 1]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon) * adv
    loss = -torch.min(unclipped, clipped)
    return loss, clipped < unclipped


def truncated_is_weights(trainer_logps: Tensor, engine_logps: Tensor, cap: float) -> Tensor:
    """Truncated importance sampling (TRL's vllm_importance_sampling_correction, token level): the
    completions were drawn by an engine whose log-probabilities differ a little from the trainer's,
    so each token's loss is weighted by min(p_trainer / p_engine, cap). [N, T] -> [N, T], no gradient.
    E.g. trainer -1.0, engine -1.5: exp(0.5) = 1.65; with cap 1.2 the weight is 1.2."""
    return torch.exp(trainer_logps.detach() - engine_logps).clamp(max=cap)                # [N, T]


def reduce_loss(per_token: Tensor, mask: Tensor, loss_type: str, max_completion_length: int, *,
                completions: int | None = None, tokens: int | None = None) -> Tensor:
    """Per-token loss [N, T] and completion mask [N, T] -> scalar, named as in the literature.

    grpo:    mean over each completion's tokens, then mean over completions (DeepSeekMath).
    dapo:    sum over all tokens of the batch / their count (token-level, DAPO).
    dr_grpo: sum over all tokens / (N x maxCompletionLength), a constant (Dr. GRPO).

    For a micro-batch of a larger batch, pass the whole batch's `completions` (N) and `tokens`
    (unmasked tokens): the micro-batches' losses, and so their gradients, then sum to the whole
    batch's.
    """
    mask = mask.to(per_token.dtype)
    n = per_token.size(0) if completions is None else completions
    if loss_type == "grpo":
        return ((per_token * mask).sum(1) / mask.sum(1).clamp_min(1)).sum() / n
    if loss_type == "dapo":
        count = mask.sum().clamp_min(1) if tokens is None else max(tokens, 1)
        return (per_token * mask).sum() / count
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (n * max_completion_length)
    raise ValueError(f"loss type {loss_type!r}: expected one of {', '.join(LOSS_TYPES)}")


def micro_batches(rows: Tensor, size: int) -> list[Tensor]:
    """The completions `rows` [M] (indices into the step's B*G) in consecutive micro-batches of at
    most `size` (the last may be shorter)."""
    return list(rows.split(max(1, size))) if rows.numel() else []


def learning_rows(advantages: Tensor, beta: float) -> Tensor:
    """The completions the update has to run through: indices [M] into advantages [B*G].

    A completion whose advantage is exactly 0 (its group's rewards were all equal) has a zero
    clipped surrogate at every token whatever the ratio, so it adds nothing to the loss or to its
    gradient; unless a KL term (beta > 0) pulls on it, it is left out of the forward and backward.
    Its tokens still count in the loss's normalisation (reduce_loss's `completions` and `tokens`),
    so the update is the one over all B*G completions, up to float rounding."""
    if beta > 0:
        return torch.arange(advantages.numel(), device=advantages.device)
    return (advantages != 0).nonzero().squeeze(1)


def completion_logprobs(model, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                        completion_mask: Tensor, temperature: float, *, fast=None) -> Tensor:
    """Log-probs of the completion tokens given their prompts: [N, T]. Differentiable.
    Logits are computed for the completion's positions only, never for the prompt's. `fast`: a
    decode.LlamaFamilyDecoder of `model` that computes its forward (decode.training_refusal)."""
    ids = torch.cat([prompt_ids, completion_ids], dim=1)              # [N, P+T]
    mask = torch.cat([prompt_mask, completion_mask], dim=1)           # [N, P+T]
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    t = completion_ids.size(1)
    if fast is not None:
        logits = fast.training_logits(ids, mask, position_ids, t + 1)                                   # [N, T+1, V]
    else:
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False,
                       **last_logits(model, t + 1)).logits              # [N, T+1, V] (or [N, P+T, V])
    return token_logprobs(logits[:, -t - 1:-1], completion_ids, temperature)   # [N, T]
