"""The next-token filters, as pure functions over a step's logits [N, V]: Hugging Face's
repetition penalty, top-k and top-p (nucleus)."""

from __future__ import annotations

import torch
from torch import Tensor


def apply_repetition_penalty(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """Hugging Face's repetition penalty (CTRL): for each token already seen in that row, a
    positive logit is divided by `penalty`, a negative one multiplied by it.
    logits [N, V] (float), seen [N, V] bool -> [N, V]."""
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Keep the k largest logits of each row (ties with the k-th kept, as transformers does);
    the rest become -inf. logits [N, V] -> [N, V]."""
    k = min(k, logits.size(-1))
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]                  # [N, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: Tensor, p: float) -> Tensor:
    """Nucleus filtering: keep the smallest set of most likely tokens whose probability reaches
    p (always at least the most likely one); the rest become -inf. logits [N, V] -> [N, V]."""
    ordered, order = torch.sort(logits, dim=-1, descending=True, stable=True)   # [N, V]
    probs = torch.softmax(ordered, dim=-1)
    before = probs.cumsum(dim=-1) - probs                              # mass of the more likely tokens
    drop_sorted = before >= p                                          # the set had reached p already
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
