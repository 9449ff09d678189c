"""GRPO's math, as pure functions with shape comments.

B = prompts in the step, G = completions per prompt (the group), T = completion tokens.
Every function here has a hand-computed test in tests/trainer/test_grpo_math.py.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
from torch import Tensor

from trainer.config import LOSS_TYPES



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


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float) -> Tensor:
    """Log-probability of each sampled token under logits scaled as they were when sampling.

    logits [N, T, V], tokens [N, T] -> [N, T]. Temperature 0 (greedy) is treated as 1.
    """
    scaled = logits.float() / (temperature if temperature > 0 else 1.0)
    return torch.log_softmax(scaled, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


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


def reduce_loss(per_token: Tensor, mask: Tensor, loss_type: str, max_completion_length: int) -> Tensor:
    """Per-token loss [N, T] and completion mask [N, T] -> scalar, named as in the literature.

    grpo:    mean over each completion's tokens, then mean over completions (DeepSeekMath).
    dapo:    sum over all tokens of the batch / their count (token-level, DAPO).
    dr_grpo: sum over all tokens / (N x maxCompletionLength), a constant (Dr. GRPO).
    """
    mask = mask.to(per_token.dtype)
    if loss_type == "grpo":
        return ((per_token * mask).sum(1) / mask.sum(1).clamp_min(1)).mean()
    if loss_type == "dapo":
        return (per_token * mask).sum() / mask.sum().clamp_min(1)
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.size(0) * max_completion_length)
    raise ValueError(f"loss type {loss_type!r}: expected one of {', '.join(LOSS_TYPES)}")


class GenerationInterrupted(Exception):
    """Sampling was abandoned because a stop (preemption) was requested between tokens."""


@torch.no_grad()
def sample(model, prompt_ids: Tensor, prompt_mask: Tensor, *, max_new_tokens: int, temperature: float,
           eos_id: int, pad_id: int, generator: torch.Generator | None,
           should_stop: Callable[[], bool] | None = None) -> tuple[Tensor, Tensor]:
    """Autoregressive sampling with a KV cache and an explicit generator (so it can be replayed).

    prompt_ids, prompt_mask [N, P] (left-padded). Returns completion ids [N, T<=max_new_tokens]
    (pad after the first EOS) and completion mask [N, T] (1 up to and including the first EOS).
    Temperature 0 is greedy. Raises GenerationInterrupted when `should_stop()` turns true.
    """
    n = prompt_ids.size(0)
    cache_arg = _cache_argument(model)
    position_ids = (prompt_mask.cumsum(-1) - 1).clamp_min(0)          # [N, P]
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=position_ids, use_cache=True)
    past, logits = _cache_of(out), out.logits[:, -1]                  # [N, V]
    attention = prompt_mask
    next_pos = position_ids[:, -1:] + 1                               # [N, 1]
    done = torch.zeros(n, dtype=torch.bool, device=prompt_ids.device)
    tokens, masks = [], []
    for _ in range(max_new_tokens):
        if should_stop is not None and should_stop():
            raise GenerationInterrupted()
        if temperature > 0:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)   # [N]
        else:
            nxt = logits.argmax(dim=-1)
        masks.append(~done)
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        tokens.append(nxt)
        done = done | (nxt == eos_id)
        if bool(done.all()):
            break
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
        out = model(input_ids=nxt.unsqueeze(1), attention_mask=attention, position_ids=next_pos,
                    use_cache=True, **{cache_arg: past})
        past, logits = _cache_of(out), out.logits[:, -1]
        next_pos = next_pos + 1
    return torch.stack(tokens, dim=1), torch.stack(masks, dim=1).long()


def _cache_argument(model) -> str:
    """transformers 5 renamed `past_key_values` to `cache`; accept both, so users' pinned
    transformers versions keep working."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(type(base).forward).parameters else "past_key_values"


def _cache_of(out):
    return out["cache"] if "cache" in out else out["past_key_values"]


def completion_logprobs(model, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                        completion_mask: Tensor, temperature: float) -> Tensor:
    """Log-probs of the completion tokens given their prompts: [N, T]. Differentiable."""
    ids = torch.cat([prompt_ids, completion_ids], dim=1)              # [N, P+T]
    mask = torch.cat([prompt_mask, completion_mask], dim=1)           # [N, P+T]
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits
    p = prompt_ids.size(1)
    return token_logprobs(logits[:, p - 1:-1], completion_ids, temperature)   # [N, T]
