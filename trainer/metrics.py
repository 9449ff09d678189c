"""A training step's metrics, over all B x G completions (every process's share gathered).

Only what is cheap and exact: reward mean and spread (each reward's mean by name), the groups
that taught nothing split into solved (every completion scored 1 on the first reward: fine) and
no signal (all failed alike), completion length and the truncated fraction, the loss, the
gradient norm before clipping, the mean token entropy of sampling, the clip ratio when numIterations > 1 (on the first iteration the
ratio is exactly 1 and nothing is clipped) and the KL to the reference when beta > 0.

Why the loss sits near 0 when numIterations is 1: the ratio is 1, so the loss is minus the mean
advantage, and advantages are centred in every group (they sum to 0). Its gradient is not 0:
learning shows in the reward and the gradient norm, not the loss."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from grpo_run.trainer import grpo
from grpo_run.trainer.distributed import concat

LOSS_NOTE = "loss ~0 by construction when numIterations is 1: advantages average 0 in each group"


def step_metrics(shares: list[dict[str, Any]], group_size: int, tokens: int, *, primary: str,
                 iterations: int) -> dict[str, Any]:
    """A step's metrics from each process's share (one share alone). `primary`: the first
    reward's name (what "solved" means); `iterations`: numIterations (the clip ratio is reported
    only above 1)."""
    rewards = torch.tensor(concat([s["rewards"] for s in shares]), dtype=torch.float32)     # [B*G]
    lengths = torch.tensor(concat([s["lengths"] for s in shares]), dtype=torch.float32)     # [B*G]
    truncated = torch.tensor(concat([s["truncated"] for s in shares]), dtype=torch.float32)
    first = torch.tensor(concat([s["byReward"][primary] for s in shares]), dtype=torch.float32)   # [B*G]
    names = shares[0]["byReward"]
    identical = grpo.identical_group_fraction(rewards, group_size)
    solved = grpo.solved_group_fraction(rewards, first, group_size)
    out = {
        "rewardMean": rewards.mean().item(),
        "rewardStd": rewards.std(unbiased=False).item(),
        "rewards": {name: float(np.mean(concat([s["byReward"][name] for s in shares]))) for name in names},
        "identicalGroups": identical,             # = solvedGroups + noSignalGroups
        "solvedGroups": solved,                   # every completion solved it: nothing left to learn there
        "noSignalGroups": identical - solved,     # all failed alike: nothing to learn from
        "completionLength": lengths.mean().item(),
        # per sampled token: the entropy (nats) of the distribution it was drawn from
        "tokenEntropy": sum(s["entropy"] for s in shares) / max(float(lengths.sum()), 1.0),
        "truncatedFraction": truncated.mean().item(),   # cut at maxCompletionLength
        "loss": sum(s["loss"] for s in shares),
        "microBatches": sum(s["microBatches"] for s in shares),
        "learningCompletions": sum(s["learning"] for s in shares),   # the others had advantage 0: no gradient
        "kl": sum(s["kl"] for s in shares) / max(tokens, 1),
    }
    if iterations > 1:
        out["clipRatio"] = sum(s["clipped"] for s in shares) / max(tokens, 1)
    if "turns" in shares[0]:                       # episodes: how long they ran, and which limit ended them
        ended = concat([s["truncatedBy"] for s in shares])
        out["episodeTurns"] = float(np.mean(concat([s["turns"] for s in shares])))
        out["truncatedByMaxTurns"] = sum(1 for t in ended if t == "maxTurns") / len(ended)
        out["truncatedByContext"] = sum(1 for t in ended if t == "context") / len(ended)
        out["truncatedByStepTime"] = sum(1 for t in ended if t == "stepTime") / len(ended)
    if "toolCalls" in shares[0]:                   # tools: how often they were called, and answered with an error
        calls, errors = concat([s["toolCalls"] for s in shares]), concat([s["toolErrors"] for s in shares])
        out["toolCalls"] = float(np.mean(calls))
        out["toolErrorRate"] = sum(errors) / max(sum(calls), 1)
        out["truncatedByToolTime"] = sum(1 for t in ended if t == "toolTime") / len(ended)
    return out
